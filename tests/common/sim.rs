//! The simulator (`harness sim`): storage ledger, CSI driver, kubelet, and
//! Flux with the tenant chart's pre-delete hook. The storage directory is
//! the ground truth: one file per volume, named by its volumeHandle.

use std::path::PathBuf;
use std::process::Command;

use super::cluster::ControlPlane;
use super::process::Process;

pub struct Simulator {
    pub process: Process,
    pub storage: PathBuf,
}

impl Simulator {
    /// Starts a simulator for every tenant of the control plane: storage,
    /// CSI driver, kubelets, Kamaji's control planes, and the management
    /// node that runs the Pods of Jobs (the tenant chart's real pre-delete
    /// hook, run by the real helm-controller).
    pub fn start(cp: &ControlPlane) -> Simulator {
        let storage = cp.state.join(cp.unique("storage"));
        std::fs::create_dir_all(&storage).expect("storage dir");
        let control = std::fs::read_to_string(cp.state.join("control.addr"))
            .expect("control.addr")
            .trim()
            .to_string();
        let control = if control.starts_with("http") {
            control
        } else {
            format!("http://{control}")
        };
        // The platform's names, from the profile the product uses.
        let profile = cp.state.join(cp.unique("profile.json"));
        let json = serde_json::to_string(&volume_gate::profile::Profile::cozystack())
            .expect("profile serializes");
        std::fs::write(&profile, json).expect("write the profile");
        let mut cmd = Command::new(&cp.harness);
        cmd.arg("sim")
            .arg("--profile")
            .arg(&profile)
            .arg("--management")
            .arg(&cp.management.kubeconfig)
            .arg("--storage")
            .arg(&storage)
            .args([
                "--control",
                &control,
                "--retry-base",
                "1s",
                "--retry-max",
                "4s",
                "--hook-timeout",
                "10s",
                "--probe-interval",
                "1s",
            ]);
        cmd.args(["--flux=false", "--run-jobs"]);
        let log = cp
            .state
            .join("logs")
            .join(format!("{}.log", cp.unique("sim")));
        Simulator {
            process: Process::start("simulator", cmd, log),
            storage,
        }
    }

    /// Volumes on storage for a tenant: the files whose names start with
    /// `<namespace>.<tenant>.`.
    pub fn volumes_of(&self, namespace: &str, tenant: &str) -> Vec<String> {
        let prefix = format!("{namespace}.{tenant}.");
        let mut v: Vec<String> = std::fs::read_dir(&self.storage)
            .expect("read storage")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().to_string())
            .filter(|n| n.starts_with(&prefix))
            .collect();
        v.sort();
        v
    }

    pub fn log(&self) -> String {
        self.process.log_text()
    }
}
