//! volume-gate installed on the management cluster as shipped: namespace,
//! ServiceAccounts and RBAC from `manifests/`, the webhook and the worker as
//! local processes running as those ServiceAccounts (TokenRequest), and the
//! shipped webhook configurations pointed at the local webhook.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kube::api::{Api, DeleteParams, DynamicObject, ObjectMeta, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use volume_gate::record::Keys;

use super::cluster::ControlPlane;
use super::manifests;
use super::process::Process;
use super::wait::eventually;

pub const NAMESPACE: &str = "volume-gate";
pub const WORKER_SA: &str = "volume-gate-worker";
pub const WEBHOOK_SA: &str = "volume-gate-webhook";

/// The volume-gate binary, beside the running executable's directory:
/// for the package's tests (`target/<profile>/deps/<test>`), the one Cargo
/// builds for them; for the demo and the benchmarks
/// (`target/<profile>/examples/<name>`), built first (Cargo builds no binary
/// for an example).
pub fn binary() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().expect("current exe");
            let dir = exe.parent().expect("target/<profile>/<kind>");
            let profile_dir = dir.parent().expect("target/<profile>");
            let binary = profile_dir.join("volume-gate");
            if dir.ends_with("deps") {
                assert!(
                    binary.is_file(),
                    "{} is missing: run the tests with cargo test (or tests/suite.sh), which builds it",
                    binary.display()
                );
                return binary;
            }
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
            binary
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

/// How the gate runs: the worker's flags, the log filters of both
/// processes, the webhook's certificate reload interval, and the names of
/// its files. The tests' gate is [`GateConfig::tests`]; a benchmark's,
/// [`GateConfig::bench`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GateConfig {
    /// `None`: the tests' names (certificates in `gate-certs`, logs
    /// `volume-gate-webhook.log` and `volume-gate-worker-N.log`, worker
    /// identities `test-worker-N`); `Some(tag)`: a benchmark's
    /// (`bench-certs-TAG`, `bench-webhook-TAG.log`, `bench-worker-TAG-N.log`
    /// and identities `bench-worker-TAG-N`).
    pub tag: Option<String>,
    pub worker_args: Vec<String>,
    /// `RUST_LOG` of the webhook and of the worker.
    pub webhook_log_filter: String,
    pub worker_log_filter: String,
    /// The webhook's `--cert-reload-interval`; `None`: its default.
    pub cert_reload_interval: Option<String>,
    /// How long the API server may take to call both webhooks once they
    /// are configured.
    pub webhooks_active_within: Duration,
    /// A profile file both processes read (`--profile`, as the chart's
    /// ConfigMap is given to them); `None`: the built-in Cozystack profile.
    pub profile: Option<PathBuf>,
}

impl GateConfig {
    /// The tests' gate: both processes log at `info`, the webhook reloads
    /// its certificate every 500ms.
    pub fn tests(worker_args: Vec<String>) -> GateConfig {
        GateConfig {
            tag: None,
            worker_args,
            webhook_log_filter: "info".into(),
            worker_log_filter: "info".into(),
            cert_reload_interval: Some("500ms".into()),
            webhooks_active_within: Duration::from_secs(30),
            profile: None,
        }
    }

    /// A benchmark's gate, its files named by `tag`: the webhook logs
    /// warnings only (one JSON line per decision, as shipped, would make
    /// the log's own cost what a burst measures) and reloads its
    /// certificate at its default interval; the worker logs with
    /// `worker_log_filter`.
    pub fn bench(tag: &str, worker_args: &[String], worker_log_filter: &str) -> GateConfig {
        GateConfig {
            tag: Some(tag.to_string()),
            worker_args: worker_args.to_vec(),
            webhook_log_filter: "warn".into(),
            worker_log_filter: worker_log_filter.into(),
            cert_reload_interval: None,
            webhooks_active_within: Duration::from_secs(60),
            profile: None,
        }
    }

    fn certs_dir(&self) -> String {
        match &self.tag {
            None => "gate-certs".into(),
            Some(tag) => format!("bench-certs-{tag}"),
        }
    }

    fn webhook_log(&self) -> String {
        match &self.tag {
            None => "volume-gate-webhook.log".into(),
            Some(tag) => format!("bench-webhook-{tag}.log"),
        }
    }

    fn worker_log(&self, generation: usize) -> String {
        match &self.tag {
            None => format!("volume-gate-worker-{generation}.log"),
            Some(tag) => format!("bench-worker-{tag}-{generation}.log"),
        }
    }

