//! The Wasm policy host: one engine, linker and instance pools for all guests.
