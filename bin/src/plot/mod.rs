//! Training-curve charts drawn with plotters (pure Rust, bitmap backend, the DejaVu Sans font
//! under `assets/fonts/` rendered by ab_glyph), laid out as a grid of panels and encoded to PNG.

pub mod chart;

pub use chart::{Band, Figure, Panel, Series, Style};