    fn worker_identity(&self, generation: usize) -> String {
        match &self.tag {
            None => format!("test-worker-{generation}"),
            Some(tag) => format!("bench-worker-{tag}-{generation}"),
        }
    }
}

pub struct Gate {
    pub webhook: Process,
    pub worker: Option<Process>,
    pub webhook_port: u16,
    pub webhook_admin: u16,
    pub worker_admin: u16,
    pub certs: PathBuf,
    pub config: GateConfig,
    webhook_kubeconfig: PathBuf,
    worker_kubeconfig: PathBuf,
    log_dir: PathBuf,
    restarts: usize,
}

impl Gate {
    /// Installs the tests' gate; returns once the API server calls both webhooks.
    pub async fn install(cp: &ControlPlane) -> Gate {
        Self::install_with(cp, test_worker_args()).await
    }

    /// As [`Gate::install`], with these worker flags.
    pub async fn install_with(cp: &ControlPlane, worker_args: Vec<String>) -> Gate {
        Self::install_configured(cp, GateConfig::tests(worker_args)).await
    }

    /// Installs RBAC and CRDs, starts the webhook, applies the shipped
    /// webhook configurations pointed at it, starts the worker; returns
    /// once it is ready and the API server calls both webhooks.
    pub async fn install_configured(cp: &ControlPlane, config: GateConfig) -> Gate {
        apply_crds(cp).await;
        Self::install_documents(cp, config, manifests::base_documents()).await
    }

    /// The gate as the chart installs it for a plain Cluster API platform
    /// (`platform.profile=cluster-api`): its RBAC, its profile ConfigMap's
    /// file given to both processes, its webhook configurations, on
    /// Cluster API's own core manager (started first: the probe's Cluster
    /// goes through its webhooks too).
    pub async fn install_cluster_api(cp: &ControlPlane, worker_args: Vec<String>) -> Gate {
        crate::capi::capi(cp).await;
        cp.namespace(NAMESPACE).await;
        // The KubeVirt infrastructure's CRDs (DataVolumes, VMs) and the
        // snapshot ones its storage serves: a management-side CSI
        // controller's disks are DataVolumes.
        let client = cp.management_client().await;
        let crds = super::cluster::repo_root().join("tests/fixtures/crds/management");
        for f in ["cdi.kubevirt.io.yaml", "kubevirt.io.yaml"]
            .map(|f| crds.join(f))
            .into_iter()
            .chain(super::sim::snapshot_crds())
        {
            manifests::apply_file(&client, &f).await;
        }
        let rendered = crate::chart::template(
            NAMESPACE,
            &[
                "platform.profile=cluster-api",
                // Every Cluster may run its CSI controller management-side
                // (kubevirt-csi-driver's split deployment), the chart's
                // default names: a Cluster without one is judged as before.
                "platform.clusterApi.managementCsi.enabled=true",
                "certificates.mode=secret",
                // Replaced by the tests' own CA (`manifests::point_at_local`).
                "certificates.caBundle=Cg==",
            ],
        );
        let profile = rendered
            .values()
            .find(|d| {
                manifests::kind_of(d) == "ConfigMap"
                    && d["metadata"]["name"] == "volume-gate-profile"
            })
            .and_then(|d| d["data"]["profile.yaml"].as_str())
            .expect("the chart ships a profile for cluster-api")
            .to_string();
        let file = cluster_api_profile_file(cp);
        std::fs::write(&file, profile).expect("write the cluster-api profile");
        // What the tests run as processes (the workloads), the uninstall
        // hook (`tests/chart_install.rs` runs it with Helm) aside.
        let docs = rendered
            .into_values()
            .filter(|d| d["metadata"]["annotations"]["helm.sh/hook"].is_null())
            .collect();
        let config = GateConfig {
            profile: Some(file),
            ..GateConfig::tests(worker_args)
        };
        Self::install_documents(cp, config, docs).await
    }

