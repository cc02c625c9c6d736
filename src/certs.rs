//! `volume-gate certs`: a serving CA and certificate minted with rcgen.
//!
//! The CA signs the webhook's serving certificate and goes, base64-encoded,
//! into the `caBundle` of the webhook configurations. Re-issuing the serving
//! certificate from the same CA (`--reuse-ca`) rotates it without touching the
//! `caBundle`; the webhook picks up the new pair without a restart.

use std::fs::{self, OpenOptions, Permissions};
use std::io::{self, Write};
use std::net::IpAddr;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use base64::Engine as _;
use jiff::{SignedDuration, Timestamp};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// File names inside `--out`, as a `kubernetes.io/tls` Secret names its keys.
pub const CA_CERT_FILE: &str = "ca.crt";
pub const CA_KEY_FILE: &str = "ca.key";
pub const TLS_CERT_FILE: &str = "tls.crt";
pub const TLS_KEY_FILE: &str = "tls.key";
pub const CA_BUNDLE_FILE: &str = "ca-bundle.b64";

/// Certificates are valid from a little before now: the clocks of the machine
/// minting them and of the API server verifying them are never quite equal.
const BACKDATE: SignedDuration = SignedDuration::from_mins(5);

#[derive(Debug, Clone, clap::Args)]
pub struct GenerateArgs {
    /// Name of the webhook Service.
    #[arg(long, default_value = "volume-gate-webhook")]
    pub service: String,
    /// Namespace of the webhook Service.
    #[arg(long, default_value = "volume-gate")]
    pub namespace: String,
    /// Directory to write ca.crt, ca.key, tls.crt, tls.key and ca-bundle.b64 into.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Extra subject alternative name for the serving certificate: a DNS name
    /// or an IP address (e.g. 127.0.0.1 for local tests). Repeatable.
    #[arg(long = "san", value_name = "NAME_OR_IP")]
    pub sans: Vec<String>,
    /// Validity of the serving certificate, in days.
    #[arg(long, default_value_t = 365, value_parser = clap::value_parser!(u32).range(1..))]
    pub days: u32,
    /// Validity of the CA, in days.
    #[arg(long, default_value_t = 3650, value_parser = clap::value_parser!(u32).range(1..))]
    pub ca_days: u32,
    /// If DIR/ca.crt and DIR/ca.key exist, keep that CA and issue only a new
    /// serving certificate: rotation without changing the caBundle.
    #[arg(long)]
    pub reuse_ca: bool,
}

impl GenerateArgs {
    pub fn spec(&self) -> ServingSpec {
        ServingSpec {
            service: self.service.clone(),
            namespace: self.namespace.clone(),
            extra_sans: self.sans.clone(),
            days: self.days,
            ca_days: self.ca_days,
        }
    }
}

/// What the serving certificate is for: the webhook Service, and how long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServingSpec {
    pub service: String,
    pub namespace: String,
    /// DNS names or IP addresses, beyond the Service's own names.
    pub extra_sans: Vec<String>,
    pub days: u32,
    pub ca_days: u32,
}

impl ServingSpec {
    pub fn new(service: impl Into<String>, namespace: impl Into<String>) -> Self {
        Self {
            service: service.into(),
            namespace: namespace.into(),
            extra_sans: Vec::new(),
            days: 365,
            ca_days: 3650,
        }
    }

    /// Every name the API server may use to reach the Service, then the extras.
    pub fn subject_alt_names(&self) -> Vec<String> {
        let (svc, ns) = (&self.service, &self.namespace);
        let mut names = vec![
            svc.clone(),
            format!("{svc}.{ns}"),
            format!("{svc}.{ns}.svc"),
            format!("{svc}.{ns}.svc.cluster.local"),
        ];
        for extra in &self.extra_sans {
            if !names.contains(extra) {
                names.push(extra.clone());
            }
        }
        names
    }
}

/// A CA certificate and its private key, PEM-encoded. No `Debug`: it holds a key.
#[derive(Clone)]
pub struct CaPem {
    pub cert: String,
    pub key: String,
}

/// The output of [`generate`]. No `Debug`: it holds keys.
pub struct CertBundle {
    pub ca: CaPem,
    /// The CA was given (`--reuse-ca`), not minted: the caBundle is unchanged.
    pub ca_reused: bool,
    pub ca_not_after: Timestamp,
    pub tls_cert: String,
    pub tls_key: String,
    pub sans: Vec<String>,
    pub not_after: Timestamp,
}

