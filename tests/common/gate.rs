//! volume-gate installed on the management cluster as shipped: namespace,
//! ServiceAccounts and RBAC from `manifests/`, the webhook and the worker as
//! local processes running as those ServiceAccounts (TokenRequest), and the
//! shipped webhook configurations pointed at the local webhook.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use kube::api::{Api, DynamicObject, ObjectMeta, PostParams};
use kube::core::{ApiResource, GroupVersionKind};

use super::cluster::{ControlPlane, client_from};
use super::manifests;
use super::process::Process;
use super::wait::eventually;

pub const NAMESPACE: &str = "volume-gate";
pub const WORKER_SA: &str = "volume-gate-worker";
pub const WEBHOOK_SA: &str = "volume-gate-webhook";

/// The volume-gate binary: Cargo's for tests; for the demo example, built
/// beside it (examples do not get CARGO_BIN_EXE_*).
pub fn binary() -> PathBuf {
    if let Some(p) = option_env!("CARGO_BIN_EXE_volume-gate") {
        return PathBuf::from(p);
    }
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().expect("current exe");
            let profile_dir = exe
                .parent()
                .and_then(|d| d.parent())
                .expect("target/<profile>/examples");
            let release = profile_dir.ends_with("release");
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let mut cmd = Command::new(cargo);
            cmd.args(["build", "--bin", "volume-gate"])
                .current_dir(super::cluster::repo_root());
            if release {
                cmd.arg("--release");
            }
            assert!(
                cmd.status().expect("run cargo build").success(),
                "cargo build --bin volume-gate failed"
            );
            profile_dir.join("volume-gate")
        })
        .clone()
}

/// A free loopback port below the kernel's ephemeral range, so no outgoing
/// connection can take it between this check and the server's bind.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let spread = (std::process::id() % 1000) as u16 * 20;
    loop {
        let port = 10000 + spread + NEXT.fetch_add(1, Ordering::SeqCst) % 20000;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

pub fn helmrelease_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("helm.toolkit.fluxcd.io", "v2", "HelmRelease"),
        "helmreleases",
    )
}

/// Worker flags for tests: short bounds so Blocked is reached quickly.
pub fn test_worker_args() -> Vec<String> {
    [
        "--wait-bound",
        "90s",
        "--retry-base",
        "1s",
        "--retry-max",
        "5s",
        "--probe-timeout",
        "3s",
        "--lease-duration",
        "4s",
    ]
    .map(String::from)
    .to_vec()
}

pub struct Gate {
    pub webhook: Process,
    pub worker: Option<Process>,
    pub webhook_port: u16,
    pub webhook_admin: u16,
    pub worker_admin: u16,
    pub certs: PathBuf,
    worker_kubeconfig: PathBuf,
    worker_args: Vec<String>,
    log_dir: PathBuf,
    restarts: usize,
}

impl Gate {
    /// Installs the gate; returns once the API server calls both webhooks.
    pub async fn install(cp: &ControlPlane) -> Gate {
        Self::install_with(cp, test_worker_args()).await
    }

    pub async fn install_with(cp: &ControlPlane, worker_args: Vec<String>) -> Gate {
        let client = cp.management_client().await;
        let docs = manifests::base_documents();
        for doc in docs
            .iter()
            .filter(|d| !manifests::is_workload(d) && !manifests::is_webhook_configuration(d))
        {
            manifests::apply(&client, doc).await;
        }
        apply_crds(cp).await;

        let certs = cp.state.join("gate-certs");
        let ca_bundle = generate_certs(&certs);
        let mut gate = Gate::start_webhook(cp, certs, free_port(), worker_args).await;

        let base = format!("https://127.0.0.1:{}", gate.webhook_port);
        for doc in docs
            .iter()
            .filter(|d| manifests::is_webhook_configuration(d))
        {
            manifests::apply(&client, &manifests::point_at_local(doc, &base, &ca_bundle)).await;
        }
        gate.start_worker_and_wait(cp).await;
        gate
    }

