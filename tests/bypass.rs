//! The ways around the gate that were found by trying, as someone who may
//! edit a tenant's namespace (`mallory`: everything on releases, Secrets,
//! Deployments, Kamaji and Cluster API objects there, but not the override
//! verb and not the worker), each closed, on the real API server with the
//! shipped webhook configurations.

use volume_gate_testkit as common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::tenant::{
    Tenant, TenantOptions, kcp_resource, kubeconfig_data, resource, tcp_resource,
};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use serde_json::{Value, json};
use volume_gate::record::Phase;

fn env() -> &'static common::Env {
    common::gated_short()
}

const PARENT_KIND: &str = "apps.cozystack.io/application.kind";
const PARENT_GROUP: &str = "apps.cozystack.io/application.group";
const CHILD: &str = "cozystack.io/target-cluster-name";
const CAPI: &str = "cluster.x-k8s.io/cluster-name";
const KAMAJI: &str = "kamaji.clastix.io/component";
const FLUX: &str = "helm.toolkit.fluxcd.io/name";

fn cluster_resource() -> ApiResource {
    resource("cluster.x-k8s.io", "v1beta1", "Cluster", "clusters")
}

fn deployment_resource() -> ApiResource {
    resource("apps", "v1", "Deployment", "deployments")
}

fn dry() -> DeleteParams {
    DeleteParams {
        dry_run: true,
        ..Default::default()
    }
}

/// The namespace editor of `t`'s namespace (`common::editor`).
async fn mallory(t: &Tenant) -> kube::Client {
    common::editor::mallory(env().cp, &[&t.namespace]).await
}

fn labels_patch(labels: Value) -> Patch<Value> {
    Patch::Merge(json!({"metadata": {"labels": labels}}))
}

fn assert_refused<T: std::fmt::Debug>(
    what: &str,
    result: Result<T, kube::Error>,
    needles: &[&str],
) -> String {
    let err = result.expect_err(what).to_string();
    assert!(
        err.contains("volume-gate"),
        "{what}: refused, but not by the gate: {err}"
    );
    for n in needles {
        assert!(err.contains(n), "{what}: the refusal names {n:?}: {err}");
    }
    err
}

async fn finish(t: &Tenant) {
    let env = env();
    t.set_driver(&env.sim, true).await;
    t.wait_parent_gone(Duration::from_secs(180)).await;
    assert!(
        env.sim.volumes_of(&t.namespace, &t.name).is_empty(),
        "the teardown freed every volume"
    );
}

