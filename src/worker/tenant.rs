//! Reaching the tenant's own API: the admin kubeconfig Secret (step 1) and
//! the /readyz probe (step 2). Kubeconfig contents are never logged.

use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};

use super::ErrorKind;
use crate::profile::Profile;

/// A kubeconfig larger than this is not a kubeconfig.
pub const MAX_KUBECONFIG_BYTES: usize = 256 * 1024;

/// Why the tenant API cannot be used; each is its own Blocked message.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum TenantAccessError {
    #[error(
        "kubeconfig Secret {namespace}/{name} not found: the release phase needs the tenant's admin kubeconfig to reach its API"
    )]
    SecretNotFound { namespace: String, name: String },
    #[error(
        "reading kubeconfig Secret {namespace}/{name} is forbidden for the worker: grant it get on that Secret (see manifests/base/worker-rbac.yaml)"
    )]
    SecretForbidden { namespace: String, name: String },
    #[error("cannot read kubeconfig Secret {namespace}/{name}: {message}")]
    SecretUnreadable {
        namespace: String,
        name: String,
        message: String,
    },
    #[error("kubeconfig Secret {namespace}/{name} is unparseable: {message}")]
    Unparseable {
        namespace: String,
        name: String,
        message: String,
    },
    #[error("tenant API did not answer /readyz within {}s ({server})", timeout.as_secs())]
    NotAnswering { server: String, timeout: Duration },
    #[error("tenant API at {server} is not ready: {message}")]
    NotReady { server: String, message: String },
}

impl TenantAccessError {
    /// Its metric label.
    pub fn kind(&self) -> ErrorKind {
        match self {
            TenantAccessError::SecretNotFound { .. } => ErrorKind::KubeconfigNotFound,
            TenantAccessError::SecretForbidden { .. } => ErrorKind::KubeconfigForbidden,
            TenantAccessError::SecretUnreadable { .. } => ErrorKind::KubeconfigUnreadable,
            TenantAccessError::Unparseable { .. } => ErrorKind::KubeconfigUnparseable,
            TenantAccessError::NotAnswering { .. } => ErrorKind::TenantApiSilent,
            TenantAccessError::NotReady { .. } => ErrorKind::TenantApiNotReady,
        }
    }
}

/// A client for the tenant's API, and where it points (for messages).
pub struct TenantApi {
    pub client: kube::Client,
    pub server: String,
    /// SHA-256 (hex) of the certificate authorities the client trusts: the
    /// server it reaches holds a key one of them certified.
    pub ca_sha256: String,
}

