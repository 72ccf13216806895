//! Settings precedence is flags > MLXGATE_* env > config file > defaults,
//! proven by which port the real server ends up listening on.

mod support;

use support::{ServerBuilder, free_port, run_cli, try_request};

fn listening(addr_port: u16) -> bool {
    try_request(
        std::net::SocketAddr::from(([127, 0, 0, 1], addr_port)),
        "GET",
        "/healthz",
        &[],
        None,
    )
    .is_ok_and(|r| r.status == 200)
}

#[test]
fn flag_beats_env_beats_file() {
    let (a, b, c) = (free_port(), free_port(), free_port());
    let s = ServerBuilder::new()
        .config(&format!("port = {a}\n"))
        .env("MLXGATE_PORT", b.to_string())
        .port(c)
        .arg("--port")
        .arg(c.to_string())
        .start();
    assert_eq!(s.addr.port(), c);
    assert!(!listening(a) && !listening(b));
}

#[test]
fn env_beats_file() {
    let (a, b) = (free_port(), free_port());
    let s = ServerBuilder::new()
        .config(&format!("port = {a}\n"))
        .env("MLXGATE_PORT", b.to_string())
        .port(b)
        .start();
    assert_eq!(s.addr.port(), b);
    assert!(!listening(a));
}

#[test]
fn file_beats_default_and_config_path_can_come_from_env() {
    let a = free_port();
    let dir = tempfile::tempdir().expect("temp dir");
    let cfg = dir.path().join("gw.toml");
    std::fs::write(&cfg, format!("port = {a}\nhost = \"127.0.0.1\"\n")).expect("write");
    let s = ServerBuilder::new()
        .env("MLXGATE_CONFIG", cfg.display().to_string())
        .port(a)
        .start();
    assert_eq!(s.addr.port(), a);
}

#[test]
fn invalid_config_file_fails_fast_with_the_reason() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cfg = dir.path().join("bad.toml");
    std::fs::write(&cfg, "prot = 80\n").expect("write");
    let (st, _, err) = run_cli(
        &["serve", "--config", cfg.to_str().unwrap_or_default()],
        &[],
    );
    assert!(!st.success());
    assert!(err.contains("bad.toml") && err.contains("prot"), "{err}");
}

#[test]
fn help_documents_each_option_and_its_env_var() {
    let (st, out, _) = run_cli(&["serve", "--help"], &[]);
    assert!(st.success());
    for needle in [
        "--config",
        "MLXGATE_CONFIG",
        "--host",
        "MLXGATE_HOST",
        "--port",
        "MLXGATE_PORT",
        "--model",
        "MLXGATE_MODEL",
        "--data-dir",
        "MLXGATE_DATA_DIR",
        "MLXGATE_ADMIN_KEY",
    ] {
        assert!(out.contains(needle), "--help lacks {needle}:\n{out}");
    }
}
