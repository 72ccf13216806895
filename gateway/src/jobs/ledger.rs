//! The job ledger: one embedded redb database, `<data_dir>/jobs.redb`.
//!
//! Rows are JSON values in the `jobs` table keyed by id. Ids are a persisted,
//! zero-padded counter (`job-000000000042`), so key order is submission order
//! and "newest first" is a reverse range scan. The `jobs_index` table holds
//! `status:<status>:<id>`, `kind:<kind>:<id>` and `tenant:<hex tenant>:<id>`
//! keys for filtered listing (rows from before jobs had owners have no tenant
//! key: they are listed to admins only, who list without a tenant filter);
//! rows and index keys change in the same transaction, so they cannot
//! disagree. Status changes commit with `Durability::Immediate` (fsync before
//! `commit` returns); progress updates use `Durability::None`: they are
//! crash-consistent like everything in redb but may be lost with the process,
//! which costs nothing (the next update or final state rewrites them).

use std::path::{Path, PathBuf};

use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};
use serde_json::Value;

use super::types::{JobKind, JobRow, JobStatus};
use crate::util::time::rfc3339_now;

const JOBS: TableDefinition<&str, &str> = TableDefinition::new("jobs");
const INDEX: TableDefinition<&str, ()> = TableDefinition::new("jobs_index");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const NEXT_ID: &str = "next_id";

/// Largest page `list` returns.
pub const MAX_PAGE: usize = 200;

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("job ledger database: {0}")]
    Db(#[from] redb::Error),
    #[error("job ledger row {id} is unreadable: {source}")]
    BadRow {
        id: String,
        source: serde_json::Error,
    },
    #[error("no job `{0}`")]
    NotFound(String),
    #[error("job {id} is {from}; it cannot become {to}")]
    InvalidTransition {
        id: String,
        from: JobStatus,
        to: JobStatus,
    },
}

// redb reports through several error types; fold them into one.
macro_rules! from_redb {
    ($($t:ty),*) => {$(
        impl From<$t> for LedgerError {
            fn from(e: $t) -> Self {
                LedgerError::Db(e.into())
            }
        }
    )*};
}
from_redb!(
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError,
    redb::SetDurabilityError
);

/// Which rows `list` returns.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub status: Option<JobStatus>,
    pub kind: Option<JobKind>,
    /// Only this tenant's jobs (`None`: everyone's, for admins).
    pub tenant: Option<String>,
}

/// Which slice of the newest-first order `list` returns.
#[derive(Debug, Clone)]
pub struct Page {
    /// 1..=[`MAX_PAGE`].
    pub limit: usize,
    /// Return rows older than this id (the previous page's `next_cursor`).
    pub cursor: Option<String>,
}

impl Default for Page {
    fn default() -> Self {
        Page {
            limit: 20,
            cursor: None,
        }
    }
}

/// One page of rows, newest first.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Listing {
    pub data: Vec<JobRow>,
    /// Pass as `cursor` for the next page; `None` on the last page.
    pub next_cursor: Option<String>,
}

/// What a status change also sets on the row.
#[derive(Debug, Clone, Default)]
pub struct Patch {
    pub message: Option<String>,
    pub error: Option<String>,
    pub output_path: Option<String>,
    pub summary: Option<Value>,
}

/// What start-up recovery did.
#[derive(Debug, Default)]
pub struct Recovered {
    /// Rows that were `running` under a dead process, now `zombie`.
    pub zombies: Vec<JobRow>,
    /// Rows still `queued`, oldest first: to run again.
    pub queued: Vec<JobRow>,
}

pub struct Ledger {
    db: Database,
    data_dir: PathBuf,
}

fn status_key(s: JobStatus, id: &str) -> String {
    format!("status:{s}:{id}")
}

fn kind_key(k: JobKind, id: &str) -> String {
    format!("kind:{k}:{id}")
}

/// `tenant:<hex>:`: hex, so that no tenant name can run into another's
/// prefix (a tenant may contain `:`).
fn tenant_prefix(tenant: &str) -> String {
    use std::fmt::Write;
    tenant.bytes().fold(String::from("tenant:"), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    }) + ":"
}

