//! API keys, scopes and the caller identity: what a configured key is and
//! who a request acts for. No HTTP here; reading a key from a request and
//! checking it against the configured keys is `http::auth`.
//!
//! Keys are only ever held as SHA-256 digests: the config file stores the hex
//! digest and the bootstrap admin key is hashed as soon as it is read, so a
//! leaked config or core dump does not leak usable keys.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

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

/// Who is calling, as established by `http::auth::KeyStore::authorize`.
///
/// The dispatcher inserts it into the request's extensions for every route in
/// an authenticated zone, so handlers and later layers (Wasm routing policies,
/// metrics) read it with `req.extensions().get::<Caller>()`. Made once per
/// key and shared: cloning it (every request does, more than once) copies
/// three pointers, no strings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub key_id: Arc<str>,
    pub tenant: Arc<str>,
    pub scopes: Arc<[Scope]>,
}

impl Caller {
    /// Key id given to callers of open (keyless, loopback-only) inference.
    pub const ANONYMOUS: &'static str = "anonymous";

    pub fn has(&self, scope: Scope) -> bool {
        self.scopes.contains(&scope)
    }

    pub fn is_anonymous(&self) -> bool {
        &*self.key_id == Self::ANONYMOUS
    }

    pub(crate) fn anonymous(scope: Scope) -> Self {
        Caller {
            key_id: Self::ANONYMOUS.into(),
            tenant: Self::ANONYMOUS.into(),
            scopes: [scope].into(),
        }
    }
}

impl ApiKey {
    /// A key of tenant `t` whose secret is `secret`, no concurrency cap
    /// of its own (tests).
    #[cfg(test)]
    pub(crate) fn for_test(id: &str, scopes: &[Scope], secret: &str) -> ApiKey {
        ApiKey {
            id: id.into(),
            tenant: "t".into(),
            scopes: scopes.to_vec(),
            sha256: KeyHash::of(secret),
            max_concurrent_requests: None,
        }
    }

    /// Who a request carrying this key acts as.
    pub fn caller(&self) -> Caller {
        Caller {
            key_id: self.id.as_str().into(),
            tenant: self.tenant.as_str().into(),
            scopes: self.scopes.as_slice().into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
