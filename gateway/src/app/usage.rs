//! Token usage per UTC day, tenant, key, model and backend, kept in redb
//! (`<data_dir>/usage.redb`) so `GET /admin/usage` reports survive
//! restarts. A finished request adds to a map in memory; the map is folded
//! into the database every few seconds and at shutdown, so serving a
//! request writes nothing to disk.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::Serialize;

use crate::util::time::Date;

/// Row key: `day \x1f tenant \x1f key \x1f model \x1f backend` (days as
/// `YYYY-MM-DD` sort in order). Value: requests, prompt, completion and
/// cached tokens.
const USAGE: TableDefinition<&str, (u64, u64, u64, u64)> = TableDefinition::new("usage_by_day");

const SEP: char = '\u{1f}';

/// What one request used, and where it went. The names are shared, not
/// copied: a request's accounting allocates no strings.
#[derive(Debug, Clone)]
pub struct RequestUsage {
    pub tenant: Arc<str>,
    pub key_id: Arc<str>,
    pub model: Arc<str>,
    /// `local`, or the upstream that answered.
    pub backend: Arc<str>,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
}

/// A row's names: tenant, key, model, backend.
type Names = [Arc<str>; 4];

/// One row of a usage report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UsageRow {
    pub date: String,
    pub tenant: String,
    pub key_id: String,
    pub model: String,
    pub backend: String,
    pub requests: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
}

type Counts = (u64, u64, u64, u64);

fn add(a: Counts, b: Counts) -> Counts {
    (a.0 + b.0, a.1 + b.1, a.2 + b.2, a.3 + b.3)
}

pub struct UsageLedger {
    path: PathBuf,
    db: OnceLock<Result<Database, String>>,
    /// Added since the last flush, by UTC day (days since 1970) and names.
    pending: Mutex<HashMap<(i64, Names), Counts, crate::util::FnvBuild>>,
}

impl UsageLedger {
    pub fn new(path: PathBuf) -> UsageLedger {
        UsageLedger {
            path,
            db: OnceLock::new(),
            pending: Mutex::new(HashMap::default()),
        }
    }