    /// As [`Gate::install_configured`], from `docs` (a chart render of
    /// another platform's) instead of the kustomize base, and without the
    /// Cozystack fixture's CRDs (the platform brings its own).
    pub async fn install_documents(
        cp: &ControlPlane,
        config: GateConfig,
        docs: Vec<serde_json::Value>,
    ) -> Gate {
        let client = cp.management_client().await;
        for doc in docs
            .iter()
            .filter(|d| !manifests::is_workload(d) && !manifests::is_webhook_configuration(d))
        {
            manifests::apply(&client, doc).await;
        }

        let certs = cp.state.join(config.certs_dir());
        let ca_bundle = generate_certs(&certs);
        let mut gate = Gate::start_webhook_configured(cp, certs, free_port(), config).await;

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

    /// Starts the tests' webhook as ServiceAccount
    /// `volume-gate/volume-gate-webhook` (which must exist), serving the
    /// certificate in `certs` on `webhook_port`, and waits until it is
    /// ready; no worker yet.
    pub async fn start_webhook(
        cp: &ControlPlane,
        certs: PathBuf,
        webhook_port: u16,
        worker_args: Vec<String>,
    ) -> Gate {
        Self::start_webhook_configured(cp, certs, webhook_port, GateConfig::tests(worker_args))
            .await
    }

    /// As [`Gate::start_webhook`], configured by `config`.
    pub async fn start_webhook_configured(
        cp: &ControlPlane,
        certs: PathBuf,
        webhook_port: u16,
        config: GateConfig,
    ) -> Gate {
        let log_dir = cp.state.join("logs");
        let webhook_kubeconfig = cp.service_account_kubeconfig(NAMESPACE, WEBHOOK_SA).await;
        let worker_kubeconfig = cp.service_account_kubeconfig(NAMESPACE, WORKER_SA).await;
        let webhook_admin = free_port();
        let webhook = spawn_webhook(
            &config,
            &certs,
            (webhook_port, webhook_admin),
            &webhook_kubeconfig,
            &log_dir,
        );
        wait_ready(webhook_admin, &webhook).await;
        Gate {
            webhook,
            worker: None,
            webhook_port,
            webhook_admin,
            worker_admin: 0,
            certs,
            config,
            webhook_kubeconfig,
            worker_kubeconfig,
            log_dir,
            restarts: 0,
        }
    }

    /// A webhook process started as this gate starts its webhook: same
    /// port, admin port, certificates, ServiceAccount and log. The caller
    /// stops the running one first.
    pub fn spawn_webhook(&self) -> Process {
        spawn_webhook(
            &self.config,
            &self.certs,
            (self.webhook_port, self.webhook_admin),
            &self.webhook_kubeconfig,
            &self.log_dir,
        )
    }

    /// Starts the worker, waits until it is ready and the API server calls
    /// both webhooks.
    pub async fn start_worker_and_wait(&mut self, cp: &ControlPlane) {
        self.start_worker();
        wait_ready(self.worker_admin, self.worker.as_ref().unwrap()).await;
        wait_webhooks_active_for(cp, self.config.webhooks_active_within, &self.profile()).await;
    }

    /// The profile this gate's processes read.
    pub fn profile(&self) -> volume_gate::profile::Profile {
        volume_gate::profile::Profile::load_or_default(self.config.profile.as_deref())
            .expect("the gate's profile file")
    }

    /// The command line of this gate's worker, with admin port `admin_port`
    /// and identity `identity`: the worker's flags, ServiceAccount and log
    /// filter.
    pub fn worker_command(&self, admin_port: u16, identity: &str) -> Command {
        let mut cmd = Command::new(binary());
        cmd.arg("worker")
            .arg(format!("--admin-listen=127.0.0.1:{admin_port}"))
            .args(&self.config.worker_args)
            .arg(format!("--identity={identity}"))
            .env("KUBECONFIG", &self.worker_kubeconfig)
            .env("POD_NAMESPACE", NAMESPACE)
            .env("RUST_LOG", &self.config.worker_log_filter);
        if let Some(profile) = &self.config.profile {
            cmd.arg("--profile").arg(profile);
        }
        cmd
    }

    /// Starts a worker (after a kill, a fresh one: the restart scenario).
    pub fn start_worker(&mut self) {
        self.worker_admin = free_port();
        let cmd = self.worker_command(
            self.worker_admin,
            &self.config.worker_identity(self.restarts),
        );
        let log = self.log_dir.join(self.config.worker_log(self.restarts));
        self.restarts += 1;
        self.worker = Some(Process::start("worker", cmd, log));
    }

    /// Stops the running worker (SIGTERM), starts one with `worker_args`
    /// instead, and waits until it is ready and leads.
    pub async fn restart_worker_with(&mut self, worker_args: Vec<String>) {
        if let Some(old) = self.worker.take() {
            old.kill(libc::SIGTERM);
        }
        self.config.worker_args = worker_args;
        self.start_worker();
        wait_ready(self.worker_admin, self.worker.as_ref().unwrap()).await;
        self.wait_leading().await;
    }

    /// Waits until the running worker leads: its controller is running.
    pub async fn wait_leading(&self) {
        let log = self.worker_log_path();
        eventually("worker leading", Duration::from_secs(120), || {
            let log = log.clone();
            async move {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                if text.contains("leading: starting the controller") {
                    Ok(())
                } else {
                    Err("not leading yet".into())
                }
            }
        })
        .await;
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
        self.config.worker_identity(self.restarts.saturating_sub(1))
    }

    /// The log of every worker this gate started, in order.
    pub fn worker_log(&self) -> String {
        let mut all = String::new();
        for i in 0..self.restarts {
            all.push_str(
                &std::fs::read_to_string(self.log_dir.join(self.config.worker_log(i)))
                    .unwrap_or_default(),
            );
        }
        all
    }

    /// The log file of the worker started last.
    pub fn worker_log_path(&self) -> PathBuf {
        self.log_dir
            .join(self.config.worker_log(self.restarts.saturating_sub(1)))
    }

    /// The size of [`Gate::worker_log_path`] now: where what comes next starts.
    pub fn worker_log_len(&self) -> u64 {
        std::fs::metadata(self.worker_log_path())
            .map(|m| m.len())
            .unwrap_or(0)
    }

    pub fn webhook_log(&self) -> String {
        self.webhook.log_text()
    }

    pub fn worker_pid(&self) -> u32 {
        self.worker
            .as_ref()
            .and_then(|w| w.pid())
            .expect("worker running")
    }

    pub fn webhook_pid(&self) -> u32 {
        self.webhook.pid().expect("webhook running")
    }

    pub async fn worker_metrics(&self) -> String {
        http_get(self.worker_admin, "/metrics")
            .await
            .map(|(_, b)| b)
            .unwrap_or_default()
    }

    /// Removes the webhook configurations and stops both processes; returns
    /// once the API server no longer calls a webhook that is gone.
    pub async fn uninstall(mut self, cp: &ControlPlane) {
        let client = cp.management_client().await;
        for (kind, plural) in [
            (
                "ValidatingWebhookConfiguration",
                "validatingwebhookconfigurations",
            ),
            (
                "MutatingWebhookConfiguration",
                "mutatingwebhookconfigurations",
            ),
        ] {
            let ar = ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk("admissionregistration.k8s.io", "v1", kind),
                plural,
            );
            let api: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
            let _ = api.delete("volume-gate", &DeleteParams::default()).await;
        }
        if let Some(w) = self.worker.take() {
            w.kill(libc::SIGTERM);
        }
        self.webhook.kill(libc::SIGTERM);
        // The API server's webhook cache lags the deletion: wait until a
        // parent create is no longer mutated.
        cp.namespace("volume-gate-probe").await;
        let profile = self.profile();
        let api: Api<DynamicObject> =
            Api::namespaced_with(client, "volume-gate-probe", &profile.parent_resource());
        let probe = probe_parent(&profile);
        eventually(
            "webhooks gone from the API server",
            Duration::from_secs(60),
            || {
                let (api, probe) = (api.clone(), probe.clone());
                async move {
                    match api.create(&dry_run(), &probe).await {
                        Ok(o) if o.metadata.finalizers.as_ref().is_none_or(|f| f.is_empty()) => {
                            Ok(())
                        }
                        other => Err(format!("{other:?}")),
                    }
                }
            },
        )
        .await;
    }
}

