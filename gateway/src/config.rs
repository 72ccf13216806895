//! Gateway settings: TOML file, then `MLXGATE_*` environment, then flags.
