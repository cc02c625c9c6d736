//! The Proxmox path (`infra: null`: the tenant's own CSI driver holds each
//! disk, nothing stands behind it in the management cluster): a Retain
//! volume stays on storage after an override, the Delete one is freed.

use volume_gate_testkit as common;

use std::time::Duration;

use common::tenant::{RETAIN_STORAGE_CLASS, STORAGE_CLASS, Tenant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_proxmox_path_a_retain_disk_stays_after_the_override_and_the_delete_one_goes() {
    let env = common::gated_one_layer();
    let t = Tenant::create(env.cp, &env.cp.unique("proxmox")).await;
    t.wait_custody().await;
    t.with_claims_of(&[("kept", RETAIN_STORAGE_CLASS), ("freed", STORAGE_CLASS)])
        .await;
    t.delete_parent().await;
    // Blocked with the Delete volume freed (not an earlier Blocked that a
    // slow release can cause, naming both).
    let record = t.wait_blocked_with_left(1, Duration::from_secs(120)).await;
    let inv = record.inventory.expect("inventory");
    assert_eq!((inv.total, inv.left()), (2, 1));
    let kept = inv.remaining().next().expect("the Retain volume").clone();
    assert!(kept.is_retain() && kept.infra.is_none(), "{kept:?}");
    let residue = env.sim.wait_disks(&t.namespace, &t.name, 1).await;

    t.grant_override("platform-admins").await;
    let alice = env.cp.client_as("alice", &["platform-admins"]).await;
    t.annotate_override(&alice, "retained by design")
        .await
        .expect("override accepted");
    let note = t.wait_event("Warning", "Overridden", |_| true).await;
    let handle = kept.handle.clone().unwrap();
    assert!(
        note.contains("1 volume left on storage") && note.contains(&handle),
        "the Warning names the disk that stays: {note}"
    );
    t.wait_parent_gone(Duration::from_secs(120)).await;
    assert_eq!(
        env.sim.volumes_of(&t.namespace, &t.name),
        residue,
        "exactly the Retain disk stays"
    );
}
