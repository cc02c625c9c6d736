//! `cargo run --example demo`: the incident, closed, on this machine.
//!
//! Starts a real management cluster and a tenant cluster (kube-apiserver,
//! kube-controller-manager, kube-scheduler, etcd), installs volume-gate from
//! `manifests/`, runs the simulator (storage, CSI driver, kubelet, Flux and
//! the tenant's pre-delete hook), creates a tenant with volumes in use,
//! deletes it, and shows the gate holding the teardown until every volume is
//! freed. Everything it starts stops when it exits.

#[path = "../common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

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
            println!("      {f}");
        }
    }
    v
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let started = Instant::now();
    step(
        1,
        "Starting a local control plane (building the harness on first use; a cold build takes minutes)",
    );
    let cp = common::cluster::control_plane();
    println!(
        "    management kubeconfig: {}",
        cp.management.kubeconfig.display()
    );

    step(
        2,
        "Installing volume-gate from manifests/ (RBAC, ServiceAccounts, webhook configurations) and the simulator",
    );
    let env = tokio::task::spawn_blocking(common::gated)
        .await
        .expect("install");
    println!(
        "    webhook on https://127.0.0.1:{}, worker leading; logs in {}",
        env.gate.as_ref().unwrap().lock().unwrap().webhook_port,
        cp.state.join("logs").display()
    );

    step(
        3,
        "Creating tenant kubernetes-demo: a Pod with two claims, a Pod with one, a StatefulSet",
    );
    let t = Tenant::create(cp, "demo").await;
    t.wait_custody().await;
    println!(
        "    custody taken: finalizer volumes.cozystack.io/release on {}/{}",
        t.namespace, t.name
    );
    t.incident_workload().await;
    let before = ledger(&env.sim, &t);

    step(
        4,
        "Deleting the tenant (its parent HelmRelease), as Cozystack does",
    );
    t.delete_parent().await;
    let mut last = String::new();
    let deadline = Instant::now() + Duration::from_secs(300);
    while t.parent().await.is_some() {
        let r = t.record().await;
        let now = format!(
            "{} {}",
            r.phase.map_or("NotStarted", Phase::as_str),
            r.message.unwrap_or_default()
        );
        if now != last {
            println!("    record: phase {now}");
            last = now;
        }
        assert!(
            Instant::now() < deadline,
            "teardown did not finish in 5 minutes; see {}",
            cp.state.join("logs").display()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    println!("    parent release gone: the teardown finished");

    step(
        5,
        "What the gate held back while the volumes were released (from the simulated Flux hook)",
    );
    for line in env
        .sim
        .log()
        .lines()
        .filter(|l| l.contains(&t.name) && (l.contains("hook") || l.contains("flux")))
        .take(12)
    {
        let short: String = line.chars().take(200).collect();
        println!("    {short}");
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
