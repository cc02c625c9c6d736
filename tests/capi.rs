//! The incident on a plain Cluster API cluster, without volume-gate, on
//! Cluster API's own core manager (v1.14.2) and the real control plane:
//! `kubectl delete cluster` deletes the Machines first (a deleting
//! Cluster's Machines are not drained, and their volumes' detach is not
//! waited for: core/reconcilers/machine/machine_controller.go
//! `isDeleteNodeAllowed` -> `errClusterIsBeingDeleted`), the node and the
//! CSI driver that ran on it go with the last one, then the control plane,
//! and every volume of the cluster is left on storage. The world is
//! `volume_gate_testkit::capi` (docs/development.md, "The Cluster API
//! world").

use volume_gate_testkit as common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::capi::{self, CapiCluster, DeletionWatch, ManagementCsi};
use kube::ResourceExt;
use kube::api::{Api, DynamicObject, PostParams};

/// The incident on Cluster API: a Cluster whose claims are mounted by
/// running Pods, deleted with kubectl as a user would; Cluster API deletes
/// the MachineDeployment, MachineSet and Machine before the control plane,
/// the Cluster goes, and every volume stays on storage: stranded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_gate_deleting_a_capi_cluster_strands_every_volume() {
    let env = common::ungated_cluster_api();
    let started = Instant::now();
    let ns = env.cp.unique("capi-leak");
    let name = "c1";
    let c = CapiCluster::create(env.cp, &ns, name, BTreeMap::new()).await;
    let ready = started.elapsed();
    c.workload(
        "apps",
        &[
            ("two-claims", &["data-a", "data-b"]),
            ("one-claim", &["logs"]),
        ],
    )
    .await;
    let before = env.sim.volumes_of(&ns, name);
    assert_eq!(
        before.len(),
        3,
        "the in-tenant driver provisioned one disk per claim: {before:?}"
    );
    let machine = c.machines().await[0].metadata.name.clone().expect("name");

    let mut watch = DeletionWatch::open(&c.management, &ns).await;
    let deleting = Instant::now();
    c.kubectl_delete(env.cp, &[], &mut watch, Duration::from_secs(300))
        .await;
    let teardown = deleting.elapsed();

    let control_plane = watch
        .deletion_requested_at("HarnessControlPlane", name)
        .unwrap_or_else(|| panic!("the control plane was never deleted:\n{}", watch.render()));
    let md = c.machine_deployment();
    let mss = watch.names("MachineSet");
    assert_eq!(mss.len(), 1, "one MachineSet:\n{}", watch.render());
    for (kind, n) in [
        ("MachineDeployment", md.as_str()),
        ("MachineSet", mss[0].as_str()),
        ("Machine", machine.as_str()),
    ] {
        let gone = watch
            .deleted_at(kind, n)
            .unwrap_or_else(|| panic!("{kind} {n} was not deleted:\n{}", watch.render()));
        assert!(
            gone < control_plane,
            "Cluster API deletes the {kind} before the control plane; revisions:\n{}",
            watch.render()
        );
    }

    let after = env.sim.volumes_of(&ns, name);
    assert_eq!(
        after,
        before,
        "THE INCIDENT, on Cluster API: the node and its CSI driver went with the last Machine, \
         the control plane after, and every volume stayed; simulator log:\n{}",
        env.sim.log()
    );
    eprintln!("the teardown, in etcd revision order:\n{}", watch.render());
    let capi = capi::capi(env.cp).await;
    eprintln!(
        "timings: cluster ready (Machine Running) {:.1}s, kubectl delete to Cluster gone {:.1}s; \
         Cluster API manager started in {:.1}s, RSS {} KiB",
        ready.as_secs_f64(),
        teardown.as_secs_f64(),
        capi.started_in.as_secs_f64(),
        capi.rss_kib().unwrap_or(0)
    );
}

