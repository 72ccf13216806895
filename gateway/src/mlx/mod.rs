//! MLX runtime facts and model files loaded through MLX.