fn parse_row(id: &str, json: &str) -> Result<JobRow, LedgerError> {
    serde_json::from_str(json).map_err(|source| LedgerError::BadRow {
        id: id.to_owned(),
        source,
    })
}

fn encode(row: &JobRow) -> String {
    // A row holds only strings, numbers and JSON values: this cannot fail.
    serde_json::to_string(row).unwrap_or_default()
}

impl Ledger {
    /// Opens (or creates) `<data_dir>/jobs.redb`. redb repairs a database
    /// left open by a killed process on open.
    pub fn open(data_dir: &Path) -> Result<Ledger, LedgerError> {
        std::fs::create_dir_all(data_dir.join("jobs"))
            .map_err(|e| LedgerError::Db(redb::Error::Io(e)))?;
        let db = Database::create(data_dir.join("jobs.redb"))?;
        let txn = db.begin_write()?;
        {
            txn.open_table(JOBS)?;
            txn.open_table(INDEX)?;
            txn.open_table(META)?;
        }
        txn.commit()?;
        Ok(Ledger {
            db,
            data_dir: data_dir.to_owned(),
        })
    }

    /// Where a job's NDJSON event log lives.
    pub fn log_path(&self, id: &str) -> PathBuf {
        self.data_dir.join("jobs").join(format!("{id}.ndjson"))
    }

    /// Records a new `queued` job of `tenant` and returns its row.
    pub fn submit(
        &self,
        kind: JobKind,
        config: Value,
        submitted_by: Option<String>,
        tenant: Option<String>,
    ) -> Result<JobRow, LedgerError> {
        let txn = self.db.begin_write()?;
        let row = {
            let mut meta = txn.open_table(META)?;
            let n = meta.get(NEXT_ID)?.map_or(1, |v| v.value());
            meta.insert(NEXT_ID, n + 1)?;
            let id = format!("job-{n:012}");
            let row = JobRow {
                log_path: self.log_path(&id).display().to_string(),
                id,
                kind,
                status: JobStatus::Queued,
                config,
                progress: 0.0,
                message: None,
                output_path: None,
                error: None,
                submitted_by,
                tenant,
                created_at: rfc3339_now(),
                started_at: None,
                ended_at: None,
                pid: None,
                summary: None,
            };
            txn.open_table(JOBS)?
                .insert(row.id.as_str(), encode(&row).as_str())?;
            let mut index = txn.open_table(INDEX)?;
            index.insert(status_key(row.status, &row.id).as_str(), ())?;
            index.insert(kind_key(row.kind, &row.id).as_str(), ())?;
            if let Some(t) = &row.tenant {
                index.insert(format!("{}{}", tenant_prefix(t), row.id).as_str(), ())?;
            }
            row
        };
        txn.commit()?;
        Ok(row)
    }