// ---------------------------------------------------------------------------
// 1. One added label let the CSI release go
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parents_kind_label_added_to_the_csi_release_is_refused_and_its_delete_still_reviewed() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("kindlabel")).await;
    t.wait_custody().await;
    let m = mallory(&t).await;
    let hrs: Api<DynamicObject> =
        Api::namespaced_with(m, &t.namespace, &common::gate::helmrelease_resource());
    let csi = common::profile()
        .csi_release_name(&t.name)
        .expect("Cozystack has a CSI release");
    let patch = labels_patch(json!({PARENT_KIND: "Kubernetes"}));
    assert_refused(
        "kind label on the CSI release",
        hrs.patch(&csi, &PatchParams::default(), &patch).await,
        &["relabel", &csi],
    );
    assert_refused(
        "DELETE of the CSI release",
        hrs.delete(&csi, &DeleteParams::default()).await,
        &["CSI driver release"],
    );

    // A CSI release that carries the label from its creation (nothing to
    // relabel) is still reviewed on DELETE: by its name.
    let ns = format!("{}-born", t.namespace);
    env.cp.namespace(&ns).await;
    let r = "kubernetes-born";
    let csi = common::profile()
        .csi_release_name(r)
        .expect("Cozystack has a CSI release");
    let api: Api<DynamicObject> = Api::namespaced_with(
        t.management.clone(),
        &ns,
        &common::gate::helmrelease_resource(),
    );
    common::tenant::paper_parent(&api, r).await;
    let mut labels = BTreeMap::from([(CHILD.to_string(), r.to_string())]);
    labels.insert(PARENT_KIND.into(), "Kubernetes".into());
    let born = object(
        "helm.toolkit.fluxcd.io/v2",
        "HelmRelease",
        &ns,
        &csi,
        &labels,
        json!({"spec": common::flux::inert_spec("csi")}),
    );
    api.create(
        &PostParams::default(),
        &serde_json::from_value(born).unwrap(),
    )
    .await
    .expect("create a CSI release born with a parent's kind label");
    assert_refused(
        "DELETE of a CSI release born with a parent's kind label",
        api.delete(&csi, &dry()).await,
        &["CSI driver release", &format!("{ns}/{csi}")],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parents_kind_label_added_to_a_child_in_teardown_is_refused() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("childkind")).await;
    t.wait_custody().await;
    let m = mallory(&t).await;
    t.hold_in_teardown(&env.sim).await;
    let hrs: Api<DynamicObject> =
        Api::namespaced_with(m, &t.namespace, &common::gate::helmrelease_resource());
    let coredns = format!("{}-coredns", t.name);
    for labels in [
        json!({PARENT_KIND: "Kubernetes"}),
        json!({PARENT_KIND: "Kubernetes", PARENT_GROUP: "apps.cozystack.io"}),
    ] {
        assert_refused(
            &format!("{labels} on {coredns}"),
            hrs.patch(
                &coredns,
                &PatchParams::default(),
                &labels_patch(labels.clone()),
            )
            .await,
            &["relabel"],
        );
    }
    assert_refused(
        "DELETE of the child",
        hrs.delete(&coredns, &DeleteParams::default()).await,
        &["refusing to delete"],
    );
    finish(&t).await;
}

// ---------------------------------------------------------------------------
// 2. The admin kubeconfig rewritten to reach another cluster
// ---------------------------------------------------------------------------

