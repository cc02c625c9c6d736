//! The serving certificate pair, re-read from disk and swapped atomically.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use jiff::Timestamp;
use rustls::InconsistentKeys;
use rustls::pki_types::pem::{self, PemObject, SectionKind};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::TlsError;

/// A zero interval would make tokio's timer panic.
const MIN_INTERVAL: Duration = Duration::from_millis(10);

/// Serves the certificate pair found at two paths and follows their changes.
///
/// Secret volumes are updated by swapping a `..data` symlink, which inotify on
/// the file paths does not reliably report; the files are therefore re-read
/// every interval and compared byte for byte.
pub struct CertReloader {
    cert_path: PathBuf,
    key_path: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
    disk: Mutex<DiskState>,
    generation: AtomicU64,
}

#[derive(Clone, PartialEq, Eq)]
struct Pair {
    cert: Vec<u8>,
    key: Vec<u8>,
}

/// What the files held at the last look, good or bad, so that an unchanged
/// bad state is reported once rather than every interval.
#[derive(PartialEq, Eq)]
enum Observed {
    Pair(Pair),
    Unreadable(String),
}

struct DiskState {
    served: Pair,
    last: Observed,
}

/// The outcome of one look at the files.
#[derive(Debug)]
pub(super) enum Reload {
    Unchanged,
    /// The files are back to the pair being served after being unusable.
    Restored,
    Swapped {
        generation: u64,
    },
    /// The files changed to something that cannot be served; the previous pair stays.
    Rejected(TlsError),
}

impl CertReloader {
    /// Loads the pair, failing with an error that names the file at fault.
    pub fn load(
        cert_path: impl AsRef<Path>,
        key_path: impl AsRef<Path>,
    ) -> Result<Arc<Self>, TlsError> {
        let (cert_path, key_path) = (
            cert_path.as_ref().to_path_buf(),
            key_path.as_ref().to_path_buf(),
        );
        let pair = read_pair(&cert_path, &key_path)?;
        let certified = parse_pair(&pair, &cert_path, &key_path)?;
        if let Some(not_after) = expired(&certified) {
            // Refusing to start would not help: a renewed pair is picked up once mounted.
            warn!(cert = %cert_path.display(), %not_after, "the serving certificate has expired; clients will refuse it");
        }
        Ok(Arc::new(Self {
            cert_path,
            key_path,
            current: RwLock::new(Arc::new(certified)),
            disk: Mutex::new(DiskState {
                served: pair.clone(),
                last: Observed::Pair(pair),
            }),
            generation: AtomicU64::new(0),
        }))
    }

    /// Re-reads the files every `interval` until `shutdown`, swapping in a
    /// changed pair; a pair that cannot be served is logged and ignored.
    pub fn spawn_reload(self: &Arc<Self>, interval: Duration, shutdown: CancellationToken) {
        let reloader = Arc::clone(self);
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(interval.max(MIN_INTERVAL));
            ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
            // The first tick completes at once, and `load` has just read the files.
            ticks.tick().await;
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    _ = ticks.tick() => {}
                }
                let this = Arc::clone(&reloader);
                match tokio::task::spawn_blocking(move || this.reload_if_changed()).await {
                    Ok(outcome) => reloader.log(outcome),
                    Err(e) => warn!(error = %e, "serving certificate reload task failed"),
                }
            }
        });
    }

    /// How many times a new pair has been swapped in since `load`.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// When the certificate new handshakes are given expires (Unix seconds).
    pub fn not_after(&self) -> Option<i64> {
        leaf_not_after(&self.current_leaf_der()).map(|t| t.as_second())
    }

    /// DER of the end-entity certificate new handshakes are given.
    pub fn current_leaf_der(&self) -> Vec<u8> {
        self.current()
            .end_entity_cert()
            .map(|c| c.to_vec())
            .unwrap_or_default()
    }

    fn current(&self) -> Arc<CertifiedKey> {
        // The lock only guards an Arc assignment: a poisoned lock holds a valid pair.
        Arc::clone(&self.current.read().unwrap_or_else(PoisonError::into_inner))
    }

    pub(super) fn reload_if_changed(&self) -> Reload {
        let mut disk = self.disk.lock().unwrap_or_else(PoisonError::into_inner);
        let read = read_pair(&self.cert_path, &self.key_path);
        let observed = match &read {
            Ok(pair) => Observed::Pair(pair.clone()),
            Err(e) => Observed::Unreadable(e.to_string()),
        };
        if observed == disk.last {
            return Reload::Unchanged;
        }
        disk.last = observed;
        let pair = match read {
            Ok(pair) => pair,
            Err(e) => return Reload::Rejected(e),
        };
        if pair == disk.served {
            return Reload::Restored;
        }
        let certified = match parse_pair(&pair, &self.cert_path, &self.key_path) {
            Ok(certified) => certified,
            Err(e) => return Reload::Rejected(e),
        };
        if let Some(not_after) = expired(&certified) {
            return Reload::Rejected(TlsError::Expired {
                path: self.cert_path.clone(),
                not_after,
            });
        }
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(certified);
        disk.served = pair;
        Reload::Swapped {
            generation: self.generation.fetch_add(1, Ordering::AcqRel) + 1,
        }
    }

    fn log(&self, outcome: Reload) {
        let cert = self.cert_path.display();
        match outcome {
            Reload::Unchanged => {}
            Reload::Restored => {
                info!(%cert, "serving certificate files are usable again and unchanged")
            }
            Reload::Swapped { generation } => {
                let not_after = leaf_not_after(&self.current_leaf_der())
                    .map(|t| t.to_string())
                    .unwrap_or_default();
                info!(%cert, generation, not_after, "serving certificate reloaded; new handshakes use it");
            }
            Reload::Rejected(error) => {
                warn!(%cert, key = %self.key_path.display(), %error, "keeping the previous serving certificate")
            }
        }
    }
}

