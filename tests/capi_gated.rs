//! volume-gate on a plain Cluster API platform, on Cluster API's own core
//! manager (v1.14.2) and the real control plane: the gate as the chart
//! installs it with `platform.profile=cluster-api` (its webhook
//! configurations, RBAC and profile), the worker and webhook as processes.
//! The same `kubectl delete cluster` that strands every volume without it
//! (`tests/capi.rs`) frees every one with it (docs/cluster-api.md).

use volume_gate_testkit as common;

use std::time::{Duration, Instant};

use common::capi::{self, CapiCluster, DeletionWatch, ManagementCsi};
use k8s_openapi::api::core::v1::PersistentVolume;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use volume_gate::profile::Profile;
use volume_gate::record::Keys;

/// A finalizer of the test's own on a tenant PV: the release phase waits
/// for the PV, so the teardown stays open until the test removes it.
const HOLD: &str = "volume-gate.test/hold";

fn profile() -> Profile {
    Profile::cluster_api()
}

/// A Cluster opted in (the profile's label), in custody once the worker's
/// finalizer is on it.
async fn protected_cluster(env: &common::Env, prefix: &str) -> CapiCluster {
    protected_cluster_with(env, prefix, None).await
}

/// As [`protected_cluster`], its CSI controller management-side as that
/// Deployment when `csi_controller` names one.
async fn protected_cluster_with(
    env: &common::Env,
    prefix: &str,
    csi_controller: Option<&str>,
) -> CapiCluster {
    let ns = env.cp.unique(prefix);
    let labels = profile().parent.match_labels.clone();
    let c = CapiCluster::create_with(env.cp, &ns, "c1", labels, csi_controller).await;
    let clusters: Api<DynamicObject> = Api::namespaced_with(
        c.management.clone(),
        &ns,
        &capi::core_resource("v1beta2", "Cluster"),
    );
    let finalizer = profile().custody_finalizer;
    // Custody, once taken, stays until the worker ends it.
    common::wait::eventually(
        "the worker's custody of the Cluster",
        Duration::from_secs(60),
        || async {
            let c = clusters.get("c1").await.map_err(|e| e.to_string())?;
            if c.finalizers().contains(&finalizer) {
                Ok(())
            } else {
                Err(format!("finalizers {:?}", c.finalizers()))
            }
        },
    )
    .await;
    c
}

/// With volume-gate: Cluster API's deletes of the machines are refused
/// until the worker has released every volume through the cluster's own
/// API and recorded `Released`; then Cluster API deletes the machines, the
/// control plane, the infrastructure, and the Cluster goes with 0 volumes
/// left on storage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_gate_deleting_a_capi_cluster_frees_every_volume_and_records_released() {
    let env = common::cluster_api();
    let keys = Keys::new(&profile().annotation_prefix);
    let c = protected_cluster(env, "capi-gated").await;
    let (ns, name) = (c.namespace.clone(), c.name.clone());
    c.workload(
        "apps",
        &[
            ("two-claims", &["data-a", "data-b"]),
            ("one-claim", &["logs"]),
        ],
    )
    .await;
    let before = env.sim.volumes_of(&ns, &name);
    assert_eq!(before.len(), 3, "one disk per claim: {before:?}");
    let machine = c.machines().await[0].name_any();

    let mut watch = DeletionWatch::open(&c.management, &ns).await;
    let deleting = Instant::now();
    c.kubectl_delete(env.cp, &[], &mut watch, Duration::from_secs(285))
        .await;
    let teardown = deleting.elapsed();

    let released = watch.recorded(&name, &keys.phase, "Released", &env.worker_log());
    let asked = watch
        .deletion_requested_at("Cluster", &name)
        .expect("the Cluster's deletion");
    assert!(asked < released, "{}", watch.render());
    let mss = watch.names("MachineSet");
    assert_eq!(mss.len(), 1, "one MachineSet:\n{}", watch.render());
    // Nothing the cluster runs on was deleted before its volumes were
    // released: Cluster API's deletes of them passed only after.
    for (kind, n) in [
        ("MachineDeployment", c.machine_deployment()),
        ("MachineSet", mss[0].clone()),
        ("Machine", machine.clone()),
        ("HarnessControlPlane", name.clone()),
        ("HarnessCluster", name.clone()),
    ] {
        let at = watch
            .deletion_requested_at(kind, &n)
            .unwrap_or_else(|| panic!("{kind} {n} was not deleted:\n{}", watch.render()));
        assert!(
            at > released,
            "{kind} {n} was deleted (revision {at}) before the volumes were released ({released}):\n{}",
            watch.render()
        );
    }
    // Cluster API tried before: the gate's refusals are in its log.
    let capi_log = capi::capi(env.cp).await.log();
    assert!(
        capi_log.contains("volume-gate") && capi_log.contains("refusing to delete"),
        "Cluster API's deletes were never refused by the gate; its log:\n{capi_log}"
    );

    let after = env.sim.volumes_of(&ns, &name);
    assert!(
        after.is_empty(),
        "volumes left on storage after the teardown: {after:?}\nsimulator log:\n{}",
        env.sim.log()
    );
    eprintln!(
        "kubectl delete to Cluster gone {:.1}s, 3 of 3 volumes freed; the teardown in etcd revision order:\n{}",
        teardown.as_secs_f64(),
        watch.render()
    );
}

