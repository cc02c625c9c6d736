//! The test fixture: a real control plane, the gate installed from
//! `manifests/`, the simulator, and Cozystack tenants.
#![allow(dead_code)]

pub mod certmanager;
pub mod chart;
pub mod cluster;
pub mod editor;
pub mod flux;
pub mod gate;
pub mod history;
pub mod manifests;
pub mod process;
pub mod scratch;
pub mod secret_volume;
pub mod sim;
pub mod tenant;
pub mod wait;

use std::sync::OnceLock;

/// The gate and the simulator, shared by the tests of a binary.
pub struct Env {
    pub cp: &'static cluster::ControlPlane,
    /// `None` without the gate.
    pub gate: Option<std::sync::Mutex<gate::Gate>>,
    pub sim: sim::Simulator,
}

/// Control plane, simulator and gate, started once per test binary. Async
/// set-up runs on a runtime of its own: each test has its own runtime.
pub fn gated() -> &'static Env {
    gated_with(gate::test_worker_args())
}

/// As [`gated`], with these worker flags (the first caller's win).
pub fn gated_with(worker_args: Vec<String>) -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| start_env(Some(worker_args)))
}

/// As [`gated`], with short bounds for the attack tests (a pass waits 10s
/// for the PVs before `Blocked`, retries within 1 to 3s): a tenant is held
/// in teardown, `Blocked`, within seconds.
pub fn gated_short() -> &'static Env {
    gated_with(short_worker_args())
}

/// The worker flags of [`gated_short`].
fn short_worker_args() -> Vec<String> {
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
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let cp = cluster::control_plane();
        let file = cp.state.join("profile-one-layer.yaml");
        std::fs::write(&file, "infra: null\n").expect("write the one-layer profile");
        let mut args = short_worker_args();
        args.extend(["--profile".to_string(), file.display().to_string()]);
        let profile = volume_gate::profile::Profile {
            infra: None,
            ..volume_gate::profile::Profile::cozystack()
        };
        start_env_with(
            Some(args),
            (flux::MIN_RETRY_DELAY, flux::MAX_RETRY_DELAY),
            profile,
        )
    })
}

/// Control plane and simulator without the gate: the world as it was.
pub fn ungated() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| start_env(None))
}

/// As [`ungated`], in a world whose tenant volumes have no infra layer:
/// the tenant's CSI driver holds each disk itself, as on the Proxmox path
/// of the seed's incident (profile `infra: null`).
pub fn ungated_one_layer() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let profile = volume_gate::profile::Profile {
            infra: None,
            ..volume_gate::profile::Profile::cozystack()
        };
        start_env_with(
            None,
            (flux::MIN_RETRY_DELAY, flux::MAX_RETRY_DELAY),
            profile,
        )
    })
}

/// As [`ungated`], with helm-controller retrying a failed reconcile after
/// `min_retry_delay` growing to `max_retry_delay` (the first caller's win):
/// for tests of Flux's own retries.
pub fn ungated_with_flux_retry(
    min_retry_delay: &'static str,
    max_retry_delay: &'static str,
) -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        start_env_with(
            None,
            (min_retry_delay, max_retry_delay),
            volume_gate::profile::Profile::cozystack(),
        )
    })
}

/// The control plane, the gate with `worker_args` (none: only the CRDs),
/// Flux's real helm-controller (`flux::flux`), and the simulator; tenants
/// are installed by helm-controller (`Tenant::create`).
fn start_env(worker_args: Option<Vec<String>>) -> Env {
    start_env_with(
        worker_args,
        (flux::MIN_RETRY_DELAY, flux::MAX_RETRY_DELAY),
        volume_gate::profile::Profile::cozystack(),
    )
}

/// As [`start_env`], with helm-controller's retry delays and the profile
/// the simulator plays (the worker's is Cozystack's); Flux's real CRDs
/// (HelmRelease among them) are installed before any test runs.
fn start_env_with(
    worker_args: Option<Vec<String>>,
    flux_retry: (&'static str, &'static str),
    profile: volume_gate::profile::Profile,
) -> Env {
    let cp = cluster::control_plane();
    let gate = std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let gate = match worker_args {
            Some(args) => Some(rt.block_on(gate::Gate::install_with(cp, args))),
            None => {
                rt.block_on(gate::apply_crds(cp));
                None
            }
        };
        rt.block_on(flux::flux_with(
            cp,
            flux_retry.0,
            flux_retry.1,
            flux::CONCURRENT,
        ));
        gate
    })
    .join()
    .expect("gate install");
    let sim = sim::Simulator::start(cp, &profile);
    Env {
        cp,
        gate: gate.map(std::sync::Mutex::new),
        sim,
    }
}

/// Serializes tests that disturb shared processes (killing the worker).
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