impl CertBundle {
    /// The `caBundle` field of a webhook configuration: base64 of the CA PEM.
    pub fn ca_bundle_b64(&self) -> String {
        base64::engine::general_purpose::STANDARD.encode(self.ca.cert.as_bytes())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    #[error(
        "--{flag} {value:?} is not a valid DNS label (lowercase letters, digits and '-', at most 63)"
    )]
    InvalidName { flag: &'static str, value: String },
    #[error("--san {san:?} is neither an IP address nor a DNS name: {reason}")]
    InvalidSan { san: String, reason: String },
    #[error("a validity of {days} days from now is out of range")]
    Validity { days: u32 },
    #[error("cannot {step}: {source}")]
    Mint {
        step: &'static str,
        source: rcgen::Error,
    },
    #[error(
        "--reuse-ca: {present} exists but {missing} does not; restore it, or remove {present} to mint a new CA \
         (then update the caBundle of the webhook configurations)"
    )]
    CaIncomplete { present: PathBuf, missing: PathBuf },
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("--reuse-ca: the CA cannot be reused: {reason}")]
    CaUnusable { reason: String },
    #[error(
        "--reuse-ca: ca.key is not the private key of ca.crt; restore the matching pair or mint a new CA"
    )]
    CaKeyMismatch,
    #[error(
        "the CA expires at {ca_not_after}, before the serving certificate would ({not_after}); \
         mint a new CA (run without --reuse-ca, then update the caBundle) or lower --days"
    )]
    CaExpiresFirst {
        ca_not_after: Timestamp,
        not_after: Timestamp,
    },
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
}

/// Mints a serving certificate for `spec`, signed by `existing_ca` when given
/// (the caBundle stays valid) or by a new CA.
pub fn generate(spec: &ServingSpec, existing_ca: Option<&CaPem>) -> Result<CertBundle, CertsError> {
    check_dns_label("service", &spec.service)?;
    check_dns_label("namespace", &spec.namespace)?;
    let sans = spec.subject_alt_names();
    let san_types = sans
        .iter()
        .map(|s| san_type(s))
        .collect::<Result<Vec<_>, _>>()?;

    let now = Timestamp::from_second(Timestamp::now().as_second())
        .expect("the current second is a valid timestamp");
    let not_before = now - BACKDATE;
    let not_after = days_from(now, spec.days)?;

    let (ca, ca_not_after, ca_reused, leaf) = match existing_ca {
        Some(ca) => {
            let (issuer, ca_not_after) = reusable_ca(ca)?;
            check_within_ca(ca_not_after, not_after)?;
            let leaf = issue_serving_cert(spec, san_types, not_before, not_after, &issuer)?;
            (ca.clone(), ca_not_after, true, leaf)
        }
        None => {
            let ca_not_after = days_from(now, spec.ca_days)?;
            check_within_ca(ca_not_after, not_after)?;
            let issuer = mint_ca(spec, not_before, ca_not_after)?;
            let leaf = issue_serving_cert(spec, san_types, not_before, not_after, &issuer)?;
            (
                CaPem {
                    cert: issuer.pem(),
                    key: issuer.key().serialize_pem(),
                },
                ca_not_after,
                false,
                leaf,
            )
        }
    };
    Ok(CertBundle {
        ca,
        ca_reused,
        ca_not_after,
        tls_cert: leaf.0,
        tls_key: leaf.1,
        sans,
        not_after,
    })
}

