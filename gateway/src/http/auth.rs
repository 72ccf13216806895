//! Who may call which URL: the bearer token of a request, the key store
//! that knows the configured keys, and the URL zones each scope opens. The
//! key types themselves ([`Scope`], [`KeyHash`], [`ApiKey`], [`Caller`])
//! live in [`crate::auth`], below the configuration; they are re-exported
//! here.

use std::sync::{Mutex, PoisonError};

use http::HeaderMap;
use http::header::AUTHORIZATION;
use subtle::ConstantTimeEq;

use super::error::ApiError;
pub use crate::auth::{ApiKey, Caller, KeyHash, KeyHashParseError, Scope};

/// URL zones and the scope each needs. Auth is decided by zone, before route
/// matching, so a new route under `/admin/` is admin-only without anyone
/// having to remember it, and unauthenticated callers cannot probe which
/// routes exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Zone {
    /// Health and readiness: no key needed. `/metrics` is here too and
    /// checks its own rule (scrape token, admin key or loopback).
    Public,
    Scoped(Scope),
}

impl Zone {
    pub fn of_path(path: &str) -> Zone {
        let first = path.trim_start_matches('/').split('/').next().unwrap_or("");
        match first {
            "v1" => Zone::Scoped(Scope::Infer),
            "api" => Zone::Scoped(Scope::Jobs),
            "admin" => Zone::Scoped(Scope::Admin),
            _ => Zone::Public,
        }
    }
}

/// The token of an `Authorization: Bearer <token>` header: `None` without
/// the header, an invalid-key error when it holds no bearer token.
pub fn bearer_token(headers: &HeaderMap) -> Option<Result<&str, ApiError>> {
    let header = headers.get(AUTHORIZATION)?;
    let token = header
        .to_str()
        .ok()
        .and_then(|v| {
            let (kind, rest) = v.split_once(' ')?;
            kind.eq_ignore_ascii_case("bearer").then(|| rest.trim())
        })
        .filter(|t| !t.is_empty())
        .ok_or(ApiError::InvalidApiKey);
    Some(token)
}

/// The API key of a request: an `Authorization: Bearer` token, else an
/// `x-api-key` header (how Anthropic's SDKs send it).
pub fn api_key(headers: &HeaderMap) -> Option<Result<&str, ApiError>> {
    bearer_token(headers).or_else(|| {
        let key = headers.get("x-api-key")?;
        Some(
            key.to_str()
                .ok()
                .map(str::trim)
                .filter(|k| !k.is_empty())
                .ok_or(ApiError::InvalidApiKey),
        )
    })
}

/// The key a connection last authenticated with, and its index. A client
/// on a keep-alive connection presents the same key on every request, and
/// comparing it with the one remembered, in constant time, costs a small
/// part of its SHA-256 (about 3,500 instructions, 6% of a proxied request).
/// A different key on the same connection (a proxy in front multiplexing
/// clients) is compared in full, so it never passes as the remembered one.
/// The key's text lives only as long as the connection; keys that fail are
/// not remembered.
#[derive(Default)]
pub struct KeyMemo(Mutex<Option<(Box<[u8]>, usize)>>);

impl std::fmt::Debug for KeyMemo {
    /// Never the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyMemo(..)")
    }
}

/// All keys the server accepts (config `[[keys]]` plus `MLXGATE_ADMIN_KEY`).
#[derive(Debug, Clone)]
pub struct KeyStore {
    keys: Vec<ApiKey>,
    /// The caller of each key, in `keys`' order, made once.
    callers: Vec<Caller>,
    /// The caller of open inference (no keys configured).
    anonymous: Caller,
}

impl Default for KeyStore {
    fn default() -> Self {
        KeyStore::new(Vec::new())
    }
}

