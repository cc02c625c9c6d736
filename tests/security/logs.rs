//! No secret material in any log: the secrets of a run (ServiceAccount
//! tokens, the tenant admin kubeconfig's credentials, PEM blocks), every log
//! of it (volume-gate's, the simulator's, the control plane's), and where
//! one shows in the other.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::gate;
use crate::common::Env;
use crate::common::gate::{WEBHOOK_SA, WORKER_SA};
use crate::common::tenant::base64;

/// The keys under which [`all_logs`] puts the gate's own logs.
pub const WEBHOOK_LOG: &str = "webhook (Gate::webhook_log)";
pub const WORKERS_LOG: &str = "workers (Gate::worker_log)";

/// `(what, secret)` for every secret of this run: the tokens the gate runs
/// with (its ServiceAccount kubeconfigs in `state`), the credentials of the
/// tenant admin kubeconfig at `tenant_kubeconfig` as they sit in the file
/// and in the Secret, and any PEM block (private keys, certificates).
pub fn secrets(state: &Path, tenant_kubeconfig: &Path) -> Vec<(String, String)> {
    let mut secrets: Vec<(String, String)> = Vec::new();
    for f in std::fs::read_dir(state).unwrap().flatten() {
        let name = f.file_name().to_string_lossy().to_string();
        if name.starts_with("sa-") && name.ends_with(".kubeconfig") {
            let kc: Value = serde_json::from_slice(&std::fs::read(f.path()).unwrap()).unwrap();
            for u in kc["users"].as_array().unwrap() {
                let token = u["user"]["token"].as_str().expect("SA token").to_string();
                assert!(token.len() > 100, "a real token");
                secrets.push((format!("token of {name}"), token));
            }
        }
    }
    for sa in [WORKER_SA, WEBHOOK_SA] {
        assert!(
            secrets.iter().any(|(n, _)| n.contains(sa)),
            "found the {sa} token: {:?}",
            secrets.iter().map(|s| &s.0).collect::<Vec<_>>()
        );
    }
    let tenant_kc_text = std::fs::read_to_string(tenant_kubeconfig).unwrap();
    let tenant_kc: Value = serde_saphyr::from_str(&tenant_kc_text).unwrap();
    for u in tenant_kc["users"].as_array().unwrap() {
        for field in ["client-key-data", "client-certificate-data"] {
            let v = u["user"][field]
                .as_str()
                .unwrap_or_else(|| panic!("tenant kubeconfig has {field}"));
            secrets.push((format!("tenant kubeconfig {field}"), v.to_string()));
        }
    }
    let secret_b64 = base64(tenant_kc_text.as_bytes());
    let mid = secret_b64.len() / 2 / 4 * 4;
    secrets.push((
        "the admin kubeconfig Secret's data (base64 of the file)".into(),
        secret_b64[mid..mid + 64].to_string(),
    ));
    secrets.push(("a PEM block".into(), "-----BEGIN".into()));
    secrets
}

/// Every log of the run by name: the files under the control plane's
/// `logs` (the simulator's and all of the control plane's among them), the
/// gate's webhook and workers ([`WEBHOOK_LOG`], [`WORKERS_LOG`]) and the
/// simulator's. Asserts that volume-gate's own log files are among them.
pub fn all_logs(env: &Env) -> BTreeMap<String, String> {
    let mut logs: BTreeMap<String, String> = BTreeMap::new();
    for f in all_files_under(&env.cp.state.join("logs")) {
        logs.insert(
            f.display().to_string(),
            String::from_utf8_lossy(&std::fs::read(&f).unwrap()).to_string(),
        );
    }
    {
        let gate = gate();
        logs.insert(WEBHOOK_LOG.into(), gate.webhook_log());
        logs.insert(WORKERS_LOG.into(), gate.worker_log());
    }
    logs.insert("simulator (Simulator::log)".into(), env.sim.log());
    assert!(
        logs.keys().any(|k| k.contains("volume-gate-webhook")),
        "the webhook's log is among them: {:?}",
        logs.keys()
    );
    assert!(
        logs.keys().any(|k| k.contains("volume-gate-worker")),
        "a worker's log is among them: {:?}",
        logs.keys()
    );
    logs
}

/// Where a secret shows in a log: one finding per (log, secret), the line
/// quoted with the secret itself redacted (a failure must not leak it
/// further); split into volume-gate's logs and the others'.
pub fn findings(
    logs: &BTreeMap<String, String>,
    secrets: &[(String, String)],
) -> (Vec<String>, Vec<String>) {
    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    for (log, text) in logs {
        for (what, needle) in secrets {
            if let Some(at) = text.find(needle.as_str()) {
                let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
                let line = text[line_start..]
                    .lines()
                    .next()
                    .unwrap_or("")
                    .replace(needle.as_str(), "<REDACTED>");
                let excerpt: String = line.chars().take(200).collect();
                let finding = format!("{log}: contains {what}; line starts {excerpt:?}");
                if log == WEBHOOK_LOG || log == WORKERS_LOG || is_volume_gate_log(Path::new(log)) {
                    ours.push(finding);
                } else {
                    theirs.push(finding);
                }
            }
        }
    }
    (ours, theirs)
}

fn all_files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Whether a log file is written by volume-gate itself (webhook, workers).
fn is_volume_gate_log(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with("volume-gate-"))
}
