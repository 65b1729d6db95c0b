//! The message of a caught panic, for the places that turn a panic in backend work into an
//! error (the serve worker, the GPU probe).

use std::any::Any;

/// The panic's message when it carries one (`panic!` with a string), else "unknown error".
pub fn panic_text(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("unknown error")
}