/// `volume-gate certs generate`: writes the files and prints what it did.
pub fn run_generate(args: GenerateArgs) -> Result<(), CertsError> {
    let dir = args.out.as_path();
    fs::create_dir_all(dir).map_err(|source| CertsError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let existing = if args.reuse_ca { read_ca(dir)? } else { None };
    let bundle = generate(&args.spec(), existing.as_ref())?;

    let mut written = Vec::new();
    let mut write = |name: &str, contents: &[u8], mode: u32| -> Result<(), CertsError> {
        let path = dir.join(name);
        write_atomically(&path, contents, mode).map_err(|source| CertsError::Write {
            path: path.clone(),
            source,
        })?;
        written.push(path);
        Ok(())
    };
    if !bundle.ca_reused {
        write(CA_KEY_FILE, bundle.ca.key.as_bytes(), 0o600)?;
        write(CA_CERT_FILE, bundle.ca.cert.as_bytes(), 0o644)?;
    }
    write(TLS_KEY_FILE, bundle.tls_key.as_bytes(), 0o600)?;
    write(TLS_CERT_FILE, bundle.tls_cert.as_bytes(), 0o644)?;
    write(
        CA_BUNDLE_FILE,
        format!("{}\n", bundle.ca_bundle_b64()).as_bytes(),
        0o644,
    )?;
    // Make the renames durable before reporting success.
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| CertsError::Write {
            path: dir.to_path_buf(),
            source,
        })?;

    let files: Vec<String> = written.iter().map(|p| p.display().to_string()).collect();
    println!("wrote {}", files.join(", "));
    if bundle.ca_reused {
        println!(
            "CA: kept {}, expires {}; caBundle unchanged",
            dir.join(CA_CERT_FILE).display(),
            bundle.ca_not_after
        );
    } else {
        println!(
            "CA: new, expires {}; put {} into the caBundle of the webhook configurations",
            bundle.ca_not_after,
            dir.join(CA_BUNDLE_FILE).display()
        );
    }
    println!(
        "serving certificate: expires {}, SANs {}",
        bundle.not_after,
        bundle.sans.join(", ")
    );
    Ok(())
}

/// Reads DIR/ca.crt and DIR/ca.key for `--reuse-ca`; `None` when neither exists.
fn read_ca(dir: &Path) -> Result<Option<CaPem>, CertsError> {
    let (cert_path, key_path) = (dir.join(CA_CERT_FILE), dir.join(CA_KEY_FILE));
    let read = |path: &Path| match fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(CertsError::Read {
            path: path.to_path_buf(),
            source,
        }),
    };
    match (read(&cert_path)?, read(&key_path)?) {
        (Some(cert), Some(key)) => Ok(Some(CaPem { cert, key })),
        (None, None) => Ok(None),
        (Some(_), None) => Err(CertsError::CaIncomplete {
            present: cert_path,
            missing: key_path,
        }),
        (None, Some(_)) => Err(CertsError::CaIncomplete {
            present: key_path,
            missing: cert_path,
        }),
    }
}

fn mint_ca(
    spec: &ServingSpec,
    not_before: Timestamp,
    not_after: Timestamp,
) -> Result<CertifiedIssuer<'static, KeyPair>, CertsError> {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(|source| {
        CertsError::Mint {
            step: "generate the CA key",
            source,
        }
    })?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::OrganizationName, "volume-gate");
    params.distinguished_name.push(
        DnType::CommonName,
        format!("volume-gate CA for {}.{}", spec.service, spec.namespace),
    );
    // Path length 0: this CA signs serving certificates, never other CAs.
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    set_validity(&mut params, not_before, not_after);
    CertifiedIssuer::self_signed(params, key).map_err(|source| CertsError::Mint {
        step: "self-sign the CA certificate",
        source,
    })
}

