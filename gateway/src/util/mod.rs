//! Small helpers every layer uses, with no dependencies of their own inside
//! the crate (the bottom layer; see docs/ARCHITECTURE.md).

pub mod time;

/// The message of a caught panic (`panic!` with a literal or a format).
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}
