//! Reused routing decisions. A router may declare, once after `init`, which
//! request facts its decisions depend on (`decision-inputs` in the WIT),
//! promising that `route` ignores the backends' state and keeps no state
//! between calls. Its decisions are then pure functions of those facts, so
//! the host calls the guest once per distinct combination of them and
//! answers later requests that agree on them from a table: a lookup instead
//! of a guest call of several microseconds (most of a proxied request's
//! routing cost). The table lives with one loaded version of the policy, so
//! an upload starts it empty.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{PoisonError, RwLock};

use super::bindings::router::mlxgate::policy::types::FactSet;
use super::types::{RequestFacts, RouteDecision};

/// Most decisions kept per policy. Past it the table starts over: distinct
/// combinations beyond this many (say, a policy keyed on a header clients
/// choose freely) cost a guest call each, as without reuse, and never more
/// memory.
const MAX_DECISIONS: usize = 4096;
/// Most bytes of keys and decisions kept per policy; past it the table
/// starts over, as past [`MAX_DECISIONS`]. Keys hold request facts that
/// clients choose (the model name, header values), so a count alone would
/// let long values grow the table without bound.
const MAX_TABLE_BYTES: usize = 4 << 20;
/// Longest key kept. A request whose declared facts encode longer is
/// decided by a guest call and its decision is not kept.
const MAX_KEY_BYTES: usize = 4096;
/// What one kept decision costs beyond its key and strings (map entry,
/// boxes, enum): an estimate, so the byte budget counts short entries too.
const ENTRY_OVERHEAD: usize = 96;

/// Each fact with its WIT name, in WIT order.
const FACTS: [(FactSet, &str); 9] = [
    (FactSet::METHOD, "method"),
    (FactSet::PATH, "path"),
    (FactSet::MODEL, "model"),
    (FactSet::HEADERS, "headers"),
    (FactSet::API_KEY_ID, "api-key-id"),
    (FactSet::TENANT, "tenant"),
    (FactSet::PROMPT_TOKENS, "prompt-tokens"),
    (FactSet::MAX_TOKENS, "max-tokens"),
    (FactSet::STREAMING, "streaming"),
];

/// The WIT names of the facts in `set`, in WIT order.
pub(crate) fn fact_names(set: FactSet) -> Vec<String> {
    FACTS
        .iter()
        .filter(|(f, _)| set.contains(*f))
        .map(|(_, name)| (*name).to_string())
        .collect()
}

/// The set named by `names`; `None` if one is unknown (metadata written by
/// a newer gateway). Dropping an unknown fact from the key would reuse
/// decisions across requests that differ in it.
fn fact_set(names: &[String]) -> Option<FactSet> {
    names.iter().try_fold(FactSet::empty(), |set, name| {
        FACTS.iter().find(|(_, n)| n == name).map(|(f, _)| set | *f)
    })
}

/// The decisions of one loaded router version, keyed by the facts it
/// declared.
pub(crate) struct DecisionTable {
    /// Unique for the process's life (an address could be reused by a
    /// later table), so a thread's memo never answers for another table.
    id: u64,
    inputs: FactSet,
    decisions: RwLock<Decisions>,
}

/// The kept decisions and the bytes they hold.
#[derive(Default)]
struct Decisions {
    map: HashMap<Box<[u8]>, RouteDecision>,
    bytes: usize,
}

/// Bytes `key` and `decision` hold, for the table's budget.
fn entry_bytes(key: &[u8], decision: &RouteDecision) -> usize {
    let strings = match decision {
        RouteDecision::Local { model, .. } => model.len(),
        RouteDecision::Upstream { name, model } => {
            name.len() + model.as_ref().map_or(0, String::len)
        }
        RouteDecision::Reject { message, .. } => message.len(),
    };
    ENTRY_OVERHEAD + key.len() + strings
}

/// The last decision each thread took from a table: its table id, key and
/// decision. Most requests on a worker repeat the facts of the one before,
/// and answering those here touches nothing another thread writes (the
/// table's lock is shared by every worker).
struct Memo {
    table: u64,
    key: Vec<u8>,
    decision: RouteDecision,
}

thread_local! {
    static MEMO: RefCell<Option<Memo>> = const { RefCell::new(None) };
}

fn remember(table: u64, key: &[u8], decision: &RouteDecision) {
    MEMO.with_borrow_mut(|memo| match memo {
        Some(m) => {
            m.table = table;
            m.key.clear();
            m.key.extend_from_slice(key);
            m.decision.clone_from(decision);
        }
        None => {
            *memo = Some(Memo {
                table,
                key: key.to_vec(),
                decision: decision.clone(),
            })
        }
    });
}