    /// Starts the webhook as ServiceAccount `volume-gate/volume-gate-webhook`
    /// (which must exist), serving the certificate in `certs` on
    /// `webhook_port`, and waits until it is ready; no worker yet.
    pub async fn start_webhook(
        cp: &ControlPlane,
        certs: PathBuf,
        webhook_port: u16,
        worker_args: Vec<String>,
    ) -> Gate {
        let log_dir = cp.state.join("logs");
        let webhook_admin = free_port();
        let mut cmd = Command::new(binary());
        cmd.arg("webhook")
            .arg(format!("--listen=127.0.0.1:{webhook_port}"))
            .arg(format!("--admin-listen=127.0.0.1:{webhook_admin}"))
            .arg("--tls-cert")
            .arg(certs.join("tls.crt"))
            .arg("--tls-key")
            .arg(certs.join("tls.key"))
            .arg("--cert-reload-interval=500ms")
            .env(
                "KUBECONFIG",
                cp.service_account_kubeconfig(NAMESPACE, WEBHOOK_SA).await,
            )
            .env("RUST_LOG", "info");
        let webhook = Process::start("webhook", cmd, log_dir.join("volume-gate-webhook.log"));
        wait_ready(webhook_admin, &webhook).await;
        let worker_kubeconfig = cp.service_account_kubeconfig(NAMESPACE, WORKER_SA).await;
        Gate {
            webhook,
            worker: None,
            webhook_port,
            webhook_admin,
            worker_admin: 0,
            certs,
            worker_kubeconfig,
            worker_args,
            log_dir,
            restarts: 0,
        }
    }

    /// Starts the worker, waits until it is ready and the API server calls
    /// both webhooks.
    pub async fn start_worker_and_wait(&mut self, cp: &ControlPlane) {
        self.start_worker();
        wait_ready(self.worker_admin, self.worker.as_ref().unwrap()).await;
        wait_webhooks_active(cp).await;
    }

    /// Starts a worker (after a kill, a fresh one: the restart scenario).
    pub fn start_worker(&mut self) {
        self.worker_admin = free_port();
        let mut cmd = Command::new(binary());
        cmd.arg("worker")
            .arg(format!("--admin-listen=127.0.0.1:{}", self.worker_admin))
            .args(&self.worker_args)
            .arg(format!("--identity=test-worker-{}", self.restarts))
            .env("KUBECONFIG", &self.worker_kubeconfig)
            .env("POD_NAMESPACE", NAMESPACE)
            .env("RUST_LOG", "info");
        let log = self
            .log_dir
            .join(format!("volume-gate-worker-{}.log", self.restarts));
        self.restarts += 1;
        self.worker = Some(Process::start("worker", cmd, log));
    }

    /// SIGKILLs the worker, as a crash would.
    pub fn kill_worker(&mut self) {
        if let Some(w) = self.worker.take() {
            w.kill(libc::SIGKILL);
        }
    }

    /// SIGTERMs the worker, as the kubelet does, and waits up to `bound`
    /// for it to exit by itself; a worker still running then is SIGKILLed
    /// and the failure returned.
    pub fn terminate_worker(
        &mut self,
        bound: Duration,
    ) -> Result<std::process::ExitStatus, String> {
        let w = self.worker.take().ok_or("no worker running")?;
        w.signal(libc::SIGTERM);
        match w.wait_exit(bound) {
            Some(status) => Ok(status),
            None => {
                w.kill(libc::SIGKILL);
                Err(format!(
                    "the worker was still running {bound:?} after SIGTERM"
                ))
            }
        }
    }

    /// The identity the running worker was started with.
    pub fn worker_identity(&self) -> String {
        format!("test-worker-{}", self.restarts.saturating_sub(1))
    }

    pub fn worker_log(&self) -> String {
        let mut all = String::new();
        for i in 0..self.restarts {
            all.push_str(
                &std::fs::read_to_string(self.log_dir.join(format!("volume-gate-worker-{i}.log")))
                    .unwrap_or_default(),
            );
        }
        all
    }

    pub fn webhook_log(&self) -> String {
        self.webhook.log_text()
    }

    pub async fn worker_metrics(&self) -> String {
        http_get(self.worker_admin, "/metrics")
            .await
            .map(|(_, b)| b)
            .unwrap_or_default()
    }
}

/// The CRDs the tests need on the management cluster.
pub async fn apply_crds(cp: &ControlPlane) {
    let client = cp.management_client().await;
    let dir = super::cluster::repo_root().join("tests/fixtures/crds/management");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("CRD dir")
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for f in files {
        manifests::apply_file(&client, &f).await;
    }
    wait_crd_established(&client, "helmreleases.helm.toolkit.fluxcd.io").await;
}

