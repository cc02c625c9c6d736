//! cert-manager's controller and cainjector (v1.21, the subset the chart
//! uses: self-signed and CA issuers, the Certificate pipeline, injection
//! into webhook configurations), built from the Go module proxy by
//! `tests/certmanager/build.sh`, run against the management API server.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use super::cluster::{ControlPlane, run_build_script};
use super::gate::wait_crd_established;
use super::manifests;
use super::process::Process;

/// The directory of the build: `cert-manager` and `crds/`.
pub fn build_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| run_build_script("tests/certmanager/build.sh"))
        .clone()
}

/// The two processes; they stop when dropped.
pub struct CertManager {
    pub controller: Process,
    pub cainjector: Process,
}

/// Installs cert-manager's CRDs and starts its controller and cainjector,
/// watching `namespace` only, as the management cluster's admin.
pub async fn start(cp: &ControlPlane, namespace: &str) -> CertManager {
    let dir = build_dir();
    let client = cp.management_client().await;
    let mut crds: Vec<_> = std::fs::read_dir(dir.join("crds"))
        .expect("cert-manager CRDs")
        .map(|e| e.unwrap().path())
        .collect();
    crds.sort();
    for f in &crds {
        manifests::apply_file(&client, f).await;
    }
    for crd in [
        "issuers.cert-manager.io",
        "certificates.cert-manager.io",
        "certificaterequests.cert-manager.io",
    ] {
        wait_crd_established(&client, crd).await;
    }
    let logs = cp.state.join("logs");
    let role = |role: &str| {
        let mut cmd = Command::new(dir.join("cert-manager"));
        crate::process::go_program(&mut cmd);
        cmd.arg(role)
            .arg("--kubeconfig")
            .arg(&cp.management.kubeconfig)
            .arg("--namespace")
            .arg(namespace);
        Process::start(
            &format!("cert-manager-{role}"),
            cmd,
            logs.join(format!("cert-manager-{role}.log")),
        )
    };
    CertManager {
        controller: role("controller"),
        cainjector: role("cainjector"),
    }
}