impl DecisionTable {
    /// A table for a router whose decisions depend on the facts `names`;
    /// `None` (every request calls the guest) if a name is unknown.
    pub(crate) fn new(names: &[String]) -> Option<Self> {
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        Some(DecisionTable {
            id: NEXT_ID.fetch_add(1, Relaxed),
            inputs: fact_set(names)?,
            decisions: RwLock::new(Decisions::default()),
        })
    }

    /// Whether decisions depend on the prompt's length in tokens (which
    /// costs a tokenization to know).
    pub(crate) fn reads_prompt_tokens(&self) -> bool {
        self.inputs.contains(FactSet::PROMPT_TOKENS)
    }

    /// The facts of `facts` that decisions depend on, encoded without
    /// ambiguity (strings length-prefixed; a missing key id or tenant reads
    /// as "", as guests see it).
    pub(crate) fn key(&self, facts: &RequestFacts) -> Vec<u8> {
        let mut key = Vec::with_capacity(64);
        let text = |key: &mut Vec<u8>, s: &str| {
            key.extend_from_slice(&(s.len() as u64).to_le_bytes());
            key.extend_from_slice(s.as_bytes());
        };
        let has = |f: FactSet| self.inputs.contains(f);
        if has(FactSet::METHOD) {
            text(&mut key, facts.method);
        }
        if has(FactSet::PATH) {
            text(&mut key, facts.path);
        }
        if has(FactSet::MODEL) {
            text(&mut key, facts.model);
        }
        if has(FactSet::HEADERS) {
            key.extend_from_slice(&(facts.headers.len() as u64).to_le_bytes());
            for (name, value) in &facts.headers {
                text(&mut key, name);
                text(&mut key, value);
            }
        }
        if has(FactSet::API_KEY_ID) {
            text(&mut key, facts.api_key_id.unwrap_or_default());
        }
        if has(FactSet::TENANT) {
            text(&mut key, facts.tenant.unwrap_or_default());
        }
        if has(FactSet::PROMPT_TOKENS) {
            key.extend_from_slice(&facts.prompt_tokens.to_le_bytes());
        }
        if has(FactSet::MAX_TOKENS) {
            match facts.max_tokens {
                Some(n) => {
                    key.push(1);
                    key.extend_from_slice(&n.to_le_bytes());
                }
                None => key.push(0),
            }
        }
        if has(FactSet::STREAMING) {
            key.push(u8::from(facts.streaming));
        }
        key
    }

    /// The decision made for `key`, if any: this thread's last one when it
    /// matches, else the table's.
    pub(crate) fn get(&self, key: &[u8]) -> Option<RouteDecision> {
        let memo = MEMO.with_borrow(|memo| {
            memo.as_ref()
                .filter(|m| m.table == self.id && m.key == key)
                .map(|m| m.decision.clone())
        });
        if memo.is_some() {
            return memo;
        }
        let found = self
            .decisions
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .map
            .get(key)
            .cloned();
        if let Some(d) = &found {
            remember(self.id, key, d);
        }
        found
    }

    /// Keeps `decision` for `key`; a full table (by count or bytes) starts
    /// over first. A key over [`MAX_KEY_BYTES`] is not kept.
    pub(crate) fn insert(&self, key: Vec<u8>, decision: RouteDecision) {
        if key.len() > MAX_KEY_BYTES {
            return;
        }
        remember(self.id, &key, &decision);
        let cost = entry_bytes(&key, &decision);
        let mut decisions = self
            .decisions
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if decisions.map.len() >= MAX_DECISIONS || decisions.bytes + cost > MAX_TABLE_BYTES {
            decisions.map = HashMap::new();
            decisions.bytes = 0;
        }
        let key_len = key.len();
        if let Some(old) = decisions.map.insert(key.into_boxed_slice(), decision) {
            // Another thread kept this key first: it is counted once.
            decisions.bytes -= entry_bytes(&[], &old) + key_len;
        }
        decisions.bytes += cost;
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.decisions.read().unwrap().map.len()
    }

    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.decisions.read().unwrap().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts<'a>(model: &'a str, tenant: Option<&'a str>, max: Option<u32>) -> RequestFacts<'a> {
        RequestFacts {
            method: "POST",
            path: "/v1/chat/completions",
            model,
            tenant,
            max_tokens: max,
            ..RequestFacts::default()
        }
    }

