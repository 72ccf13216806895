//! Per-policy call metrics: lock-free counters kept across versions of a
//! policy name, snapshotted for the HTTP layer's Prometheus rendering.

use crate::util::prometheus_label;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use serde::Serialize;

use super::error::FailureKind;
use super::types::PolicyKind;

/// Upper bounds of the latency histogram buckets, in seconds.
pub const LATENCY_BUCKETS_S: [f64; 12] = [
    0.000_005, 0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005,
    0.01, 0.1,
];

#[derive(Debug, Default)]
pub(crate) struct Counters {
    calls: AtomicU64,
    failures: [AtomicU64; FailureKind::ALL.len()],
    buckets: [AtomicU64; LATENCY_BUCKETS_S.len()],
    latency_sum_ns: AtomicU64,
    instances_created: AtomicU64,
    /// The most linear memory any instance has had, in bytes.
    memory_peak: AtomicU64,
    /// Sharded by thread: every proxied request may count here, and one
    /// counter would bounce between the worker threads' caches.
    decisions_reused: [PaddedCounter; REUSE_SHARDS],
}

const REUSE_SHARDS: usize = 8;

/// A counter alone on its cache line.
#[derive(Debug, Default)]
#[repr(align(128))]
struct PaddedCounter(AtomicU64);

/// This thread's shard of a sharded counter.
fn shard() -> usize {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    thread_local! {
        static SHARD: usize = (NEXT.fetch_add(1, Relaxed) as usize) % REUSE_SHARDS;
    }
    SHARD.with(|s| *s)
}

impl Counters {
    pub(crate) fn record(&self, elapsed: Duration, failure: Option<FailureKind>) {
        self.calls.fetch_add(1, Relaxed);
        if let Some(kind) = failure {
            self.failures[kind.index()].fetch_add(1, Relaxed);
        }
        let secs = elapsed.as_secs_f64();
        if let Some(i) = LATENCY_BUCKETS_S.iter().position(|b| secs <= *b) {
            self.buckets[i].fetch_add(1, Relaxed);
        }
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.latency_sum_ns.fetch_add(ns, Relaxed);
    }

    pub(crate) fn instance_created(&self) {
        self.instances_created.fetch_add(1, Relaxed);
    }

    /// An instance's linear memory reached `bytes`.
    pub(crate) fn memory_seen(&self, bytes: usize) {
        self.memory_peak.fetch_max(bytes as u64, Relaxed);
    }

    /// A request answered by a reused decision, without a call.
    pub(crate) fn decision_reused(&self) {
        self.decisions_reused[shard()].0.fetch_add(1, Relaxed);
    }

    pub(crate) fn snapshot(&self, name: &str, kind: PolicyKind) -> PolicyMetrics {
        let mut cumulative = 0;
        let buckets = LATENCY_BUCKETS_S
            .iter()
            .zip(&self.buckets)
            .map(|(le, n)| {
                cumulative += n.load(Relaxed);
                (*le, cumulative)
            })
            .collect();
        PolicyMetrics {
            name: name.to_string(),
            kind,
            calls: self.calls.load(Relaxed),
            failures: FailureKind::ALL
                .iter()
                .map(|k| (*k, self.failures[k.index()].load(Relaxed)))
                .collect(),
            latency_buckets: buckets,
            latency_sum_seconds: self.latency_sum_ns.load(Relaxed) as f64 / 1e9,
            instances_created: self.instances_created.load(Relaxed),
            memory_peak_bytes: self.memory_peak.load(Relaxed),
            decisions_reused: self
                .decisions_reused
                .iter()
                .map(|c| c.0.load(Relaxed))
                .sum(),
        }
    }
}

/// Snapshot of one policy's metrics.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyMetrics {
    pub name: String,
    pub kind: PolicyKind,
    /// All calls, failed ones included (dataset: one per batch or retry).
    pub calls: u64,
    /// Failures by kind, every kind listed.
    pub failures: Vec<(FailureKind, u64)>,
    /// Cumulative counts per upper bound in seconds (Prometheus `le`);
    /// calls slower than the last bound only count in `calls` (`+Inf`).
    pub latency_buckets: Vec<(f64, u64)>,
    pub latency_sum_seconds: f64,
    /// Fresh instances made (first use, after traps, after reuse limits).
    pub instances_created: u64,
    /// The most linear memory any of its instances has had (what a guest
    /// costs: a Rust one a few hundred KiB, a Python one tens of MiB).
    pub memory_peak_bytes: u64,
    /// Requests a router answered with a reused decision, not counted in
    /// `calls` (see `decision-inputs` in the WIT).
    pub decisions_reused: u64,
}

