//! The infra layer (docs/design.md §5b) on the real control plane: a tenant
//! volume is a tenant PV and, behind it, a DataVolume, its PVC and that
//! PVC's PV in the management cluster, whose deletion frees the disk (the
//! ledger file). `Released` needs both layers gone; when the tenant API
//! cannot be reached, the management side decides.
//!
//! The worker here frees from the management side after 3 s of an
//! unreachable tenant API (`--infra-after`; 2 minutes by default) and waits
//! 30 s for disks per pass. Blocked messages are read from the record's
//! history: an Event series keeps the note of its first occurrence.

use volume_gate_testkit as common;

use std::time::Duration;

use common::tenant::{Tenant, TenantOptions};
use common::wait::eventually;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use volume_gate::record::Phase;

fn env() -> &'static common::Env {
    let mut args = common::gate::test_worker_args();
    let bound = args
        .iter()
        .position(|a| a == "--wait-bound")
        .expect("--wait-bound");
    args[bound + 1] = "30s".into();
    args.extend(["--infra-after".into(), "3s".into()]);
    common::gated_with(args)
}

/// The next record in phase Blocked whose message satisfies `matches`.
async fn next_blocked(t: &Tenant, what: &str, matches: impl Fn(&str) -> bool) -> String {
    t.history
        .next_record(what, Duration::from_secs(120), |r| {
            r.phase == Some(Phase::Blocked) && r.message.as_deref().is_some_and(&matches)
        })
        .await
        .message
        .unwrap_or_default()
}

/// The Released record, then the parent gone.
async fn released_and_gone(t: &Tenant) -> volume_gate::record::Record {
    let record = t
        .wait_phase(Phase::Released, Duration::from_secs(180))
        .await;
    t.wait_parent_gone(Duration::from_secs(180)).await;
    record
}