/// The SHA-256 (hex) of a set of CA certificates (DER), whatever their
/// order or PEM wrapping.
pub fn ca_fingerprint(certs: &[Vec<u8>]) -> String {
    let mut sorted: Vec<&Vec<u8>> = certs.iter().collect();
    sorted.sort();
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    for der in sorted {
        ctx.update(&(der.len() as u64).to_be_bytes());
        ctx.update(der);
    }
    ctx.finish()
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Step 1: the admin kubeconfig, from the first present key of the profile.
pub async fn read_kubeconfig(
    management: &kube::Client,
    profile: &Profile,
    namespace: &str,
    tenant: &str,
) -> Result<Kubeconfig, TenantAccessError> {
    let name = profile.kubeconfig_secret_name(tenant);
    let api: Api<Secret> = Api::namespaced(management.clone(), namespace);
    let secret = match api.get(&name).await {
        Ok(s) => s,
        Err(kube::Error::Api(s)) if s.code == 404 => {
            return Err(TenantAccessError::SecretNotFound {
                namespace: namespace.into(),
                name,
            });
        }
        Err(kube::Error::Api(s)) if s.code == 403 => {
            return Err(TenantAccessError::SecretForbidden {
                namespace: namespace.into(),
                name,
            });
        }
        Err(e) => {
            return Err(TenantAccessError::SecretUnreadable {
                namespace: namespace.into(),
                name,
                message: e.to_string(),
            });
        }
    };
    let unparseable = |message: String| TenantAccessError::Unparseable {
        namespace: namespace.into(),
        name: name.clone(),
        message,
    };
    let data = secret.data.unwrap_or_default();
    let Some((key, bytes)) = profile
        .kubeconfig
        .keys
        .iter()
        .find_map(|k| data.get(k).map(|v| (k, v)))
    else {
        return Err(unparseable(format!(
            "it has none of the keys {}",
            profile.kubeconfig.keys.join(", ")
        )));
    };
    parse_kubeconfig(&bytes.0).map_err(|m| unparseable(format!("key {key}: {m}")))
}

/// Parses and vets a kubeconfig. Only inline credentials are accepted: an
/// `exec` plugin, an auth provider or a file path would let whoever writes
/// the Secret run commands or read files inside the worker.
pub fn parse_kubeconfig(bytes: &[u8]) -> Result<Kubeconfig, String> {
    if bytes.len() > MAX_KUBECONFIG_BYTES {
        return Err(format!(
            "{} bytes, more than the {MAX_KUBECONFIG_BYTES} a kubeconfig may have",
            bytes.len()
        ));
    }
    let text = std::str::from_utf8(bytes).map_err(|_| "not UTF-8 text".to_string())?;
    // The parser's own message may quote the input, which may hold a key.
    let kc = Kubeconfig::from_yaml(text)
        .map_err(|_| "not a kubeconfig (YAML parse failed)".to_string())?;
    if kc.clusters.is_empty() || kc.contexts.is_empty() {
        return Err("it names no cluster or no context".into());
    }
    // Entries are named by their index, never by their name: a name is
    // tenant-written text and could hold pasted secret material (fuzz F4).
    for (c, named) in kc.clusters.iter().enumerate() {
        let cluster = named
            .cluster
            .as_ref()
            .ok_or_else(|| format!("clusters[{c}] has no details"))?;
        let server = cluster.server.as_deref().unwrap_or("");
        if !server.starts_with("https://") {
            return Err(format!("clusters[{c}] server must be an https:// URL"));
        }
        if cluster.certificate_authority.is_some() {
            return Err(format!(
                "clusters[{c}] refers to a CA file; only certificate-authority-data is accepted"
            ));
        }
        if cluster.tls_server_name.is_some() {
            return Err(format!(
                "clusters[{c}] sets tls-server-name, which would accept a server certified for another name"
            ));
        }
        if cluster.insecure_skip_tls_verify == Some(true) {
            return Err(format!(
                "clusters[{c}] skips TLS verification, which would hand admin credentials to anyone"
            ));
        }
        // The worker pins a tenant cluster by the CA that certified it.
        if cluster
            .certificate_authority_data
            .as_deref()
            .is_none_or(str::is_empty)
        {
            return Err(format!(
                "clusters[{c}] has no certificate-authority-data: the worker knows a tenant cluster by the CA \
                 that certified its API server"
            ));
        }
        if cluster.proxy_url.is_some() {
            return Err(format!(
                "clusters[{c}] sets a proxy-url, which is not accepted"
            ));
        }
    }
    for (a, u) in kc.auth_infos.iter().enumerate() {
        let Some(auth) = u.auth_info.as_ref() else {
            continue;
        };
        if auth.exec.is_some() || auth.auth_provider.is_some() {
            return Err(format!(
                "users[{a}] uses an exec plugin or auth provider, which is not accepted"
            ));
        }
        if auth.client_certificate.is_some()
            || auth.client_key.is_some()
            || auth.token_file.is_some()
        {
            return Err(format!(
                "users[{a}] refers to files; only inline -data fields and token are accepted"
            ));
        }
    }
    Ok(kc)
}

/// A client for the kubeconfig's current context.
pub async fn client_for(kc: Kubeconfig, request_timeout: Duration) -> Result<TenantApi, String> {
    let mut config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(|e| format!("kubeconfig unusable: {e}"))?;
    config.connect_timeout = Some(request_timeout.min(Duration::from_secs(10)));
    config.read_timeout = Some(request_timeout);
    config.write_timeout = Some(request_timeout);
    let server = config.cluster_url.to_string();
    let ca_sha256 = ca_fingerprint(config.root_cert.as_deref().unwrap_or_default());
    let client = kube::Client::try_from(config)
        .map_err(|e| format!("cannot build a client for {server}: {e}"))?;
    Ok(TenantApi {
        client,
        server,
        ca_sha256,
    })
}

/// Step 1 whole: the admin kubeconfig, vetted, as a client.
pub async fn connect(
    management: &kube::Client,
    profile: &Profile,
    namespace: &str,
    tenant: &str,
    request_timeout: Duration,
) -> Result<TenantApi, TenantAccessError> {
    let kc = read_kubeconfig(management, profile, namespace, tenant).await?;
    client_for(kc, request_timeout)
        .await
        .map_err(|message| TenantAccessError::Unparseable {
            namespace: namespace.into(),
            name: profile.kubeconfig_secret_name(tenant),
            message,
        })
}

/// Step 2: a kubeconfig that exists is not an API server that answers.
pub async fn probe_ready(api: &TenantApi, timeout: Duration) -> Result<(), TenantAccessError> {
    let request = http::Request::get("/readyz")
        .body(Vec::new())
        .expect("static request is valid");
    match tokio::time::timeout(timeout, api.client.request_text(request)).await {
        Err(_) => Err(TenantAccessError::NotAnswering {
            server: api.server.clone(),
            timeout,
        }),
        Ok(Ok(body)) if body.trim() == "ok" => Ok(()),
        Ok(Ok(body)) => Err(TenantAccessError::NotReady {
            server: api.server.clone(),
            message: crate::text::one_line(&body),
        }),
        Ok(Err(e)) => match e {
            kube::Error::Api(s) => Err(TenantAccessError::NotReady {
                server: api.server.clone(),
                message: s.message,
            }),
            // Connection refused, TLS failure, DNS: nothing answered; the
            // cause is deep in the error chain, and it is what an operator needs.
            other => Err(TenantAccessError::NotReady {
                server: api.server.clone(),
                message: error_chain(&other),
            }),
        },
    }
}

/// An error and its causes, `a: b: c`, without repeats.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = s.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
apiVersion: v1
kind: Config
clusters:
- name: t
  cluster:
    server: https://127.0.0.1:6443
    certificate-authority-data: AAAA
users:
- name: admin
  user:
    token: abc
contexts:
- name: t
  context: {cluster: t, user: admin}
current-context: t
"#;

    #[test]
    fn an_inline_kubeconfig_is_accepted() {
        parse_kubeconfig(GOOD.as_bytes()).unwrap();
    }

    #[test]
    fn garbage_is_unparseable_without_echoing_it() {
        let err = parse_kubeconfig(b"\x00\x01secret-token-value: [").unwrap_err();
        assert!(!err.contains("secret-token-value"), "{err}");
        let err = parse_kubeconfig(b"apiVersion: [unclosed secret-token-value").unwrap_err();
        assert!(!err.contains("secret-token-value"), "{err}");
    }

    #[test]
    fn a_huge_kubeconfig_is_refused_by_size() {
        let err = parse_kubeconfig(&vec![b'a'; MAX_KUBECONFIG_BYTES + 1]).unwrap_err();
        assert!(err.contains("bytes"), "{err}");
    }

    #[test]
    fn exec_plugins_are_refused() {
        let y = GOOD.replace(
            "    token: abc",
            "    exec: {apiVersion: client.authentication.k8s.io/v1, command: /bin/sh}",
        );
        assert!(parse_kubeconfig(y.as_bytes()).unwrap_err().contains("exec"));
    }

    #[test]
    fn file_references_are_refused() {
        let y = GOOD.replace(
            "    token: abc",
            "    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token",
        );
        assert!(
            parse_kubeconfig(y.as_bytes())
                .unwrap_err()
                .contains("files")
        );
        let y = GOOD.replace(
            "certificate-authority-data: AAAA",
            "certificate-authority: /etc/ca.crt",
        );
        assert!(
            parse_kubeconfig(y.as_bytes())
                .unwrap_err()
                .contains("CA file")
        );
    }

    #[test]
    fn skipping_tls_verification_is_refused() {
        let y = GOOD.replace(
            "    certificate-authority-data: AAAA",
            "    insecure-skip-tls-verify: true",
        );
        assert!(
            parse_kubeconfig(y.as_bytes())
                .unwrap_err()
                .contains("TLS verification")
        );
    }

    #[test]
    fn a_cluster_without_its_ca_or_verified_under_another_name_is_refused() {
        let y = GOOD.replace("    certificate-authority-data: AAAA\n", "");
        assert!(
            parse_kubeconfig(y.as_bytes())
                .unwrap_err()
                .contains("no certificate-authority-data")
        );
        let y = GOOD.replace(
            "    certificate-authority-data: AAAA",
            "    certificate-authority-data: AAAA\n    tls-server-name: kubernetes-b.tenant-y.svc",
        );
        assert!(
            parse_kubeconfig(y.as_bytes())
                .unwrap_err()
                .contains("tls-server-name")
        );
    }

    #[test]
    fn the_ca_fingerprint_is_of_the_set_whatever_its_order() {
        let (a, b) = (vec![1u8, 2, 3], vec![4u8, 5]);
        assert_eq!(
            ca_fingerprint(&[a.clone(), b.clone()]),
            ca_fingerprint(&[b.clone(), a.clone()])
        );
        assert_ne!(
            ca_fingerprint(std::slice::from_ref(&a)),
            ca_fingerprint(&[a, b])
        );
        assert_eq!(ca_fingerprint(&[]).len(), 64);
    }

    #[test]
    fn plain_http_servers_are_refused() {
        let y = GOOD.replace("https://127.0.0.1:6443", "http://127.0.0.1:8080");
        assert!(
            parse_kubeconfig(y.as_bytes())
                .unwrap_err()
                .contains("https://")
        );
    }

    #[test]
    fn errors_name_entries_by_index_not_by_their_tenant_written_name() {
        let y = GOOD
            .replace("https://127.0.0.1:6443", "http://127.0.0.1:8080")
            .replace(
                "- name: t\n  cluster:",
                "- name: pasted-TOKEN-eyJhbGciOiJSUzI1NiJ9\n  cluster:",
            );
        let err = parse_kubeconfig(y.as_bytes()).unwrap_err();
        assert_eq!(err, "clusters[0] server must be an https:// URL");
    }

    #[test]
    fn an_empty_kubeconfig_is_refused() {
        assert!(
            parse_kubeconfig(b"apiVersion: v1\nkind: Config\n")
                .unwrap_err()
                .contains("no cluster")
        );
    }
}
