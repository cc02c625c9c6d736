//! The simulated CSI driver of the tenant (stopped, slowed) and its
//! simulated control plane (stopped by Kamaji).

use std::time::Duration;

use serde_json::{Value, json};

use super::Tenant;
use crate::sim::Simulator;
use crate::wait::eventually;

impl Tenant {
    /// Stops (or restarts) this tenant's simulated CSI driver while its
    /// release stays installed: a stuck or crashed driver. Returns once the
    /// simulator has acted on it.
    pub async fn set_driver(&self, sim: &Simulator, running: bool) {
        let action = if running { "activated" } else { "deactivated" };
        let value = if running {
            Value::Null
        } else {
            json!("stopped")
        };
        self.annotate_csi_release(sim, "harness.volume-gate.test/driver", value, action)
            .await
    }

    /// Makes this tenant's simulated driver slow: it frees a released
    /// volume `delay` (a Go duration, "20s") after it sees it released.
    /// Returns once the simulator has seen it.
    pub async fn set_free_after(&self, sim: &Simulator, delay: &str) {
        self.annotate_csi_release(
            sim,
            "harness.volume-gate.test/free-after",
            json!(delay),
            "free-after",
        )
        .await
    }

    /// Sets annotation `key` on R-csi to `value` (null removes it) and waits
    /// for the simulator's next log line `N/R <action>` about this tenant.
    async fn annotate_csi_release(&self, sim: &Simulator, key: &str, value: Value, action: &str) {
        let needle = format!("{}/{} {action}", self.namespace, self.name);
        let before = sim.log().matches(&needle).count();
        let patch = json!({"metadata": {"annotations": {key: value}}});
        self.hr_api()
            .patch(
                &crate::profile()
                    .csi_release_name(&self.name)
                    .expect("Cozystack has a CSI release"),
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .expect("annotate the CSI release");
        eventually(
            &format!("simulator saw: {needle}"),
            Duration::from_secs(60),
            || {
                let n = sim.log().matches(&needle).count();
                let tail = if n > before {
                    String::new()
                } else {
                    sim.tail_of(&self.namespace, &self.name, 25)
                };
                async move {
                    if n > before {
                        Ok(())
                    } else {
                        Err(format!(
                            "{n} times; the simulator's last lines about it:\n{tail}"
                        ))
                    }
                }
            },
        )
        .await;
    }

    /// Waits until the simulator has stopped this tenant's API server (its
    /// TenantControlPlane deleted): from then on nothing can free a volume.
    pub async fn wait_api_stopped(&self, sim: &Simulator, timeout: Duration) {
        let needle = format!("{}/{} stopped tenant API server", self.namespace, self.name);
        eventually(&format!("simulator: {needle}"), timeout, || {
            let seen = sim.log().contains(&needle);
            async move {
                if seen {
                    Ok(())
                } else {
                    Err("not yet".to_string())
                }
            }
        })
        .await
    }
}
