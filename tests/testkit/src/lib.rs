//! The test fixture: a real control plane, the gate installed from
//! `manifests/`, the simulator, and Cozystack tenants.

pub mod capi;
pub mod certmanager;
pub mod chart;
pub mod cluster;
pub mod cozystack;
pub mod editor;
pub mod exposition;
pub mod flux;
pub mod gate;
pub mod history;
pub mod manifests;
pub mod node;
pub mod process;
pub mod prometheus;
pub mod scratch;
pub mod secret_volume;
pub mod sim;
pub mod tenant;
pub mod wait;

use std::sync::OnceLock;

/// The platform the fixture builds and the gate is configured for: the
/// Cozystack profile. Its names (`R-csi`, `R-admin-kubeconfig`, the custody
/// finalizer, the record's prefix) are what tests use, not copies of them.
pub fn profile() -> volume_gate::profile::Profile {
    volume_gate::profile::Profile::cozystack()
}

/// The record's annotation keys under [`profile`]'s prefix.
pub fn keys() -> volume_gate::record::Keys {
    volume_gate::record::Keys::new(&profile().annotation_prefix)
}

/// The gate and the simulator, shared by the tests of a binary.
pub struct Env {
    pub cp: &'static cluster::ControlPlane,
    /// `None` without the gate.
    pub gate: Option<std::sync::Mutex<gate::Gate>>,
    pub sim: sim::Simulator,
    /// What it was started with.
    pub config: EnvConfig,
}

impl Env {
    /// What the gate's processes read, taken under its lock (which is not
    /// held across an await).
    fn with_gate<R>(&self, f: impl FnOnce(&gate::Gate) -> R) -> R {
        f(&self
            .gate
            .as_ref()
            .expect("a gated environment")
            .lock()
            .unwrap())
    }

    /// The worker's /metrics now; empty while it does not answer.
    pub async fn worker_metrics(&self) -> String {
        metrics_on(self.with_gate(|g| g.worker_admin)).await
    }

    /// The webhook's /metrics now; empty while it does not answer.
    pub async fn webhook_metrics(&self) -> String {
        metrics_on(self.with_gate(|g| g.webhook_admin)).await
    }

    /// The running worker's log so far, for failure messages.
    pub fn worker_log(&self) -> String {
        self.with_gate(|g| g.worker_log())
    }

    /// The directory of the webhook's serving certificate.
    pub fn gate_certs(&self) -> std::path::PathBuf {
        self.with_gate(|g| g.certs.clone())
    }
}

/// /metrics on the admin `port`; empty while nothing answers there.
async fn metrics_on(port: u16) -> String {
    gate::http_get(port, "/metrics")
        .await
        .map(|(_, b)| b)
        .unwrap_or_default()
}

/// What a test binary's shared environment is: whether the gate runs (and
/// its worker's flags), the world the simulator plays (with or without an
/// infra layer), and helm-controller's configuration. A binary has one
/// control plane and so one environment: [`env`] starts it with the first
/// caller's configuration and refuses any other.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvConfig {
    /// The platform the gate is installed for (its profile, webhook
    /// configurations and RBAC from the chart's render for it).
    pub platform: Platform,
    /// The worker's flags; `None`: no gate (only its CRDs), the world as it was.
    pub worker_args: Option<Vec<String>>,
    /// The tenant volumes' layers.
    pub layers: Layers,
    pub flux: flux::FluxConfig,
}

/// The platform an environment plays, and a gated one is installed for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Platform {
    /// Cozystack: its tenants' Cluster API objects on Cluster API's own
    /// core manager at Cozystack's version ([`capi::Core::COZYSTACK`]) and
    /// its providers played; the gate from the kustomize base, the
    /// built-in profile.
    Cozystack,
    /// A plain Cluster API platform: Cluster API's own core manager
    /// ([`capi::Core::UPSTREAM`], started by the first cluster), and the
    /// gate as the chart installs it with `platform.profile=cluster-api`.
    ClusterApi,
}

/// Whether tenant volumes have an infra layer on the management cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layers {
    /// Cozystack's KubeVirt path: each tenant volume is a DataVolume whose
    /// management PV holds the disk (the Cozystack profile).
    Infra,
    /// The Proxmox path of the seed's incident: the tenant's CSI driver
    /// holds each disk itself (profile `infra: null`, for the simulator and,
    /// with the gate, the worker).
    TenantOnly,
}

