//! The real control plane for a test binary: kube-apiserver,
//! kube-controller-manager (and kube-scheduler on tenant clusters) and etcd,
//! built and run by `tests/harness`. One control plane is shared by the tests
//! of a binary; it stops when the test process exits, however it exits (the
//! supervisor watches our PID).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{Api, ObjectMeta, PostParams};
use serde::Deserialize;

/// The repository: two levels above this crate (`tests/testkit`).
pub fn repo_root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// One cluster of the harness (`DIR/NAME/info.json`).
#[derive(Debug, Clone, Deserialize)]
pub struct ClusterInfo {
    pub name: String,
    pub server: String,
    pub kubeconfig: PathBuf,
    pub ca_file: PathBuf,
    /// A light tenant cluster: no scheduler (see the harness's lightAPIs).
    #[serde(default)]
    pub light: bool,
    /// A cluster run in Pods (`harness cluster up --pod`): its components'
    /// command lines, each beginning with the component's name (the
    /// harness's first argument); empty for one the harness runs.
    #[serde(default)]
    pub commands: std::collections::BTreeMap<String, Vec<String>>,
}

pub struct ControlPlane {
    pub state: PathBuf,
    pub harness: PathBuf,
    pub management: ClusterInfo,
    /// The tenant cluster started with the control plane, handed to the first tenant.
    pub first_tenant_cluster: String,
    /// The management cluster has a real node (`super::node`).
    pub node: bool,
    names: AtomicUsize,
}

static CONTROL_PLANE: OnceLock<ControlPlane> = OnceLock::new();

/// The harness binary, built on first use into a cache keyed by its sources.
pub fn harness_binary() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| run_build_script("tests/harness/build.sh"))
        .clone()
}

/// Upstream kubectl, which `tests/harness/build.sh` builds beside the
/// harness binary.
pub fn kubectl_binary() -> PathBuf {
    harness_binary().with_file_name("kubectl")
}

/// Runs a build script of the repository (its messages go to the test's
/// stderr) and returns the path it prints.
pub fn run_build_script(script: &str) -> PathBuf {
    let out = Command::new("bash")
        .arg(repo_root().join(script))
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("run {script}: {e}"));
    assert!(
        out.status.success(),
        "{script} failed (see its messages above)"
    );
    PathBuf::from(String::from_utf8(out.stdout).expect("utf-8 path").trim())
}

/// The shared control plane of this test binary, started on first use.
pub fn control_plane() -> &'static ControlPlane {
    CONTROL_PLANE.get_or_init(|| start_control_plane(false))
}

/// The control plane of this test binary, if started.
pub fn running() -> Option<&'static ControlPlane> {
    CONTROL_PLANE.get()
}

/// The shared control plane of this test binary with a real node for the
/// management cluster (`super::node`); the binary's first use decides.
pub fn control_plane_with_node() -> &'static ControlPlane {
    let cp = CONTROL_PLANE.get_or_init(|| start_control_plane(true));
    assert!(
        cp.node,
        "this test binary's control plane was started without the real node: use control_plane_with_node first"
    );
    cp
}

fn start_control_plane(node: bool) -> ControlPlane {
    {
        let harness = harness_binary();
        let state = std::env::temp_dir().join(format!("volume-gate-cp-{}", std::process::id()));
        std::fs::create_dir_all(&state).expect("state dir");
        // The supervisor removes the state directory once this process is
        // gone and it has stopped the clusters, unless a panic marked it.
        super::scratch::keep_on_failure(&state);
        let started = std::time::Instant::now();
        let out = crate::process::go_program(&mut Command::new(&harness))
            .args(["up", "--state"])
            .arg(&state)
            .args([
                "--owner-pid",
                &std::process::id().to_string(),
                "--remove-state",
                "--tenant",
                "t0",
            ])
            .args(node.then_some("--node"))
            .output()
            .expect("run harness up");
        assert!(
            out.status.success(),
            "harness up failed ({}): {}\nlogs in {}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            state.join("logs").display()
        );
        eprintln!(
            "control plane up in {:.1}s (state {})",
            started.elapsed().as_secs_f64(),
            state.display()
        );
        let management = read_info(&state, "management");
        ControlPlane {
            state,
            harness,
            management,
            first_tenant_cluster: "t0".into(),
            node,
            names: AtomicUsize::new(0),
        }
    }
}

