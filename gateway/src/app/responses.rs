//! Stored responses of `/v1/responses` (`store: true`): one embedded redb
//! database, `<data_dir>/responses.redb`, so `previous_response_id` and
//! `GET /v1/responses/{id}` work across restarts.
//!
//! A row holds the response as it was answered, the conversation it ended
//! (every message up to and including its output, as the chat template
//! sees them: the next turn's prefix) and its owner's tenant: a response
//! is visible only to keys of the tenant that created it. The `by_age`
//! table orders rows by creation so that the oldest go first when
//! `[responses] max_stored` or `retention_days` is passed (checked on every
//! store).

use std::path::Path;

use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::ResponsesConfig;
use crate::engine::ChatMessage;

const RESPONSES: TableDefinition<&str, &str> = TableDefinition::new("responses");
/// `<created_at, 20 digits>:<id>`, oldest first.
const BY_AGE: TableDefinition<&str, ()> = TableDefinition::new("responses_by_age");

/// One stored response.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StoredResponse {
    pub tenant: String,
    pub created_at: u64,
    /// The response object as it was answered.
    pub response: Value,
    /// The conversation through this response's output.
    pub conversation: Vec<ChatMessage>,
}

#[derive(Debug, thiserror::Error)]
#[error("response store: {0}")]
pub struct StoreError(String);

fn err(e: impl std::fmt::Display) -> StoreError {
    StoreError(e.to_string())
}

pub struct ResponseStore {
    db: Database,
    limits: ResponsesConfig,
}

impl ResponseStore {
    pub fn open(path: &Path, limits: ResponsesConfig) -> Result<ResponseStore, StoreError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let db = Database::create(path).map_err(err)?;
        let tx = db.begin_write().map_err(err)?;
        tx.open_table(RESPONSES).map_err(err)?;
        tx.open_table(BY_AGE).map_err(err)?;
        tx.commit().map_err(err)?;
        Ok(ResponseStore { db, limits })
    }

    /// Whether responses may be stored at all.
    pub fn enabled(&self) -> bool {
        self.limits.max_stored > 0
    }

    /// Stores `row` under `id`, then drops the oldest rows past the limits.
    pub fn put(&self, id: &str, row: &StoredResponse) -> Result<(), StoreError> {
        let text = serde_json::to_string(row).map_err(err)?;
        let tx = self.db.begin_write().map_err(err)?;
        {
            let mut rows = tx.open_table(RESPONSES).map_err(err)?;
            let mut ages = tx.open_table(BY_AGE).map_err(err)?;
            rows.insert(id, text.as_str()).map_err(err)?;
            ages.insert(age_key(row.created_at, id).as_str(), ())
                .map_err(err)?;
            let oldest_kept = row
                .created_at
                .saturating_sub(self.limits.retention_days * 86_400);
            let mut count = rows.len().map_err(err)? as usize;
            let mut doomed = Vec::new();
            for entry in ages.iter().map_err(err)? {
                let (key, _) = entry.map_err(err)?;
                let key = key.value().to_owned();
                let created: u64 = key[..20].parse().unwrap_or(0);
                if count <= self.limits.max_stored && created >= oldest_kept {
                    break;
                }
                count = count.saturating_sub(1);
                doomed.push(key);
            }
            for key in doomed {
                ages.remove(key.as_str()).map_err(err)?;
                rows.remove(&key[21..]).map_err(err)?;
            }
        }
        tx.commit().map_err(err)
    }

    /// The row `id` if `tenant` owns it.
    pub fn get(&self, id: &str, tenant: &str) -> Result<Option<StoredResponse>, StoreError> {
        let tx = self.db.begin_read().map_err(err)?;
        let rows = tx.open_table(RESPONSES).map_err(err)?;
        let Some(text) = rows.get(id).map_err(err)? else {
            return Ok(None);
        };
        let row: StoredResponse = serde_json::from_str(text.value()).map_err(err)?;
        Ok((row.tenant == tenant).then_some(row))
    }

    /// Deletes `id` if `tenant` owns it; whether it did.
    pub fn delete(&self, id: &str, tenant: &str) -> Result<bool, StoreError> {
        let Some(row) = self.get(id, tenant)? else {
            return Ok(false);
        };
        let tx = self.db.begin_write().map_err(err)?;
        {
            let mut rows = tx.open_table(RESPONSES).map_err(err)?;
            let mut ages = tx.open_table(BY_AGE).map_err(err)?;
            rows.remove(id).map_err(err)?;
            ages.remove(age_key(row.created_at, id).as_str())
                .map_err(err)?;
        }
        tx.commit().map_err(err)?;
        Ok(true)
    }
}

fn age_key(created_at: u64, id: &str) -> String {
    format!("{created_at:020}:{id}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(tenant: &str, created_at: u64) -> StoredResponse {
        StoredResponse {
            tenant: tenant.into(),
            created_at,
            response: serde_json::json!({"id": "x"}),
            conversation: vec![ChatMessage::text("user", "hi")],
        }
    }

    #[test]
    fn rows_are_their_tenants_and_the_oldest_go_first() {
        let dir = tempfile::tempdir().unwrap();
        let limits = ResponsesConfig {
            max_stored: 2,
            retention_days: 1,
        };
        let path = dir.path().join("responses.redb");
        let store = ResponseStore::open(&path, limits.clone()).unwrap();
        store.put("resp_a", &row("acme", 1_000_000)).unwrap();
        assert_eq!(
            store.get("resp_a", "acme").unwrap(),
            Some(row("acme", 1_000_000))
        );
        assert_eq!(store.get("resp_a", "globex").unwrap(), None);
        assert!(!store.delete("resp_a", "globex").unwrap());
        store.put("resp_b", &row("acme", 1_000_001)).unwrap();
        store.put("resp_c", &row("acme", 1_000_002)).unwrap();
        // Over max_stored: the oldest went.
        assert_eq!(store.get("resp_a", "acme").unwrap(), None);
        assert!(store.get("resp_b", "acme").unwrap().is_some());
        // Two days later: past retention, both older ones go.
        store
            .put("resp_d", &row("acme", 1_000_000 + 2 * 86_400))
            .unwrap();
        assert_eq!(store.get("resp_b", "acme").unwrap(), None);
        assert_eq!(store.get("resp_c", "acme").unwrap(), None);
        assert!(store.delete("resp_d", "acme").unwrap());
        assert_eq!(store.get("resp_d", "acme").unwrap(), None);
        drop(store);
        // Rows survive a reopen.
        let store = ResponseStore::open(&path, limits).unwrap();
        store.put("resp_e", &row("acme", 5)).unwrap();
        drop(store);
        let store = ResponseStore::open(&path, ResponsesConfig::default()).unwrap();
        assert!(store.get("resp_e", "acme").unwrap().is_some());
    }
}
