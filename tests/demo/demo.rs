//! `cargo run --example demo`: the incident, closed, on this machine.
//!
//! Starts a real management cluster and a tenant cluster (kube-apiserver,
//! kube-controller-manager, kube-scheduler, etcd), installs volume-gate from
//! `manifests/`, runs the simulator (storage, CSI driver, kubelet, the
//! management node that runs Jobs, Cozystack's Cluster API providers),
//! Flux's real helm-controller and Cluster API's real core manager
//! (Cozystack's v1.10.1), installs a tenant from the tenant chart with
//! volumes in use on its machine's node, deletes it, and shows
//! the gate holding the teardown (the hook refused, Flux's `UninstallFailed`)
//! until every volume is freed, and the worker's retry request ending it.
//! Everything it starts stops when it exits.
//!
//! `cargo run --example demo -- --node` (root; `docs/node.md`): the same on
//! a real node of the management cluster, volume-gate installed by `helm
//! install` from its chart and running in containers there, the tenant
//! chart's hook a real Job on that node.

use volume_gate_testkit as common;

use std::time::{Duration, Instant};

use common::flux::ready_condition;
use common::history::Seen;
use common::tenant::Tenant;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, ListParams};
use volume_gate::record::Phase;

fn step(n: u32, text: &str) {
    println!("\n\x1b[1m[{n}/6] {text}\x1b[0m");
}

