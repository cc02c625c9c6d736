//! The test fixture: a real control plane, the gate installed from
//! `manifests/`, the simulator, and Cozystack tenants.
#![allow(dead_code)]

pub mod cluster;
pub mod flux;
pub mod gate;
pub mod history;
pub mod manifests;
pub mod process;
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

/// Control plane and simulator without the gate: the world as it was.
pub fn ungated() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| start_env(None))
}

/// The control plane, the gate with `worker_args` (none: only the CRDs),
/// and the simulator; tenants are installed by the real helm-controller
/// (`flux::flux`, started by the first `Tenant::create`).
fn start_env(worker_args: Option<Vec<String>>) -> Env {
    let cp = cluster::control_plane();
    let gate = std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        match worker_args {
            Some(args) => Some(rt.block_on(gate::Gate::install_with(cp, args))),
            None => {
                rt.block_on(gate::apply_crds(cp));
                None
            }
        }
    })
    .join()
    .expect("gate install");
    let sim = sim::Simulator::start(cp);
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