/// Waits until the API server serves CRD `name` (`Established`).
pub async fn wait_crd_established(client: &kube::Client, name: &str) {
    let crds: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("apiextensions.k8s.io", "v1", "CustomResourceDefinition"),
            "customresourcedefinitions",
        ),
    );
    eventually(
        &format!("CRD {name} established"),
        Duration::from_secs(30),
        || {
            let crds = crds.clone();
            async move {
                let crd = crds.get(name).await.map_err(|e| e.to_string())?;
                let established = crd.data["status"]["conditions"]
                    .as_array()
                    .is_some_and(|c| {
                        c.iter()
                            .any(|c| c["type"] == "Established" && c["status"] == "True")
                    });
                if established {
                    Ok(())
                } else {
                    Err("not established".into())
                }
            }
        },
    )
    .await;
}

/// A minimal HTTP/1.1 GET on loopback: (status, body).
pub async fn http_get(port: u16, path: &str) -> Result<(u16, String), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&buf).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or("no status line")?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

async fn wait_ready(admin_port: u16, process: &Process) {
    eventually(
        &format!("{} /readyz", process.name),
        Duration::from_secs(60),
        || async {
            if !process.alive() {
                panic!("{} exited; its log:\n{}", process.name, process.log_text());
            }
            match http_get(admin_port, "/readyz").await {
                Ok((200, _)) => Ok(()),
                Ok((code, body)) => Err(format!("{code} {body}")),
                Err(e) => Err(e),
            }
        },
    )
    .await;
}

/// The API server's webhook configuration cache lags the objects: probe it
/// with dry-run requests until both webhooks answer.
pub async fn wait_webhooks_active(cp: &ControlPlane) {
    let client = cp.management_client().await;
    cp.namespace("volume-gate-probe").await;
    let api: Api<DynamicObject> =
        Api::namespaced_with(client, "volume-gate-probe", &helmrelease_resource());
    let mut probe = DynamicObject::new("kubernetes-probe", &helmrelease_resource());
    probe.metadata = ObjectMeta {
        name: Some("kubernetes-probe".into()),
        labels: Some(
            [
                (
                    "apps.cozystack.io/application.kind".to_string(),
                    "Kubernetes".to_string(),
                ),
                (
                    "apps.cozystack.io/application.group".to_string(),
                    "apps.cozystack.io".to_string(),
                ),
            ]
            .into(),
        ),
        annotations: Some(
            [(
                "volumes.cozystack.io/phase".to_string(),
                "Released".to_string(),
            )]
            .into(),
        ),
        ..Default::default()
    };
    // A spec Flux's own CRD schema admits (it is validated before the
    // validating webhooks are called), where that CRD is installed.
    probe.data = serde_json::json!({"spec": {
        "interval": "10m",
        "chartRef": {"kind": "ExternalArtifact", "name": "probe"},
    }});
    eventually(
        "webhooks active in the API server",
        Duration::from_secs(30),
        || {
            let (api, probe) = (api.clone(), probe.clone());
            async move {
                // The forged record must be refused by the validating webhook.
                match api
                    .create(
                        &PostParams {
                            dry_run: true,
                            ..Default::default()
                        },
                        &probe,
                    )
                    .await
                {
                    // The gate's own refusal, not the API server's word that it
                    // could not call it (which also names the webhook).
                    Err(kube::Error::Api(s))
                        if s.message.contains("volume-gate")
                            && !s.message.contains("failed calling webhook") => {}
                    other => return Err(format!("validating webhook not active yet: {other:?}")),
                }
                let mut honest = probe.clone();
                honest.metadata.annotations = None;
                let created = api
                    .create(
                        &PostParams {
                            dry_run: true,
                            ..Default::default()
                        },
                        &honest,
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                if created
                    .metadata
                    .finalizers
                    .unwrap_or_default()
                    .contains(&"volumes.cozystack.io/release".to_string())
                {
                    Ok(())
                } else {
                    Err("mutating webhook not active yet".into())
                }
            }
        },
    )
    .await;
}

pub async fn client_for_kubeconfig(path: &std::path::Path) -> kube::Client {
    client_from(path).await
}

/// A CA and a loopback serving certificate in `dir`, made by the binary's
/// own `certs generate`; returns the base64 CA bundle.
pub fn generate_certs(dir: &std::path::Path) -> String {
    let out = Command::new(binary())
        .args(["certs", "generate", "--san", "127.0.0.1", "--out"])
        .arg(dir)
        .output()
        .expect("run volume-gate certs generate");
    assert!(
        out.status.success(),
        "certs generate: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read_to_string(dir.join("ca-bundle.b64"))
        .expect("ca-bundle.b64")
        .trim()
        .to_string()
}
