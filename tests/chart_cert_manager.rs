//! The chart in its default certificate mode, with the real cert-manager:
//! its controller and cainjector (v1.21.2, built from the Go module proxy by
//! `tests/certmanager/build.sh`) issue the CA and the serving certificate
//! from the chart's Issuers and Certificates and inject the CA into both
//! webhook configurations; the API server calls the webhook trusting only
//! that injected caBundle. A renewal puts a new certificate in the Secret;
//! the webhook, reading it from a Secret volume laid out as kubelet does,
//! serves it without a restart (the failure a Cozystack webhook once had: it
//! kept serving the expired certificate and, fail-closed, blocked every Pod
//! creation). A `helm upgrade` re-renders the configurations without a
//! caBundle; the injected one must survive it.
//!
//! As in `tests/chart_install.rs`, the webhook and worker are local
//! processes under the chart's ServiceAccounts, and a post-renderer points
//! the webhooks at them (and adds `127.0.0.1` to the serving certificate,
//! the address the API server calls here). The kubelet's part, copying the
//! Secret into the volume, is done by this test.

use volume_gate_testkit as common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use base64::Engine;
use common::chart::{
    WEBHOOK_CONFIGURATIONS, helm_local, webhook_configuration, worker_args_of_the_deployment,
};
use common::gate::{Gate, free_port, wait_webhooks_active};
use common::secret_volume::SecretVolume;
use common::wait::eventually;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::json;

const NS: &str = "volume-gate";
const SECRET: &str = "volume-gate-webhook-tls";

fn certificates() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("cert-manager.io", "v1", "Certificate"),
        "certificates",
    )
}

/// The files of the serving Secret, `None` until it holds all three.
async fn tls_files(secrets: &Api<Secret>) -> Result<BTreeMap<String, Vec<u8>>, String> {
    let secret = secrets.get(SECRET).await.map_err(|e| e.to_string())?;
    let data: BTreeMap<String, Vec<u8>> = secret
        .data
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, v.0))
        .collect();
    for key in ["tls.crt", "tls.key", "ca.crt"] {
        if data.get(key).is_none_or(|v| v.is_empty()) {
            return Err(format!("Secret {SECRET} has no {key} yet"));
        }
    }
    Ok(data)
}

fn volume_files(data: &BTreeMap<String, Vec<u8>>) -> Vec<(&str, &[u8])> {
    ["tls.crt", "tls.key", "ca.crt"]
        .into_iter()
        .map(|k| (k, data[k].as_slice()))
        .collect()
}

/// The first certificate of a PEM bundle, DER.
fn leaf(pem: &[u8]) -> Vec<u8> {
    CertificateDer::from_pem_slice(pem)
        .expect("a PEM certificate")
        .to_vec()
}

/// The leaf certificate served on `port` to a client that trusts only
/// `ca_pem` and checks the name `127.0.0.1` (as the API server does).
async fn served_leaf(port: u16, ca_pem: &[u8]) -> Result<Vec<u8>, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from(leaf(ca_pem))).unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    // Every connection a full handshake: what is served now, not a session.
    config.resumption = rustls::client::Resumption::disabled();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    Ok(tls.get_ref().1.peer_certificates().unwrap()[0].to_vec())
}

/// The caBundle of every webhook of both configurations, decoded.
async fn ca_bundles(client: &kube::Client) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for (kind, plural) in WEBHOOK_CONFIGURATIONS {
        let config =
            Api::<DynamicObject>::all_with(client.clone(), &webhook_configuration(kind, plural))
                .get("volume-gate")
                .await
                .unwrap_or_else(|e| panic!("{kind} volume-gate: {e}"));
        for webhook in config.data["webhooks"].as_array().expect("webhooks") {
            let b64 = webhook["clientConfig"]["caBundle"].as_str().unwrap_or("");
            out.push(
                base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .unwrap_or_default(),
            );
        }
    }
    out
}

