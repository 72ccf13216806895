//! Which serving thread the running code is on (see `http::serving`).
//!
//! Connections to an upstream are registered with the reactor of the
//! runtime that opened them; the upstream pool keeps each serving thread's
//! idle connections apart, so a request reuses one its own thread drives
//! and no I/O readiness crosses threads.

use std::cell::Cell;

thread_local! {
    static SLOT: Cell<usize> = const { Cell::new(0) };
}

/// 1 + the serving thread's index on a serving thread, 0 anywhere else.
pub fn slot() -> usize {
    SLOT.with(Cell::get)
}

/// Marks the current thread as serving thread `index` (0-based).
pub fn set_serving_index(index: usize) {
    SLOT.with(|s| s.set(index + 1));
}
