//! API keys, scopes and the caller identity attached to each request.
//!
//! Keys are only ever held as SHA-256 digests: the config file stores the hex
//! digest and the bootstrap admin key is hashed as soon as it is read, so a
//! leaked config or core dump does not leak usable keys. Lookups compare
//! digests in constant time and always scan every key.

use std::fmt;
use std::str::FromStr;

use http::HeaderMap;
use http::header::AUTHORIZATION;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::error::ApiError;

/// What a key may do. Each URL zone needs one scope (see [`Zone`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// The OpenAI-style inference API under `/v1/`.
    Infer,
    /// The batch jobs API under `/api/`.
    Jobs,
    /// The operator API under `/admin/`.
    Admin,
}

impl Scope {
    pub const ALL: [Scope; 3] = [Scope::Infer, Scope::Jobs, Scope::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Infer => "infer",
            Scope::Jobs => "jobs",
            Scope::Admin => "admin",
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A SHA-256 digest of an API key.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KeyHash([u8; 32]);

/// Why a configured `sha256` value was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("expected 64 hexadecimal characters (a SHA-256 digest; see `mlxgate keys hash`)")]
pub struct KeyHashParseError;

impl KeyHash {
    /// Hashes a plaintext key.
    pub fn of(key: &str) -> Self {
        KeyHash(Sha256::digest(key.as_bytes()).into())
    }

    pub fn to_hex(&self) -> String {
        use std::fmt::Write;
        self.0.iter().fold(String::with_capacity(64), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
    }

    /// Constant-time equality, so response timing reveals nothing about
    /// how much of a digest matched.
    pub fn ct_eq(&self, other: &KeyHash) -> bool {
        self.0.ct_eq(&other.0).into()
    }
}

impl fmt::Debug for KeyHash {
    // Digests are not secret, but keep logs short.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyHash({}…)", &self.to_hex()[..8])
    }
}

impl FromStr for KeyHash {
    type Err = KeyHashParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.len() != 64 {
            return Err(KeyHashParseError);
        }
        let mut out = [0u8; 32];
        for (i, pair) in s.as_bytes().chunks_exact(2).enumerate() {
            let hi = hex_val(pair[0]).ok_or(KeyHashParseError)?;
            let lo = hex_val(pair[1]).ok_or(KeyHashParseError)?;
            out[i] = (hi << 4) | lo;
        }
        Ok(KeyHash(out))
    }
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

impl<'de> Deserialize<'de> for KeyHash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// One configured API key.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    /// Stable name of the key, used in logs and metrics; never the key itself.
    pub id: String,
    /// The tenant the key acts for; policies may route on it.
    pub tenant: String,
    pub scopes: Vec<Scope>,
    /// Hex SHA-256 of the key (`mlxgate keys hash <KEY>`).
    pub sha256: KeyHash,
    /// Most inference requests this key may have in progress at once;
    /// overrides `[server] max_concurrent_requests_per_key` (0: no cap).
    #[serde(default)]
    pub max_concurrent_requests: Option<u32>,
}

/// Who is calling, as established by [`KeyStore::authorize`].
///
/// The dispatcher inserts it into the request's extensions for every route in
/// an authenticated zone, so handlers and later layers (Wasm routing policies,
/// metrics) read it with `req.extensions().get::<Caller>()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub key_id: String,
    pub tenant: String,
    pub scopes: Vec<Scope>,
}

impl Caller {
    /// Key id given to callers of open (keyless, loopback-only) inference.
    pub const ANONYMOUS: &'static str = "anonymous";

    pub fn has(&self, scope: Scope) -> bool {
        self.scopes.contains(&scope)
    }

    pub fn is_anonymous(&self) -> bool {
        self.key_id == Self::ANONYMOUS
    }

    fn anonymous(scope: Scope) -> Self {
        Caller {
            key_id: Self::ANONYMOUS.to_owned(),
            tenant: Self::ANONYMOUS.to_owned(),
            scopes: vec![scope],
        }
    }
}

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

/// All keys the server accepts (config `[[keys]]` plus `MLXGATE_ADMIN_KEY`).
#[derive(Debug, Clone, Default)]
pub struct KeyStore {
    keys: Vec<ApiKey>,
}

impl KeyStore {
    pub fn new(keys: Vec<ApiKey>) -> Self {
        KeyStore { keys }
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
                key_id: c.map_or_else(|| Caller::ANONYMOUS.into(), |c| c.key_id.clone()),
                scope,
            }),
        }
    }

    /// Finds the key whose digest matches `presented`. Every key is compared,
    /// so timing does not depend on which (if any) matched.
    pub fn lookup(&self, presented: &str) -> Option<&ApiKey> {
        let digest = KeyHash::of(presented);
        let mut found = None;
        for key in &self.keys {
            if key.sha256.ct_eq(&digest) && found.is_none() {
                found = Some(key);
            }
        }
        found
    }

    /// Decides whether a request in `scope`'s zone may proceed and who it is.
    ///
    /// With no key configured at all, inference is open (startup refuses that
    /// on a non-loopback host unless explicitly allowed) and every other zone
    /// is closed.
    pub fn authorize(&self, headers: &HeaderMap, scope: Scope) -> Result<Caller, ApiError> {
        if self.keys.is_empty() {
            return match scope {
                Scope::Infer => Ok(Caller::anonymous(scope)),
                other => Err(ApiError::ZoneClosed { scope: other }),
            };
        }
        let token = bearer_token(headers).ok_or(ApiError::MissingApiKey)??;
        let key = self.lookup(token).ok_or(ApiError::InvalidApiKey)?;
        if !key.scopes.contains(&scope) {
            return Err(ApiError::InsufficientScope {
                key_id: key.id.clone(),
                scope,
            });
        }
        Ok(Caller {
            key_id: key.id.clone(),
            tenant: key.tenant.clone(),
            scopes: key.scopes.clone(),
        })
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
    fn hex_round_trip_and_known_digest() {
        let h = KeyHash::of("abc");
        assert_eq!(
            h.to_hex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(h.to_hex().parse::<KeyHash>().unwrap(), h);
        assert!("xyz".parse::<KeyHash>().is_err());
        assert!("g".repeat(64).parse::<KeyHash>().is_err());
    }

    #[test]
    fn authorize_outcomes() {
        let s = store();
        assert!(matches!(
            s.authorize(&HeaderMap::new(), Scope::Infer),
            Err(ApiError::MissingApiKey)
        ));
        assert!(matches!(
            s.authorize(&bearer("Bearer nope"), Scope::Infer),
            Err(ApiError::InvalidApiKey)
        ));
        assert!(matches!(
            s.authorize(&bearer("Basic secret"), Scope::Infer),
            Err(ApiError::InvalidApiKey)
        ));
        assert!(matches!(
            s.authorize(&bearer("Bearer secret"), Scope::Admin),
            Err(ApiError::InsufficientScope { .. })
        ));
        let c = s.authorize(&bearer("bearer secret"), Scope::Infer).unwrap();
        assert_eq!((c.key_id.as_str(), c.tenant.as_str()), ("k1", "acme"));
    }

    #[test]
    fn no_keys_opens_inference_only() {
        let s = KeyStore::default();
        assert!(
            s.authorize(&HeaderMap::new(), Scope::Infer)
                .unwrap()
                .is_anonymous()
        );
        assert!(matches!(
            s.authorize(&HeaderMap::new(), Scope::Admin),
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