async fn wait_ca_injected(client: &kube::Client, ca_pem: &[u8], when: &str) {
    eventually(
        &format!("cainjector's caBundle on every webhook {when}"),
        Duration::from_secs(60),
        || async {
            let bundles = ca_bundles(client).await;
            if !bundles.is_empty() && bundles.iter().all(|b| b == ca_pem) {
                Ok(())
            } else {
                Err(format!(
                    "{} of {} webhooks carry the CA",
                    bundles.iter().filter(|b| *b == ca_pem).count(),
                    bundles.len()
                ))
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cert_manager_issues_and_injects_and_the_webhook_serves_a_renewal_without_a_restart() {
    let env = common::ungated();
    let cp = env.cp;
    let client = cp.management_client().await;
    cp.namespace(NS).await;
    let _cert_manager = common::certmanager::start(cp, NS).await;

    // Install with the default values: cert-manager mode.
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let kubeconfig = &cp.management.kubeconfig;
    helm_local("install", NS, kubeconfig, &base, &[]);

    // cert-manager issues the CA and the serving certificate.
    let certs: Api<DynamicObject> = Api::namespaced_with(client.clone(), NS, &certificates());
    for name in ["volume-gate-ca", "volume-gate-webhook"] {
        eventually(
            &format!("Certificate {name} Ready"),
            Duration::from_secs(60),
            || async {
                let c = certs.get(name).await.map_err(|e| e.to_string())?;
                let ready = c.data["status"]["conditions"].as_array().is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c["type"] == "Ready" && c["status"] == "True")
                });
                if ready {
                    Ok(())
                } else {
                    Err(format!("status: {}", c.data["status"]))
                }
            },
        )
        .await;
    }
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    let issued = tls_files(&secrets).await.expect("the serving Secret");
    let ca_pem = issued["ca.crt"].clone();
    // cainjector writes that CA into both configurations.
    wait_ca_injected(&client, &ca_pem, "after install").await;

    // The kubelet's part: the Secret as a volume, kept in step with it.
    let dir = cp.state.join("chart-cert-manager-tls");
    std::fs::create_dir_all(&dir).unwrap();
    let mut volume = SecretVolume::new(&dir, &volume_files(&issued));
    let stop = Arc::new(AtomicBool::new(false));
    let sync = {
        let (secrets, stop) = (secrets.clone(), stop.clone());
        let mut current = issued.clone();
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                if let Ok(now) = tls_files(&secrets).await
                    && now != current
                {
                    volume.publish(&volume_files(&now));
                    current = now;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };

    // The gate under the chart's identities, serving what cert-manager
    // issued; the API server calls it trusting only the injected CA.
    let worker_args = worker_args_of_the_deployment(&client, NS).await;
    let mut gate = Gate::start_webhook(cp, dir.clone(), port, worker_args).await;
    gate.start_worker_and_wait(cp).await;
    let first = leaf(&issued["tls.crt"]);
    assert_eq!(served_leaf(port, &ca_pem).await.unwrap(), first);
    let pid = gate.webhook.pid();

    // A renewal, asked for as `cmctl renew` asks: the Issuing condition.
    certs
        .patch_status(
            "volume-gate-webhook",
            &PatchParams::default(),
            &Patch::Json::<()>(
                serde_json::from_value(json!([{
                    "op": "add", "path": "/status/conditions/-",
                    "value": {"type": "Issuing", "status": "True", "reason": "ManuallyTriggered",
                              "message": "renewal asked for by the test",
                              "lastTransitionTime": jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string()}
                }]))
                .unwrap(),
            ),
        )
        .await
        .expect("ask for a renewal");
    let renewed = eventually(
        "a renewed certificate in the Secret",
        Duration::from_secs(60),
        || async {
            let now = tls_files(&secrets).await?;
            if leaf(&now["tls.crt"]) != first {
                Ok(now)
            } else {
                Err("still the first certificate".into())
            }
        },
    )
    .await;
    assert_eq!(renewed["ca.crt"], ca_pem, "a renewal keeps the CA");
    assert_ne!(
        renewed["tls.key"], issued["tls.key"],
        "rotationPolicy Always: a new key"
    );
    let renewed_leaf = leaf(&renewed["tls.crt"]);
    eventually(
        "the webhook serving the renewed certificate",
        Duration::from_secs(30),
        || async {
            let served = served_leaf(port, &ca_pem).await?;
            if served == renewed_leaf {
                Ok(())
            } else {
                Err("still serving the first certificate".into())
            }
        },
    )
    .await;
    assert_eq!(gate.webhook.pid(), pid, "the same webhook process");
    assert!(gate.webhook.alive(), "the webhook was not restarted");
    // The API server still calls it, with the same injected CA.
    wait_ca_injected(&client, &ca_pem, "after the renewal").await;
    wait_webhooks_active(cp).await;

    // An upgrade re-renders the configurations without a caBundle: the
    // injected one survives it (or is written again), and the API server
    // keeps calling the gate.
    helm_local(
        "upgrade",
        NS,
        kubeconfig,
        &base,
        &["--set", "webhook.replicas=3"],
    );
    wait_ca_injected(&client, &ca_pem, "after helm upgrade").await;
    wait_webhooks_active(cp).await;

    stop.store(true, Ordering::SeqCst);
    sync.await.unwrap();
    gate.kill_worker();
}