impl ResolvesServerCert for CertReloader {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

impl fmt::Debug for CertReloader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertReloader")
            .field("cert_path", &self.cert_path)
            .field("key_path", &self.key_path)
            .field("generation", &self.generation())
            .finish_non_exhaustive()
    }
}

fn read_pair(cert_path: &Path, key_path: &Path) -> Result<Pair, TlsError> {
    let mut cert = read_file(cert_path)?;
    // A `..data` swap between the two reads tears the pair; a certificate that
    // changed while the key was read says so, and a second look heals it.
    for _ in 0..3 {
        let key = read_file(key_path)?;
        let again = read_file(cert_path)?;
        if again == cert {
            return Ok(Pair { cert, key });
        }
        cert = again;
    }
    let key = read_file(key_path)?;
    Ok(Pair { cert, key })
}

fn read_file(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound => TlsError::Missing {
            path: path.to_path_buf(),
        },
        _ => TlsError::Read {
            path: path.to_path_buf(),
            source,
        },
    })
}

fn parse_pair(pair: &Pair, cert_path: &Path, key_path: &Path) -> Result<CertifiedKey, TlsError> {
    let sections = pem_sections(&pair.cert, cert_path)?;
    let chain: Vec<CertificateDer<'static>> = sections
        .iter()
        .filter(|(kind, _)| *kind == SectionKind::Certificate)
        .map(|(_, der)| CertificateDer::from(der.clone()))
        .collect();
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            path: cert_path.to_path_buf(),
            found: kinds(&sections),
        });
    }

    let sections = pem_sections(&pair.key, key_path)?;
    let found = kinds(&sections);
    let key = sections
        .into_iter()
        .find_map(|(kind, der)| PrivateKeyDer::from_pem(kind, der))
        .ok_or_else(|| TlsError::NoPrivateKey {
            path: key_path.to_path_buf(),
            found,
        })?;
    let signing_key = rustls::crypto::ring::sign::any_supported_type(&key).map_err(|e| {
        TlsError::UnusableKey {
            path: key_path.to_path_buf(),
            reason: e.to_string(),
        }
    })?;

    let certified = CertifiedKey::new(chain, signing_key);
    match certified.keys_match() {
        // Unknown: the key type cannot report its public half; rustls accepts that too.
        Ok(()) | Err(rustls::Error::InconsistentKeys(InconsistentKeys::Unknown)) => Ok(certified),
        Err(rustls::Error::InconsistentKeys(InconsistentKeys::KeyMismatch)) => {
            Err(TlsError::KeyMismatch {
                cert: cert_path.to_path_buf(),
                key: key_path.to_path_buf(),
            })
        }
        Err(e) => Err(TlsError::BadCertificate {
            path: cert_path.to_path_buf(),
            reason: e.to_string(),
        }),
    }
}