/// The control plane and the infrastructure cluster are the Cluster's
/// because its references name them, whatever their own names, labels or
/// owners say: in custody, moving a reference or the opt-in label away is
/// refused; in teardown, deleting either is refused until the volumes are
/// released (a PV the test holds with a finalizer of its own keeps the
/// phase from finishing), then Cluster API deletes them itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_protected_cluster_references_is_held_and_the_reference_cannot_be_moved() {
    let env = common::cluster_api();
    let c = protected_cluster(env, "capi-refs").await;
    let (ns, name) = (c.namespace.clone(), c.name.clone());
    let clusters: Api<DynamicObject> = Api::namespaced_with(
        c.management.clone(),
        &ns,
        &capi::core_resource("v1beta2", "Cluster"),
    );
    let refused = |what: &str, r: Result<DynamicObject, kube::Error>, wanted: &str| match r {
        Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains(wanted) => s.message,
        other => panic!("{what}: {other:?}"),
    };
    // In custody: the reference and the opt-in label stay.
    let moved = serde_json::json!({"spec": {"controlPlaneRef": {
        "apiGroup": "controlplane.cluster.x-k8s.io", "kind": "HarnessControlPlane", "name": "decoy"}}});
    refused(
        "moving the control plane reference of a Cluster in custody",
        clusters
            .patch(&name, &PatchParams::default(), &Patch::Merge(&moved))
            .await,
        "spec.controlPlaneRef",
    );
    let key = profile().parent.match_labels.keys().next().unwrap().clone();
    let unlabel = serde_json::json!({"metadata": {"labels": {key: null}}});
    refused(
        "removing the opt-in label of a Cluster in custody",
        clusters
            .patch(&name, &PatchParams::default(), &Patch::Merge(&unlabel))
            .await,
        "volume-gate",
    );

    // A teardown the test holds open: the claim's PV keeps a finalizer.
    c.workload("apps", &[("holder", &["data"])]).await;
    let pvs: Api<PersistentVolume> = Api::all(c.api.clone());
    let pv = pvs.list(&Default::default()).await.expect("list PVs").items[0].name_any();
    let hold =
        serde_json::json!({"metadata": {"finalizers": [HOLD, "kubernetes.io/pv-protection"]}});
    pvs.patch(&pv, &PatchParams::default(), &Patch::Merge(&hold))
        .await
        .expect("hold the PV");
    let mut watch = DeletionWatch::open(&c.management, &ns).await;
    clusters
        .delete(&name, &DeleteParams::default())
        .await
        .expect("delete the Cluster");
    for kind in ["HarnessControlPlane", "HarnessCluster"] {
        let api: Api<DynamicObject> =
            Api::namespaced_with(c.management.clone(), &ns, &capi::harness_resource(kind));
        // What a namespace's editor can write on it first: its owner
        // references and labels go; the Cluster's reference still names it.
        api.patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(
                &serde_json::json!({"metadata": {"ownerReferences": null, "labels": null}}),
            ),
        )
        .await
        .unwrap_or_else(|e| panic!("strip {kind}'s owners and labels: {e}"));
        let message = refused(
            &format!("deleting the {kind} a deleting Cluster references"),
            api.delete(&name, &DeleteParams::default())
                .await
                .map(|_| DynamicObject::new(&name, &capi::harness_resource(kind))),
            "volume-gate",
        );
        assert!(
            message.contains(&format!("{ns}/{name}")),
            "names the cluster: {message}"
        );
    }
    // Let the phase finish: Cluster API then deletes them itself.
    let released = serde_json::json!({"metadata": {"finalizers": null}});
    pvs.patch(&pv, &PatchParams::default(), &Patch::Merge(&released))
        .await
        .expect("let the PV go");
    watch
        .until_deleted("Cluster", &name, Duration::from_secs(240))
        .await;
    for kind in ["HarnessControlPlane", "HarnessCluster"] {
        assert!(
            watch.deleted_at(kind, &name).is_some(),
            "Cluster API deleted the {kind} after the release:\n{}",
            watch.render()
        );
    }
    assert!(
        env.sim.volumes_of(&ns, &name).is_empty(),
        "{}",
        env.sim.log()
    );
}