    pub fn get(&self, id: &str) -> Result<JobRow, LedgerError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(JOBS)?;
        let json = table
            .get(id)?
            .ok_or_else(|| LedgerError::NotFound(id.to_owned()))?;
        parse_row(id, json.value())
    }

    /// Moves a job to `to` (refusing moves [`JobStatus::can_become`] does
    /// not allow) and applies `patch`; sets start/end times and the pid.
    pub fn transition(&self, id: &str, to: JobStatus, patch: Patch) -> Result<JobRow, LedgerError> {
        self.transition_from(id, None, to, patch)
    }

    /// Like [`Ledger::transition`], but only from status `from` when given
    /// (so that a cancel meant for a queued job cannot stop a running one
    /// behind the runner's back).
    pub fn transition_from(
        &self,
        id: &str,
        from: Option<JobStatus>,
        to: JobStatus,
        patch: Patch,
    ) -> Result<JobRow, LedgerError> {
        let txn = self.db.begin_write()?;
        let row = {
            let mut jobs = txn.open_table(JOBS)?;
            let mut row = {
                let json = jobs
                    .get(id)?
                    .ok_or_else(|| LedgerError::NotFound(id.to_owned()))?;
                parse_row(id, json.value())?
            };
            if !row.status.can_become(to) || from.is_some_and(|f| f != row.status) {
                return Err(LedgerError::InvalidTransition {
                    id: id.to_owned(),
                    from: row.status,
                    to,
                });
            }
            let mut index = txn.open_table(INDEX)?;
            index.remove(status_key(row.status, id).as_str())?;
            index.insert(status_key(to, id).as_str(), ())?;
            apply(&mut row, to, patch);
            jobs.insert(id, encode(&row).as_str())?;
            row
        };
        txn.commit()?;
        Ok(row)
    }

    /// Sets progress (clamped to 0..=1) and/or message on a live row.
    pub fn update_progress(
        &self,
        id: &str,
        progress: Option<f64>,
        message: Option<&str>,
    ) -> Result<(), LedgerError> {
        let mut txn = self.db.begin_write()?;
        txn.set_durability(Durability::None)?;
        {
            let mut jobs = txn.open_table(JOBS)?;
            let mut row = {
                let json = jobs
                    .get(id)?
                    .ok_or_else(|| LedgerError::NotFound(id.to_owned()))?;
                parse_row(id, json.value())?
            };
            if row.status.is_final() {
                return Ok(());
            }
            if let Some(p) = progress.filter(|p| p.is_finite()) {
                row.progress = p.clamp(0.0, 1.0);
            }
            if let Some(m) = message {
                row.message = Some(m.to_owned());
            }
            jobs.insert(id, encode(&row).as_str())?;
        }
        txn.commit()?;
        Ok(())
    }

    /// Rows matching `filter`, newest first, one page at a time.
    pub fn list(&self, filter: &Filter, page: &Page) -> Result<Listing, LedgerError> {
        let limit = page.limit.clamp(1, MAX_PAGE);
        let txn = self.db.begin_read()?;
        let jobs = txn.open_table(JOBS)?;
        let mut data = Vec::with_capacity(limit + 1);
        let cursor = page.cursor.as_deref();
        // The most selective index first; the row is checked against the
        // whole filter either way.
        let prefix = match (&filter.tenant, filter.status, filter.kind) {
            (Some(t), _, _) => Some(tenant_prefix(t)),
            (None, Some(s), _) => Some(format!("status:{s}:")),
            (None, None, Some(k)) => Some(format!("kind:{k}:")),
            (None, None, None) => None,
        };
        match prefix {
            None => {
                let range = match cursor {
                    Some(c) => jobs.range::<&str>(..c)?,
                    None => jobs.range::<&str>(..)?,
                };
                for entry in range.rev() {
                    let (k, v) = entry?;
                    data.push(parse_row(k.value(), v.value())?);
                    if data.len() > limit {
                        break;
                    }
                }
            }
            Some(prefix) => {
                let index = txn.open_table(INDEX)?;
                // ';' sorts right after ':', so this bounds the prefix.
                let end = match cursor {
                    Some(c) => format!("{prefix}{c}"),
                    None => format!("{};", &prefix[..prefix.len() - 1]),
                };
                for entry in index.range::<&str>(prefix.as_str()..end.as_str())?.rev() {
                    let (k, _) = entry?;
                    let key = k.value();
                    let id = &key[prefix.len()..];
                    let Some(json) = jobs.get(id)? else { continue };
                    let row = parse_row(id, json.value())?;
                    let wanted = filter.kind.is_none_or(|kind| kind == row.kind)
                        && filter.status.is_none_or(|status| status == row.status)
                        && filter
                            .tenant
                            .as_ref()
                            .is_none_or(|t| row.tenant.as_ref() == Some(t));
                    if !wanted {
                        continue;
                    }
                    data.push(row);
                    if data.len() > limit {
                        break;
                    }
                }
            }
        }
        let next_cursor = if data.len() > limit {
            data.truncate(limit);
            data.last().map(|r| r.id.clone())
        } else {
            None
        };
        Ok(Listing { data, next_cursor })
    }

    /// Start-up: rows `running` under a previous process become `zombie`
    /// (with the reason); `queued` rows are returned to run again.
    pub fn recover(&self) -> Result<Recovered, LedgerError> {
        let mut out = Recovered::default();
        let txn = self.db.begin_write()?;
        {
            let mut jobs = txn.open_table(JOBS)?;
            let mut index = txn.open_table(INDEX)?;
            let mut running = Vec::new();
            for entry in index.range::<&str>("status:running:".."status:running;")? {
                let (k, _) = entry?;
                running.push(k.value()["status:running:".len()..].to_owned());
            }
            for id in running {
                let mut row = {
                    let Some(json) = jobs.get(id.as_str())? else {
                        continue;
                    };
                    parse_row(&id, json.value())?
                };
                let reason = match row.pid {
                    Some(pid) => {
                        format!("the gateway process (pid {pid}) died while the job was running")
                    }
                    None => "the gateway process died while the job was running".to_owned(),
                };
                index.remove(status_key(row.status, &id).as_str())?;
                index.insert(status_key(JobStatus::Zombie, &id).as_str(), ())?;
                apply(
                    &mut row,
                    JobStatus::Zombie,
                    Patch {
                        message: Some(reason.clone()),
                        error: Some(reason),
                        ..Patch::default()
                    },
                );
                jobs.insert(id.as_str(), encode(&row).as_str())?;
                out.zombies.push(row);
            }
            for entry in index.range::<&str>("status:queued:".."status:queued;")? {
                let (k, _) = entry?;
                let id = &k.value()["status:queued:".len()..];
                if let Some(json) = jobs.get(id)? {
                    out.queued.push(parse_row(id, json.value())?);
                }
            }
        }
        txn.commit()?;
        Ok(out)
    }
}