impl EnvConfig {
    /// The gate with the worker flags for tests ([`gate::test_worker_args`]).
    pub fn gated() -> EnvConfig {
        EnvConfig::gated_with(gate::test_worker_args())
    }

    /// The gate with these worker flags.
    pub fn gated_with(worker_args: Vec<String>) -> EnvConfig {
        EnvConfig {
            platform: Platform::Cozystack,
            worker_args: Some(worker_args),
            layers: Layers::Infra,
            flux: flux::FluxConfig::default(),
        }
    }

    /// The gate with short bounds for the attack tests (a pass waits 10s
    /// for the PVs before `Blocked`, retries within 1 to 3s): a tenant is
    /// held in teardown, `Blocked`, within seconds.
    pub fn gated_short() -> EnvConfig {
        EnvConfig::gated_with(short_worker_args())
    }

    /// No gate: the world as it was.
    pub fn ungated() -> EnvConfig {
        EnvConfig {
            platform: Platform::Cozystack,
            worker_args: None,
            layers: Layers::Infra,
            flux: flux::FluxConfig::default(),
        }
    }

    /// This configuration with tenant volumes of no infra layer.
    pub fn tenant_only(self) -> EnvConfig {
        EnvConfig {
            layers: Layers::TenantOnly,
            ..self
        }
    }

    /// This configuration with helm-controller retrying a failed reconcile
    /// after `min_retry_delay`, growing to `max_retry_delay`.
    pub fn flux_retry(self, min_retry_delay: &'static str, max_retry_delay: &'static str) -> Self {
        EnvConfig {
            flux: flux::FluxConfig {
                min_retry_delay,
                max_retry_delay,
                ..self.flux
            },
            ..self
        }
    }

    /// The gate for a plain Cluster API platform, with the short worker
    /// flags and the chart's management-side CSI controller knob on: a
    /// cluster's driver runs inside it (volumes of one layer) or, where its
    /// HarnessCluster says so, management-side (DataVolumes).
    pub fn cluster_api() -> EnvConfig {
        EnvConfig {
            platform: Platform::ClusterApi,
            ..EnvConfig::gated_short().tenant_only()
        }
    }

    /// A plain Cluster API platform without the gate.
    pub fn cluster_api_ungated() -> EnvConfig {
        EnvConfig {
            platform: Platform::ClusterApi,
            ..EnvConfig::ungated()
        }
    }

    /// The profile of this world: Cozystack's, without the infra layer
    /// for [`Layers::TenantOnly`]; Cluster API's built-in one.
    pub fn profile(&self) -> volume_gate::profile::Profile {
        if self.platform == Platform::ClusterApi {
            return volume_gate::profile::Profile::cluster_api();
        }
        match self.layers {
            Layers::Infra => volume_gate::profile::Profile::cozystack(),
            Layers::TenantOnly => volume_gate::profile::Profile {
                infra: None,
                ..volume_gate::profile::Profile::cozystack()
            },
        }
    }
}

/// This test binary's environment: control plane, simulator and (if
/// configured) the gate, started once with `config`. Async set-up runs on
/// a runtime of its own: each test has its own runtime.
///
/// Panics if the environment was already started with another
/// configuration: one control plane carries one gate, one simulator and
/// one helm-controller, so a test asking for another would silently run
/// in a world it did not ask for.
pub fn env(config: EnvConfig) -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    let env = ENV.get_or_init(|| start_env(config.clone()));
    refuse_another("shared environment", &env.config, &config);
    env
}

/// Panics, naming both, if `asked` is not the configuration `started` a
/// shared `what` was started with: there is one per test binary.
pub fn refuse_another<T: PartialEq + std::fmt::Debug>(what: &str, started: &T, asked: &T) {
    assert!(
        started == asked,
        "this test binary's {what} was started with\n  {started:?}\nand a caller asks for\n  {asked:?}\n\
         a test binary has one: give every caller the same configuration"
    );
}

/// The gate with the worker flags for tests: [`EnvConfig::gated`].
pub fn gated() -> &'static Env {
    env(EnvConfig::gated())
}

/// The gate with these worker flags: [`EnvConfig::gated_with`].
pub fn gated_with(worker_args: Vec<String>) -> &'static Env {
    env(EnvConfig::gated_with(worker_args))
}

/// The gate with short bounds for the attack tests: [`EnvConfig::gated_short`].
pub fn gated_short() -> &'static Env {
    env(EnvConfig::gated_short())
}

