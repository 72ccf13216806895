//! The HTTP layer: routes, auth, errors in the OpenAI shape, metrics.