fn pem_sections(bytes: &[u8], path: &Path) -> Result<Vec<(SectionKind, Vec<u8>)>, TlsError> {
    let not_pem = |problem: &str| TlsError::NotPem {
        path: path.to_path_buf(),
        problem: problem.to_string(),
    };
    // The problem is described in our words: pem's own messages may quote the
    // offending line, and this may be a private key.
    let sections = <(SectionKind, Vec<u8>)>::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            not_pem(match e {
                pem::Error::MissingSectionEnd { .. } => "a block has no -----END----- line",
                pem::Error::IllegalSectionStart { .. } => "a -----BEGIN----- line is malformed",
                pem::Error::Base64Decode(_) => "a block's base64 body is invalid",
                pem::Error::SectionTooLarge => "a block is too large",
                _ => "the PEM is malformed",
            })
        })?;
    if sections.is_empty() {
        return Err(not_pem("no -----BEGIN ...----- block found"));
    }
    Ok(sections)
}

fn kinds(sections: &[(SectionKind, Vec<u8>)]) -> String {
    sections
        .iter()
        .map(|(kind, _)| format!("{kind:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The leaf's expiry, if it has passed.
fn expired(certified: &CertifiedKey) -> Option<Timestamp> {
    let not_after = leaf_not_after(certified.end_entity_cert().ok()?)?;
    (not_after < Timestamp::now()).then_some(not_after)
}

fn leaf_not_after(der: &[u8]) -> Option<Timestamp> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    Timestamp::from_second(cert.validity().not_after.timestamp()).ok()
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::certs::{CertBundle, ServingSpec};

    pub(crate) fn spec() -> ServingSpec {
        let mut spec = ServingSpec::new("volume-gate-webhook", "volume-gate");
        spec.extra_sans = vec!["127.0.0.1".into()];
        spec
    }

    pub(crate) fn write_pair(dir: &Path, bundle: &CertBundle) -> (PathBuf, PathBuf) {
        write_files(dir, bundle.tls_cert.as_bytes(), bundle.tls_key.as_bytes())
    }

    fn write_files(dir: &Path, cert: &[u8], key: &[u8]) -> (PathBuf, PathBuf) {
        let (cert_path, key_path) = (dir.join("tls.crt"), dir.join("tls.key"));
        std::fs::write(&cert_path, cert).unwrap();
        std::fs::write(&key_path, key).unwrap();
        (cert_path, key_path)
    }

    fn leaf(bundle: &CertBundle) -> Vec<u8> {
        CertificateDer::from_pem_slice(bundle.tls_cert.as_bytes())
            .unwrap()
            .to_vec()
    }

    fn bundles() -> (CertBundle, CertBundle) {
        let a = crate::certs::generate(&spec(), None).unwrap();
        let b = crate::certs::generate(&spec(), Some(&a.ca)).unwrap();
        (a, b)
    }

    #[test]
    fn load_names_the_missing_file() {
        let dir = tempfile::tempdir().unwrap();
        let err =
            CertReloader::load(dir.path().join("tls.crt"), dir.path().join("tls.key")).unwrap_err();
        assert!(
            matches!(&err, TlsError::Missing { path } if path.ends_with("tls.crt")),
            "{err}"
        );
        assert!(err.to_string().contains("tls.crt does not exist"), "{err}");
    }

    #[test]
    fn load_refuses_a_file_that_is_not_pem() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = write_files(dir.path(), b"\x30\x82\x01\x0a binary DER", b"irrelevant");
        let err = CertReloader::load(cert, key).unwrap_err();
        assert!(
            matches!(&err, TlsError::NotPem { path, .. } if path.ends_with("tls.crt")),
            "{err}"
        );
    }

    #[test]
    fn load_notices_certificate_and_key_paths_swapped() {
        let dir = tempfile::tempdir().unwrap();
        let (a, _) = bundles();
        let (cert, key) = write_pair(dir.path(), &a);
        let err = CertReloader::load(&key, &cert).unwrap_err();
        assert!(
            matches!(&err, TlsError::NoCertificate { path, found } if path.ends_with("tls.key") && found == "PrivateKey"),
            "{err}"
        );
    }

    #[test]
    fn load_refuses_a_key_that_does_not_match_the_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = bundles();
        let (cert, key) = write_files(dir.path(), a.tls_cert.as_bytes(), b.tls_key.as_bytes());
        let err = CertReloader::load(cert, key).unwrap_err();
        assert!(matches!(err, TlsError::KeyMismatch { .. }), "{err}");
        assert!(
            !err.to_string().contains("PRIVATE"),
            "errors never quote key material: {err}"
        );
    }

    #[test]
    fn reload_swaps_a_changed_pair_and_counts_the_swap() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = bundles();
        let (cert, key) = write_pair(dir.path(), &a);
        let reloader = CertReloader::load(cert, key).unwrap();
        assert!(matches!(reloader.reload_if_changed(), Reload::Unchanged));
        assert_eq!(
            (reloader.generation(), reloader.current_leaf_der()),
            (0, leaf(&a))
        );

        write_pair(dir.path(), &b);
        assert!(matches!(
            reloader.reload_if_changed(),
            Reload::Swapped { generation: 1 }
        ));
        assert_eq!(
            (reloader.generation(), reloader.current_leaf_der()),
            (1, leaf(&b))
        );
    }

    #[test]
    fn reload_keeps_serving_the_previous_pair_while_the_new_one_is_bad() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = bundles();
        let (cert, key) = write_pair(dir.path(), &a);
        let reloader = CertReloader::load(cert, key).unwrap();

        write_files(dir.path(), b.tls_cert.as_bytes(), a.tls_key.as_bytes());
        assert!(matches!(
            reloader.reload_if_changed(),
            Reload::Rejected(TlsError::KeyMismatch { .. })
        ));
        assert!(
            matches!(reloader.reload_if_changed(), Reload::Unchanged),
            "an unchanged bad pair is reported once"
        );
        assert_eq!(
            (reloader.generation(), reloader.current_leaf_der()),
            (0, leaf(&a))
        );

        write_pair(dir.path(), &b);
        assert!(matches!(
            reloader.reload_if_changed(),
            Reload::Swapped { generation: 1 }
        ));
        assert_eq!(reloader.current_leaf_der(), leaf(&b));
    }

    #[test]
    fn reload_refuses_to_swap_in_an_expired_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let (a, _) = bundles();
        let (cert, key) = write_pair(dir.path(), &a);
        let reloader = CertReloader::load(cert, key).unwrap();

        let expired_key = rcgen::KeyPair::generate().unwrap();
        let mut params =
            rcgen::CertificateParams::new(vec!["volume-gate-webhook.volume-gate.svc".to_string()])
                .unwrap();
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        let expired_cert = params.self_signed(&expired_key).unwrap();
        write_files(
            dir.path(),
            expired_cert.pem().as_bytes(),
            expired_key.serialize_pem().as_bytes(),
        );

        let outcome = reloader.reload_if_changed();
        assert!(
            matches!(&outcome, Reload::Rejected(TlsError::Expired { not_after, .. }) if not_after.to_string() == "2021-01-01T00:00:00Z"),
            "{outcome:?}"
        );
        assert_eq!(
            (reloader.generation(), reloader.current_leaf_der()),
            (0, leaf(&a))
        );
    }

    #[test]
    fn reload_rides_out_files_that_vanish_and_come_back() {
        let dir = tempfile::tempdir().unwrap();
        let (a, _) = bundles();
        let (cert, key) = write_pair(dir.path(), &a);
        let reloader = CertReloader::load(&cert, &key).unwrap();

        std::fs::remove_file(&cert).unwrap();
        assert!(matches!(
            reloader.reload_if_changed(),
            Reload::Rejected(TlsError::Missing { .. })
        ));
        assert!(matches!(reloader.reload_if_changed(), Reload::Unchanged));
        write_pair(dir.path(), &a);
        assert!(matches!(reloader.reload_if_changed(), Reload::Restored));
        assert_eq!(reloader.generation(), 0);
    }

    #[tokio::test]
    async fn spawned_reload_follows_the_files_until_shutdown() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = bundles();
        let (cert, key) = write_pair(dir.path(), &a);
        let reloader = CertReloader::load(cert, key).unwrap();
        let shutdown = CancellationToken::new();
        reloader.spawn_reload(Duration::from_millis(20), shutdown.clone());

        write_pair(dir.path(), &b);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while reloader.generation() == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the reload task never swapped the new pair in"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(reloader.current_leaf_der(), leaf(&b));
        shutdown.cancel();
    }
}