/// Copies `from`'s admin kubeconfig into `into`'s Secret, as mallory.
async fn copy_kubeconfig(m: &kube::Client, from: &Tenant, into: &Tenant) {
    let text = std::fs::read(&from.cluster.kubeconfig).expect("kubeconfig");
    let patch = json!({"data": kubeconfig_data(&text)});
    Api::<Secret>::namespaced(m.clone(), &into.namespace)
        .patch(
            &common::profile().kubeconfig_secret_name(&into.name),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .expect(
            "the Secret's data may change (Kamaji rotates it); the worker checks where it leads",
        );
}

async fn restore_kubeconfig(t: &Tenant) {
    copy_kubeconfig(&t.management, t, t).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubeconfig_copied_from_another_tenant_blocks_and_the_other_tenants_claims_stay() {
    let env = env();
    // Tenant B shares the namespace: its kubeconfig is readable there.
    let a = Tenant::create(env.cp, &env.cp.unique("victim")).await;
    let b = Tenant::create(
        env.cp,
        TenantOptions::new(&env.cp.unique("bystander")).in_namespace(&a.namespace),
    )
    .await;
    for t in [&a, &b] {
        t.wait_custody().await;
        t.with_held_claims(&["data"]).await;
        t.wait_cluster_bound().await;
    }
    let m = mallory(&a).await;
    let a_volumes = env.sim.volumes_of(&a.namespace, &a.name);
    let b_volumes = env.sim.volumes_of(&b.namespace, &b.name);
    assert_eq!((a_volumes.len(), b_volumes.len()), (1, 1));
    copy_kubeconfig(&m, &b, &a).await;

    a.delete_parent().await;
    let record = a.wait_phase(Phase::Blocked, Duration::from_secs(60)).await;
    let message = record.message.unwrap_or_default();
    assert!(
        message.contains("different cluster") && message.contains("kube-system UID"),
        "{message}"
    );
    assert!(
        record.inventory.is_none(),
        "nothing was inventoried through the other cluster: {:?}",
        record.inventory
    );
    a.wait_event("Warning", "Blocked", |note| {
        note.contains("different cluster")
    })
    .await;
    // B was never touched: its claim and its disk are there.
    let claims: Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
        Api::namespaced(b.api.clone(), "apps");
    let claim = claims.get("data").await.expect("B's claim still exists");
    assert!(
        claim.metadata.deletion_timestamp.is_none(),
        "B's claim was not deleted"
    );
    assert_eq!(
        env.sim.volumes_of(&b.namespace, &b.name),
        b_volumes,
        "B's disk is on storage"
    );
    assert_eq!(
        env.sim.volumes_of(&a.namespace, &a.name),
        a_volumes,
        "A's disk is on storage, and A says so"
    );
    assert!(a.parent().await.is_some(), "A is still held");

    // With its own kubeconfig back, A's teardown finishes and frees A's disk only.
    restore_kubeconfig(&a).await;
    a.wait_parent_gone(Duration::from_secs(120)).await;
    assert!(env.sim.volumes_of(&a.namespace, &a.name).is_empty());
    assert_eq!(
        env.sim.volumes_of(&b.namespace, &b.name),
        b_volumes,
        "B keeps its disk"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubeconfig_swapped_while_blocked_does_not_turn_blocked_into_released() {
    let env = env();
    let a = Tenant::create(env.cp, &env.cp.unique("stuck")).await;
    let b = Tenant::create(
        env.cp,
        TenantOptions::new(&env.cp.unique("empty")).in_namespace(&a.namespace),
    )
    .await;
    a.wait_custody().await;
    a.with_held_claims(&["x", "y"]).await;
    a.wait_cluster_bound().await;
    b.wait_cluster_bound().await;
    let m = mallory(&a).await;
    a.set_driver(&env.sim, false).await;
    a.delete_parent().await;
    let blocked = a.wait_phase(Phase::Blocked, Duration::from_secs(60)).await;
    assert!(
        blocked.message.unwrap_or_default().contains("not freed"),
        "Blocked on the stopped driver first"
    );

    // B has none of A's PVs: through B, every one of them would look freed.
    copy_kubeconfig(&m, &b, &a).await;
    let record = a
        .history
        .next_record(
            "Blocked naming a different cluster",
            Duration::from_secs(60),
            |r| {
                r.phase == Some(Phase::Blocked)
                    && r.message
                        .as_deref()
                        .is_some_and(|m| m.contains("different cluster"))
            },
        )
        .await;
    assert_eq!(
        record.inventory.map(|i| (i.total, i.left())),
        Some((2, 2)),
        "the inventory still says both disks are left"
    );
    assert!(
        !a.history
            .all()
            .iter()
            .filter_map(|s| s.record())
            .any(|r| r.phase == Some(Phase::Released)),
        "never Released through another cluster"
    );
    assert_eq!(env.sim.volumes_of(&a.namespace, &a.name).len(), 2);

    restore_kubeconfig(&a).await;
    finish(&a).await;
}

// ---------------------------------------------------------------------------
// 3. Guards a relabel first made blind
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kcsi_controller_and_the_admin_kubeconfig_are_held_whatever_their_labels() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("blind")).await;
    t.wait_custody().await;
    let m = mallory(&t).await;
    // The tenant's kcsi controller, as its parent release made it (Flux's
    // labels and Helm's ownership annotations).
    let kcsi = format!("{}-kcsi-controller", t.name);
    let deployments: Api<DynamicObject> =
        Api::namespaced_with(m.clone(), &t.namespace, &deployment_resource());
    let secrets: Api<Secret> = Api::namespaced(m.clone(), &t.namespace);
    let kubeconfig = common::profile().kubeconfig_secret_name(&t.name);

    // Before the teardown: the labels the webhooks once selected on go.
    secrets
        .patch(
            &kubeconfig,
            &PatchParams::default(),
            &labels_patch(json!({KAMAJI: null})),
        )
        .await
        .expect("not an identity label");
    t.hold_in_teardown(&env.sim).await;
    // During it: the Deployment's Flux labels go too (Helm's annotations
    // still say whose it is, so it stays in its release: allowed).
    let flux_away = labels_patch(json!({FLUX: null, "helm.toolkit.fluxcd.io/namespace": null}));
    deployments
        .patch(&kcsi, &PatchParams::default(), &flux_away)
        .await
        .expect("still an object of its release");

    assert_refused(
        "DELETE of the unlabelled kcsi controller",
        deployments.delete(&kcsi, &DeleteParams::default()).await,
        &["CSI controller"],
    );
    assert_refused(
        "DELETE of the unlabelled admin kubeconfig",
        secrets.delete(&kubeconfig, &DeleteParams::default()).await,
        &["admin kubeconfig"],
    );
    finish(&t).await;
}

// ---------------------------------------------------------------------------
// 4. A guarded kind never recognised
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capi_cluster_of_any_name_labelled_for_the_tenant_is_held() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("extra")).await;
    t.wait_custody().await;
    let m = mallory(&t).await;
    let extra = format!("{}-extra", t.name);
    let cluster = json!({"apiVersion": "cluster.x-k8s.io/v1beta1", "kind": "Cluster",
        "metadata": {"name": extra, "namespace": t.namespace, "labels": {CAPI: t.name}}, "spec": {}});
    common::manifests::apply(&t.management, &cluster).await;
    t.hold_in_teardown(&env.sim).await;
    let clusters: Api<DynamicObject> = Api::namespaced_with(m, &t.namespace, &cluster_resource());
    let err = assert_refused(
        "DELETE of Cluster R-extra",
        clusters.delete(&extra, &DeleteParams::default()).await,
        &["Cluster API cluster"],
    );
    assert!(
        err.contains(&format!("tenant {} ", t.name)),
        "judged for the tenant its label names: {err}"
    );
    finish(&t).await;
}

