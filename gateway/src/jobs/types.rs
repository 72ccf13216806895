//! The job vocabulary shared by the ledger, the runner, every job kind and
//! the HTTP layer: kinds, statuses, rows and the streamed event grammar
//! (`started` -> `log` / `stage` / `metric` -> `done` | `failed` | `cancelled`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// What a job does. `dataset`, `quantize` and `finetune` are the heavy kinds
/// (they also need the admin scope).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobKind {
    Noop,
    Crash,
    Dataset,
    Quantize,
    Finetune,
}

impl JobKind {
    pub const ALL: [JobKind; 5] = [
        JobKind::Noop,
        JobKind::Crash,
        JobKind::Dataset,
        JobKind::Quantize,
        JobKind::Finetune,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            JobKind::Noop => "noop",
            JobKind::Crash => "crash",
            JobKind::Dataset => "dataset",
            JobKind::Quantize => "quantize",
            JobKind::Finetune => "finetune",
        }
    }

    /// Kinds that read or write the file system or burn real compute need
    /// the `admin` scope to submit; `noop` and `crash` only `jobs`.
    pub fn needs_admin(self) -> bool {
        matches!(
            self,
            JobKind::Dataset | JobKind::Quantize | JobKind::Finetune
        )
    }
}

impl fmt::Display for JobKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for JobKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        JobKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown job kind `{s}`; expected noop, crash, dataset, quantize or finetune"
                )
            })
    }
}

/// Where a job stands. `done`, `failed`, `zombie` and `cancelled` are final.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobStatus {
    Queued,
    Running,
    Done,
    Failed,
    /// It was running when the gateway process died.
    Zombie,
    Cancelled,
}

impl JobStatus {
    pub const ALL: [JobStatus; 6] = [
        JobStatus::Queued,
        JobStatus::Running,
        JobStatus::Done,
        JobStatus::Failed,
        JobStatus::Zombie,
        JobStatus::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            JobStatus::Queued => "queued",
            JobStatus::Running => "running",
            JobStatus::Done => "done",
            JobStatus::Failed => "failed",
            JobStatus::Zombie => "zombie",
            JobStatus::Cancelled => "cancelled",
        }
    }

    pub fn is_final(self) -> bool {
        !matches!(self, JobStatus::Queued | JobStatus::Running)
    }

    /// The allowed moves; everything else is a bug or a race lost to a
    /// cancel, and the ledger refuses it.
    pub fn can_become(self, next: JobStatus) -> bool {
        use JobStatus::*;
        matches!(
            (self, next),
            (Queued, Running | Cancelled | Failed) | (Running, Done | Failed | Cancelled | Zombie)
        )
    }
}

impl fmt::Display for JobStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for JobStatus {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        JobStatus::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown job status `{s}`; expected queued, running, done, failed, zombie or cancelled"
                )
            })
    }
}

/// One persisted job, as stored in the ledger and returned by the API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRow {
    pub id: String,
    pub kind: JobKind,
    pub status: JobStatus,
    /// The submitted config, as given.
    pub config: Value,
    /// 0..=1.
    pub progress: f64,
    pub message: Option<String>,
    /// The job's NDJSON event log.
    pub log_path: String,
    pub output_path: Option<String>,
    pub error: Option<String>,
    /// Who submitted it (API key id), when known.
    #[serde(default)]
    pub submitted_by: Option<String>,
    /// The tenant of the key that submitted it, which owns it: any key of
    /// that tenant, and admin-scope callers, may see and cancel it; to other
    /// callers it does not exist. Rows from before jobs had owners have none
    /// and are the admins' only.
    #[serde(default)]
    pub tenant: Option<String>,
    /// RFC 3339 UTC times.
    pub created_at: String,
    pub started_at: Option<String>,
    pub ended_at: Option<String>,
    /// Pid of the process that ran (or runs) it; tells a restarted gateway
    /// that a `running` row belongs to a process that is gone.
    #[serde(default)]
    pub pid: Option<u32>,
    /// The final summary (`done` event's `summary`), if any.
    #[serde(default)]
    pub summary: Option<Value>,
}

impl JobRow {
    /// Whether a caller of `tenant` (an admin-scope one when `admin`) may
    /// see, follow and cancel this job.
    pub fn visible_to(&self, tenant: &str, admin: bool) -> bool {
        admin || self.tenant.as_deref() == Some(tenant)
    }
}