/// The management-side CSI controller shape (kubevirt-csi-driver's split
/// deployment, the chart's `platform.clusterApi.managementCsi` with its
/// default names): the controller runs in the Cluster's namespace and
/// frees each volume by deleting its DataVolume as its own ServiceAccount.
/// `kubectl delete cluster --cascade=foreground` has Kubernetes' garbage
/// collector delete the controller and its identity (owned by the Cluster)
/// at once, and Cluster API delete the machines: the gate refuses both
/// until the worker has released every volume, which the controller frees
/// while it still may; then the disks are gone, the record `Released`, and
/// only after that the controller and its identity are deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_gate_a_management_side_csi_controller_frees_every_disk_before_it_and_its_identity_go()
 {
    let env = common::cluster_api();
    let keys = Keys::new(&profile().annotation_prefix);
    let shipped = common::gate::cluster_api_profile(env.cp);
    let m = ManagementCsi::of_profile(&shipped, "c1");
    let c = protected_cluster_with(env, "capi-mgmt", Some(&m.controller)).await;
    let (ns, name) = (c.namespace.clone(), c.name.clone());
    c.management_csi(&m).await;
    c.workload(
        "apps",
        &[
            ("two-claims", &["data-a", "data-b"]),
            ("one-claim", &["logs"]),
        ],
    )
    .await;
    let dvs = c.data_volumes(&m.labels).await;
    assert_eq!(
        dvs.len(),
        3,
        "one DataVolume per claim, by the controller's labels: {dvs:?}"
    );
    let disks = env.sim.volumes_of(&ns, &name);
    assert_eq!(
        disks.len(),
        3,
        "one management disk per DataVolume: {disks:?}"
    );

    let mut watch = DeletionWatch::open_with(&c.management, &ns, ManagementCsi::kinds()).await;
    c.kubectl_delete(
        env.cp,
        &["--cascade=foreground"],
        &mut watch,
        Duration::from_secs(285),
    )
    .await;

    let released = watch.recorded(&name, &keys.phase, "Released", &env.worker_log());
    // The controller freed every disk while it ran: each DataVolume went
    // before the record.
    for dv in &dvs {
        let gone = watch
            .deleted_at("DataVolume", dv)
            .unwrap_or_else(|| panic!("DataVolume {dv} was not deleted:\n{}", watch.render()));
        assert!(
            gone < released,
            "DataVolume {dv} after Released:\n{}",
            watch.render()
        );
    }
    // The controller and its identity were deleted only after.
    for (kind, n) in [
        ("Deployment", &m.controller),
        ("ServiceAccount", &m.identity),
        ("Role", &m.identity),
        ("RoleBinding", &m.identity),
    ] {
        let at = watch
            .deletion_requested_at(kind, n)
            .or_else(|| watch.deleted_at(kind, n))
            .unwrap_or_else(|| panic!("{kind} {n} was not deleted:\n{}", watch.render()));
        assert!(
            at > released,
            "{kind} {n} was deleted (revision {at}) before the volumes were released ({released}):\n{}",
            watch.render()
        );
    }
    assert!(
        c.data_volumes(&m.labels).await.is_empty(),
        "DataVolumes left"
    );
    let after = env.sim.volumes_of(&ns, &name);
    assert!(
        after.is_empty(),
        "disks left on the management storage: {after:?}\nsimulator log:\n{}",
        env.sim.log()
    );
    eprintln!(
        "3 of 3 disks freed by the management-side controller; the teardown in etcd revision order:\n{}",
        watch.render()
    );
}
