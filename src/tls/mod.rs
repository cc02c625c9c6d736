//! Serving TLS: rustls only, TLS 1.2+, certificates reloaded from disk.
//!
//! [`CertReloader`] re-reads the mounted certificate pair and swaps it in
//! atomically, so a rotated Secret is served to new handshakes without a
//! restart and without dropping established connections; [`serve`] runs the
//! HTTPS accept loop with bounded handshakes, header timeouts and a graceful
//! drain.

mod reload;
mod serve;

use std::path::PathBuf;
use std::sync::Arc;

use rustls::SupportedProtocolVersion;
use rustls::server::ServerConfig;

pub use reload::CertReloader;
pub use serve::serve;

/// The only protocol versions served: TLS 1.0 and 1.1 are refused.
pub const PROTOCOL_VERSIONS: &[&SupportedProtocolVersion] =
    &[&rustls::version::TLS13, &rustls::version::TLS12];

/// ALPN protocols offered, preferred first.
pub const ALPN_PROTOCOLS: &[&[u8]] = &[b"h2", b"http/1.1"];

/// Why a certificate pair cannot be served. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path} does not exist; mount the webhook's TLS Secret there or pass its path")]
    Missing { path: PathBuf },
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not PEM: {problem}")]
    NotPem { path: PathBuf, problem: String },
    #[error(
        "{path} holds no CERTIFICATE block (found: {found}); are the certificate and key paths swapped?"
    )]
    NoCertificate { path: PathBuf, found: String },
    #[error(
        "{path} holds no private key block (found: {found}); are the certificate and key paths swapped?"
    )]
    NoPrivateKey { path: PathBuf, found: String },
    #[error("the private key in {path} cannot be used: {reason}")]
    UnusableKey { path: PathBuf, reason: String },
    #[error("the certificate in {path} cannot be parsed: {reason}")]
    BadCertificate { path: PathBuf, reason: String },
    #[error(
        "the certificate in {path} expired at {not_after}; re-issue it, e.g. `volume-gate certs generate --reuse-ca`"
    )]
    Expired {
        path: PathBuf,
        not_after: jiff::Timestamp,
    },
    #[error(
        "the private key in {key} does not match the certificate in {cert}; \
         mount tls.crt and tls.key of the same Secret, or re-issue both with `volume-gate certs generate`"
    )]
    KeyMismatch { cert: PathBuf, key: PathBuf },
}

/// The webhook's rustls configuration: ring, TLS 1.2 and 1.3, no client
/// certificates, ALPN h2 then http/1.1, certificates from `resolver`.
pub fn server_config(resolver: Arc<CertReloader>) -> Arc<ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(PROTOCOL_VERSIONS)
        .expect("the ring provider supports TLS 1.2 and 1.3")
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = ALPN_PROTOCOLS.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_tls_1_2_and_1_3_are_served() {
        let versions: Vec<_> = PROTOCOL_VERSIONS.iter().map(|v| v.version).collect();
        assert_eq!(
            versions,
            [
                rustls::ProtocolVersion::TLSv1_3,
                rustls::ProtocolVersion::TLSv1_2
            ]
        );
    }

    #[test]
    fn server_config_offers_h2_then_http1() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = reload::tests::write_pair(
            dir.path(),
            &crate::certs::generate(&reload::tests::spec(), None).unwrap(),
        );
        let config = server_config(CertReloader::load(cert, key).unwrap());
        assert_eq!(
            config.alpn_protocols,
            [b"h2".to_vec(), b"http/1.1".to_vec()]
        );
    }
}