/// One event a job reports. Extra fields ride along in `extra` and are
/// flattened into the NDJSON line, as the seed grammar allows. The time
/// (`ts`) and sequence number are added when the event is stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum JobEvent {
    /// `ts` (on every stored event) is the start time.
    Started {},
    Log {
        line: String,
    },
    Stage {
        stage: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        progress: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message: Option<String>,
        #[serde(flatten)]
        extra: Map<String, Value>,
    },
    Metric {
        /// `train` | `val` for training; other kinds name their own.
        kind: String,
        step: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        loss: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        progress: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message: Option<String>,
        #[serde(flatten)]
        extra: Map<String, Value>,
    },
    Done {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        output_dir: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        summary: Option<Value>,
    },
    Failed {
        error: String,
        /// `zombie` when the job died with the process rather than failing.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        status: Option<JobStatus>,
    },
    Cancelled {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message: Option<String>,
    },
}

impl JobEvent {
    pub fn log(line: impl Into<String>) -> Self {
        JobEvent::Log { line: line.into() }
    }

    pub fn stage(stage: impl Into<String>, progress: Option<f64>, message: Option<String>) -> Self {
        JobEvent::Stage {
            stage: stage.into(),
            progress,
            message,
            extra: Map::new(),
        }
    }

    /// Whether the stream ends after this event.
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            JobEvent::Done { .. } | JobEvent::Failed { .. } | JobEvent::Cancelled { .. }
        )
    }

    /// The progress and message this event reports for the row, if any.
    pub fn row_update(&self) -> Option<(Option<f64>, Option<&str>)> {
        match self {
            JobEvent::Stage {
                progress, message, ..
            }
            | JobEvent::Metric {
                progress, message, ..
            } if progress.is_some() || message.is_some() => Some((*progress, message.as_deref())),
            _ => None,
        }
    }
}

/// An event as stored: its place in the job's log and when it was written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredEvent {
    pub seq: u64,
    /// Unix seconds (fractional) when it was written.
    pub ts: f64,
    #[serde(flatten)]
    pub event: JobEvent,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_serialize_flat_with_the_seed_grammar() {
        let e = StoredEvent {
            seq: 3,
            ts: 1.5,
            event: JobEvent::Stage {
                stage: "load".into(),
                progress: Some(0.5),
                message: None,
                extra: Map::from_iter([("tensor".to_string(), Value::from("w"))]),
            },
        };
        let text = serde_json::to_string(&e).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["type"], "stage");
        assert_eq!(v["seq"], 3);
        assert_eq!(v["tensor"], "w");
        let back: StoredEvent = serde_json::from_str(&text).unwrap();
        assert_eq!(back, e);
        let done: StoredEvent =
            serde_json::from_str(r#"{"seq":9,"ts":2.0,"type":"done","output_dir":"/x"}"#).unwrap();
        assert!(done.event.is_terminal());
    }

    #[test]
    fn rows_are_visible_to_their_tenant_and_admins_and_old_rows_to_admins_only() {
        // A row written before jobs had owners has no `tenant` field.
        let old: JobRow = serde_json::from_value(serde_json::json!({
            "id": "job-000000000001", "kind": "noop", "status": "done", "config": {},
            "progress": 1.0, "message": null, "log_path": "x", "output_path": null,
            "error": null, "submitted_by": "worker", "created_at": "t",
            "started_at": null, "ended_at": null
        }))
        .unwrap();
        assert_eq!(old.tenant, None);
        assert!(!old.visible_to("t", false));
        assert!(old.visible_to("t", true));
        let mine = JobRow {
            tenant: Some("t".into()),
            ..old
        };
        assert!(mine.visible_to("t", false));
        assert!(!mine.visible_to("u", false));
        assert!(mine.visible_to("u", true));
    }

    #[test]
    fn transitions() {
        assert!(JobStatus::Queued.can_become(JobStatus::Running));
        assert!(JobStatus::Running.can_become(JobStatus::Zombie));
        assert!(!JobStatus::Done.can_become(JobStatus::Running));
        assert!(!JobStatus::Queued.can_become(JobStatus::Done));
    }
}
