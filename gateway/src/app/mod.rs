//! The application: what the server owns and decides, below the wire
//! (`http` parses requests, calls in here and maps the results) and above
//! the domain modules (`engine`, `policy`, `jobs`). Nothing here speaks HTTP.

pub mod policies;

pub use policies::Policies;
