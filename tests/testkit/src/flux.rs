//! The real Flux helm-controller (built by `tests/flux/build.sh`) against the
//! management API server, with charts delivered the way Cozystack delivers
//! them: a HelmRelease's `chartRef` of kind `ExternalArtifact`, whose status
//! points at a chart tarball served on loopback.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use serde_json::json;

use super::cluster::{ControlPlane, repo_root, run_build_script};
use super::cozystack;
use super::gate::{free_port, http_get};
use super::manifests;
use super::process::Process;
use super::wait::eventually;

/// The directory `tests/flux/build.sh` prints: `helm-controller`, `crds/`.
pub fn flux_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| run_build_script("tests/flux/build.sh"))
        .clone()
}

pub fn external_artifact_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("source.toolkit.fluxcd.io", "v1", "ExternalArtifact"),
        "externalartifacts",
    )
}

/// helm-controller running against the management cluster, and the server
/// its charts come from.
pub struct Flux {
    pub process: Process,
    pub charts: ChartServer,
}

/// How helm-controller runs. Always Cozystack's arguments
/// ([`cozystack::HELM_CONTROLLER_ARGS`]), as its identity, with what the
/// fixture changes, each for a reason:
///
/// - **retry delays**: Cozystack passes none, so Flux's own apply (750 ms
///   doubling to 15 min: [`FluxConfig::cozystack`]). The tests' default
///   starts at [`MIN_RETRY_DELAY`], so that a retry within a test's bounds
///   can only be the one the worker asked for: with 750 ms, a test of the
///   worker's retry request could not fail.
/// - **workers** (`--concurrent`): Cozystack runs 5 in each helm-controller,
///   the main one and each shard of the flux-shard-operator (one per 100
///   releases, up to 16); the fixture's one helm-controller plays the main
///   one and a shard, so [`CONCURRENT`].
/// - **no label selector**: Cozystack's main controller watches
///   `!sharding.fluxcd.io/key` and each shard `sharding.fluxcd.io/key=shard<i>`,
///   with the same image, identity and other flags; the one controller here
///   watches every release.
/// - `--events-addr` names no notification-controller (none runs here), and
///   `--log-level=debug`, for the logs a failed test keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FluxConfig {
    pub min_retry_delay: &'static str,
    pub max_retry_delay: &'static str,
    pub concurrent: u32,
}

impl Default for FluxConfig {
    fn default() -> Self {
        FluxConfig {
            min_retry_delay: MIN_RETRY_DELAY,
            max_retry_delay: MAX_RETRY_DELAY,
            concurrent: CONCURRENT,
        }
    }
}

impl FluxConfig {
    /// Flux's own retry delays, which Cozystack keeps (fluxcd/pkg
    /// `runtime/controller/rate_limiter.go`), and Cozystack's 5 workers.
    pub fn cozystack() -> FluxConfig {
        FluxConfig {
            min_retry_delay: "750ms",
            max_retry_delay: "15m",
            concurrent: 5,
        }
    }

    /// helm-controller's arguments but its listening addresses:
    /// Cozystack's, with this configuration's changes.
    pub fn args(&self) -> Vec<String> {
        let mut args: Vec<String> = cozystack::HELM_CONTROLLER_ARGS
            .iter()
            .filter(|a| {
                !a.starts_with("--concurrent=")
                    && !a.starts_with("--watch-label-selector=")
                    && !a.starts_with("--log-level=")
            })
            .map(|a| a.to_string())
            .collect();
        args.extend([
            format!("--concurrent={}", self.concurrent),
            "--log-level=debug".into(),
            "--events-addr=".into(),
            format!("--min-retry-delay={}", self.min_retry_delay),
            format!("--max-retry-delay={}", self.max_retry_delay),
        ]);
        args
    }
}

static FLUX: tokio::sync::OnceCell<(FluxConfig, Flux)> = tokio::sync::OnceCell::const_new();

/// This test binary's helm-controller with the default configuration,
/// started on first use (see [`flux_with`]).
pub async fn flux(cp: &ControlPlane) -> &'static Flux {
    flux_with(cp, FluxConfig::default()).await
}

/// This test binary's helm-controller, started on first use with `config`
/// (a benchmark measuring Flux's own retries starts it with Flux's
/// defaults). Panics if it was started with another configuration: a
/// binary has one helm-controller.
pub async fn flux_with(cp: &ControlPlane, config: FluxConfig) -> &'static Flux {
    let (started, flux) = FLUX
        .get_or_init(|| async { (config.clone(), Flux::start_with(cp, &config).await) })
        .await;
    super::refuse_another("helm-controller", started, &config);
    flux
}

/// The helm-controller this test binary runs, whatever its configuration
/// (an environment's, see `common::env`), or one started with the default
/// configuration if there is none yet: for those that only need a
/// helm-controller to install what they create (tenants), not a particular
/// one.
pub async fn running(cp: &ControlPlane) -> &'static Flux {
    match FLUX.get() {
        Some((_, flux)) => flux,
        None => flux(cp).await,
    }
}

