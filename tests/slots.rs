//! Issue 41, case 6: one tenant's slow driver cannot keep the worker's
//! release slots from the tenants behind it (`release::Turn`,
//! `docs/design.md` §5).
//!
//! The worker here has one slot, and a turn of 3 s. The slow tenant's
//! driver frees its volumes one at a time, each well inside the wait bound
//! (each of its PVs is held by a finalizer the test takes off, one every
//! 5 s): its pass, which before the turn held the slot until the last one
//! went, now gives it up to the tenant deleted behind it, which is
//! released while the slow one still has volumes held.

use volume_gate_testkit as common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::tenant::{STORAGE_CLASS, Tenant};
use k8s_openapi::api::core::v1::PersistentVolume;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

const HOLD: &str = "volume-gate.test/slow-driver";

/// The turn under test; `VOLUME_GATE_SLOTS_TURN=1h` plays the worker
/// before turns (a pass held its slot to the end), the baseline of
/// `docs/benchmarks-scale.md` "Release slots" (the test then fails, as
/// that worker did).
fn turn() -> String {
    std::env::var("VOLUME_GATE_SLOTS_TURN").unwrap_or_else(|_| "3s".into())
}

fn env() -> &'static common::Env {
    // The short worker's flags but its wait bound (well above the driver's
    // pace here), one slot and a turn.
    let short = common::short_worker_args();
    let mut args: Vec<String> = short
        .chunks(2)
        .filter(|pair| pair[0] != "--wait-bound")
        .flatten()
        .cloned()
        .collect();
    for (flag, value) in [
        ("--max-concurrent-releases", "1".to_string()),
        ("--release-turn", turn()),
        ("--wait-bound", "30s".to_string()),
    ] {
        args.extend([flag.to_string(), value]);
    }
    common::gated_with(args)
}

/// Holds each of `t`'s PVs with a finalizer of the test's: deleted, a PV
/// stays until the test lets it go. Returns their names.
async fn hold_volumes(t: &Tenant) -> Vec<String> {
    let pvs: Api<PersistentVolume> = Api::all(t.api.clone());
    let mut names = Vec::new();
    for pv in pvs.list(&Default::default()).await.expect("list PVs").items {
        let name = pv.metadata.name.clone().expect("named");
        let mut finalizers = pv.metadata.finalizers.clone().unwrap_or_default();
        finalizers.push(HOLD.into());
        pvs.patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": finalizers}})),
        )
        .await
        .expect("hold the PV");
        names.push(name);
    }
    names.sort();
    names
}

/// Lets PV `name` of the tenant cluster `api` go: its finalizer off.
async fn let_go(api: &kube::Client, name: &str) {
    let pvs: Api<PersistentVolume> = Api::all(api.clone());
    let Ok(pv) = pvs.get(name).await else { return };
    let finalizers: Vec<String> = pv
        .metadata
        .finalizers
        .unwrap_or_default()
        .into_iter()
        .filter(|f| f != HOLD)
        .collect();
    pvs.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": finalizers}})),
    )
    .await
    .expect("let the PV go");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_drivers_tenant_gives_its_release_slot_to_the_tenant_behind_it() {
    let env = env();
    let cp = env.cp;
    let slow = Tenant::create(cp, &cp.unique("slow")).await;
    slow.wait_custody().await;
    let claims = ["a", "b", "c", "d", "e", "f", "g", "h"].map(|c| (c, STORAGE_CLASS));
    slow.with_claims_of(&claims).await;
    let held = hold_volumes(&slow).await;
    assert_eq!(held.len(), claims.len());
    let queued = Tenant::create(cp, &cp.unique("queued")).await;
    queued.wait_custody().await;
    queued.with_held_claims(&["data"]).await;

    // The slow tenant's pass takes the one slot and waits on its driver:
    // every claim deleted, every PV released and held.
    slow.delete_parent().await;
    let pvs: Api<PersistentVolume> = Api::all(slow.api.clone());
    common::wait::eventually(
        "the slow tenant's PVs deleted and held",
        Duration::from_secs(60),
        || async {
            let items = pvs
                .list(&Default::default())
                .await
                .map_err(|e| e.to_string())?
                .items;
            let waiting = items
                .iter()
                .filter(|p| p.metadata.deletion_timestamp.is_some())
                .count();
            if waiting == held.len() {
                Ok(())
            } else {
                Err(format!("{waiting} of {} deleted", held.len()))
            }
        },
    )
    .await;

    // Its driver frees one volume every 5 s, each inside the 30 s bound.
    let freed = Arc::new(AtomicUsize::new(0));
    let driver = {
        let (freed, held, api) = (freed.clone(), held.clone(), slow.api.clone());
        tokio::spawn(async move {
            for name in &held {
                // The driver's pace, which the test plays: not a wait for
                // anything to happen.
                tokio::time::sleep(Duration::from_secs(5)).await;
                let_go(&api, name).await;
                freed.fetch_add(1, Ordering::SeqCst);
            }
        })
    };

    let deleted = Instant::now();
    queued.delete_parent().await;
    queued.wait_parent_gone(Duration::from_secs(120)).await;
    let queued_took = deleted.elapsed();
    let freed_then = freed.load(Ordering::SeqCst);
    eprintln!(
        "release slots (--release-turn {}): the queued tenant was released {:.1}s after its deletion, while the slow one had {freed_then} of {} volumes freed",
        turn(),
        queued_took.as_secs_f64(),
        held.len()
    );
    assert!(
        freed_then < held.len(),
        "the queued tenant was released only after the slow one's last volume ({freed_then} of {} freed)",
        held.len()
    );
    let note = slow
        .wait_event("Normal", "SlotYielded", |n| {
            n.contains("gave its release slot")
        })
        .await;
    assert!(note.contains("--release-turn"), "{note}");

    driver.await.expect("the slow driver ran");
    slow.wait_parent_gone(Duration::from_secs(180)).await;
    assert!(env.sim.volumes_of(&slow.namespace, &slow.name).is_empty());
    assert!(
        env.sim
            .volumes_of(&queued.namespace, &queued.name)
            .is_empty()
    );
}