fn read_info(state: &Path, name: &str) -> ClusterInfo {
    let path = state.join(name).join("info.json");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

impl ControlPlane {
    /// A name unique within this test binary: `prefix-N`.
    pub fn unique(&self, prefix: &str) -> String {
        format!("{prefix}-{}", self.names.fetch_add(1, Ordering::SeqCst))
    }

    /// Starts (or finds running) the harness cluster `name`.
    pub fn cluster_up(&self, name: &str) -> ClusterInfo {
        self.cluster_up_with(name, false)
    }

    /// Starts (or finds running) the harness cluster `name`; `light` (fixed
    /// when it is first created) leaves out the scheduler and the APIs and
    /// controllers the volume-release phase does not use.
    pub fn cluster_up_with(&self, name: &str, light: bool) -> ClusterInfo {
        let out = Command::new(&self.harness)
            .args(["cluster", "up", name, "--state"])
            .arg(&self.state)
            .args(light.then_some("--light"))
            .stderr(Stdio::inherit())
            .output()
            .expect("run harness cluster up");
        assert!(
            out.status.success(),
            "harness cluster up {name} failed; logs in {}",
            self.state.join("logs").display()
        );
        serde_json::from_slice(&out.stdout).expect("cluster info JSON")
    }

    /// Prepares harness cluster `name` to run in Pods: its ports, PKI and
    /// kubeconfig, and its components' command lines (`commands`), which
    /// the harness does not run.
    pub fn cluster_prepare_pod(&self, name: &str) -> ClusterInfo {
        let out = Command::new(&self.harness)
            .args(["cluster", "up", name, "--pod", "--state"])
            .arg(&self.state)
            .stderr(Stdio::inherit())
            .output()
            .expect("run harness cluster up --pod");
        assert!(
            out.status.success(),
            "harness cluster up {name} --pod failed"
        );
        serde_json::from_slice(&out.stdout).expect("cluster info JSON")
    }

    /// Stops the harness cluster `name` (its API server stops answering).
    pub fn cluster_down(&self, name: &str) {
        let status = Command::new(&self.harness)
            .args(["cluster", "down", name, "--state"])
            .arg(&self.state)
            .status()
            .expect("run harness cluster down");
        assert!(status.success(), "harness cluster down {name} failed");
    }

    pub async fn management_client(&self) -> kube::Client {
        client_from(&self.management.kubeconfig).await
    }

    /// Upstream kubectl ([`kubectl_binary`]) against a kubeconfig.
    pub fn kubectl(&self, kubeconfig: &Path) -> Command {
        let mut c = Command::new(kubectl_binary());
        c.arg("--kubeconfig").arg(kubeconfig);
        c
    }

    /// Creates a namespace in the management cluster.
    pub async fn namespace(&self, name: &str) {
        let api: Api<Namespace> = Api::all(self.management_client().await);
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        match api.create(&PostParams::default(), &ns).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("create namespace {name}: {e}"),
        }
    }

    /// A kubeconfig file for a ServiceAccount of the management cluster,
    /// with a token from TokenRequest: the identity a component runs as.
    pub async fn service_account_kubeconfig(&self, namespace: &str, name: &str) -> PathBuf {
        let client = self.management_client().await;
        let api: Api<ServiceAccount> = Api::namespaced(client, namespace);
        let req = TokenRequest {
            spec: Some(TokenRequestSpec {
                expiration_seconds: Some(24 * 3600),
                ..Default::default()
            }),
            ..Default::default()
        };
        let token = api
            .create_token_request(name, &PostParams::default(), &req)
            .await
            .unwrap_or_else(|e| panic!("TokenRequest for {namespace}/{name}: {e}"))
            .status
            .expect("token status")
            .token;
        let ca = std::fs::read(&self.management.ca_file).expect("read CA");
        use base64::Engine;
        let kc = serde_json::json!({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "management", "cluster": {
                "server": self.management.server,
                "certificate-authority-data": base64::engine::general_purpose::STANDARD.encode(ca)}}],
            "users": [{"name": name, "user": {"token": token}}],
            "contexts": [{"name": "sa", "context": {"cluster": "management", "user": name}}],
            "current-context": "sa",
        });
        let path = self.state.join(format!("sa-{namespace}-{name}.kubeconfig"));
        std::fs::write(&path, serde_json::to_vec_pretty(&kc).unwrap())
            .expect("write SA kubeconfig");
        path
    }
}

pub async fn client_from(kubeconfig: &Path) -> kube::Client {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig)
        .unwrap_or_else(|e| panic!("read {}: {e}", kubeconfig.display()));
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .unwrap_or_else(|e| panic!("kubeconfig {}: {e}", kubeconfig.display()));
    kube::Client::try_from(config).expect("client")
}

impl ControlPlane {
    /// A management client acting as `user` in `groups` (impersonation by
    /// the admin): how a test speaks as a person without real credentials.
    pub async fn client_as(&self, user: &str, groups: &[&str]) -> kube::Client {
        let kc = kube::config::Kubeconfig::read_from(&self.management.kubeconfig)
            .expect("read kubeconfig");
        let mut config =
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .expect("config");
        config.auth_info.impersonate = Some(user.to_string());
        config.auth_info.impersonate_groups = Some(groups.iter().map(|g| g.to_string()).collect());
        kube::Client::try_from(config).expect("client")
    }
}