/// Returns the serving certificate and key, PEM-encoded.
fn issue_serving_cert(
    spec: &ServingSpec,
    sans: Vec<SanType>,
    not_before: Timestamp,
    not_after: Timestamp,
    issuer: &Issuer<'_, KeyPair>,
) -> Result<(String, String), CertsError> {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(|source| {
        CertsError::Mint {
            step: "generate the serving key",
            source,
        }
    })?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(
        DnType::CommonName,
        format!("{}.{}.svc", spec.service, spec.namespace),
    );
    params.subject_alt_names = sans;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    set_validity(&mut params, not_before, not_after);
    let cert = params
        .signed_by(&key, issuer)
        .map_err(|source| CertsError::Mint {
            step: "sign the serving certificate",
            source,
        })?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Parses a CA to sign with, checking it is a CA and that the key is its own.
fn reusable_ca(ca: &CaPem) -> Result<(Issuer<'static, KeyPair>, Timestamp), CertsError> {
    let unusable = |reason: String| CertsError::CaUnusable { reason };
    let der = CertificateDer::from_pem_slice(ca.cert.as_bytes())
        .map_err(|e| unusable(format!("ca.crt holds no PEM certificate ({e})")))?;
    let (_, parsed) = x509_parser::parse_x509_certificate(&der)
        .map_err(|e| unusable(format!("ca.crt is not a valid X.509 certificate ({e})")))?;
    if !parsed.is_ca() {
        return Err(unusable(
            "ca.crt is not a CA certificate (basicConstraints cA is not set)".into(),
        ));
    }
    let not_after = Timestamp::from_second(parsed.validity().not_after.timestamp())
        .map_err(|e| unusable(format!("ca.crt has an out-of-range expiry ({e})")))?;
    // Only the error kind is shown: rcgen's messages never echo the key, but be sure.
    let key = KeyPair::from_pem(&ca.key)
        .map_err(|_| unusable("ca.key is not a PEM private key in a supported format".into()))?;
    if parsed.public_key().raw != rcgen::PublicKeyData::subject_public_key_info(&key).as_slice() {
        return Err(CertsError::CaKeyMismatch);
    }
    let issuer = Issuer::from_ca_cert_der(&der, key)
        .map_err(|e| unusable(format!("ca.crt cannot act as issuer ({e})")))?;
    Ok((issuer, not_after))
}

fn check_within_ca(ca_not_after: Timestamp, not_after: Timestamp) -> Result<(), CertsError> {
    if ca_not_after < not_after {
        return Err(CertsError::CaExpiresFirst {
            ca_not_after,
            not_after,
        });
    }
    Ok(())
}

fn days_from(now: Timestamp, days: u32) -> Result<Timestamp, CertsError> {
    now.checked_add(SignedDuration::from_hours(24 * i64::from(days)))
        .map_err(|_| CertsError::Validity { days })
}

fn set_validity(params: &mut CertificateParams, not_before: Timestamp, not_after: Timestamp) {
    let unix_epoch = rcgen::date_time_ymd(1970, 1, 1);
    let since_epoch =
        |t: Timestamp| std::time::Duration::from_secs(t.as_second().max(0).unsigned_abs());
    params.not_before = unix_epoch + since_epoch(not_before);
    params.not_after = unix_epoch + since_epoch(not_after);
}

fn san_type(san: &str) -> Result<SanType, CertsError> {
    if let Ok(ip) = san.parse::<IpAddr>() {
        return Ok(SanType::IpAddress(ip));
    }
    let invalid = |reason: &str| CertsError::InvalidSan {
        san: san.to_string(),
        reason: reason.to_string(),
    };
    let name = san.strip_prefix("*.").unwrap_or(san);
    if name.is_empty() || san.len() > 253 {
        return Err(invalid("a DNS name has 1 to 253 characters"));
    }
    // DNS is case-insensitive: a SAN may be written in capitals.
    if !name
        .to_ascii_lowercase()
        .split('.')
        .all(crate::names::is_label)
    {
        return Err(invalid(
            "each dot-separated label must be 1-63 letters, digits or '-', not starting or ending with '-'",
        ));
    }
    let ia5 = rcgen::string::Ia5String::try_from(san).map_err(|e| invalid(&e.to_string()))?;
    Ok(SanType::DnsName(ia5))
}

fn check_dns_label(flag: &'static str, value: &str) -> Result<(), CertsError> {
    if crate::names::is_label(value) {
        Ok(())
    } else {
        Err(CertsError::InvalidName {
            flag,
            value: value.to_string(),
        })
    }
}

/// Writes through a temporary file and a rename, so a reader (the webhook's
/// reloader, a `kubectl create secret --from-file`) never sees half a file.
fn write_atomically(path: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    // A stale temporary file would keep its old mode; create_new sets ours.
    if let Err(e) = fs::remove_file(&tmp)
        && e.kind() != io::ErrorKind::NotFound
    {
        return Err(e);
    }
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)?;
    // The umask may have narrowed the mode; certificates must stay readable.
    file.set_permissions(Permissions::from_mode(mode))?;
    file.write_all(contents)?;
    file.sync_all()?;
    fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::client::WebPkiServerVerifier;
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::{ServerName, UnixTime};
    use std::sync::Arc;

    fn spec() -> ServingSpec {
        ServingSpec::new("volume-gate-webhook", "volume-gate")
    }

    fn leaf_der(bundle: &CertBundle) -> CertificateDer<'static> {
        CertificateDer::from_pem_slice(bundle.tls_cert.as_bytes()).unwrap()
    }

    /// Verifies the serving certificate as a TLS client trusting only the CA would.
    fn verify_as_client(
        ca_pem: &str,
        leaf: &CertificateDer<'_>,
        name: &str,
    ) -> Result<(), rustls::Error> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap())
            .unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .unwrap();
        let name = ServerName::try_from(name.to_string()).unwrap();
        verifier
            .verify_server_cert(leaf, &[], &name, &[], UnixTime::now())
            .map(|_| ())
    }

    #[test]
    fn serving_cert_is_trusted_for_every_name_of_the_service() {
        let bundle = generate(&spec(), None).unwrap();
        let names = [
            "volume-gate-webhook",
            "volume-gate-webhook.volume-gate",
            "volume-gate-webhook.volume-gate.svc",
            "volume-gate-webhook.volume-gate.svc.cluster.local",
        ];
        assert_eq!(bundle.sans, names);
        for name in names {
            verify_as_client(&bundle.ca.cert, &leaf_der(&bundle), name).unwrap();
        }
        assert!(
            verify_as_client(&bundle.ca.cert, &leaf_der(&bundle), "other.volume-gate.svc").is_err()
        );
    }

    #[test]
    fn extra_sans_cover_ip_addresses_and_dns_names() {
        let mut spec = spec();
        spec.extra_sans = vec!["127.0.0.1".into(), "webhook.example.test".into()];
        let bundle = generate(&spec, None).unwrap();
        verify_as_client(&bundle.ca.cert, &leaf_der(&bundle), "127.0.0.1").unwrap();
        verify_as_client(&bundle.ca.cert, &leaf_der(&bundle), "webhook.example.test").unwrap();
    }

    #[test]
    fn ca_signs_certificates_and_serving_cert_is_for_servers_only() {
        let bundle = generate(&spec(), None).unwrap();
        let ca_der = CertificateDer::from_pem_slice(bundle.ca.cert.as_bytes()).unwrap();
        let (_, ca) = x509_parser::parse_x509_certificate(&ca_der).unwrap();
        assert!(ca.is_ca());
        let ca_usage = ca.key_usage().unwrap().unwrap().value;
        assert!(ca_usage.key_cert_sign());

        let der = leaf_der(&bundle);
        let (_, leaf) = x509_parser::parse_x509_certificate(&der).unwrap();
        assert!(!leaf.is_ca());
        assert!(leaf.key_usage().unwrap().unwrap().value.digital_signature());
        let eku = leaf.extended_key_usage().unwrap().unwrap().value;
        assert!(eku.server_auth && !eku.client_auth);
        assert_eq!(leaf.issuer(), ca.subject());
        assert_eq!(
            ca.public_key().algorithm.algorithm,
            x509_parser::oid_registry::OID_KEY_TYPE_EC_PUBLIC_KEY
        );
    }

    #[test]
    fn validity_follows_days_and_starts_slightly_in_the_past() {
        let mut spec = spec();
        spec.days = 30;
        let bundle = generate(&spec, None).unwrap();
        let der = leaf_der(&bundle);
        let (_, leaf) = x509_parser::parse_x509_certificate(&der).unwrap();
        let validity = leaf.validity();
        assert_eq!(
            validity.not_after.timestamp() - validity.not_before.timestamp(),
            30 * 86_400 + 300
        );
        assert_eq!(bundle.not_after.as_second(), validity.not_after.timestamp());
        assert!(bundle.ca_not_after > bundle.not_after);
    }

    #[test]
    fn reissue_with_existing_ca_keeps_the_ca_bundle_valid() {
        let first = generate(&spec(), None).unwrap();
        let second = generate(&spec(), Some(&first.ca)).unwrap();
        assert!(second.ca_reused);
        assert_eq!(second.ca_bundle_b64(), first.ca_bundle_b64());
        assert_ne!(second.tls_cert, first.tls_cert);
        assert_ne!(second.tls_key, first.tls_key);
        verify_as_client(
            &first.ca.cert,
            &leaf_der(&second),
            "volume-gate-webhook.volume-gate.svc",
        )
        .unwrap();
    }

    #[test]
    fn reuse_refuses_a_ca_key_that_is_not_the_ca_certificates() {
        let a = generate(&spec(), None).unwrap();
        let b = generate(&spec(), None).unwrap();
        let mixed = CaPem {
            cert: a.ca.cert,
            key: b.ca.key,
        };
        assert!(matches!(
            generate(&spec(), Some(&mixed)),
            Err(CertsError::CaKeyMismatch)
        ));
    }

    #[test]
    fn reuse_refuses_a_serving_certificate_as_ca() {
        let a = generate(&spec(), None).unwrap();
        let leaf_as_ca = CaPem {
            cert: a.tls_cert,
            key: a.tls_key,
        };
        let err = generate(&spec(), Some(&leaf_as_ca)).err().unwrap();
        assert!(err.to_string().contains("not a CA certificate"), "{err}");
    }

    #[test]
    fn serving_cert_may_not_outlive_its_ca() {
        let mut spec = spec();
        spec.ca_days = 10;
        spec.days = 11;
        assert!(matches!(
            generate(&spec, None),
            Err(CertsError::CaExpiresFirst { .. })
        ));
    }

    #[test]
    fn bad_names_are_refused_before_anything_is_minted() {
        let mut bad_san = spec();
        bad_san.extra_sans = vec!["not a name".into()];
        assert!(
            matches!(generate(&bad_san, None), Err(CertsError::InvalidSan { san, .. }) if san == "not a name")
        );
        let bad_service = ServingSpec::new("Volume_Gate", "volume-gate");
        assert!(matches!(
            generate(&bad_service, None),
            Err(CertsError::InvalidName {
                flag: "service",
                ..
            })
        ));
    }

    fn args(out: &Path) -> GenerateArgs {
        GenerateArgs {
            service: "volume-gate-webhook".into(),
            namespace: "volume-gate".into(),
            out: out.to_path_buf(),
            sans: vec!["127.0.0.1".into()],
            days: 365,
            ca_days: 3650,
            reuse_ca: false,
        }
    }

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn run_generate_writes_keys_private_and_the_ca_bundle_on_one_line() {
        let dir = tempfile::tempdir().unwrap();
        run_generate(args(dir.path())).unwrap();
        assert_eq!(mode(&dir.path().join(CA_KEY_FILE)), 0o600);
        assert_eq!(mode(&dir.path().join(TLS_KEY_FILE)), 0o600);
        assert_eq!(mode(&dir.path().join(TLS_CERT_FILE)), 0o644);
        let b64 = fs::read_to_string(dir.path().join(CA_BUNDLE_FILE)).unwrap();
        assert_eq!(b64.lines().count(), 1);
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(b64.trim_end())
            .unwrap();
        assert_eq!(decoded, fs::read(dir.path().join(CA_CERT_FILE)).unwrap());
        let leftovers: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty());
    }

    #[test]
    fn run_generate_with_reuse_ca_rotates_only_the_serving_pair() {
        let dir = tempfile::tempdir().unwrap();
        run_generate(args(dir.path())).unwrap();
        let read = |name: &str| fs::read(dir.path().join(name)).unwrap();
        let (ca_crt, ca_key, tls_crt) =
            (read(CA_CERT_FILE), read(CA_KEY_FILE), read(TLS_CERT_FILE));

        run_generate(GenerateArgs {
            reuse_ca: true,
            ..args(dir.path())
        })
        .unwrap();
        assert_eq!(read(CA_CERT_FILE), ca_crt);
        assert_eq!(read(CA_KEY_FILE), ca_key);
        assert_ne!(read(TLS_CERT_FILE), tls_crt);

        run_generate(args(dir.path())).unwrap();
        assert_ne!(
            read(CA_CERT_FILE),
            ca_crt,
            "without --reuse-ca a new CA is minted"
        );
    }

    #[test]
    fn reuse_ca_with_half_a_ca_names_the_missing_file() {
        let dir = tempfile::tempdir().unwrap();
        run_generate(args(dir.path())).unwrap();
        fs::remove_file(dir.path().join(CA_KEY_FILE)).unwrap();
        let err = run_generate(GenerateArgs {
            reuse_ca: true,
            ..args(dir.path())
        })
        .unwrap_err();
        assert!(
            matches!(&err, CertsError::CaIncomplete { missing, .. } if missing.ends_with(CA_KEY_FILE)),
            "{err}"
        );
    }

    #[test]
    fn reuse_ca_without_a_ca_mints_one() {
        let dir = tempfile::tempdir().unwrap();
        run_generate(GenerateArgs {
            reuse_ca: true,
            ..args(dir.path())
        })
        .unwrap();
        assert!(dir.path().join(CA_CERT_FILE).exists());
    }
}