impl PolicyMetrics {
    pub fn failures_of(&self, kind: FailureKind) -> u64 {
        self.failures
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(0, |(_, n)| *n)
    }
}

/// Renders metrics in the Prometheus text format (families
/// `mlxgate_policy_calls_total`, `mlxgate_policy_failures_total`,
/// `mlxgate_policy_call_duration_seconds`, `mlxgate_policy_instances_created_total`,
/// `mlxgate_policy_decisions_reused_total`, and the gauge
/// `mlxgate_policy_memory_peak_bytes`).
pub fn render_prometheus(metrics: &[PolicyMetrics]) -> String {
    let mut out = String::new();
    write_counter(
        &mut out,
        metrics,
        "mlxgate_policy_calls_total",
        "Wasm policy calls.",
        |m| m.calls,
    );
    write_failures(&mut out, metrics);
    write_latencies(&mut out, metrics);
    write_counter(
        &mut out,
        metrics,
        "mlxgate_policy_instances_created_total",
        "Fresh Wasm instances made.",
        |m| m.instances_created,
    );
    write_counter(
        &mut out,
        metrics,
        "mlxgate_policy_decisions_reused_total",
        "Requests answered with a reused router decision, without a call.",
        |m| m.decisions_reused,
    );
    write_family(
        &mut out,
        metrics,
        ("mlxgate_policy_memory_peak_bytes", "gauge"),
        "The most linear memory one of the policy's instances has had.",
        |m| m.memory_peak_bytes,
    );
    out
}

/// A counter family with one series per policy.
fn write_counter(
    out: &mut String,
    metrics: &[PolicyMetrics],
    name: &str,
    help: &str,
    value: fn(&PolicyMetrics) -> u64,
) {
    write_family(out, metrics, (name, "counter"), help, value);
}

/// A family of type `typ` with one series per policy.
fn write_family(
    out: &mut String,
    metrics: &[PolicyMetrics],
    (name, typ): (&str, &str),
    help: &str,
    value: fn(&PolicyMetrics) -> u64,
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {typ}");
    for m in metrics {
        let _ = writeln!(
            out,
            "{name}{{policy=\"{}\",kind=\"{}\"}} {}",
            prometheus_label(&m.name),
            m.kind,
            value(m)
        );
    }
}

/// `mlxgate_policy_failures_total`: one series per policy and failure kind.
fn write_failures(out: &mut String, metrics: &[PolicyMetrics]) {
    out.push_str(
        "# HELP mlxgate_policy_failures_total Failed Wasm policy calls by failure kind.\n",
    );
    out.push_str("# TYPE mlxgate_policy_failures_total counter\n");
    for m in metrics {
        for (kind, n) in &m.failures {
            let _ = writeln!(
                out,
                "mlxgate_policy_failures_total{{policy=\"{}\",kind=\"{}\",failure=\"{}\"}} {}",
                prometheus_label(&m.name),
                m.kind,
                kind,
                n
            );
        }
    }
}

/// `mlxgate_policy_call_duration_seconds`: a latency histogram per policy.
fn write_latencies(out: &mut String, metrics: &[PolicyMetrics]) {
    out.push_str("# HELP mlxgate_policy_call_duration_seconds Wasm policy call latency.\n");
    out.push_str("# TYPE mlxgate_policy_call_duration_seconds histogram\n");
    for m in metrics {
        let labels = format!(
            "policy=\"{}\",kind=\"{}\"",
            prometheus_label(&m.name),
            m.kind
        );
        for (le, n) in &m.latency_buckets {
            let _ = writeln!(
                out,
                "mlxgate_policy_call_duration_seconds_bucket{{{labels},le=\"{le}\"}} {n}"
            );
        }
        let _ = writeln!(
            out,
            "mlxgate_policy_call_duration_seconds_bucket{{{labels},le=\"+Inf\"}} {}",
            m.calls
        );
        let _ = writeln!(
            out,
            "mlxgate_policy_call_duration_seconds_sum{{{labels}}} {}",
            m.latency_sum_seconds
        );
        let _ = writeln!(
            out,
            "mlxgate_policy_call_duration_seconds_count{{{labels}}} {}",
            m.calls
        );
    }
}