impl KeyStore {
    pub fn new(keys: Vec<ApiKey>) -> Self {
        let callers = keys.iter().map(ApiKey::caller).collect();
        KeyStore {
            keys,
            callers,
            anonymous: Caller::anonymous(Scope::Infer),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// For routes that need more than their URL zone's scope (e.g. admin
    /// actions under `/v1/`): `caller` must hold `scope`; with no keys
    /// configured at all, such actions are closed.
    pub fn require(&self, caller: Option<&Caller>, scope: Scope) -> Result<(), ApiError> {
        match caller {
            Some(c) if c.has(scope) => Ok(()),
            _ if self.is_empty() => Err(ApiError::ZoneClosed { scope }),
            c => Err(ApiError::InsufficientScope {
                key_id: c.map_or_else(|| Caller::ANONYMOUS.into(), |c| c.key_id.to_string()),
                scope,
            }),
        }
    }

    /// Finds the key whose digest matches `presented`. Every key is compared,
    /// so timing does not depend on which (if any) matched.
    pub fn lookup(&self, presented: &str) -> Option<&ApiKey> {
        self.position(presented).map(|i| &self.keys[i])
    }

    fn position(&self, presented: &str) -> Option<usize> {
        let digest = KeyHash::of(presented);
        let mut found = None;
        for (i, key) in self.keys.iter().enumerate() {
            if key.sha256.ct_eq(&digest) && found.is_none() {
                found = Some(i);
            }
        }
        found
    }

    /// The index of `presented` among the keys, through the connection's
    /// `memo`: the key it last authenticated, compared in constant time,
    /// else the SHA-256 lookup (a key found is remembered).
    fn position_on(&self, presented: &str, memo: &KeyMemo) -> Option<usize> {
        let mut known = memo.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((key, i)) = known.as_ref()
            && key.len() == presented.len()
            && bool::from(key.ct_eq(presented.as_bytes()))
        {
            return Some(*i);
        }
        let i = self.position(presented)?;
        *known = Some((presented.as_bytes().into(), i));
        Some(i)
    }

    /// Decides whether a request in `scope`'s zone may proceed and who it is;
    /// `memo` is the connection's (see [`KeyMemo`]).
    ///
    /// With no key configured at all, inference is open (startup refuses that
    /// on a non-loopback host unless explicitly allowed) and every other zone
    /// is closed.
    pub fn authorize(
        &self,
        headers: &HeaderMap,
        scope: Scope,
        memo: &KeyMemo,
    ) -> Result<Caller, ApiError> {
        if self.keys.is_empty() {
            return match scope {
                Scope::Infer => Ok(self.anonymous.clone()),
                other => Err(ApiError::ZoneClosed { scope: other }),
            };
        }
        let token = api_key(headers).ok_or(ApiError::MissingApiKey)??;
        let i = self
            .position_on(token, memo)
            .ok_or(ApiError::InvalidApiKey)?;
        let caller = &self.callers[i];
        if !caller.has(scope) {
            return Err(ApiError::InsufficientScope {
                key_id: caller.key_id.to_string(),
                scope,
            });
        }
        Ok(caller.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn store() -> KeyStore {
        KeyStore::new(vec![ApiKey {
            id: "k1".into(),
            tenant: "acme".into(),
            scopes: vec![Scope::Infer],
            sha256: KeyHash::of("secret"),
            max_concurrent_requests: None,
        }])
    }

    fn bearer(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(AUTHORIZATION, HeaderValue::from_str(v).unwrap());
        h
    }

    #[test]
    fn authorize_outcomes() {
        let s = store();
        assert!(matches!(
            s.authorize(&HeaderMap::new(), Scope::Infer, &KeyMemo::default()),
            Err(ApiError::MissingApiKey)
        ));
        assert!(matches!(
            s.authorize(&bearer("Bearer nope"), Scope::Infer, &KeyMemo::default()),
            Err(ApiError::InvalidApiKey)
        ));
        assert!(matches!(
            s.authorize(&bearer("Basic secret"), Scope::Infer, &KeyMemo::default()),
            Err(ApiError::InvalidApiKey)
        ));
        assert!(matches!(
            s.authorize(&bearer("Bearer secret"), Scope::Admin, &KeyMemo::default()),
            Err(ApiError::InsufficientScope { .. })
        ));
        let c = s
            .authorize(&bearer("bearer secret"), Scope::Infer, &KeyMemo::default())
            .unwrap();
        assert_eq!((&*c.key_id, &*c.tenant), ("k1", "acme"));
    }

    #[test]
    fn a_connection_remembers_its_key_but_never_passes_another() {
        let s = KeyStore::new(vec![
            ApiKey::for_test("a", &[Scope::Infer], "key-a"),
            ApiKey::for_test("b", &[Scope::Infer, Scope::Admin], "key-b"),
        ]);
        let memo = KeyMemo::default();
        let who = |token: &str| {
            s.authorize(&bearer(&format!("Bearer {token}")), Scope::Infer, &memo)
                .map(|c| c.key_id.to_string())
                .map_err(|e| e.code())
        };
        assert_eq!(who("key-a"), Ok("a".into()));
        assert_eq!(who("key-a"), Ok("a".into()));
        // Same length, one byte off: refused, and the memo keeps key-a.
        assert_eq!(who("key-c"), Err("invalid_api_key"));
        assert_eq!(who("key-"), Err("invalid_api_key"));
        assert_eq!(who("key-b"), Ok("b".into()));
        assert_eq!(who("key-a"), Ok("a".into()));
        let scope = s.authorize(&bearer("Bearer key-a"), Scope::Admin, &memo);
        assert!(matches!(scope, Err(ApiError::InsufficientScope { .. })));
    }

    #[test]
    fn no_keys_opens_inference_only() {
        let s = KeyStore::default();
        assert!(
            s.authorize(&HeaderMap::new(), Scope::Infer, &KeyMemo::default())
                .unwrap()
                .is_anonymous()
        );
        assert!(matches!(
            s.authorize(&HeaderMap::new(), Scope::Admin, &KeyMemo::default()),
            Err(ApiError::ZoneClosed { .. })
        ));
    }

    #[test]
    fn zones() {
        assert_eq!(Zone::of_path("/v1/models"), Zone::Scoped(Scope::Infer));
        assert_eq!(Zone::of_path("/admin/x"), Zone::Scoped(Scope::Admin));
        assert_eq!(Zone::of_path("/api/jobs"), Zone::Scoped(Scope::Jobs));
        assert_eq!(Zone::of_path("/healthz"), Zone::Public);
        assert_eq!(Zone::of_path("/v1x"), Zone::Public);
    }
}
