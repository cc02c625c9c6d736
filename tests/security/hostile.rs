//! Hostile admin kubeconfig Secrets: writing them into a tenant's Secret,
//! the payloads (garbage, a huge body, a server where nothing listens, an
//! exec plugin), and what the worker is expected to do with them: record
//! `Blocked` with a message, and stay the same live process.

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};
use volume_gate::record::Phase;

use super::gate;
use crate::common;
use crate::common::gate::http_get;
use crate::common::tenant::{Tenant, base64, kubeconfig_data};

/// Replaces the admin kubeconfig with `bytes` under the profile's first
/// key (`super-admin.svc`) and drops the others, so no other key can stand
/// in for it.
pub async fn set_kubeconfig_bytes(t: &Tenant, bytes: &[u8]) {
    let profile = common::profile();
    let mut data = serde_json::Map::new();
    for (i, key) in profile.kubeconfig.keys.iter().enumerate() {
        let value = if i == 0 {
            json!(base64(bytes))
        } else {
            Value::Null
        };
        data.insert(key.clone(), value);
    }
    patch_secret(
        t,
        json!({"data": data}),
        "patch the admin kubeconfig Secret",
    )
    .await;
}

/// Puts the tenant's real kubeconfig back under every key.
pub async fn restore_kubeconfig(t: &Tenant) {
    let kc = std::fs::read(&t.cluster.kubeconfig).unwrap();
    patch_secret(
        t,
        json!({"data": kubeconfig_data(&kc)}),
        "restore the admin kubeconfig Secret",
    )
    .await;
}

async fn patch_secret(t: &Tenant, patch: Value, what: &str) {
    Api::<Secret>::namespaced(t.management.clone(), &t.namespace)
        .patch(
            &common::profile().kubeconfig_secret_name(&t.name),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .expect(what);
}

/// 4 KiB of bytes that are not YAML, not even UTF-8, with `canary` inside.
pub fn garbage(canary: &str) -> Vec<u8> {
    let mut garbage: Vec<u8> = (0u32..4096)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8 | 0x80)
        .collect();
    garbage.extend_from_slice(canary.as_bytes());
    garbage.extend_from_slice(b"\xff\xfe: [{{{");
    garbage
}

/// A kubeconfig header and a 900 KiB body.
pub fn huge() -> Vec<u8> {
    let mut huge = b"apiVersion: v1\nkind: Config\n".to_vec();
    huge.extend(std::iter::repeat_n(b'#', 900 * 1024));
    huge
}

/// The tenant's kubeconfig with every server at `server`.
pub fn served_at(t: &Tenant, server: &str) -> Vec<u8> {
    let mut kc = tenant_kubeconfig(t);
    for c in kc["clusters"].as_array_mut().unwrap() {
        c["cluster"]["server"] = json!(server);
    }
    serde_json::to_vec(&kc).unwrap()
}

/// The tenant's kubeconfig whose users authenticate with an exec plugin:
/// a shell that writes its parent's PID (the process that obeyed the
/// plugin) into `witness`.
pub fn exec_plugin(t: &Tenant, witness: &Path) -> Vec<u8> {
    let mut kc = tenant_kubeconfig(t);
    for u in kc["users"].as_array_mut().unwrap() {
        u["user"] = json!({"exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": "/bin/sh",
            "args": ["-c", format!("echo $PPID > {}", witness.display())],
            "interactiveMode": "Never",
        }});
    }
    serde_json::to_vec(&kc).unwrap()
}

fn tenant_kubeconfig(t: &Tenant) -> Value {
    serde_saphyr::from_str(&std::fs::read_to_string(&t.cluster.kubeconfig).unwrap()).unwrap()
}

/// Waits for the next record (see `Tenant::wait_phase`) that is Blocked with
/// a message containing `needle`, and returns the message.
pub async fn wait_blocked_with(t: &Tenant, needle: &str, timeout: Duration) -> String {
    let record = t
        .history
        .next_record(&format!("Blocked naming {needle:?}"), timeout, |r| {
            r.phase == Some(Phase::Blocked)
                && r.message.as_deref().is_some_and(|m| m.contains(needle))
        })
        .await;
    record.message.unwrap_or_default()
}

/// The attempt number a Blocked message names (`(attempt N; ...`).
pub fn attempt(message: &str) -> Option<u32> {
    message
        .split("(attempt ")
        .nth(1)
        .and_then(|s| s.split(';').next())
        .and_then(|n| n.parse::<u32>().ok())
}

/// The worker is still the same running process and answers /readyz.
pub async fn assert_worker_alive(pid_before: Option<u32>, after: &str) {
    let (alive, pid, admin) = {
        let gate = gate();
        let w = gate.worker.as_ref().expect("a worker");
        (w.alive(), w.pid(), gate.worker_admin)
    };
    assert!(
        alive,
        "the worker died after {after}; its log:\n{}",
        gate().worker_log()
    );
    assert_eq!(pid, pid_before, "the worker was not replaced after {after}");
    let (code, body) = http_get(admin, "/readyz")
        .await
        .unwrap_or_else(|e| panic!("worker /readyz after {after}: {e}"));
    assert_eq!(code, 200, "worker /readyz after {after}: {body}");
}
