//! Small helpers every layer uses, with no dependencies of their own inside
//! the crate (the bottom layer; see docs/ARCHITECTURE.md).

pub mod json;
pub mod threads;
pub mod time;
pub mod tls;

/// The error type of boxed bodies and loaders: any error, sendable.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The message of a caught panic (`panic!` with a literal or a format).
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// A Prometheus label value with the text format's escapes (backslash,
/// quote, newline): names from the config (models, policies) may hold them.
pub fn prometheus_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// FNV-1a, for small maps whose keys come from the operator's config (key
/// ids), never from clients: a few instructions per byte where the
/// standard SipHash costs a couple of hundred per lookup, and nothing to
/// defend against flooding.
#[derive(Clone, Copy)]
pub struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl std::hash::Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// A `HashMap` hasher builder for [`Fnv`].
pub type FnvBuild = std::hash::BuildHasherDefault<Fnv>;