/// The spec of a HelmRelease that Flux leaves alone (suspended; its chart
/// named as Cozystack's are): for objects a test needs only as API objects.
/// Deleting one, helm-controller only removes its finalizer.
pub fn inert_spec(chart: &str) -> serde_json::Value {
    json!({
        "chart": {"spec": {"chart": chart, "sourceRef": {"kind": "HelmRepository", "name": "cozystack-apps", "namespace": "cozy-public"}}},
        "interval": "5m",
        "suspend": true,
    })
}

/// helm-controller's first retry of a failed reconcile (an uninstall refused
/// by the gate) comes this long after the failure, growing to
/// `MAX_RETRY_DELAY`: a retry within a test's bounds can only be one that
/// was asked for (`reconcile.fluxcd.io/requestedAt`).
///
/// helm-controller adds its finalizer and then requeues through the same
/// rate limiter; the tests create HelmReleases with `FLUX_FINALIZER` already
/// on, as Cozystack's objects have it after their first reconcile.
pub const MIN_RETRY_DELAY: &str = "10m";
pub const FLUX_FINALIZER: &str = "finalizers.fluxcd.io";
pub const MAX_RETRY_DELAY: &str = "15m";
/// helm-controller's workers in the tests. Flux's default is 4; platforms
/// running many releases raise it (10 in the Flux operator's cluster-size
/// profiles and its FluxInstance examples). With 4, parent releases whose
/// install waits for their child releases to be Ready hold the workers the
/// children need, and tenants built a few at a time queue for minutes.
pub const CONCURRENT: u32 = 10;

/// helm-controller acts as Cozystack's Flux does: ServiceAccount
/// `cozy-fluxcd/flux`, bound to cluster-admin, its namespace labelled as
/// Cozystack's is ([`cozystack::FLUX`], [`cozystack::FLUX_NAMESPACE_LABELS`]).
/// The gate knows it by that name: it alone writes a HelmRelease's status
/// and applies a parent release's children (the profile's `writers`).
async fn controller_identity(cp: &ControlPlane) -> PathBuf {
    cozystack::act_as(cp, &cozystack::FLUX, &cozystack::FLUX_NAMESPACE_LABELS).await
}

impl Flux {
    /// Installs Flux's real CRDs (replacing the fixture's HelmRelease CRD)
    /// and starts helm-controller with the ExternalArtifact feature gate,
    /// `config`'s retry delays (helm-controller's own defaults are 750ms
    /// and 15m) and workers (its default: 4). Tests use [`flux`].
    pub async fn start_with(cp: &ControlPlane, config: &FluxConfig) -> Flux {
        let dir = flux_dir();
        let client = cp.management_client().await;
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir.join("crds"))
            .expect("crds")
            .map(|e| e.expect("entry").path())
            .collect();
        files.sort();
        for f in &files {
            manifests::apply_file(&client, f).await;
        }
        for name in [
            "helmreleases.helm.toolkit.fluxcd.io",
            "externalartifacts.source.toolkit.fluxcd.io",
            "helmcharts.source.toolkit.fluxcd.io",
            "ocirepositories.source.toolkit.fluxcd.io",
        ] {
            super::gate::wait_crd_established(&client, name).await;
        }
        let kubeconfig = controller_identity(cp).await;
        let health = free_port();
        let mut cmd = Command::new(dir.join("helm-controller"));
        crate::process::go_program(&mut cmd);
        cmd.env("KUBECONFIG", &kubeconfig)
            .args(config.args())
            .args([
                &format!("--metrics-addr=127.0.0.1:{}", free_port()),
                &format!("--health-addr=127.0.0.1:{health}"),
            ]);
        let log = cp
            .state
            .join("logs")
            .join(format!("{}.log", cp.unique("helm-controller")));
        let process = Process::start("helm-controller", cmd, log);
        eventually(
            "helm-controller /readyz",
            Duration::from_secs(60),
            || async {
                if !process.alive() {
                    panic!("helm-controller exited; its log:\n{}", process.log_text());
                }
                match http_get(health, "/readyz").await {
                    Ok((200, _)) => Ok(()),
                    Ok((code, body)) => Err(format!("{code} {body}")),
                    Err(e) => Err(e),
                }
            },
        )
        .await;
        Flux {
            process,
            charts: ChartServer::start(cp.state.join(cp.unique("charts"))),
        }
    }

    /// Packages the chart at `tests/fixtures/charts/<chart>` and publishes it
    /// as ExternalArtifact `name` in `namespace`, status and all, as a
    /// source producer would.
    pub async fn publish_chart(
        &self,
        client: &kube::Client,
        namespace: &str,
        name: &str,
        chart: &str,
    ) {
        self.publish_chart_dir(
            client,
            namespace,
            name,
            &repo_root().join("tests/fixtures/charts").join(chart),
        )
        .await;
    }

    /// As [`Flux::publish_chart`], the chart folder `chart` wherever it is
    /// (a chart a test made: another version of a fixture's).
    pub async fn publish_chart_dir(
        &self,
        client: &kube::Client,
        namespace: &str,
        name: &str,
        chart: &Path,
    ) {
        let (file, digest) = self.charts.package(chart, &format!("{namespace}-{name}"));
        // A chart artifact's revision is the chart's version and digest, as
        // source-controller writes it; helm-controller refuses a chart
        // whose version is not the revision's.
        let meta = std::fs::read_to_string(chart.join("Chart.yaml")).expect("Chart.yaml");
        let version = meta
            .lines()
            .find_map(|l| l.strip_prefix("version:"))
            .map(|v| v.trim().trim_matches('"').to_string())
            .expect("a chart version");
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), namespace, &external_artifact_resource());
        let mut obj = DynamicObject::new(name, &external_artifact_resource()).within(namespace);
        obj.data = json!({"spec": {"sourceRef": {"apiVersion": "volume-gate.test/v1", "kind": "ChartServer", "name": "charts"}}});
        // Tenants sharing a namespace share its artifacts.
        match api.create(&PostParams::default(), &obj).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => panic!("create ExternalArtifact {namespace}/{name}: {e}"),
        }
        let now = jiff::Timestamp::now()
            .strftime("%Y-%m-%dT%H:%M:%SZ")
            .to_string();
        let status = json!({"status": {"artifact": {
            "path": file, "url": format!("http://127.0.0.1:{}/{file}", self.charts.port),
            "revision": format!("{version}@{digest}"), "digest": digest, "lastUpdateTime": now,
        }}});
        api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .expect("ExternalArtifact status");
    }

    pub fn log(&self) -> String {
        self.process.log_text()
    }
}