/// The CRDs the tests need on the management cluster, and the
/// snapshot.storage.k8s.io ones its storage serves.
pub async fn apply_crds(cp: &ControlPlane) {
    let client = cp.management_client().await;
    let dir = super::cluster::repo_root().join("tests/fixtures/crds/management");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("CRD dir")
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files.extend(super::sim::snapshot_crds());
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

/// The webhook as `config` runs it, serving the certificate in `certs` on
/// `ports` (listen, admin) as the ServiceAccount of `kubeconfig`, its log
/// in `log_dir`.
fn spawn_webhook(
    config: &GateConfig,
    certs: &Path,
    (port, admin): (u16, u16),
    kubeconfig: &Path,
    log_dir: &Path,
) -> Process {
    let mut cmd = Command::new(binary());
    cmd.arg("webhook")
        .arg(format!("--listen=127.0.0.1:{port}"))
        .arg(format!("--admin-listen=127.0.0.1:{admin}"))
        .arg("--tls-cert")
        .arg(certs.join("tls.crt"))
        .arg("--tls-key")
        .arg(certs.join("tls.key"));
    if let Some(interval) = &config.cert_reload_interval {
        cmd.arg(format!("--cert-reload-interval={interval}"));
    }
    if let Some(profile) = &config.profile {
        cmd.arg("--profile").arg(profile);
    }
    cmd.env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", &config.webhook_log_filter);
    Process::start("webhook", cmd, log_dir.join(config.webhook_log()))
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

fn dry_run() -> PostParams {
    PostParams {
        dry_run: true,
        ..Default::default()
    }
}

/// The parent the webhook probes create (dry run), under `profile`'s
/// labels: a HelmRelease with a spec Flux's own CRD schema admits (it is
/// validated before the validating webhooks are called), or a Cluster API
/// Cluster naming a played control plane (Cluster API's webhook wants a
/// reference).
fn probe_parent(profile: &volume_gate::profile::Profile) -> DynamicObject {
    let mut probe = DynamicObject::new("kubernetes-probe", &profile.parent_resource());
    probe.metadata = ObjectMeta {
        name: Some("kubernetes-probe".into()),
        labels: Some(profile.parent.match_labels.clone()),
        ..Default::default()
    };
    probe.data = if profile.parent_kind() == volume_gate::profile::flux_release_kind() {
        serde_json::json!({"spec": {
            "interval": "10m",
            "chartRef": {"kind": "ExternalArtifact", "name": "probe"},
        }})
    } else {
        serde_json::json!({"spec": {"controlPlaneRef": {
            "apiGroup": "controlplane.cluster.x-k8s.io", "kind": "HarnessControlPlane", "name": "probe",
        }}})
    };
    probe
}

/// The API server's webhook configuration cache lags the objects: probe it
/// with dry-run requests until both webhooks answer.
pub async fn wait_webhooks_active(cp: &ControlPlane) {
    wait_webhooks_active_within(cp, Duration::from_secs(30)).await
}

/// As [`wait_webhooks_active`], within `bound`.
pub async fn wait_webhooks_active_within(cp: &ControlPlane, bound: Duration) {
    wait_webhooks_active_for(cp, bound, &volume_gate::profile::Profile::cozystack()).await
}

/// As [`wait_webhooks_active_within`], for the webhooks of `profile`'s
/// platform.
pub async fn wait_webhooks_active_for(
    cp: &ControlPlane,
    bound: Duration,
    profile: &volume_gate::profile::Profile,
) {
    let keys = Keys::new(&profile.annotation_prefix);
    let client = cp.management_client().await;
    cp.namespace("volume-gate-probe").await;
    let api: Api<DynamicObject> =
        Api::namespaced_with(client, "volume-gate-probe", &profile.parent_resource());
    let mut forged = probe_parent(profile);
    forged.metadata.annotations = Some([(keys.phase.clone(), "Released".to_string())].into());
    let probe = probe_parent(profile);
    eventually("webhooks active in the API server", bound, || {
        let (api, forged, probe) = (api.clone(), forged.clone(), probe.clone());
        let finalizer = profile.custody_finalizer.clone();
        async move {
            // The forged record must be refused by the validating webhook.
            match api.create(&dry_run(), &forged).await {
                // The gate's own refusal, not the API server's word that it
                // could not call it (which also names the webhook).
                Err(kube::Error::Api(s))
                    if s.message.contains("volume-gate")
                        && !s.message.contains("failed calling webhook") => {}
                other => return Err(format!("validating webhook not active yet: {other:?}")),
            }
            let created = api
                .create(&dry_run(), &probe)
                .await
                .map_err(|e| e.to_string())?;
            if created
                .metadata
                .finalizers
                .unwrap_or_default()
                .contains(&finalizer)
            {
                Ok(())
            } else {
                Err("mutating webhook not active yet".into())
            }
        }
    })
    .await;
}

/// A CA and a loopback serving certificate in `dir`, made by the binary's
/// own `certs generate`; returns the base64 CA bundle.
pub fn generate_certs(dir: &std::path::Path) -> String {
    crate::process::run_ok(
        Command::new(binary())
            .args(["certs", "generate", "--san", "127.0.0.1", "--out"])
            .arg(dir),
        "volume-gate certs generate",
    );
    std::fs::read_to_string(dir.join("ca-bundle.b64"))
        .expect("ca-bundle.b64")
        .trim()
        .to_string()
}

/// Where [`Gate::install_cluster_api`] writes the profile the chart ships.
fn cluster_api_profile_file(cp: &ControlPlane) -> PathBuf {
    cp.state.join("profile-cluster-api.yaml")
}

/// The profile the gate installed for Cluster API reads: the chart's.
pub fn cluster_api_profile(cp: &ControlPlane) -> volume_gate::profile::Profile {
    volume_gate::profile::Profile::load(&cluster_api_profile_file(cp))
        .unwrap_or_else(|e| panic!("the installed cluster-api profile: {e}"))
}
