//! Cross-crate tests live in `cross/` (declared as test targets in this package's Cargo.toml).

#![forbid(unsafe_code)]