/// The Ready condition of a HelmRelease: (status, reason, message).
pub fn ready_condition(hr: &DynamicObject) -> Option<(String, String, String)> {
    let c = hr.data["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Ready")?;
    let s = |k: &str| c[k].as_str().unwrap_or("").to_string();
    Some((s("status"), s("reason"), s("message")))
}

/// Files from one directory over plain HTTP on loopback: `GET /<file>`.
/// A thread of its own, so it outlives any one test's runtime.
pub struct ChartServer {
    pub port: u16,
    dir: PathBuf,
}

impl ChartServer {
    fn start(dir: PathBuf) -> ChartServer {
        use std::io::{Read, Write};
        std::fs::create_dir_all(&dir).expect("chart dir");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the chart server");
        let port = listener.local_addr().expect("local addr").port();
        let root = dir.clone();
        std::thread::spawn(move || {
            for mut conn in listener.incoming().flatten() {
                let mut buf = vec![0u8; 8192];
                let n = conn.read(&mut buf).unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                let path = head
                    .split_whitespace()
                    .nth(1)
                    .unwrap_or("/")
                    .trim_start_matches('/')
                    .to_string();
                // One flat directory: no separators, no parent references.
                let body = (!path.is_empty() && !path.contains('/') && !path.contains(".."))
                    .then(|| std::fs::read(root.join(&path)).ok())
                    .flatten();
                let response = match body {
                    Some(b) => [
                        format!(
                            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                            b.len()
                        )
                        .into_bytes(),
                        b,
                    ]
                    .concat(),
                    None => {
                        b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                            .to_vec()
                    }
                };
                let _ = conn.write_all(&response);
            }
        });
        ChartServer { port, dir }
    }

    /// `helm package`'s layout with the system `tar`: a gzipped tarball
    /// whose top folder is the chart, named by its digest
    /// (`<artifact>-<digest>.tgz`, written under a temporary name and
    /// renamed): a file once served never changes, so an ExternalArtifact's
    /// status and the bytes it points at always agree, even while tenants
    /// sharing a namespace publish the same chart at once. Returns its file
    /// name and digest.
    fn package(&self, chart: &Path, artifact: &str) -> (String, String) {
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let name = chart
            .file_name()
            .expect("chart folder")
            .to_string_lossy()
            .to_string();
        let tmp = self.dir.join(format!(
            ".{artifact}.{}.tmp",
            SEQ.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        ));
        // Reproducible bytes (sorted entries, fixed owners and times, no gzip
        // timestamp): the same chart is the same revision, so publishing it
        // again for another tenant does not make Flux upgrade the first.
        let status = Command::new("sh")
            .arg("-c")
            .arg(r#"tar -C "$1" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - "$2" | gzip -n > "$3""#)
            .arg("package")
            .arg(chart.parent().expect("charts folder"))
            .arg(&name)
            .arg(&tmp)
            .status()
            .expect("run tar");
        assert!(status.success(), "tar of {}", chart.display());
        let out = Command::new("sha256sum")
            .arg(&tmp)
            .output()
            .expect("run sha256sum");
        let hex = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()
            .expect("a digest")
            .to_string();
        let file = format!("{artifact}-{}.tgz", &hex[..16]);
        std::fs::rename(&tmp, self.dir.join(&file)).expect("rename the chart tarball");
        (file, format!("sha256:{hex}"))
    }
}
