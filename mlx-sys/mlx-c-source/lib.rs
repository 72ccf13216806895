// Never built: see Cargo.toml.