fn ledger(sim: &common::sim::Simulator, t: &Tenant) -> Vec<String> {
    let v = sim.volumes_of(&t.namespace, &t.name);
    if v.is_empty() {
        println!("    storage ledger {}: (empty)", sim.storage.display());
    } else {
        println!(
            "    storage ledger {}: {} volumes",
            sim.storage.display(),
            v.len()
        );
        for f in &v {
            // Each disk's record names the management claim behind it: on
            // the KubeVirt path, the DataVolume of the tenant volume.
            let behind = std::fs::read_to_string(sim.storage.join(f))
                .ok()
                .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
                .and_then(|r| r["pvc"].as_str().map(str::to_string))
                .map(|pvc| format!("  (management PVC {pvc}, of the DataVolume of that name)"))
                .unwrap_or_default();
            println!("      {f}{behind}");
        }
    }
    v
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let started = Instant::now();
    step(
        1,
        "Starting a local control plane (building the harness, helm-controller and Cluster API's manager on first use; a cold build takes minutes)",
    );
    let on_node = std::env::args().any(|a| a == "--node");
    let cp = if on_node {
        bash_node_deps();
        common::cluster::control_plane_with_node()
    } else {
        common::cluster::control_plane()
    };
    println!(
        "    management kubeconfig: {}",
        cp.management.kubeconfig.display()
    );

    let (env, _installed) = if on_node {
        step(
            2,
            "Installing volume-gate with `helm install` from its chart, on the real node vg-node; the simulator, Flux's real helm-controller",
        );
        let env = common::env(common::EnvConfig::ungated());
        let installed = common::node::install_chart(cp, "volume-gate").await;
        let pods: Api<Pod> = Api::namespaced(cp.management_client().await, "volume-gate");
        for p in pods
            .list(&ListParams::default())
            .await
            .expect("list the gate's Pods")
            .items
        {
            let ip = p
                .status
                .as_ref()
                .and_then(|s| s.pod_ip.clone())
                .unwrap_or_default();
            let node = p
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default();
            println!(
                "    Pod {} Ready on {node} ({ip}), image {}",
                p.metadata.name.unwrap_or_default(),
                installed.image
            );
        }
        (env, Some(installed))
    } else {
        step(
            2,
            "Installing volume-gate from manifests/, the simulator, and Flux's real helm-controller",
        );
        let env = tokio::task::spawn_blocking(common::gated)
            .await
            .expect("install");
        println!(
            "    webhook on https://127.0.0.1:{}, worker leading; logs in {}",
            env.gate.as_ref().unwrap().lock().unwrap().webhook_port,
            cp.state.join("logs").display()
        );
        (env, None)
    };
    let flux = common::flux::flux(cp).await;
    println!(
        "    helm-controller {}",
        if flux.process.alive() {
            "running"
        } else {
            "NOT running"
        }
    );

    step(
        3,
        "Installing tenant kubernetes-demo from the tenant chart (through Flux), then a Pod with two claims, a Pod with one, a StatefulSet",
    );
    let t = Tenant::create(cp, "demo").await;
    t.wait_custody().await;
    println!(
        "    custody taken: finalizer {} on {}/{}",
        common::profile().custody_finalizer,
        t.namespace,
        t.name
    );
    t.incident_workload().await;
    let before = ledger(&env.sim, &t);
    // A disk backend that takes its time, so the hold is there to see.
    t.set_free_after(&env.sim, "20s").await;
    println!(
        "    the simulated driver frees each volume 20s after its claim goes (a slow storage backend)"
    );

    step(
        4,
        "Deleting the tenant (its parent HelmRelease), as Cozystack does; what `kubectl get hr` and the record say",
    );
    t.delete_parent().await;
    let (mut phase, mut flux_says) = (String::new(), String::new());
    loop {
        let seen = t
            .history
            .next_matching(
                "the next version of the parent",
                Duration::from_secs(300),
                |s| Some(s.clone()),
            )
            .await;
        let Seen::Parent(p) = &seen else { break };
        let r = seen.record().unwrap_or_default();
        let now = format!(
            "{} {}",
            r.phase.map_or("NotStarted", Phase::as_str),
            r.message.unwrap_or_default()
        );
        if now != phase {
            println!("    record:     phase {now}");
            phase = now;
        }
        if let Some((status, reason, message)) = ready_condition(p) {
            let now = format!("Ready={status} {reason}: {message}");
            if now != flux_says {
                println!(
                    "    helm-controller: {}",
                    now.chars().take(220).collect::<String>()
                );
                flux_says = now;
            }
        }
    }
    println!("    parent release gone: the teardown finished");

    step(
        5,
        "The pre-delete hook (a real Job, run by Flux's Helm): refused while the volumes were held, then to the end",
    );
    if on_node {
        // The hook's Pods ran on the node; the kubelet's Events outlive them.
        let events = Api::<Event>::namespaced(cp.management_client().await, &t.namespace)
            .list(&ListParams::default())
            .await
            .expect("the tenant namespace's Events")
            .items;
        // (MissingClusterDNS: the node has no cluster DNS; the hook needs none.)
        for e in events.iter().filter(|e| {
            e.involved_object
                .name
                .as_deref()
                .is_some_and(|n| n.contains("-pre-cleanup"))
                && e.reason.as_deref() != Some("MissingClusterDNS")
        }) {
            let from = e
                .source
                .as_ref()
                .and_then(|s| s.host.clone().or(s.component.clone()))
                .or(e.reporting_component.clone())
                .unwrap_or_default();
            let short: String = format!(
                "{} {} {}: {}",
                e.involved_object.kind.clone().unwrap_or_default(),
                e.involved_object.name.clone().unwrap_or_default(),
                e.reason.clone().unwrap_or_default(),
                e.message.clone().unwrap_or_default()
            )
            .chars()
            .take(260)
            .collect();
            println!("    [{from}] {short}");
        }
    }
    for line in env.sim.hook_lines(&t.namespace, &t.name) {
        if [
            " running ",
            " exited ",
            "denied the request",
            "Step 3",
            "Cleanup completed",
        ]
        .iter()
        .any(|k| line.contains(k))
        {
            // `TIME job N/JOB ACTION pod P: TEXT` -> `ACTION: TEXT`
            let action = line.split_whitespace().nth(3).unwrap_or("");
            let text = line.split_once(": ").map_or(line.as_str(), |(_, t)| t);
            let short: String = format!("{action}: {text}").chars().take(300).collect();
            println!("    {short}");
        }
    }

    step(6, "The storage ledger afterwards");
    let after = ledger(&env.sim, &t);
    println!(
        "\n{} of {} volumes freed by the CSI driver before it was removed; {} left on storage. ({:.0}s)",
        before.len() - after.len(),
        before.len(),
        after.len(),
        started.elapsed().as_secs_f64()
    );
    if !after.is_empty() {
        std::process::exit(1);
    }
}

/// The real node's Debian packages, installed when missing (as the test
/// suite does).
fn bash_node_deps() {
    let script = common::cluster::repo_root().join("tests/harness/node-deps.sh");
    let status = std::process::Command::new("bash")
        .arg(&script)
        .status()
        .expect("run tests/harness/node-deps.sh");
    assert!(status.success(), "{} failed", script.display());
}