/// A tenant with the seed's workload: 4 volumes, each a DataVolume with a
/// PVC and a PV in the management cluster, and a disk in the ledger.
async fn tenant_with_disks(app: &str) -> (Tenant, common::tenant::InfraObjects) {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique(app)).await;
    t.wait_custody().await;
    t.incident_workload().await;
    let disks = env.sim.volumes_of(&t.namespace, &t.name);
    assert_eq!(disks.len(), 4, "one management disk per claim: {disks:?}");
    let infra = t.infra_objects(None).await;
    assert_eq!(
        (
            infra.datavolumes.len(),
            infra.claims.len(),
            infra.volumes.len()
        ),
        (4, 4, 4),
        "each tenant volume is a DataVolume, a PVC and a PV in the management cluster: {infra:?}"
    );
    (t, infra)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gated_teardown_frees_both_layers() {
    let env = env();
    let (t, before) = tenant_with_disks("both").await;

    t.delete_parent().await;
    let released = released_and_gone(&t).await;

    assert!(
        env.sim.volumes_of(&t.namespace, &t.name).is_empty(),
        "no disk left in the ledger"
    );
    let left = t.infra_objects(Some(&before)).await;
    assert!(
        left.is_empty(),
        "no DataVolume, PVC or PV of the tenant left: {left:?}"
    );
    // Each inventoried volume names the DataVolume behind it.
    assert!(
        released
            .inventory
            .as_ref()
            .is_some_and(|i| i
                .volumes
                .iter()
                .all(|v| v
                    .infra
                    .as_ref()
                    .is_some_and(|r| Some(&r.name) == v.handle.as_ref()
                        && before.datavolumes.contains(&r.name)))),
        "{:?}",
        released.inventory
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_dead_after_the_inventory_is_released_from_the_management_side_and_a_label_alone_deletes_nothing()
 {
    let env = env();
    let (t, before) = tenant_with_disks("dies").await;
    // A DataVolume that carries the tenant's label but is in no inventory:
    // a label is writable by whoever edits the namespace, so it must never
    // be enough for the worker to delete.
    let stranger = format!("{}-stranger", t.name);
    t.datavolumes()
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
                "metadata": {"name": stranger, "labels": {"cluster.x-k8s.io/cluster-name": t.name}},
                "spec": {"source": {"blank": {}}, "storage": {"resources": {"requests": {"storage": "1Gi"}}, "storageClassName": "sim-infra"}},
            }))
            .unwrap(),
        )
        .await
        .expect("create the stranger DataVolume");
    env.sim.wait_disks(&t.namespace, &t.name, 5).await;

    // The driver stops, so the phase holds after the inventory; then the
    // tenant API dies.
    t.set_driver(&env.sim, false).await;
    t.delete_parent().await;
    t.wait_inventory().await;
    env.cp.cluster_down(&t.cluster.name);

    let note = t
        .wait_event("Warning", "FreedFromManagement", |n| {
            n.contains("freeing 4 volumes from the management side")
        })
        .await;
    assert!(note.contains("the tenant API cannot be reached"), "{note}");
    let blocked = next_blocked(&t, "Blocked naming the stranger", |m| {
        m.contains(&stranger) && m.contains("so kept")
    })
    .await;
    assert!(
        blocked.contains("labelled cluster.x-k8s.io/cluster-name=")
            && blocked.contains("named by no inventoried volume, so kept"),
        "{blocked}"
    );
    // Every inventoried disk is freed; the stranger's is kept.
    let ledger = env.sim.volumes_of(&t.namespace, &t.name);
    assert_eq!(
        ledger.len(),
        1,
        "only the stranger's disk is left: {ledger:?}"
    );
    let left = t.infra_objects(Some(&before)).await;
    assert_eq!(left.datavolumes, vec![stranger.clone()], "{left:?}");

    // Deleted by a person, it goes, and the teardown finishes.
    t.datavolumes()
        .delete(&stranger, &DeleteParams::default())
        .await
        .expect("delete the stranger");
    let record = released_and_gone(&t).await;
    let message = record.message.clone().unwrap_or_default();
    assert!(
        message.contains("4 volumes freed, none left on storage")
            && message.contains("4 volumes freed from the management side"),
        "{message}"
    );
    assert!(env.sim.volumes_of(&t.namespace, &t.name).is_empty());
    let inv = record.inventory.expect("inventory kept");
    assert!(
        inv.volumes
            .iter()
            .all(|v| v.gone && v.infra.as_ref().is_some_and(|r| r.freed_here)),
        "each volume is recorded as freed from the management side: {inv:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_dead_from_the_start_that_holds_no_disk_is_released_with_no_override() {
    let env = env();
    let t = Tenant::create(
        env.cp,
        TenantOptions::new(&env.cp.unique("never")).values(json!({"nodes": 0})),
    )
    .await;
    t.wait_custody().await;
    env.cp.cluster_down(&t.cluster.name);

    t.delete_parent().await;
    let record = released_and_gone(&t).await;
    let note = record.message.clone().unwrap_or_default();
    assert!(
        note.contains("holds no disk")
            && note.contains("the tenant API cannot be reached")
            && note.contains(&format!("cluster.x-k8s.io/cluster-name={}", t.name)),
        "{note}"
    );
    assert!(record.override_.is_none(), "no override was needed");
    t.wait_event("Normal", "Released", |n| n.contains("holds no disk"))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_dead_from_the_start_that_holds_disks_keeps_them_until_an_override() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("nodinv")).await;
    t.wait_custody().await;
    t.with_held_claims(&["data"]).await;
    let before = t.infra_objects(None).await;
    env.cp.cluster_down(&t.cluster.name);

    t.delete_parent().await;
    let note = next_blocked(&t, "Blocked without an inventory", |m| {
        m.contains("no inventory was taken")
    })
    .await;
    assert!(
        note.contains(&before.datavolumes[0]) && note.contains("reclaim policy is unknown"),
        "{note}"
    );
    // Well past the wait before freeing (3 s), nothing without a recorded
    // policy was deleted.
    next_blocked(&t, "the fifth Blocked", |m| {
        m.contains("no inventory was taken") && m.contains("attempt 5;")
    })
    .await;
    assert_eq!(t.infra_objects(Some(&before)).await, before);
    assert_eq!(env.sim.volumes_of(&t.namespace, &t.name).len(), 1);

    t.grant_override("platform-admins").await;
    let alice = env
        .cp
        .client_as("alice", &["platform-admins", "system:authenticated"])
        .await;
    t.annotate_override(&alice, "tenant never answered; disk abandoned (ticket 7)")
        .await
        .expect("authorized override accepted");
    // The hook's step 5 then deletes the tenant's DataVolumes by label; the
    // disk, whose policy nothing recorded, was kept before custody ended.
    t.wait_parent_gone(Duration::from_secs(180)).await;
    assert_eq!(
        env.sim.volumes_of(&t.namespace, &t.name).len(),
        1,
        "the disk of unknown policy is still on storage"
    );
    let kept = t.kept_disks().await;
    assert_eq!(kept.len(), 1, "and found by its label: {kept:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_datavolume_that_cannot_be_deleted_keeps_the_tenant_blocked_naming_it() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("stuckdv")).await;
    t.wait_custody().await;
    t.with_held_claims(&["data", "logs"]).await;
    let before = t.infra_objects(None).await;
    let stuck = before.datavolumes[0].clone();
    let keep = json!({"metadata": {"finalizers": ["example.com/keep"]}});
    t.datavolumes()
        .patch(&stuck, &PatchParams::default(), &Patch::Merge(&keep))
        .await
        .expect("add a finalizer");

    t.delete_parent().await;
    let note = next_blocked(&t, "Blocked naming the stuck DataVolume", |m| {
        m.contains(&stuck)
    })
    .await;
    assert!(
        note.contains("the tenant's PVs are gone, but the management cluster still holds")
            && note.contains("being deleted, held by finalizers example.com/keep"),
        "{note}"
    );
    assert!(
        t.parent().await.is_some(),
        "the parent is held while the disk is"
    );
    // The other disk is freed, the stuck one is not.
    env.sim.wait_disks(&t.namespace, &t.name, 1).await;
    next_blocked(&t, "Blocked still naming it", |m| m.contains(&stuck)).await;

    // Its finalizer removed, the DataVolume goes, and with it the disk.
    let free = json!({"metadata": {"finalizers": null}});
    t.datavolumes()
        .patch(&stuck, &PatchParams::default(), &Patch::Merge(&free))
        .await
        .expect("remove the finalizer");
    released_and_gone(&t).await;
    assert!(env.sim.volumes_of(&t.namespace, &t.name).is_empty());
    assert!(t.infra_objects(Some(&before)).await.is_empty());
}