/// The worker flags of [`EnvConfig::gated_short`].
pub fn short_worker_args() -> Vec<String> {
    [
        "--wait-bound",
        "10s",
        "--retry-base",
        "1s",
        "--retry-max",
        "3s",
        "--probe-timeout",
        "3s",
        "--lease-duration",
        "4s",
    ]
    .map(String::from)
    .to_vec()
}

/// As [`gated_short`], in a world whose tenant volumes have no infra layer
/// (the Proxmox path: the tenant's CSI driver holds each disk itself); the
/// worker runs with a profile whose `infra` is null.
pub fn gated_one_layer() -> &'static Env {
    env(EnvConfig::gated_short().tenant_only())
}

/// The gate installed for a plain Cluster API platform
/// ([`EnvConfig::cluster_api`]).
pub fn cluster_api() -> &'static Env {
    env(EnvConfig::cluster_api())
}

/// Control plane and simulator without the gate: the world as it was.
pub fn ungated() -> &'static Env {
    env(EnvConfig::ungated())
}

/// A plain Cluster API platform without the gate
/// ([`EnvConfig::cluster_api_ungated`]).
pub fn ungated_cluster_api() -> &'static Env {
    env(EnvConfig::cluster_api_ungated())
}

/// As [`ungated`], in a world whose tenant volumes have no infra layer:
/// the tenant's CSI driver holds each disk itself, as on the Proxmox path
/// of the seed's incident (profile `infra: null`).
pub fn ungated_one_layer() -> &'static Env {
    env(EnvConfig::ungated().tenant_only())
}

/// As [`ungated`], with helm-controller retrying a failed reconcile after
/// `min_retry_delay` growing to `max_retry_delay`: for tests of Flux's own
/// retries.
pub fn ungated_with_flux_retry(
    min_retry_delay: &'static str,
    max_retry_delay: &'static str,
) -> &'static Env {
    env(EnvConfig::ungated().flux_retry(min_retry_delay, max_retry_delay))
}

/// The control plane, the gate as `config` says (none: only the CRDs),
/// Flux's real helm-controller (`flux::flux_with`; its real CRDs, with
/// HelmRelease, are installed before any test runs), and the simulator
/// playing `config`'s profile; tenants are installed by helm-controller
/// (`Tenant::create`).
fn start_env(config: EnvConfig) -> Env {
    let cp = cluster::control_plane();
    let profile = config.profile();
    let platform = config.platform;
    let worker_args = config.worker_args.clone().map(|mut args| {
        if config.layers == Layers::TenantOnly && platform == Platform::Cozystack {
            let file = cp.state.join("profile-one-layer.yaml");
            std::fs::write(&file, "infra: null\n").expect("write the one-layer profile");
            args.extend(["--profile".to_string(), file.display().to_string()]);
        }
        args
    });
    let flux_config = config.flux.clone();
    let gate = std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let gate = match worker_args {
            Some(args) if platform == Platform::ClusterApi => {
                Some(rt.block_on(gate::Gate::install_cluster_api(cp, args)))
            }
            Some(args) => Some(rt.block_on(gate::Gate::install_with(cp, args))),
            None => {
                rt.block_on(gate::apply_crds(cp));
                None
            }
        };
        if platform == Platform::Cozystack {
            rt.block_on(capi::core(cp, capi::Core::COZYSTACK));
        }
        rt.block_on(flux::flux_with(cp, flux_config));
        gate
    })
    .join()
    .expect("gate install");
    // The simulator reads a profile for the Cozystack tenants it plays; it
    // plays a Cluster API cluster from Cluster API's own objects, whatever
    // the gate's profile (`tests/harness/sim_capi.go`), with the infra layer
    // (CDI, KubeVirt, the management storage) that a management-side CSI
    // controller's DataVolumes need.
    let sim_profile = match platform {
        Platform::Cozystack => profile,
        Platform::ClusterApi => volume_gate::profile::Profile::cozystack(),
    };
    let sim = sim::Simulator::start(cp, &sim_profile);
    Env {
        cp,
        gate: gate.map(std::sync::Mutex::new),
        sim,
        config,
    }
}

/// Serializes tests that disturb shared processes (killing the worker).
pub fn serial() -> Serial {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    Serial {
        _turn: LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner()),
    }
}

/// A test's turn among those that disturb shared processes, held for the
/// whole test. It is held across awaits by design: each test runs on a
/// runtime of its own, so no task of the holder's runtime waits for it;
/// tests of other runtimes block until it is dropped.
pub struct Serial {
    _turn: std::sync::MutexGuard<'static, ()>,
}
