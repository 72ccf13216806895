//! Restarts and `kill -9`: rows `running` under a dead process come back
//! `zombie` with the reason, `queued` rows run again, and killing the real
//! binary mid-write never corrupts the ledger or the event logs.

#[path = "jobs_common/mod.rs"]
mod common;
#[path = "support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use support::{BIN, free_port, try_request};

const T: Duration = Duration::from_secs(30);

/// A gateway on a data dir that outlives it (ServerBuilder makes a fresh
/// one per server).
struct Gateway {
    child: Child,
    addr: std::net::SocketAddr,
}

impl Gateway {
    fn start(dir: &Path, jobs_section: &str) -> Gateway {
        let config = dir.join("config.toml");
        std::fs::write(&config, config_toml(jobs_section)).unwrap();
        for _ in 0..3 {
            let port = free_port();
            let mut cmd = Command::new(BIN);
            cmd.current_dir(dir)
                .args(["serve", "--port", &port.to_string()])
                .arg("--config")
                .arg(&config)
                .arg("--data-dir")
                .arg(dir.join("data"))
                .arg("--model")
                .arg(dir.join("no-model.gguf"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join(format!("server-{port}.log"))).unwrap());
            for (k, _) in std::env::vars() {
                if k.starts_with("MLXGATE_") {
                    cmd.env_remove(k);
                }
            }
            cmd.env("MLXGATE_ADMIN_KEY", ADMIN);
            let mut child = cmd.spawn().expect("spawn mlxgate");
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                if let Ok(Some(_)) = child.try_wait() {
                    break; // port taken in the meantime: try another
                }
                if try_request(addr, "GET", "/healthz", &[], None).is_ok_and(|r| r.status == 200) {
                    return Gateway { child, addr };
                }
                assert!(Instant::now() < deadline, "gateway did not start");
                std::thread::sleep(Duration::from_millis(25));
            }
        }
        panic!("gateway did not start in 3 attempts");
    }

    /// SIGKILL: no shutdown code runs.
    fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Gateway {
    /// SIGTERM, then waits for the process to exit; returns how long it took.
    fn sigterm(mut self) -> Duration {
        let started = Instant::now();
        let ok = Command::new("sh")
            .args(["-c", &format!("kill -TERM {}", self.child.id())])
            .status()
            .unwrap()
            .success();
        assert!(ok);
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{status}");
        started.elapsed()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn log_path(row: &serde_json::Value) -> PathBuf {
    PathBuf::from(row["log_path"].as_str().unwrap())
}

#[test]
fn restart_turns_running_into_zombie_and_reruns_queued() {
    let dir = tempfile::tempdir().unwrap();
    let g = Gateway::start(dir.path(), "concurrency = { noop = 1 }");
    let a = submit_ok(g.addr, "noop", json!({"steps": 10000, "delay_ms": 20}));
    let a_id = a["id"].as_str().unwrap().to_owned();
    wait_job(g.addr, &a_id, T, |r| {
        r["status"] == "running" && r["progress"].as_f64().unwrap() > 0.0
    });
    let b = submit_ok(g.addr, "noop", json!({"steps": 2, "delay_ms": 10}));
    let b_id = b["id"].as_str().unwrap().to_owned();
    assert_eq!(get_job(g.addr, &b_id)["status"], "queued");
    g.kill9();

    let g = Gateway::start(dir.path(), "concurrency = { noop = 1 }");
    let a = get_job(g.addr, &a_id);
    assert_eq!(a["status"], "zombie", "{a}");
    assert!(a["error"].as_str().unwrap().contains("died"), "{a}");
    assert!(a["message"].as_str().unwrap().contains("died"), "{a}");
    assert!(a["ended_at"].is_string());
    let b = wait_final(g.addr, &b_id, T);
    assert_eq!(b["status"], "done", "{b}");

    // The zombie's stream replays and ends with its closing event.
    let ev = parse_sse(
        &call(
            g.addr,
            "GET",
            &format!("/api/jobs/{a_id}/events"),
            ADMIN,
            None,
        )
        .text(),
    );
    let last = &ev.last().unwrap().1;
    assert_eq!(last["type"], "failed");
    assert_eq!(last["status"], "zombie");
    let (events, torn) = read_log(&log_path(&a));
    assert!(!torn);
    let seqs: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
    // Listing by status sees the new states; ids keep counting up.
    let r = call(g.addr, "GET", "/api/jobs?status=zombie", ADMIN, None);
    assert_eq!(r.json()["data"][0]["id"], a_id.as_str());
    let c = submit_ok(g.addr, "noop", json!({"steps": 0}));
    assert!(c["id"].as_str().unwrap() > b_id.as_str());
}

#[test]
fn kill_9_never_corrupts_the_ledger_or_the_logs() {
    let dir = tempfile::tempdir().unwrap();
    let mut killed: Vec<String> = Vec::new();
    for round in 0..3u64 {
        let g = Gateway::start(dir.path(), "");
        for id in &killed {
            let row = get_job(g.addr, id);
            assert_eq!(row["status"], "zombie", "{row}");
        }
        // No delay: the job writes events (and progress rows) as fast as it can.
        let row = submit_ok(g.addr, "noop", json!({"steps": 100_000, "delay_ms": 0}));
        let id = row["id"].as_str().unwrap().to_owned();
        let log = log_path(&row);
        let deadline = Instant::now() + T;
        while std::fs::metadata(&log).map_or(0, |m| m.len()) < 20_000 + round * 7_919 {
            assert!(Instant::now() < deadline, "job wrote too little");
            std::thread::sleep(Duration::from_millis(2));
        }
        g.kill9();
        let (events, _torn) = read_log(&log);
        assert!(events.len() > 10);
        let seqs: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
        assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
        killed.push(id);
    }
    let g = Gateway::start(dir.path(), "");
    for id in &killed {
        let row = get_job(g.addr, id);
        assert_eq!(row["status"], "zombie", "{row}");
        assert!(row["error"].as_str().unwrap().contains("died"));
        // After restart the torn tail is gone and the log closes cleanly.
        let (events, torn) = read_log(&log_path(&row));
        assert!(!torn);
        assert_eq!(events.last().unwrap()["status"], "zombie");
    }
    let r = call(g.addr, "GET", "/api/jobs?limit=10", ADMIN, None);
    assert_eq!(r.json()["data"].as_array().unwrap().len(), 3);
    let ok = submit_ok(g.addr, "noop", json!({"steps": 1, "delay_ms": 0}));
    assert_eq!(
        wait_final(g.addr, ok["id"].as_str().unwrap(), T)["status"],
        "done"
    );
}

#[test]
fn sigterm_cancels_running_jobs_and_keeps_queued_ones() {
    let dir = tempfile::tempdir().unwrap();
    let g = Gateway::start(dir.path(), "concurrency = { noop = 1 }");
    let a = submit_ok(g.addr, "noop", json!({"steps": 10000, "delay_ms": 20}));
    let a_id = a["id"].as_str().unwrap().to_owned();
    wait_job(g.addr, &a_id, T, |r| r["status"] == "running");
    let b = submit_ok(g.addr, "noop", json!({"steps": 1, "delay_ms": 0}));
    let b_id = b["id"].as_str().unwrap().to_owned();
    let mut follower = SseStream::open(g.addr, &format!("/api/jobs/{a_id}/events"), ADMIN, &[]);
    assert!(follower.next_event().is_some());
    let took = g.sigterm();
    // The follower's stream ended with the job, so draining was quick.
    assert!(took < Duration::from_secs(8), "shutdown took {took:?}");
    let rest = follower.collect_rest();
    assert_eq!(rest.last().unwrap().1["type"], "cancelled", "{rest:?}");

    let g = Gateway::start(dir.path(), "concurrency = { noop = 1 }");
    let a = get_job(g.addr, &a_id);
    assert_eq!(a["status"], "cancelled", "{a}");
    assert!(a["message"].as_str().unwrap().contains("shut down"), "{a}");
    assert_eq!(wait_final(g.addr, &b_id, T)["status"], "done");
}