    fn known(names: &[String]) -> DecisionTable {
        DecisionTable::new(names).expect("known facts")
    }

    fn local(model: &str) -> RouteDecision {
        RouteDecision::local(model.to_string())
    }

    #[test]
    fn names_round_trip_in_wit_order() {
        let set = FactSet::TENANT | FactSet::MODEL | FactSet::STREAMING;
        let names = fact_names(set);
        assert_eq!(names, ["model", "tenant", "streaming"]);
        assert_eq!(fact_set(&names).unwrap().as_array(), set.as_array());
        // An unknown fact turns reuse off rather than leaving the key.
        let newer = ["model".to_string(), "client-ip".to_string()];
        assert!(fact_set(&newer).is_none());
        assert!(DecisionTable::new(&newer).is_none());
    }

    #[test]
    fn keys_see_only_the_declared_facts() {
        let table = known(&fact_names(FactSet::TENANT | FactSet::MODEL));
        let a = table.key(&facts("m", Some("acme"), Some(5)));
        // Facts outside the declared set do not change the key...
        assert_eq!(a, table.key(&facts("m", Some("acme"), None)));
        // ...declared ones do.
        assert_ne!(a, table.key(&facts("m2", Some("acme"), Some(5))));
        assert_ne!(a, table.key(&facts("m", Some("globex"), Some(5))));
        // A missing tenant is "", as guests see it.
        assert_eq!(
            table.key(&facts("m", None, None)),
            table.key(&facts("m", Some(""), None))
        );
    }

    #[test]
    fn keys_are_unambiguous_across_field_boundaries() {
        let table = known(&fact_names(FactSet::TENANT | FactSet::MODEL));
        assert_ne!(
            table.key(&facts("ab", Some("c"), None)),
            table.key(&facts("a", Some("bc"), None))
        );
        let headers = known(&fact_names(FactSet::HEADERS));
        let with = |h: Vec<(&'static str, &'static str)>| RequestFacts {
            headers: h,
            ..RequestFacts::default()
        };
        assert_ne!(
            headers.key(&with(vec![("x-tenant", "a")])),
            headers.key(&with(vec![("x-tenant", ""), ("a", "")]))
        );
        let max = known(&fact_names(FactSet::MAX_TOKENS));
        assert_ne!(
            max.key(&facts("m", None, None)),
            max.key(&facts("m", None, Some(0)))
        );
    }

    #[test]
    fn a_threads_memo_answers_only_for_its_own_table() {
        let names = fact_names(FactSet::MODEL);
        let (a, b) = (known(&names), known(&names));
        let key = a.key(&facts("m", None, None));
        a.insert(key.clone(), local("from a"));
        assert_eq!(a.get(&key), Some(local("from a")));
        // Same key, other table: not the memo's answer.
        assert_eq!(b.get(&key), None);
        b.insert(key.clone(), local("from b"));
        assert_eq!(b.get(&key), Some(local("from b")));
        assert_eq!(a.get(&key), Some(local("from a")));
        // Another key on the same table misses the memo.
        assert_eq!(a.get(&a.key(&facts("other", None, None))), None);
    }

    #[test]
    fn a_full_table_starts_over() {
        let table = known(&fact_names(FactSet::MODEL));
        for i in 0..MAX_DECISIONS {
            let model = i.to_string();
            table.insert(table.key(&facts(&model, None, None)), local(&model));
        }
        assert_eq!(table.len(), MAX_DECISIONS);
        let key = table.key(&facts("one more", None, None));
        table.insert(key.clone(), local("x"));
        assert_eq!(table.len(), 1);
        assert_eq!(table.get(&key), Some(local("x")));
    }

    #[test]
    fn the_table_is_bounded_in_bytes_and_long_keys_are_not_kept() {
        let table = known(&fact_names(FactSet::MODEL));
        let long = "m".repeat(MAX_KEY_BYTES);
        let key = table.key(&facts(&long, None, None));
        table.insert(key.clone(), local("x"));
        assert_eq!((table.len(), table.get(&key)), (0, None));
        // Keys just under the cap: the byte budget, not the count, ends it.
        for i in 0..2 * MAX_TABLE_BYTES / MAX_KEY_BYTES {
            let model = format!("{i:08}{}", "m".repeat(MAX_KEY_BYTES - 64));
            table.insert(table.key(&facts(&model, None, None)), local("x"));
            assert!(table.bytes() <= MAX_TABLE_BYTES, "{}", table.bytes());
        }
        assert!(table.len() < MAX_DECISIONS);
    }
}