// ---------------------------------------------------------------------------
// Coverage: every label combination on every guarded kind is reviewed
// ---------------------------------------------------------------------------

/// The labels that decide what an object is, or which webhook is sent it.
const KEYS: [&str; 6] = [CHILD, PARENT_KIND, PARENT_GROUP, CAPI, KAMAJI, FLUX];

/// Combination `bits` of [`KEYS`], with values naming tenant `r`.
fn combination(bits: usize, r: &str) -> BTreeMap<String, String> {
    let value = |k: &str| match k {
        PARENT_KIND => "Kubernetes".to_string(),
        PARENT_GROUP => "apps.cozystack.io".to_string(),
        KAMAJI => "admin-kubeconfig".to_string(),
        _ => r.to_string(),
    };
    KEYS.iter()
        .enumerate()
        .filter(|(i, _)| bits & (1 << i) != 0)
        .map(|(_, k)| (k.to_string(), value(k)))
        .collect()
}

fn object(
    api_version: &str,
    kind: &str,
    ns: &str,
    name: &str,
    labels: &BTreeMap<String, String>,
    body: Value,
) -> Value {
    let mut o = json!({"apiVersion": api_version, "kind": kind, "metadata": {"name": name, "namespace": ns, "labels": labels}});
    o.as_object_mut()
        .unwrap()
        .extend(body.as_object().unwrap().clone());
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_guarded_object_under_any_pair_of_identity_labels_is_reviewed_in_teardown() {
    let env = env();
    let client = env.cp.management_client().await;
    let ns = "tenant-coverage";
    env.cp.namespace(ns).await;
    let hr = common::gate::helmrelease_resource();
    let hrs: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &hr);
    // Every subset of at most two of the keys (each webhook's selection
    // turns on one key, or on two together), and all six: 23 combinations.
    let combos: Vec<usize> = (0..1usize << KEYS.len())
        .filter(|b| b.count_ones() <= 2 || b.count_ones() as usize == KEYS.len())
        .collect();

    // One tenant per combination (a parent release and nothing behind it:
    // the worker can never release it, so it stays in teardown, not done),
    // and every guarded object of it carrying that combination of labels.
    let mut expected: Vec<(ApiResource, String, String)> = Vec::new();
    for &bits in &combos {
        let r = format!("kubernetes-cover-{bits}");
        common::tenant::paper_parent(&hrs, &r).await;
        let l = combination(bits, &r);
        let mut with_child = l.clone();
        with_child.insert(CHILD.into(), r.clone());
        let mut with_capi = l.clone();
        with_capi.insert(CAPI.into(), r.clone());
        let hr_body = json!({"spec": common::flux::inert_spec("x")});
        let objects = [
            (
                hr.clone(),
                object(
                    "helm.toolkit.fluxcd.io/v2",
                    "HelmRelease",
                    ns,
                    &common::profile()
                        .csi_release_name(&r)
                        .expect("Cozystack has a CSI release"),
                    &l,
                    hr_body.clone(),
                ),
            ),
            (
                hr.clone(),
                object(
                    "helm.toolkit.fluxcd.io/v2",
                    "HelmRelease",
                    ns,
                    &format!("{r}-coredns"),
                    &with_child,
                    hr_body.clone(),
                ),
            ),
            (
                kcp_resource(),
                object(
                    "controlplane.cluster.x-k8s.io/v1alpha1",
                    "KamajiControlPlane",
                    ns,
                    &r,
                    &l,
                    json!({"spec": {}}),
                ),
            ),
            (
                tcp_resource(),
                object(
                    "kamaji.clastix.io/v1alpha1",
                    "TenantControlPlane",
                    ns,
                    &r,
                    &l,
                    json!({"spec": {}}),
                ),
            ),
            (
                cluster_resource(),
                object(
                    "cluster.x-k8s.io/v1beta1",
                    "Cluster",
                    ns,
                    &r,
                    &l,
                    json!({"spec": {}}),
                ),
            ),
            (
                cluster_resource(),
                object(
                    "cluster.x-k8s.io/v1beta1",
                    "Cluster",
                    ns,
                    &format!("{r}-extra"),
                    &with_capi,
                    json!({"spec": {}}),
                ),
            ),
            (
                resource(
                    "cluster.x-k8s.io",
                    "v1beta1",
                    "MachineDeployment",
                    "machinedeployments",
                ),
                object(
                    "cluster.x-k8s.io/v1beta1",
                    "MachineDeployment",
                    ns,
                    &format!("md-{bits}"),
                    &with_capi,
                    json!({"spec": common::capi::cozystack_machine_deployment_spec(&r, &format!("md-{bits}"))}),
                ),
            ),
            (
                resource("cluster.x-k8s.io", "v1beta1", "Machine", "machines"),
                object(
                    "cluster.x-k8s.io/v1beta1",
                    "Machine",
                    ns,
                    &format!("m-{bits}"),
                    &with_capi,
                    json!({"spec": common::capi::cozystack_machine_spec(&r, &format!("m-{bits}"))}),
                ),
            ),
            (
                resource("", "v1", "Secret", "secrets"),
                object(
                    "v1",
                    "Secret",
                    ns,
                    &common::profile().kubeconfig_secret_name(&r),
                    &l,
                    json!({"data": {}}),
                ),
            ),
            (
                deployment_resource(),
                object(
                    "apps/v1",
                    "Deployment",
                    ns,
                    &format!("{r}-kcsi-controller"),
                    &l,
                    json!({"spec": {
                    "replicas": 0, "selector": {"matchLabels": {"app": "kcsi"}},
                    "template": {"metadata": {"labels": {"app": "kcsi"}}, "spec": {"containers": [{"name": "c", "image": "kcsi"}]}}}}),
                ),
            ),
        ];
        for (ar, o) in objects {
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
            let name = o["metadata"]["name"].as_str().unwrap().to_string();
            api.create(&PostParams::default(), &serde_json::from_value(o).unwrap())
                .await
                .unwrap_or_else(|e| panic!("create {} {name}: {e}", ar.kind));
            expected.push((ar, name, r.clone()));
        }
    }
    // Every parent in teardown (in custody since its creation).
    for &bits in &combos {
        hrs.delete(
            &format!("kubernetes-cover-{bits}"),
            &DeleteParams::default(),
        )
        .await
        .expect("delete parent");
    }

    let mut unreviewed = Vec::new();
    for (ar, name, r) in &expected {
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, ar);
        match api.delete(name, &dry()).await {
            Err(kube::Error::Api(s))
                if s.message.contains("volume-gate")
                    && s.message.contains(&format!("tenant {r} ")) => {}
            other => unreviewed.push(format!(
                "{} {name}: {:?}",
                ar.kind,
                other.map(|_| "allowed")
            )),
        }
    }
    // And a relabel that strips or adds every identity label on a release
    // or a Cluster API object is refused as well.
    for bits in [0usize, (1 << KEYS.len()) - 1] {
        let r = format!("kubernetes-cover-{bits}");
        for (ar, name) in [
            (hr.clone(), format!("{r}-coredns")),
            (cluster_resource(), format!("{r}-extra")),
        ] {
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
            for labels in [
                json!({CHILD: null, CAPI: null}),
                json!({PARENT_KIND: "Kubernetes", PARENT_GROUP: null, CAPI: "kubernetes-nobody"}),
            ] {
                let pp = PatchParams {
                    dry_run: true,
                    ..Default::default()
                };
                match api.patch(&name, &pp, &labels_patch(labels.clone())).await {
                    Err(kube::Error::Api(s))
                        if s.message.contains("volume-gate")
                            && s.message.contains("refusing to relabel") => {}
                    other => unreviewed.push(format!(
                        "relabel {} {name} with {labels}: {:?}",
                        ar.kind,
                        other.map(|_| "allowed")
                    )),
                }
            }
        }
    }
    assert!(
        unreviewed.is_empty(),
        "{} of {} guarded objects (and relabels) were not refused by the gate in teardown:\n{}",
        unreviewed.len(),
        expected.len(),
        unreviewed.join("\n")
    );
}