/// Cluster API's conversion webhook serves the CRDs: a MachineDeployment
/// written as `cluster.x-k8s.io/v1beta1` (as Cozystack's tenant chart
/// writes it) is stored as v1beta2 and read back in either version, its
/// infrastructure reference converted (`apiVersion` to `apiGroup`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v1beta1_machine_deployment_is_read_back_as_v1beta2() {
    let env = common::ungated_cluster_api();
    capi::capi(env.cp).await;
    let ns = env.cp.unique("capi-conv");
    env.cp.namespace(&ns).await;
    let client = env.cp.management_client().await;
    let v1beta1: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &ns,
        &capi::core_resource("v1beta1", "MachineDeployment"),
    );
    let v1beta2: Api<DynamicObject> = Api::namespaced_with(
        client,
        &ns,
        &capi::core_resource("v1beta2", "MachineDeployment"),
    );
    v1beta1
        .create(
            &PostParams::default(),
            &capi::v1beta1_machine_deployment("md", "elsewhere"),
        )
        .await
        .expect("create a v1beta1 MachineDeployment");

    let read = v1beta2.get("md").await.expect("read it as v1beta2");
    let tmpl = &read.data["spec"]["template"]["spec"];
    assert_eq!(
        tmpl["infrastructureRef"],
        serde_json::json!({"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "HarnessMachineTemplate", "name": "md"}),
        "v1beta2 names the group, not the version: {read:?}"
    );
    assert_eq!(tmpl["bootstrap"]["dataSecretName"], "elsewhere-bootstrap");
    assert_eq!(read.data["spec"]["clusterName"], "elsewhere");
    assert_eq!(
        read.labels()
            .get(capi::CLUSTER_NAME_LABEL)
            .map(String::as_str),
        Some("elsewhere"),
        "defaulted by Cluster API's webhook"
    );

    let back = v1beta1.get("md").await.expect("read it as v1beta1");
    assert_eq!(
        back.data["spec"]["template"]["spec"]["infrastructureRef"]["apiVersion"],
        "infrastructure.cluster.x-k8s.io/v1alpha1",
        "v1beta1 names the version again (from the contract label): {back:?}"
    );
}

/// The incident with the management-side CSI controller shape
/// (kubevirt-csi-driver's split deployment: the controller in the Cluster's
/// namespace, its disks DataVolumes there): `kubectl delete cluster
/// --cascade=foreground` has the garbage collector delete the controller
/// and its identity (owned by the Cluster) at once, and Cluster API the
/// machines and the control plane; nothing deleted the claims, so no
/// DataVolume was freed, and every disk stays on the management storage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_gate_deleting_a_capi_cluster_with_a_management_side_csi_controller_strands_every_disk()
 {
    let env = common::ungated_cluster_api();
    let ns = env.cp.unique("capi-mgmt-leak");
    let name = "c1";
    // Upstream's names, prefixed with the cluster's, and the label key of
    // its README's example (the chart's defaults).
    let m = ManagementCsi {
        controller: format!("{name}-kubevirt-csi-controller"),
        identity: format!("{name}-kubevirt-csi"),
        labels: BTreeMap::from([("csi-driver/cluster".to_string(), name.to_string())]),
    };
    let c = CapiCluster::create_with(env.cp, &ns, name, BTreeMap::new(), Some(&m.controller)).await;
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
    assert_eq!(dvs.len(), 3, "one DataVolume per claim: {dvs:?}");
    let before = env.sim.volumes_of(&ns, name);
    assert_eq!(
        before.len(),
        3,
        "one management disk per DataVolume: {before:?}"
    );

    let mut watch = DeletionWatch::open_with(&c.management, &ns, ManagementCsi::kinds()).await;
    c.kubectl_delete(
        env.cp,
        &["--cascade=foreground"],
        &mut watch,
        Duration::from_secs(300),
    )
    .await;
    for (kind, n) in [
        ("Deployment", &m.controller),
        ("ServiceAccount", &m.identity),
    ] {
        assert!(
            watch.deleted_at(kind, n).is_some(),
            "{kind} {n} went with the Cluster:\n{}",
            watch.render()
        );
    }
    assert_eq!(
        c.data_volumes(&m.labels).await,
        dvs,
        "THE INCIDENT, management-side: every DataVolume stayed; simulator log:\n{}",
        env.sim.log()
    );
    assert_eq!(
        env.sim.volumes_of(&ns, name),
        before,
        "every disk stayed on the management storage"
    );
    eprintln!("the teardown, in etcd revision order:\n{}", watch.render());
}