/// A tenant snapshot is, behind it, a VolumeSnapshot of the management
/// storage (the KubeVirt driver's CreateSnapshot), and the storage holds the
/// snapshot as long as that VolumeSnapshot's content: `Released` waits for
/// a content being deleted, one that cannot go keeps the tenant `Blocked`
/// naming it, and a finalizer on the VolumeSnapshot itself holds nothing
/// once its content, and the snapshot on storage, are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_management_snapshot_that_cannot_go_keeps_the_tenant_blocked_naming_its_content() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("stucksnap")).await;
    t.wait_custody().await;
    let snap = t.with_snapshot("sim-snapshots").await;
    let content = t.infra_content_of(&snap).await;
    // A restore from it that never completes (no such StorageClass): the
    // snapshot controller does not delete a snapshot a volume is being
    // created from.
    let restore: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": "restore", "namespace": t.namespace},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "no-such-class",
                 "resources": {"requests": {"storage": "1Gi"}},
                 "dataSource": {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": snap}}
    }))
    .unwrap();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(t.management.clone(), &t.namespace);
    claims
        .create(&PostParams::default(), &restore)
        .await
        .expect("create the restoring claim");
    // And someone else's finalizer on the VolumeSnapshot.
    let hold =
        json!([{"op": "add", "path": "/metadata/finalizers/-", "value": "example.com/keep"}]);
    t.infra_snapshots()
        .patch(
            &snap,
            &PatchParams::default(),
            &Patch::Json::<()>(serde_json::from_value(hold).unwrap()),
        )
        .await
        .expect("add a finalizer to the management VolumeSnapshot");

    t.delete_parent().await;
    let note = next_blocked(&t, "Blocked naming the management content", |m| {
        m.contains(&content)
    })
    .await;
    assert!(
        note.contains(
            "the disks are freed, but the management storage still holds 1 snapshot being deleted"
        ) && note.contains(&format!("VolumeSnapshotContent {content}")),
        "{note}"
    );
    assert!(
        t.parent().await.is_some(),
        "the parent is held while the snapshot is"
    );
    let left = env.sim.volumes_of(&t.namespace, &t.name);
    assert_eq!(left.len(), 1, "the snapshot is on storage: {left:?}");

    // The restore given up, the snapshot controllers free the snapshot; the
    // VolumeSnapshot's own finalizer does not hold the tenant.
    claims
        .delete("restore", &Default::default())
        .await
        .expect("delete the restoring claim");
    // The snapshot-controller retries the VolumeSnapshot with a backoff that
    // has grown while the restore held it (up to 5 minutes): a change to it
    // queues it now, as any edit would. Its timing is not what is tested.
    t.infra_snapshots()
        .patch(
            &snap,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"annotations": {"example.com/restore": "gone"}}})),
        )
        .await
        .expect("annotate the management VolumeSnapshot");
    released_and_gone(&t).await;
    assert!(env.sim.volumes_of(&t.namespace, &t.name).is_empty());
    let vs = t
        .infra_snapshots()
        .get(&snap)
        .await
        .expect("the VolumeSnapshot is still held by its finalizer");
    assert!(
        vs.metadata.deletion_timestamp.is_some(),
        "{:?}",
        vs.metadata
    );
    // Let it go, so the namespace can be.
    let finalizers: Vec<String> = vs
        .metadata
        .finalizers
        .unwrap_or_default()
        .into_iter()
        .filter(|f| f != "example.com/keep")
        .collect();
    t.infra_snapshots()
        .patch(
            &snap,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"finalizers": finalizers}})),
        )
        .await
        .expect("remove the finalizer");
}