// ---------------------------------------------------------------------------
// Everything the driver needs: the objects of the parent release
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_parent_releases_objects_are_held_in_teardown_and_none_can_be_taken_out_of_it() {
    // The KubeVirt CSI controller's identity is a template of the parent
    // release: Helm's uninstall would delete it while the Deployment, held,
    // stays, and the driver could then free no disk.
    let env = env();
    let client = env.cp.management_client().await;
    let ns = "tenant-identity";
    let r = "kubernetes-identity";
    env.cp.namespace(ns).await;
    let hrs: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), ns, &common::gate::helmrelease_resource());
    common::tenant::paper_parent(&hrs, r).await;
    let owned = json!({"meta.helm.sh/release-name": r, "meta.helm.sh/release-namespace": ns});
    let kcsi = format!("{r}-kcsi");
    let rbac = "rbac.authorization.k8s.io/v1";
    let objects: Vec<(ApiResource, bool, Value)> = vec![
        (
            resource("", "v1", "ServiceAccount", "serviceaccounts"),
            true,
            json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": kcsi}}),
        ),
        (
            resource("rbac.authorization.k8s.io", "v1", "Role", "roles"),
            true,
            json!({"apiVersion": rbac, "kind": "Role", "metadata": {"name": kcsi},
            "rules": [{"apiGroups": ["cdi.kubevirt.io"], "resources": ["datavolumes"], "verbs": ["get", "create", "delete"]}]}),
        ),
        (
            resource(
                "rbac.authorization.k8s.io",
                "v1",
                "RoleBinding",
                "rolebindings",
            ),
            true,
            json!({"apiVersion": rbac, "kind": "RoleBinding", "metadata": {"name": kcsi},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": kcsi},
            "subjects": [{"kind": "ServiceAccount", "name": kcsi, "namespace": ns}]}),
        ),
        (
            resource(
                "rbac.authorization.k8s.io",
                "v1",
                "ClusterRole",
                "clusterroles",
            ),
            false,
            json!({"apiVersion": rbac, "kind": "ClusterRole", "metadata": {"name": kcsi},
            "rules": [{"apiGroups": [""], "resources": ["persistentvolumes"], "verbs": ["get"]}]}),
        ),
        (
            resource(
                "rbac.authorization.k8s.io",
                "v1",
                "ClusterRoleBinding",
                "clusterrolebindings",
            ),
            false,
            json!({"apiVersion": rbac, "kind": "ClusterRoleBinding", "metadata": {"name": format!("{kcsi}-binding")},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": kcsi},
            "subjects": [{"kind": "ServiceAccount", "name": kcsi, "namespace": ns}]}),
        ),
        (
            resource("", "v1", "ConfigMap", "configmaps"),
            true,
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "driver-config"}, "data": {"k": "v"}}),
        ),
    ];
    let api_for = |ar: &ApiResource, namespaced: bool| -> Api<DynamicObject> {
        if namespaced {
            Api::namespaced_with(client.clone(), ns, ar)
        } else {
            Api::all_with(client.clone(), ar)
        }
    };
    for (ar, namespaced, doc) in &objects {
        let mut doc = doc.clone();
        doc["metadata"]["annotations"] = owned.clone();
        doc["metadata"]["labels"] = json!({"app.kubernetes.io/managed-by": "Helm"});
        api_for(ar, *namespaced)
            .create(
                &PostParams::default(),
                &serde_json::from_value(doc).unwrap(),
            )
            .await
            .expect("create a release object");
    }
    // Outside teardown they go as usual (an upgrade may drop a template).
    let cm = api_for(&objects[5].0, true);
    cm.delete("driver-config", &dry())
        .await
        .expect("a release object may be deleted outside teardown");

    hrs.delete(r, &DeleteParams::default())
        .await
        .expect("delete the parent");
    let mut let_through = Vec::new();
    for (ar, namespaced, doc) in &objects {
        let name = doc["metadata"]["name"].as_str().unwrap();
        let api = api_for(ar, *namespaced);
        match api.delete(name, &DeleteParams::default()).await {
            // The CSI controller's identity is held by its name first.
            Err(kube::Error::Api(s))
                if s.message.contains("volume-gate")
                    && s.message.contains(&format!("tenant {r} "))
                    && (s.message.contains("parent release")
                        || s.message.contains(
                            "the identity the tenant's CSI controller frees disks with",
                        )) => {}
            other => let_through.push(format!(
                "DELETE {} {name}: {:?}",
                ar.kind,
                other.map(|_| "allowed")
            )),
        }
        // Taking it out of the release first is refused the same way.
        let away = Patch::Merge(
            json!({"metadata": {"annotations": {"meta.helm.sh/release-name": null, "meta.helm.sh/release-namespace": null}}}),
        );
        match api.patch(name, &PatchParams::default(), &away).await {
            Err(kube::Error::Api(s))
                if s.message.contains("volume-gate")
                    && s.message.contains("refusing to relabel") => {}
            other => let_through.push(format!(
                "un-annotate {} {name}: {:?}",
                ar.kind,
                other.map(|_| "allowed")
            )),
        }
    }
    assert!(
        let_through.is_empty(),
        "objects of the parent release not held in teardown:\n{}",
        let_through.join("\n")
    );
}
