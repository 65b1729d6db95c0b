//! A small self-contained chart renderer: an RGB canvas with lines and an embedded bitmap font
//! (no system fonts, no C libraries), panels with axes laid out in a grid, encoded to PNG.

pub mod canvas;
pub mod chart;
pub mod font;

pub use chart::{Band, Figure, Panel, Series, Style};
