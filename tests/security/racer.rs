//! Two workers racing for the Lease: the Lease's holder, sampled for as
//! long as a scenario runs, and a second worker started as the fixture
//! starts its own.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;

use super::gate;
use crate::common::Env;
use crate::common::gate::{NAMESPACE, free_port, http_get};
use crate::common::process::Process;
use crate::common::wait::eventually;

/// The worker Lease's holder, if any.
pub async fn lease_holder(admin: &kube::Client) -> Option<String> {
    Api::<Lease>::namespaced(admin.clone(), NAMESPACE)
        .get_opt("volume-gate-worker")
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
        .filter(|h| !h.is_empty())
}

/// Waits for the Lease to have a holder and returns it.
pub async fn wait_lease_holder(admin: &kube::Client) -> String {
    eventually("a Lease holder", Duration::from_secs(30), || async {
        lease_holder(admin)
            .await
            .ok_or_else(|| "no holder".to_string())
    })
    .await
}

/// A second worker: the fixture's worker command line with an admin port
/// and identity (`racer`) of its own; returns once it is ready and waits
/// for the Lease.
pub async fn start_racer(env: &Env) -> Process {
    let racer_admin = free_port();
    let racer_log = env
        .cp
        .state
        .join("logs")
        .join(format!("volume-gate-{}.log", env.cp.unique("racer")));
    let cmd = gate().worker_command(racer_admin, "racer");
    let racer = Process::start("racer", cmd, racer_log);
    eventually(
        "the racer is up and waiting for the Lease",
        Duration::from_secs(60),
        || async {
            assert!(racer.alive(), "the racer exited: {}", racer.log_text());
            let ready = matches!(http_get(racer_admin, "/readyz").await, Ok((200, _)));
            if ready && racer.log_text().contains("waiting to lead") {
                Ok(())
            } else {
                Err(racer.log_text())
            }
        },
    )
    .await;
    racer
}

/// The Lease's holder, sampled every 200ms until [`HolderSamples::stop`].
pub struct HolderSamples {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<Option<String>>>>,
    sampler: tokio::task::JoinHandle<()>,
}

impl HolderSamples {
    pub fn start(admin: &kube::Client) -> HolderSamples {
        let stop = Arc::new(AtomicBool::new(false));
        let seen: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
        let sampler = {
            let (stop, seen, admin) = (stop.clone(), seen.clone(), admin.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let h = lease_holder(&admin).await;
                    seen.lock().unwrap().push(h);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            })
        };
        HolderSamples {
            stop,
            seen,
            sampler,
        }
    }

    /// Stops sampling; every holder seen, in order.
    pub async fn stop(self) -> Vec<Option<String>> {
        self.stop.store(true, Ordering::SeqCst);
        self.sampler.await.unwrap();
        self.seen.lock().unwrap().clone()
    }
}