fn apply(row: &mut JobRow, to: JobStatus, patch: Patch) {
    row.status = to;
    let now = rfc3339_now();
    if to == JobStatus::Running {
        row.started_at = Some(now.clone());
        row.pid = Some(std::process::id());
    }
    if to.is_final() {
        row.ended_at = Some(now);
        if to == JobStatus::Done {
            row.progress = 1.0;
        }
    }
    if patch.message.is_some() {
        row.message = patch.message;
    }
    if patch.error.is_some() {
        row.error = patch.error;
    }
    if patch.output_path.is_some() {
        row.output_path = patch.output_path;
    }
    if patch.summary.is_some() {
        row.summary = patch.summary;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn submit_list_filter_paginate_transition() {
        let dir = tempfile::tempdir().unwrap();
        let l = Ledger::open(dir.path()).unwrap();
        let mut ids = Vec::new();
        for i in 0..7 {
            let kind = if i % 2 == 0 {
                JobKind::Noop
            } else {
                JobKind::Crash
            };
            ids.push(
                l.submit(kind, serde_json::json!({ "i": i }), None, None)
                    .unwrap()
                    .id,
            );
        }
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
        let page =
            |f: &Filter, limit, cursor: Option<String>| l.list(f, &Page { limit, cursor }).unwrap();
        let all = Filter::default();
        let p1 = page(&all, 3, None);
        assert_eq!(
            p1.data.iter().map(|r| &r.id).collect::<Vec<_>>(),
            vec![&ids[6], &ids[5], &ids[4]]
        );
        let p2 = page(&all, 3, p1.next_cursor.clone());
        assert_eq!(p2.data[0].id, ids[3]);
        let p3 = page(&all, 3, p2.next_cursor.clone());
        assert_eq!(p3.data.len(), 1);
        assert!(p3.next_cursor.is_none());

        let noop = Filter {
            kind: Some(JobKind::Noop),
            ..Filter::default()
        };
        let p = page(&noop, 2, None);
        assert_eq!(
            p.data.iter().map(|r| &r.id).collect::<Vec<_>>(),
            vec![&ids[6], &ids[4]]
        );
        assert_eq!(page(&noop, 2, p.next_cursor).data.len(), 2);

        l.transition(&ids[0], JobStatus::Running, Patch::default())
            .unwrap();
        l.update_progress(&ids[0], Some(0.5), Some("half")).unwrap();
        let running = Filter {
            status: Some(JobStatus::Running),
            ..Filter::default()
        };
        let p = page(&running, 10, None);
        assert_eq!(p.data.len(), 1);
        assert_eq!(p.data[0].progress, 0.5);
        assert_eq!(p.data[0].message.as_deref(), Some("half"));
        let both = Filter {
            status: Some(JobStatus::Queued),
            kind: Some(JobKind::Crash),
            tenant: None,
        };
        assert_eq!(page(&both, 10, None).data.len(), 3);

        assert!(matches!(
            l.transition(&ids[1], JobStatus::Done, Patch::default()),
            Err(LedgerError::InvalidTransition { .. })
        ));
        assert!(matches!(l.get("job-nope"), Err(LedgerError::NotFound(_))));
        drop(l);

        let l = Ledger::open(dir.path()).unwrap();
        let r = l.recover().unwrap();
        assert_eq!(r.zombies.len(), 1);
        assert!(r.zombies[0].error.as_deref().unwrap().contains("died"));
        assert_eq!(r.queued.len(), 6);
        assert_eq!(r.queued[0].id, ids[1]);
        assert_eq!(l.get(&ids[0]).unwrap().status, JobStatus::Zombie);
        // The counter survives reopening.
        let next = l.submit(JobKind::Noop, Value::Null, None, None).unwrap();
        assert!(next.id > ids[6]);
    }

    #[test]
    fn tenants_list_only_their_own_rows() {
        let dir = tempfile::tempdir().unwrap();
        let l = Ledger::open(dir.path()).unwrap();
        let submit = |kind, tenant: Option<&str>| {
            l.submit(kind, Value::Null, None, tenant.map(str::to_owned))
                .unwrap()
                .id
        };
        let a1 = submit(JobKind::Noop, Some("a"));
        let _old = submit(JobKind::Noop, None);
        // A tenant whose name starts another's, with the separator in it.
        let _ab = submit(JobKind::Noop, Some("a:b"));
        let a2 = submit(JobKind::Crash, Some("a"));
        let a3 = submit(JobKind::Noop, Some("a"));
        let list = |f: Filter, limit| {
            let p = l
                .list(
                    &f,
                    &Page {
                        limit,
                        cursor: None,
                    },
                )
                .unwrap();
            (
                p.data.into_iter().map(|r| r.id).collect::<Vec<_>>(),
                p.next_cursor,
            )
        };
        let of_a = |kind, status| Filter {
            kind,
            status,
            tenant: Some("a".into()),
        };
        assert_eq!(
            list(of_a(None, None), 10).0,
            vec![a3.clone(), a2.clone(), a1.clone()]
        );
        let (page, cursor) = list(of_a(None, None), 2);
        assert_eq!(page, vec![a3.clone(), a2.clone()]);
        let rest = l
            .list(&of_a(None, None), &Page { limit: 2, cursor })
            .unwrap();
        assert_eq!(rest.data.len(), 1);
        assert_eq!(rest.data[0].id, a1);
        assert_eq!(
            list(of_a(Some(JobKind::Noop), None), 10).0,
            vec![a3.clone(), a1.clone()]
        );
        l.transition(&a1, JobStatus::Running, Patch::default())
            .unwrap();
        assert_eq!(
            list(of_a(None, Some(JobStatus::Running)), 10).0,
            vec![a1.clone()]
        );
        // Nobody else's rows, and the ownerless one only without a tenant.
        assert!(
            list(of_a(None, None), 10)
                .0
                .iter()
                .all(|id| l.get(id).unwrap().tenant.as_deref() == Some("a"))
        );
        assert_eq!(list(Filter::default(), 10).0.len(), 5);
        assert!(
            list(
                Filter {
                    tenant: Some("b".into()),
                    ..Filter::default()
                },
                10
            )
            .0
            .is_empty()
        );
    }
}