    fn db(&self) -> Result<&Database, String> {
        self.db
            .get_or_init(|| {
                let err = |e: &dyn std::fmt::Display| format!("{e} ({})", self.path.display());
                if let Some(dir) = self.path.parent() {
                    std::fs::create_dir_all(dir).map_err(|e| err(&e))?;
                }
                let db = Database::create(&self.path).map_err(|e| err(&e))?;
                let tx = db.begin_write().map_err(|e| err(&e))?;
                tx.open_table(USAGE).map_err(|e| err(&e))?;
                tx.commit().map_err(|e| err(&e))?;
                Ok(db)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Adds one finished request (to today, UTC).
    pub fn record(&self, u: &RequestUsage) {
        let names = [
            Arc::clone(&u.tenant),
            Arc::clone(&u.key_id),
            Arc::clone(&u.model),
            Arc::clone(&u.backend),
        ];
        let key = (crate::util::time::unix_secs() as i64 / 86_400, names);
        let counts = (1, u.prompt_tokens, u.completion_tokens, u.cached_tokens);
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let slot = pending.entry(key).or_default();
        *slot = add(*slot, counts);
    }

    /// Folds what was added since the last flush into the database.
    pub fn flush(&self) -> Result<(), String> {
        let taken = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()));
        if taken.is_empty() {
            return Ok(());
        }
        let pending: Vec<(String, Counts)> = taken
            .iter()
            .map(|((day, names), c)| (row_key(*day, names), *c))
            .collect();
        let write = || -> Result<(), Box<dyn std::error::Error>> {
            let tx = self.db()?.begin_write()?;
            {
                let mut table = tx.open_table(USAGE)?;
                for (key, counts) in &pending {
                    let old = table
                        .get(key.as_str())?
                        .map(|v| v.value())
                        .unwrap_or_default();
                    table.insert(key.as_str(), add(old, *counts))?;
                }
            }
            tx.commit()?;
            Ok(())
        };
        write().map_err(|e| {
            // Kept for the next flush rather than lost.
            let mut again = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            for (key, counts) in taken {
                let slot = again.entry(key).or_default();
                *slot = add(*slot, counts);
            }
            format!("cannot write usage to {}: {e}", self.path.display())
        })
    }

    /// The rows of days `from..=to` (`YYYY-MM-DD`), of `tenant` when given,
    /// what is not flushed yet included, in key order.
    pub fn report(
        &self,
        tenant: Option<&str>,
        from: &str,
        to: &str,
    ) -> Result<Vec<UsageRow>, String> {
        let mut rows: std::collections::BTreeMap<String, Counts> = Default::default();
        let wanted = |key: &str| {
            let mut parts = key.split(SEP);
            let day = parts.next().unwrap_or_default();
            day >= from && day <= to && tenant.is_none_or(|t| parts.next() == Some(t))
        };
        let mut read = || -> Result<(), Box<dyn std::error::Error>> {
            let tx = self.db()?.begin_read()?;
            let table = tx.open_table(USAGE)?;
            for entry in table.range(from..)? {
                let (k, v) = entry?;
                let key = k.value();
                if key.split(SEP).next().is_some_and(|day| day > to) {
                    break;
                }
                if wanted(key) {
                    rows.insert(key.to_owned(), v.value());
                }
            }
            Ok(())
        };
        read().map_err(|e| format!("cannot read usage from {}: {e}", self.path.display()))?;
        for ((day, names), counts) in self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let key = row_key(*day, names);
            if wanted(&key) {
                let slot = rows.entry(key).or_default();
                *slot = add(*slot, *counts);
            }
        }
        Ok(rows
            .into_iter()
            .map(
                |(key, (requests, prompt_tokens, completion_tokens, cached_tokens))| {
                    let mut p = key.split(SEP).map(str::to_owned);
                    let mut next = || p.next().unwrap_or_default();
                    UsageRow {
                        date: next(),
                        tenant: next(),
                        key_id: next(),
                        model: next(),
                        backend: next(),
                        requests,
                        prompt_tokens,
                        completion_tokens,
                        cached_tokens,
                    }
                },
            )
            .collect())
    }
}

/// The database key of `names` on `day` (days since 1970).
fn row_key(day: i64, names: &Names) -> String {
    // The separator cannot occur in a name: it is a control character,
    // which names from the config and models do not carry; strip it anyway.
    let mut key = Date::from_days(day).iso();
    for name in names {
        key.push(SEP);
        key.extend(name.chars().filter(|&c| c != SEP));
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_survives_a_reopen_and_reports_by_tenant_and_day() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("usage.redb");
        let today = Date::today().iso();
        let u = |tenant: &str, prompt| RequestUsage {
            tenant: tenant.into(),
            key_id: "k".into(),
            model: "m".into(),
            backend: "local".into(),
            prompt_tokens: prompt,
            completion_tokens: 2,
            cached_tokens: 0,
        };
        {
            let ledger = UsageLedger::new(path.clone());
            ledger.record(&u("a", 10));
            ledger.flush().unwrap();
            ledger.record(&u("a", 5));
            ledger.record(&u("b", 1));
            // Not flushed yet, still reported.
            let rows = ledger.report(Some("a"), &today, &today).unwrap();
            assert_eq!(
                (rows.len(), rows[0].requests, rows[0].prompt_tokens),
                (1, 2, 15)
            );
            ledger.flush().unwrap();
        }
        let ledger = UsageLedger::new(path);
        let rows = ledger.report(None, "2000-01-01", &today).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(
            (
                rows[0].tenant.as_str(),
                rows[0].requests,
                rows[0].completion_tokens
            ),
            ("a", 2, 4)
        );
        assert_eq!(rows[1].tenant, "b");
        assert!(
            ledger
                .report(None, "2000-01-01", "2000-01-02")
                .unwrap()
                .is_empty()
        );
    }
}
