//! rustls configurations from PEM files: the client side for `https://`
//! upstreams, the server side for the gateway's own listener
//! (`--tls-cert`/`--tls-key`). Errors name the file and say what was wrong
//! with it, so a bad config entry is refused at start with a message an
//! operator can act on.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig};

/// The certificates in a PEM file (at least one).
pub fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let bytes = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: not a PEM certificate file: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{}: no `BEGIN CERTIFICATE` block in it",
            path.display()
        ));
    }
    Ok(certs)
}

/// The first private key (PKCS#8, PKCS#1 or SEC1) in a PEM file.
pub fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    let bytes = read(path)?;
    PrivateKeyDer::from_pem_slice(&bytes)
        .map_err(|e| format!("{}: no PEM private key in it: {e}", path.display()))
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// What a client trusts and presents.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClientTls<'a> {
    /// PEM bundle of the CAs to trust instead of the built-in Mozilla
    /// roots (a private CA); `None` trusts the built-in roots.
    pub ca_file: Option<&'a Path>,
    /// Certificate chain and key presented to servers that ask for one
    /// (mutual TLS).
    pub client_cert: Option<(&'a Path, &'a Path)>,
}

/// A client configuration offering HTTP/2 and HTTP/1.1 by ALPN.
pub fn client_config(tls: &ClientTls<'_>) -> Result<Arc<ClientConfig>, String> {
    let mut roots = RootCertStore::empty();
    match tls.ca_file {
        Some(path) => {
            for cert in read_certs(path)? {
                roots
                    .add(cert)
                    .map_err(|e| format!("{}: not a usable CA certificate: {e}", path.display()))?;
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?
        .with_root_certificates(roots);
    let mut config = match tls.client_cert {
        Some((cert, key)) => builder
            .with_client_auth_cert(read_certs(cert)?, read_key(key)?)
            .map_err(|e| {
                format!(
                    "{} and {}: not a usable certificate and key: {e}",
                    cert.display(),
                    key.display()
                )
            })?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A server configuration from a certificate chain and its key, speaking
/// HTTP/1.1 (the listener's only protocol).
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, String> {
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?
        .with_no_client_auth()
        .with_single_cert(read_certs(cert)?, read_key(key)?)
        .map_err(|e| {
            format!(
                "{} and {}: not a usable certificate and key: {e}",
                cert.display(),
                key.display()
            )
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// ring: the one crypto provider built in, chosen explicitly so no process
/// default has to be installed. rustls marks ring's provider deprecated
/// because it lacks post-quantum key exchange (X25519MLKEM768, which needs
/// aws-lc-rs and its C build of several minutes); classical X25519 and
/// P-256 remain secure today, and the provider is one line to change.
#[allow(deprecated)]
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A CA and a certificate it signed for `localhost` and 127.0.0.1, as PEM
/// files in `dir`: (CA, certificate, key). For tests of TLS peers.
#[cfg(test)]
pub(crate) fn test_pki(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
    let cert = rcgen::CertificateParams::new(names)
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    let paths = (
        dir.join("ca.pem"),
        dir.join("cert.pem"),
        dir.join("key.pem"),
    );
    std::fs::write(&paths.0, ca_cert.pem()).unwrap();
    std::fs::write(&paths.1, cert.pem()).unwrap();
    std::fs::write(&paths.2, key.serialize_pem()).unwrap();
    paths
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_files_are_named_in_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let e = client_config(&ClientTls {
            ca_file: Some(&missing),
            client_cert: None,
        })
        .unwrap_err();
        assert!(e.contains("missing.pem"), "{e}");
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "not pem").unwrap();
        let e = client_config(&ClientTls {
            ca_file: Some(&junk),
            client_cert: None,
        })
        .unwrap_err();
        assert!(e.contains("junk.pem") && e.contains("CERTIFICATE"), "{e}");
        let e = server_config(&junk, &junk).unwrap_err();
        assert!(e.contains("junk.pem"), "{e}");
    }

    #[test]
    fn the_default_trusts_the_built_in_roots() {
        let config = client_config(&ClientTls::default()).unwrap();
        assert_eq!(config.alpn_protocols[0], b"h2");
    }
}