/// A management content made Retain by the platform's VolumeSnapshotClass
/// (the tenant class names it by the driver's `infraSnapshotClassName`)
/// keeps its snapshot on storage when the tenant's driver deletes the
/// VolumeSnapshot, which then goes at once: `Released` names the content,
/// found by the disk it is a snapshot of (its VolumeSnapshot deleted first
/// here, so nothing else can find it). The content is Retain from its
/// creation: a content patched to Retain just before its VolumeSnapshot is
/// deleted may still be deleted by a snapshot-controller whose cache has
/// not seen the patch (docs/reliability.md), which is not what this tests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retained_management_snapshot_content_is_named_in_released_and_stays_on_storage() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("retainsnap")).await;
    t.wait_custody().await;
    let snap = t.with_snapshot("sim-snapshots-infra-retain").await;
    let content = t.infra_content_of(&snap).await;
    let policy = t
        .infra_contents()
        .get(&content)
        .await
        .expect("the management content")
        .data
        .pointer("/spec/deletionPolicy")
        .and_then(|v| v.as_str().map(str::to_string));
    assert_eq!(
        policy.as_deref(),
        Some("Retain"),
        "the content takes the management class's policy"
    );
    // Its VolumeSnapshot deleted first (by whoever may edit the namespace):
    // the content, Retain, stays, and nothing but the disk it is a snapshot
    // of ties it to the tenant any more.
    t.infra_snapshots()
        .delete(&snap, &DeleteParams::default())
        .await
        .expect("delete the management VolumeSnapshot");
    eventually(
        "the management VolumeSnapshot gone",
        Duration::from_secs(60),
        || async {
            match t.infra_snapshots().get_opt(&snap).await {
                Ok(None) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;

    t.delete_parent().await;
    let record = released_and_gone(&t).await;
    let message = record.message.clone().unwrap_or_default();
    assert!(
        message.contains(&format!(
            "but 1 snapshot kept: VolumeSnapshotContent {content} left on the management storage"
        )),
        "{message}"
    );
    let kept = t
        .infra_contents()
        .get(&content)
        .await
        .expect("the content is kept");
    assert!(kept.metadata.deletion_timestamp.is_none());
    let left = env.sim.volumes_of(&t.namespace, &t.name);
    assert_eq!(left.len(), 1, "only the snapshot is on storage: {left:?}");
}

/// A tenant whose API dies holding a snapshot: its disks are freed from the
/// management side, but its management VolumeSnapshot is not being deleted
/// and nothing left can say whether the tenant meant to keep it: kept, and
/// named in `Released`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_tenants_management_snapshot_is_kept_and_named_when_it_is_released() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("deadsnap")).await;
    t.wait_custody().await;
    let kept = t.with_snapshot("sim-snapshots").await;

    // The driver stops, so the phase holds after the inventory; then the
    // tenant API dies.
    t.set_driver(&env.sim, false).await;
    t.delete_parent().await;
    t.wait_inventory().await;
    env.cp.cluster_down(&t.cluster.name);

    let record = released_and_gone(&t).await;
    let message = record.message.clone().unwrap_or_default();
    assert!(
        message.contains("1 volume freed from the management side")
            && message.contains(&format!("but 1 snapshot kept: VolumeSnapshot {kept}"))
            && message.contains("cannot tell"),
        "{message}"
    );
    t.assert_infra_snapshot_kept(&kept).await;
    let left = env.sim.volumes_of(&t.namespace, &t.name);
    assert_eq!(left.len(), 1, "only the snapshot is on storage: {left:?}");
}

/// The hole this closes: without an inventory, the infra labels are all the
/// phase finds a dead tenant's disks by, and whoever edits the tenant
/// namespace could remove them and leave the disks behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_disk_labels_cannot_be_removed_while_it_lives_and_its_other_edits_pass() {
    let env = env();
    let (t, before) = tenant_with_disks("relabel").await;
    let dv = before.datavolumes[0].clone();
    let claims: kube::Api<PersistentVolumeClaim> =
        kube::Api::namespaced(t.management.clone(), &t.namespace);
    let unlabel = Patch::Merge(json!({
        "metadata": {"labels": {"cluster.x-k8s.io/cluster-name": null}}
    }));
    let retarget = Patch::Merge(json!({
        "metadata": {"labels": {"cluster.x-k8s.io/cluster-name": "kubernetes-elsewhere"}}
    }));
    let pp = PatchParams::default();
    for (what, patch) in [("removal", &unlabel), ("change", &retarget)] {
        let refused = |r: Result<_, kube::Error>| match r {
            Err(kube::Error::Api(s)) => s,
            other => panic!("label {what} on a tenant's disk was not refused: {other:?}"),
        };
        let s = refused(t.datavolumes().patch(&dv, &pp, patch).await.map(|_| ()));
        assert_eq!(s.code, 403, "{s:?}");
        assert!(
            s.message.contains(&format!(
                "refusing to relabel DataVolume {}/{dv}",
                t.namespace
            )) && s.message.contains(&t.name),
            "{}",
            s.message
        );
        let s = refused(claims.patch(&dv, &pp, patch).await.map(|_| ()));
        assert_eq!(s.code, 403, "{s:?}");
        assert!(
            s.message.contains(&format!(
                "refusing to relabel PersistentVolumeClaim {}/{dv}",
                t.namespace
            )),
            "{}",
            s.message
        );
    }
    // Everything else about the disk stays writable (CDI annotates its
    // objects all the time): an annotation and another label pass.
    let annotate = Patch::Merge(json!({
        "metadata": {
            "annotations": {"example.com/note": "kept"},
            "labels": {"example.com/team": "a"}
        }
    }));
    t.datavolumes()
        .patch(&dv, &pp, &annotate)
        .await
        .expect("an annotation on a DataVolume passes");
    claims
        .patch(&dv, &pp, &annotate)
        .await
        .expect("an annotation on its PVC passes");

    // And the teardown frees it, label intact.
    t.delete_parent().await;
    released_and_gone(&t).await;
    assert!(
        env.sim.volumes_of(&t.namespace, &t.name).is_empty(),
        "no disk left in the ledger"
    );
}
