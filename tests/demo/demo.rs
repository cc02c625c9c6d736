//! `cargo run --example demo`: the incident, closed, on this machine.
//!
//! Starts a real management cluster and a tenant cluster (kube-apiserver,
//! kube-controller-manager, kube-scheduler, etcd), installs volume-gate from
//! `manifests/`, runs the simulator (storage, CSI driver, kubelet, and the
//! management node that runs Jobs) and Flux's real helm-controller, installs
//! a tenant from the tenant chart with volumes in use, deletes it, and shows
//! the gate holding the teardown (the hook refused, Flux's `UninstallFailed`)
//! until every volume is freed, and the worker's retry request ending it.
//! Everything it starts stops when it exits.

use volume_gate_testkit as common;

use std::time::{Duration, Instant};

use common::flux::ready_condition;
use common::history::Seen;
use common::tenant::Tenant;
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
        "Starting a local control plane (building the harness and helm-controller on first use; a cold build takes minutes)",
    );
    let cp = common::cluster::control_plane();
    println!(
        "    management kubeconfig: {}",
        cp.management.kubeconfig.display()
    );

    step(
        2,
        "Installing volume-gate from manifests/, the simulator, and Flux's real helm-controller",
    );
    let env = tokio::task::spawn_blocking(common::gated)
        .await
        .expect("install");
    let flux = common::flux::flux(cp).await;
    println!(
        "    webhook on https://127.0.0.1:{}, worker leading; helm-controller {}; logs in {}",
        env.gate.as_ref().unwrap().lock().unwrap().webhook_port,
        if flux.process.alive() {
            "running"
        } else {
            "NOT running"
        },
        cp.state.join("logs").display()
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
