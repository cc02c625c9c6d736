//! A disk the record says is kept stays kept (`docs/design.md` §5c), on the
//! road that deletes everything at once: the tenant's namespace; and a
//! kept disk whose volume the tenant turns to Delete is let go. The
//! override road is `retain_volumes_are_named_as_residue_and_an_override_keeps_them_on_storage`
//! (`tests/faults.rs`), the Proxmox path `tests/kept_proxmox.rs`.

use volume_gate_testkit as common;

use std::time::{Duration, Instant};

use common::exposition;
use common::tenant::{RETAIN_STORAGE_CLASS, STORAGE_CLASS, Tenant};
use k8s_openapi::api::core::v1::PersistentVolume;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::json;
use volume_gate::record::Phase;

fn env() -> &'static common::Env {
    common::gated_short()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retain_disk_survives_the_deletion_of_its_tenants_namespace_and_the_delete_one_is_freed()
{
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("nsroad")).await;
    t.wait_custody().await;
    t.with_claims_of(&[("kept", RETAIN_STORAGE_CLASS), ("freed", STORAGE_CLASS)])
        .await;
    assert_eq!(env.sim.volumes_of(&t.namespace, &t.name).len(), 2);

    // The namespace controller deletes everything in it at once; the
    // tenant's DataVolumes and their PVCs first of all, were it let.
    let started = Instant::now();
    t.delete_namespace().await;
    let record = t.wait_phase(Phase::Blocked, Duration::from_secs(90)).await;
    let inventoried_after = started.elapsed();
    let inv = record
        .inventory
        .expect("inventoried before anything was deleted");
    let kept = inv
        .volumes
        .iter()
        .find(|v| v.is_retain())
        .expect("the Retain volume");
    let pv = kept
        .infra
        .as_ref()
        .and_then(|r| r.kept.then(|| r.pv.clone()).flatten())
        .expect("its disk recorded kept");
    // Only the Delete one was freed.
    let residue = env.sim.wait_disks(&t.namespace, &t.name, 1).await;

    t.grant_override_everywhere("platform-admins").await;
    let alice = env.cp.client_as("alice", &["platform-admins"]).await;
    t.annotate_override(&alice, "the namespace goes; its Retain disk stays")
        .await
        .expect("override accepted");
    let overridden = Instant::now();
    // Once the tenant is done, the namespace controller deletes its
    // DataVolumes and their PVCs: the kept disk's PV goes Released and
    // stays. (The namespace itself goes when helm-controller has let its
    // children go, on Flux's own retry schedule: not waited for here.)
    common::wait::eventually("the kept PV Released", Duration::from_secs(120), || async {
        let pvs = t.kept_disks().await;
        match pvs
            .iter()
            .find(|d| d.metadata.name.as_deref() == Some(pv.as_str()))
        {
            Some(d) if d.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Released") => {
                Ok(())
            }
            other => Err(format!("{:?}", other.map(|d| d.status.clone()))),
        }
    })
    .await;
    let released_after = overridden.elapsed();
    // The kept PV goes Released when its PVC is gone; the DataVolumes go in
    // the same or a later sync of the namespace controller (the retry of its
    // refused deletes is on its own backoff), and once gone stay gone (a
    // namespace being deleted refuses every create).
    common::wait::eventually(
        "the namespace controller to delete the DataVolumes",
        Duration::from_secs(180),
        || async {
            match t.datavolumes().list(&Default::default()).await {
                Ok(l) if l.items.is_empty() => Ok(()),
                Ok(l) => Err(format!(
                    "{:?}",
                    l.items
                        .iter()
                        .map(|d| (
                            d.metadata.name.clone(),
                            d.metadata.deletion_timestamp.is_some()
                        ))
                        .collect::<Vec<_>>()
                )),
                // The namespace itself gone: so are they.
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await;

    // The kept disk's PV (cluster-scoped) and the disk itself stay.
    assert_eq!(
        env.sim.volumes_of(&t.namespace, &t.name),
        residue,
        "the Retain disk is on storage, the Delete one is not"
    );
    let disks = t.kept_disks().await;
    assert_eq!(
        disks
            .iter()
            .map(|d| d.metadata.name.clone().unwrap_or_default())
            .collect::<Vec<_>>(),
        vec![pv.clone()],
        "found by its label after the namespace is gone"
    );
    let annotations = disks[0].metadata.annotations.clone().unwrap_or_default();
    let keys = common::keys();
    assert_eq!(
        annotations.get(&keys.kept_for).map(String::as_str),
        Some(format!("{}/{}", t.namespace, t.name).as_str())
    );
    assert!(
        annotations
            .get(&keys.kept_volume)
            .is_some_and(|v| v.contains(&kept.pv)),
        "{annotations:?}"
    );
    acknowledge_the_kept_disk(env, &pv).await;
    eprintln!(
        "namespace road: inventoried and Blocked {:.1}s after the namespace deletion; the kept PV Released {:.1}s after the override",
        inventoried_after.as_secs_f64(),
        released_after.as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retain_volume_turned_delete_in_the_tenant_is_let_go_and_freed() {
    use k8s_openapi::api::core::v1::PersistentVolume;
    use kube::api::{Api, Patch, PatchParams};
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("letgo")).await;
    t.wait_custody().await;
    t.with_claims_of(&[("kept", RETAIN_STORAGE_CLASS)]).await;
    t.delete_parent().await;
    let record = t.wait_phase(Phase::Blocked, Duration::from_secs(60)).await;
    let inv = record.inventory.expect("inventory");
    let volume = inv.remaining().next().expect("the Retain volume").clone();
    assert_eq!(t.kept_disks().await.len(), 1, "its disk is kept");

    // What the Blocked message offers the tenant's admin: free it after all.
    let patch = serde_json::json!({"spec": {"persistentVolumeReclaimPolicy": "Delete"}});
    Api::<PersistentVolume>::all(t.api.clone())
        .patch(&volume.pv, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("the tenant's admin turns the volume to Delete");
    // The worker lets the management PV go (its policy restored), the
    // driver frees the volume, and the teardown finishes with nothing left.
    t.wait_parent_gone(Duration::from_secs(120)).await;
    assert!(t.kept_disks().await.is_empty(), "no disk is kept any more");
    assert!(
        env.sim.volumes_of(&t.namespace, &t.name).is_empty(),
        "the disk was freed"
    );
}

/// A kept disk stays on storage on purpose, and an operator says so
/// (`docs/operations.md`, "Acknowledging a kept disk"): the mutating webhook
/// stamps who and when from the request, a stamp written by hand is
/// replaced by its writer, and the worker counts the disk as acknowledged
/// (no longer residue) until the acknowledgement is withdrawn.
async fn acknowledge_the_kept_disk(env: &common::Env, pv: &str) {
    let keys = common::keys();
    let admin = env.cp.management_client().await;
    for doc in [
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": "kept-disk-annotators"},
            "rules": [{"apiGroups": [""], "resources": ["persistentvolumes"], "verbs": ["get", "patch"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "kept-disk-annotators"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "kept-disk-annotators"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "storage-admins"}]}),
    ] {
        common::manifests::apply(&admin, &doc).await;
    }
    common::tenant::wait_authorized(
        &admin,
        "storage-admins",
        "",
        "",
        "persistentvolumes",
        "patch",
    )
    .await;
    let as_user = |user: &'static str| async move {
        Api::<PersistentVolume>::all(env.cp.client_as(user, &["storage-admins"]).await)
    };
    let annotate = |api: Api<PersistentVolume>, annotations: serde_json::Value| async move {
        api.patch(
            pv,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": annotations}})),
        )
        .await
        .expect("annotate the kept PV")
        .metadata
        .annotations
        .unwrap_or_default()
    };

    // Unacknowledged, it is residue.
    assert_counted(env, pv, false).await;
    let a = annotate(
        as_user("alice").await,
        json!({keys.kept_acknowledged.as_str(): "tenant data archived off-site (ticket 7)"}),
    )
    .await;
    assert_eq!(
        a.get(&keys.kept_acknowledged_by).map(String::as_str),
        Some("alice")
    );
    let at: jiff::Timestamp = a[&keys.kept_acknowledged_at]
        .parse()
        .expect("an RFC 3339 time");
    assert!(
        (jiff::Timestamp::now() - at).get_seconds().abs() < 120,
        "{at}"
    );
    assert_counted(env, pv, true).await;

    // A stamp cannot be written by hand: the writer's own name replaces it.
    let a = annotate(
        as_user("bob").await,
        json!({keys.kept_acknowledged_by.as_str(): "the-storage-team-lead"}),
    )
    .await;
    assert_eq!(
        a.get(&keys.kept_acknowledged_by).map(String::as_str),
        Some("bob")
    );

    // Withdrawn, the stamps go and it is residue again.
    let a = annotate(
        as_user("alice").await,
        json!({keys.kept_acknowledged.as_str(): null}),
    )
    .await;
    assert!(
        !a.contains_key(&keys.kept_acknowledged_by) && !a.contains_key(&keys.kept_acknowledged_at),
        "{a:?}"
    );
    assert_counted(env, pv, false).await;
}

/// Waits until the worker's acknowledged-residue gauge is the number of
/// kept PVs the API server holds with a stamped acknowledgement (other
/// tests of this binary keep disks too), with `pv` among them or not.
async fn assert_counted(env: &common::Env, pv: &str, acknowledged: bool) {
    let keys = common::keys();
    let admin = env.cp.management_client().await;
    common::wait::eventually(
        "the worker's count of acknowledged kept disks",
        Duration::from_secs(60),
        || {
            let (admin, keys) = (admin.clone(), keys.clone());
            async move {
                let kept = Api::<PersistentVolume>::all(admin)
                    .list(&ListParams::default().labels(&format!("{}=true", keys.kept)))
                    .await
                    .map_err(|e| e.to_string())?
                    .items;
                let stamped: Vec<String> = kept
                    .iter()
                    .filter(|p| {
                        let a = p.metadata.annotations.clone().unwrap_or_default();
                        a.contains_key(&keys.kept_acknowledged)
                            && a.contains_key(&keys.kept_acknowledged_by)
                    })
                    .filter_map(|p| p.metadata.name.clone())
                    .collect();
                if stamped.contains(&pv.to_string()) != acknowledged {
                    return Err(format!("{pv} acknowledged: {stamped:?}"));
                }
                let text = env.worker_metrics().await;
                let gauge =
                    exposition::value(&text, "volume_gate_residue_acknowledged_volumes", &[]);
                let residue = exposition::value(&text, "volume_gate_residue_volumes", &[]);
                if gauge != Some(stamped.len() as f64) {
                    return Err(format!("gauge {gauge:?}, stamped {stamped:?}"));
                }
                // Unacknowledged, the disk is residue: the gauge counts it.
                if !acknowledged && residue.is_none_or(|r| r < 1.0) {
                    return Err(format!("residue {residue:?}"));
                }
                Ok(())
            }
        },
    )
    .await;
}
