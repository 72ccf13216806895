//! mlxgate: an OpenAI-compatible LLM gateway on MLX, programmable with
//! sandboxed WebAssembly guests.
//!
//! Layers (see `docs/ARCHITECTURE.md`): `http` speaks the wire protocol and knows
//! nothing of MLX; `mlx` wraps the runtime; `policy` hosts Wasm guests.
