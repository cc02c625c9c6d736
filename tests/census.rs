//! The census of the platform's writers (`docs/census.md`): every row of
//! its table walked on the real API server with the shipped webhook
//! configurations, as the identity the row names (Cozystack v1.6.2's,
//! `tests/testkit/src/cozystack.rs`), making the write the row describes.
//! A row with no case, a case with no row, or an answer other than the
//! table's fails the test, after every row is walked.
//!
//! "Held" rows are walked in both halves: refused with the gate's message
//! while tenant `d` is being deleted with its volumes not released, then
//! allowed once they are (its teardown, which makes the same writes, runs
//! to its end). Writes that change a live tenant are sent as dry runs:
//! admission judges a dry run as it judges the write, and nothing changes.

use volume_gate_testkit as common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::cozystack;
use common::tenant::{Tenant, datavolume_resource, kcp_resource, resource, tcp_resource};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use volume_gate::record::Phase;

fn env() -> &'static common::Env {
    common::env(common::EnvConfig {
        flux: common::flux::FluxConfig::cozystack(),
        ..common::EnvConfig::gated()
    })
}

fn hrs(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &common::gate::helmrelease_resource())
}

fn dry_delete() -> DeleteParams {
    DeleteParams {
        dry_run: true,
        ..Default::default()
    }
}

fn dry_patch() -> PatchParams {
    PatchParams::default().dry_run()
}

fn dry_post() -> PostParams {
    PostParams {
        dry_run: true,
        ..Default::default()
    }
}

fn merge(v: Value) -> Patch<Value> {
    Patch::Merge(v)
}

/// A client acting as `username` (a ServiceAccount's, or a hook's), in
/// the groups Kubernetes gives a ServiceAccount: impersonated by the
/// cluster's admin, and bound to cluster-admin. What is walked is the
/// gate's answer; Cozystack's own RBAC is Cozystack's to keep right.
async fn as_user(cp: &common::cluster::ControlPlane, username: &str) -> kube::Client {
    let admin = cp.management_client().await;
    let binding = format!(
        "census-{}",
        username
            .replace(':', "-")
            .trim_start_matches("system-serviceaccount-")
    );
    common::manifests::apply(
        &admin,
        &json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": binding},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": username}]}),
    )
    .await;
    let namespace = username.split(':').nth(2).unwrap_or("default");
    let group = format!("system:serviceaccounts:{namespace}");
    cp.client_as(
        username,
        &["system:serviceaccounts", &group, "system:authenticated"],
    )
    .await
}

/// The ids of the table between the `census` markers of `docs/census.md`.
fn table_ids() -> Vec<String> {
    let doc = std::fs::read_to_string(common::cluster::repo_root().join("docs/census.md"))
        .expect("docs/census.md");
    let body = doc
        .split_once("<!-- census:begin -->")
        .and_then(|(_, rest)| rest.split_once("<!-- census:end -->"))
        .map(|(table, _)| table)
        .expect("the census table between its markers");
    body.lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .map(|l| l.split('`').next().unwrap_or_default().to_string())
        .collect()
}

#[derive(Default)]
struct Census {
    results: BTreeMap<String, Result<(), String>>,
    /// The held rows, whose second half is `d`'s teardown ending.
    held: BTreeSet<String>,
}

impl Census {
    fn record(&mut self, id: &str, result: Result<(), String>) {
        let previous = self.results.insert(id.to_string(), result);
        assert!(previous.is_none(), "row {id} walked twice");
    }

    /// Every request of the row was allowed.
    fn allowed<T>(&mut self, id: &str, results: Vec<Result<T, kube::Error>>) {
        let failed: Vec<String> = results
            .into_iter()
            .filter_map(|r| r.err().map(|e| e.to_string()))
            .collect();
        self.record(
            id,
            if failed.is_empty() {
                Ok(())
            } else {
                Err(format!("refused: {failed:?}"))
            },
        );
    }

    /// The first half of a held row: every request refused by the gate,
    /// naming the tenant.
    fn held<T>(&mut self, id: &str, tenant: &str, results: Vec<Result<T, kube::Error>>) {
        let wrong: Vec<String> = results
            .into_iter()
            .filter_map(|r| match r {
                Err(kube::Error::Api(s))
                    if s.message.contains("volume-gate") && s.message.contains(tenant) =>
                {
                    None
                }
                Err(e) => Some(format!("refused, but not by the gate for {tenant}: {e}")),
                Ok(_) => Some("allowed while the volumes are not released".into()),
            })
            .collect();
        self.held.insert(id.to_string());
        self.record(
            id,
            if wrong.is_empty() {
                Ok(())
            } else {
                Err(wrong.join("; "))
            },
        );
    }

    /// The second half of every held row: the teardown that makes those
    /// writes went through once the volumes were released.
    fn then_allowed(&mut self, teardown: Result<(), String>) {
        for id in &self.held {
            if let (Some(Ok(())), Err(e)) = (self.results.get(id), &teardown) {
                self.results
                    .insert(id.clone(), Err(format!("not allowed after Released: {e}")));
            }
        }
    }

    fn finish(self) {
        let table = table_ids();
        let rows: BTreeSet<&String> = table.iter().collect();
        assert_eq!(rows.len(), table.len(), "the table repeats an id");
        let walked: BTreeSet<&String> = self.results.keys().collect();
        let mut problems: Vec<String> = Vec::new();
        for id in rows.difference(&walked) {
            problems.push(format!("{id}: a row of docs/census.md with no case here"));
        }
        for id in walked.difference(&rows) {
            problems.push(format!("{id}: a case with no row in docs/census.md"));
        }
        for (id, r) in &self.results {
            if let Err(e) = r {
                problems.push(format!("{id}: {e}"));
            }
        }
        assert!(
            problems.is_empty(),
            "{} of {} rows are wrong:\n{}",
            problems.len(),
            table.len(),
            problems.join("\n")
        );
    }
}

/// A parent as cozystack-api rebuilds it from its Application on an
/// update (`pkg/registry/apps/application/rest.go`: Update and
/// `convertApplicationToHelmRelease`): the stored resourceVersion and shard
/// label kept, its labels the application's, its annotations only those
/// prefixed `apps.cozystack.io-`, no finalizer, the spec from the
/// ApplicationDefinition and the Application.
fn rebuilt_by_cozystack_api(stored: &DynamicObject) -> DynamicObject {
    let mut o = stored.clone();
    let m = &mut o.metadata;
    m.finalizers = None;
    m.owner_references = None;
    m.managed_fields = None;
    m.annotations = m.annotations.take().map(|a| {
        a.into_iter()
            .filter(|(k, _)| k.starts_with("apps.cozystack.io-"))
            .collect()
    });
    o.data["status"] = Value::Null;
    o
}

/// `writer`'s dry-run replacement of HelmRelease `name`, made by `change`
/// from a fresh read, again on a conflict: the worker, Flux and the
/// mutating webhook write a parent too, and a controller replacing it reads
/// it anew on its next reconcile. Returns the stored object it started from
/// with the answer.
async fn replace_fresh(
    admin: &Api<DynamicObject>,
    writer: &Api<DynamicObject>,
    name: &str,
    change: impl Fn(&DynamicObject) -> DynamicObject,
) -> (DynamicObject, Result<DynamicObject, kube::Error>) {
    let mut last = None;
    for _ in 0..10 {
        let stored = admin.get(name).await.unwrap();
        let answer = writer.replace(name, &dry_post(), &change(&stored)).await;
        let conflict = matches!(&answer, Err(kube::Error::Api(s)) if s.code == 409);
        last = Some((stored, answer));
        if !conflict {
            break;
        }
    }
    last.expect("tried")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_writer_of_the_platform_gets_the_answer_the_census_states() {
    let env = env();
    let cp = env.cp;
    let admin = cp.management_client().await;
    let l = Tenant::create(cp, &cp.unique("census-live")).await;
    let d = Tenant::create(cp, &cp.unique("census-deleted")).await;
    for t in [&l, &d] {
        t.wait_custody().await;
        t.wait_cluster_bound().await;
    }
    l.with_held_claims(&["data"]).await;
    // d in teardown with its volumes not released: its driver stopped.
    d.hold_in_teardown(&env.sim).await;
    let (lr, ln, dr, dn) = (
        l.name.clone(),
        l.namespace.clone(),
        d.name.clone(),
        d.namespace.clone(),
    );
    let mut c = Census::default();

    let flux = as_user(cp, &cozystack::FLUX.username()).await;
    let controller = as_user(cp, &cozystack::COZYSTACK_CONTROLLER.username()).await;
    let api = as_user(cp, &cozystack::COZYSTACK_API.username()).await;
    let operator = as_user(cp, &cozystack::COZYSTACK_OPERATOR.username()).await;
    let shards = as_user(cp, &cozystack::FLUX_SHARD_OPERATOR.username()).await;
    let plunger = as_user(cp, &cozystack::FLUX_PLUNGER.username()).await;
    let migrations = as_user(cp, &cozystack::MIGRATION_HOOK.username()).await;
    let kamaji = as_user(cp, &cozystack::KAMAJI.username()).await;
    let capi_kamaji = as_user(cp, &cozystack::CAPI_KAMAJI.username()).await;
    let capi = as_user(cp, &cozystack::CAPI.username()).await;
    let cdi = as_user(cp, &cozystack::CDI.username()).await;
    let kubevirt = as_user(cp, &cozystack::KUBEVIRT.username()).await;
    let tenant_cleanup = as_user(
        cp,
        &format!("system:serviceaccount:cozy-system:{ln}-cleanup"),
    )
    .await;
    let hook = as_user(cp, &format!("system:serviceaccount:{dn}:{dr}-cleanup")).await;
    let namespaces = as_user(cp, volume_gate::admission::gate::NAMESPACE_CONTROLLER).await;
    let collector = as_user(
        cp,
        "system:serviceaccount:kube-system:generic-garbage-collector",
    )
    .await;
    let lcsi = format!("{lr}-csi");
    let upgraded_csi = format!("{}-v2-kubevirt-csi-node", cozystack::PARENT_ARTIFACT);

    // ---- Flux's helm-controller ----
    let parent = hrs(&admin, &ln).get(&lr).await.unwrap();
    let status =
        json!({"status": {"observedGeneration": parent.data["status"]["observedGeneration"]}});
    c.allowed(
        "flux.status",
        vec![
            hrs(&flux, &ln)
                .patch_status(&lr, &dry_patch(), &merge(status.clone()))
                .await,
            hrs(&flux, &ln)
                .patch_status(&lcsi, &dry_patch(), &merge(status))
                .await,
        ],
    );
    c.allowed(
        "flux.apply-children",
        vec![
            hrs(&flux, &ln)
                .patch(
                    &lcsi,
                    &dry_patch(),
                    &merge(json!({"spec": {"values": {"upgraded": true}}})),
                )
                .await,
        ],
    );
    c.allowed(
        "flux.move-child-source",
        vec![
            hrs(&flux, &ln)
                .patch(
                    &lcsi,
                    &dry_patch(),
                    &merge(json!({"spec": {"chartRef": {"name": upgraded_csi}}})),
                )
                .await,
        ],
    );
    let cilium = hrs(&admin, &ln).get(&format!("{lr}-cilium")).await.unwrap();
    let at = cilium
        .metadata
        .finalizers
        .as_ref()
        .and_then(|f| f.iter().position(|f| f == common::flux::FLUX_FINALIZER))
        .expect("Flux's finalizer");
    c.allowed(
        "flux.finalizer",
        vec![
            hrs(&flux, &ln)
                .patch(
                    &format!("{lr}-cilium"),
                    &dry_patch(),
                    &Patch::<Value>::Json(
                        serde_json::from_value(json!([
                            {"op": "remove", "path": format!("/metadata/finalizers/{at}")}
                        ]))
                        .unwrap(),
                    ),
                )
                .await,
        ],
    );
    c.held(
        "flux.uninstall",
        &dr,
        vec![
            Api::<Deployment>::namespaced(flux.clone(), &dn)
                .delete(&format!("{dr}-kcsi-controller"), &dry_delete())
                .await
                .map(drop),
            Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(flux.clone(), &dn)
                .delete(&format!("{dr}-kcsi"), &dry_delete())
                .await
                .map(drop),
        ],
    );

    // ---- cozystack-controller ----
    let (_, moved) = replace_fresh(&hrs(&admin, &ln), &hrs(&controller, &ln), &lr, |stored| {
        let mut moved = stored.clone();
        moved.data["spec"]["chartRef"]["name"] =
            json!(format!("{}-v2", cozystack::PARENT_ARTIFACT));
        moved.data["spec"]["valuesFrom"] = json!([{"kind": "Secret", "name": "cozystack-values"}]);
        moved
            .metadata
            .labels
            .get_or_insert_with(Default::default)
            .insert("sharding.fluxcd.io/key".into(), "tenants".into());
        moved
    })
    .await;
    c.allowed("cozystack-controller.source", vec![moved]);
    // A parent as it was before v1.0: its chart from a HelmRepository.
    let legacy_ns = cp.unique("census-legacy");
    cp.namespace(&legacy_ns).await;
    let legacy = format!("kubernetes-{}", cp.unique("legacy"));
    let mut old =
        DynamicObject::new(&legacy, &common::gate::helmrelease_resource()).within(&legacy_ns);
    old.metadata.labels = Some(common::tenant::parent_labels(&legacy));
    old.data = json!({"spec": {"interval": "5m", "suspend": true,
        "chart": {"spec": {"chart": "kubernetes", "version": "0.41.9",
            "sourceRef": {"kind": "HelmRepository", "name": "cozystack-apps", "namespace": "cozy-public"}}}}});
    hrs(&admin, &legacy_ns)
        .create(&PostParams::default(), &old)
        .await
        .expect("a pre-v1 parent");
    let (_, migrated) = replace_fresh(
        &hrs(&admin, &legacy_ns),
        &hrs(&controller, &legacy_ns),
        &legacy,
        |stored| {
            let mut next = stored.clone();
            next.data["spec"]["chart"] = Value::Null;
            next.data["spec"]["chartRef"] = json!({"kind": "ExternalArtifact",
                "name": cozystack::PARENT_ARTIFACT, "namespace": cozystack::ARTIFACT_NAMESPACE});
            next
        },
    )
    .await;
    c.allowed("cozystack-controller.v1-migration", vec![migrated]);

    // ---- cozystack-api ----
    let mut created = DynamicObject::new(
        &format!("kubernetes-{}", cp.unique("new")),
        &common::gate::helmrelease_resource(),
    )
    .within(&ln);
    created.metadata.labels = Some(common::tenant::parent_labels(
        created.metadata.name.as_ref().unwrap(),
    ));
    created.data = json!({"spec": {"interval": "5m", "suspend": true,
        "chartRef": {"kind": "ExternalArtifact", "name": cozystack::PARENT_ARTIFACT,
                     "namespace": cozystack::ARTIFACT_NAMESPACE}}});
    let made = hrs(&api, &ln).create(&dry_post(), &created).await;
    let custody = common::profile().custody_finalizer;
    let made = made.and_then(|o| {
        if o.metadata.finalizers.unwrap_or_default().contains(&custody) {
            Ok(())
        } else {
            Err(kube::Error::Service(
                "created without the custody finalizer".into(),
            ))
        }
    });
    c.allowed("cozystack-api.create", vec![made]);
    let (stored, replaced) = replace_fresh(
        &hrs(&admin, &ln),
        &hrs(&api, &ln),
        &lr,
        rebuilt_by_cozystack_api,
    )
    .await;
    let replaced = replaced.and_then(|o| {
        let keys = common::keys();
        let kept = o
            .metadata
            .finalizers
            .clone()
            .unwrap_or_default()
            .contains(&custody)
            && o.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(&keys.cluster))
                == stored
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(&keys.cluster));
        if kept {
            Ok(())
        } else {
            Err(kube::Error::Service(
                format!("custody or the record not carried over: {:?}", o.metadata).into(),
            ))
        }
    });
    c.allowed("cozystack-api.update", vec![replaced]);
    c.allowed(
        "cozystack-api.delete",
        vec![hrs(&api, &ln).delete(&lr, &dry_delete()).await.map(drop)],
    );

    // ---- the Package operator, Flux's shards and plunger, migrations ----
    let system = cp.unique("census-system");
    let mut release =
        DynamicObject::new(&system, &common::gate::helmrelease_resource()).within("cozy-system");
    release.metadata.labels = Some(BTreeMap::from([(
        "cozystack.io/package".to_string(),
        "cozystack.census".to_string(),
    )]));
    release.data = json!({"spec": {"interval": "5m", "suspend": true, "releaseName": system,
        "chartRef": {"kind": "ExternalArtifact", "name": "cozystack-census-default-x", "namespace": "cozy-system"}}});
    cp.namespace("cozy-system").await;
    let r1 = hrs(&operator, "cozy-system")
        .create(&PostParams::default(), &release)
        .await
        .map(drop);
    let r2 = hrs(&operator, "cozy-system")
        .patch(
            &system,
            &PatchParams::default(),
            &merge(json!({"spec": {"chartRef": {"name": "cozystack-census-default-y"}}})),
        )
        .await
        .map(drop);
    let r3 = hrs(&operator, "cozy-system")
        .delete(&system, &DeleteParams::default())
        .await
        .map(drop);
    c.allowed("cozystack-operator.system-release", vec![r1, r2, r3]);
    let shard = merge(json!({"metadata": {"labels": {"sharding.fluxcd.io/key": "shard3"}}}));
    c.allowed(
        "flux-shard-operator.relabel",
        vec![
            hrs(&shards, &ln).patch(&lr, &dry_patch(), &shard).await,
            hrs(&shards, &ln).patch(&lcsi, &dry_patch(), &shard).await,
        ],
    );
    c.allowed(
        "flux-plunger.suspend",
        vec![
            hrs(&plunger, &ln)
                .patch(
                    &lcsi,
                    &dry_patch(),
                    &merge(json!({"metadata": {"annotations": {"flux-plunger.cozystack.io/last-processed-version": "3"}},
                                  "spec": {"suspend": true}})),
                )
                .await,
        ],
    );
    c.allowed(
        "migrations.annotate-release-objects",
        vec![
            Api::<DynamicObject>::namespaced_with(migrations.clone(), &ln, &kcp_resource())
                .patch(
                    &lr,
                    &dry_patch(),
                    &merge(
                        json!({"metadata": {"annotations": {"helm.sh/resource-policy": "keep"}}}),
                    ),
                )
                .await,
        ],
    );

    // ---- Kamaji and Cluster API ----
    let kubeconfig = common::profile().kubeconfig_secret_name(&lr);
    let secret = Api::<Secret>::namespaced(admin.clone(), &ln)
        .get(&kubeconfig)
        .await
        .unwrap();
    c.allowed(
        "kamaji.kubeconfig",
        vec![
            Api::<Secret>::namespaced(kamaji.clone(), &ln)
                .patch(
                    &kubeconfig,
                    &dry_patch(),
                    &merge(json!({"data": secret.data})),
                )
                .await,
        ],
    );
    let tcps = |c: &kube::Client, ns: &str| {
        Api::<DynamicObject>::namespaced_with(c.clone(), ns, &tcp_resource())
    };
    c.allowed(
        "kamaji.control-plane-status",
        vec![
            tcps(&kamaji, &ln)
                .patch_status(
                    &lr,
                    &dry_patch(),
                    &merge(json!({"status": {"kubernetesResources": {"version": {"status": "Ready"}}}})),
                )
                .await,
        ],
    );
    c.allowed(
        "capi-kamaji.control-plane",
        vec![
            tcps(&capi_kamaji, &ln)
                .patch(
                    &lr,
                    &dry_patch(),
                    &merge(
                        json!({"metadata": {"labels": {"cluster.x-k8s.io/role": "control-plane"}}}),
                    ),
                )
                .await,
        ],
    );
    let mds = |c: &kube::Client, ns: &str| {
        Api::<DynamicObject>::namespaced_with(
            c.clone(),
            ns,
            &resource(
                "cluster.x-k8s.io",
                "v1beta1",
                "MachineDeployment",
                "machinedeployments",
            ),
        )
    };
    let machines = |c: &kube::Client, ns: &str| {
        Api::<DynamicObject>::namespaced_with(
            c.clone(),
            ns,
            &resource("cluster.x-k8s.io", "v1beta1", "Machine", "machines"),
        )
    };
    c.allowed(
        "capi.machines",
        vec![
            mds(&capi, &ln)
                .patch(
                    &format!("{lr}-md0"),
                    &dry_patch(),
                    &merge(json!({"metadata": {"annotations": {"cluster.x-k8s.io/revision": "2"},
                                               "finalizers": ["cluster.x-k8s.io/machinedeployment"]}})),
                )
                .await,
        ],
    );
    let machine = format!("{lr}-md0-census");
    let mut m = DynamicObject::new(
        &machine,
        &resource("cluster.x-k8s.io", "v1beta1", "Machine", "machines"),
    )
    .within(&ln);
    m.metadata.labels = Some(BTreeMap::from([(
        "cluster.x-k8s.io/cluster-name".to_string(),
        lr.clone(),
    )]));
    m.data = json!({"spec": common::capi::cozystack_machine_spec(&lr, &machine)});
    machines(&admin, &ln)
        .create(&PostParams::default(), &m)
        .await
        .expect("a worker Machine of the live tenant");
    c.allowed(
        "capi.scale-down",
        vec![
            machines(&capi, &ln)
                .delete(&machine, &dry_delete())
                .await
                .map(drop),
        ],
    );
    c.held(
        "capi.cluster-deletion",
        &dr,
        vec![
            mds(&capi, &dn)
                .delete(&format!("{dr}-md0"), &dry_delete())
                .await
                .map(drop),
        ],
    );

    // ---- CDI, KubeVirt, the lineage webhook ----
    let disks = l.infra_objects(None).await.datavolumes;
    let dv = disks
        .first()
        .expect("a DataVolume of the live tenant")
        .clone();
    let annotate = merge(
        json!({"metadata": {"annotations": {"cdi.kubevirt.io/storage.pod.phase": "Succeeded"}}}),
    );
    c.allowed(
        "cdi.disks",
        vec![
            Api::<DynamicObject>::namespaced_with(cdi.clone(), &ln, &datavolume_resource())
                .patch(&dv, &dry_patch(), &annotate)
                .await
                .map(drop),
            Api::<k8s_openapi::api::core::v1::PersistentVolumeClaim>::namespaced(cdi.clone(), &ln)
                .patch(&dv, &dry_patch(), &annotate)
                .await
                .map(drop),
        ],
    );
    let mut hotplug = Pod::default();
    hotplug.metadata.name = Some(cp.unique("hp-volume"));
    hotplug.spec = Some(k8s_openapi::api::core::v1::PodSpec {
        containers: vec![k8s_openapi::api::core::v1::Container {
            name: "hotplug".into(),
            image: Some("quay.io/kubevirt/virt-launcher".into()),
            ..Default::default()
        }],
        ..Default::default()
    });
    let pods = Api::<Pod>::namespaced(kubevirt.clone(), &ln);
    c.allowed(
        "kubevirt.hotplug",
        vec![pods.create(&dry_post(), &hotplug).await.map(drop)],
    );
    let lineage = merge(json!({"metadata": {"labels": {
        "internal.cozystack.io/managed-by-cozystack": "true",
        "apps.cozystack.io/application.group": "apps.cozystack.io",
        "apps.cozystack.io/application.kind": "Kubernetes",
        "apps.cozystack.io/application.name": lr.trim_start_matches("kubernetes-"),
        "internal.cozystack.io/tenantresource": "false"}}}));
    c.allowed(
        "lineage.labels",
        vec![
            Api::<Secret>::namespaced(kamaji.clone(), &ln)
                .patch(&kubeconfig, &dry_patch(), &lineage)
                .await
                .map(drop),
        ],
    );

    // ---- the hooks, the namespace controller, the garbage collector ----
    c.allowed(
        "tenant-cleanup.applications",
        vec![
            hrs(&tenant_cleanup, &ln)
                .delete(&lr, &dry_delete())
                .await
                .map(drop),
        ],
    );
    let children: Vec<String> = hrs(&admin, &dn)
        .list(&ListParams::default().labels(&format!("cozystack.io/target-cluster-name={dr}")))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|h| h.metadata.name)
        .collect();
    assert!(children.contains(&format!("{dr}-csi")), "{children:?}");
    let mut suspended = Vec::new();
    for child in &children {
        suspended.push(
            hrs(&hook, &dn)
                .patch(
                    child,
                    &dry_patch(),
                    &merge(json!({"spec": {"suspend": true}})),
                )
                .await
                .map(drop),
        );
    }
    c.allowed("kubernetes-cleanup.suspend", suspended);
    let mut deleted = Vec::new();
    for child in &children {
        deleted.push(hrs(&hook, &dn).delete(child, &dry_delete()).await.map(drop));
    }
    c.held("kubernetes-cleanup.children", &dr, deleted);
    c.held(
        "kubernetes-cleanup.control-plane",
        &dr,
        vec![
            Api::<DynamicObject>::namespaced_with(hook.clone(), &dn, &kcp_resource())
                .delete(&dr, &dry_delete())
                .await
                .map(drop),
            tcps(&hook, &dn).delete(&dr, &dry_delete()).await.map(drop),
        ],
    );
    let d_disks = d.infra_objects(None).await.datavolumes;
    let mut freed = Vec::new();
    for disk in &d_disks {
        freed.push(
            Api::<DynamicObject>::namespaced_with(hook.clone(), &dn, &datavolume_resource())
                .delete(disk, &dry_delete())
                .await
                .map(drop),
        );
    }
    c.allowed("kubernetes-cleanup.datavolumes", freed);
    // The namespace controller: what the driver needs held, the rest not.
    let cm = ConfigMap {
        metadata: kube::api::ObjectMeta {
            name: Some(cp.unique("census-unrelated")),
            ..Default::default()
        },
        ..Default::default()
    };
    let cm = Api::<ConfigMap>::namespaced(admin.clone(), &dn)
        .create(&PostParams::default(), &cm)
        .await
        .expect("an unrelated ConfigMap");
    let unrelated = Api::<ConfigMap>::namespaced(namespaces.clone(), &dn)
        .delete(cm.metadata.name.as_deref().unwrap(), &dry_delete())
        .await;
    let held = hrs(&namespaces, &dn)
        .delete(&format!("{dr}-csi"), &dry_delete())
        .await
        .map(drop);
    c.held("namespace-controller.namespace", &dr, vec![held]);
    if let Err(e) = unrelated {
        c.results.insert(
            "namespace-controller.namespace".into(),
            Err(format!("an unrelated ConfigMap was refused: {e}")),
        );
    }
    c.held(
        "garbage-collector.control-plane",
        &dr,
        vec![
            Api::<Secret>::namespaced(collector.clone(), &dn)
                .delete(
                    &common::profile().kubeconfig_secret_name(&dr),
                    &dry_delete(),
                )
                .await
                .map(drop),
        ],
    );

    // The second half of every held row: with its driver back, d's volumes
    // are released, and the teardown that makes those writes (Flux's
    // uninstall, its hook, Cluster API's and Kubernetes' cascade) goes on
    // to its end, with no volume left.
    d.set_driver(&env.sim, true).await;
    let teardown = async {
        d.wait_phase(Phase::Released, Duration::from_secs(240))
            .await;
        d.wait_parent_gone(Duration::from_secs(240)).await;
        let left = env.sim.volumes_of(&dn, &dr);
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("volumes left on storage: {left:?}"))
        }
    }
    .await;
    c.then_allowed(teardown);
    c.finish();
}

/// A condition of a Cluster API v1beta1 object is `True`.
fn condition_true(o: &DynamicObject, kind: &str) -> bool {
    o.data["status"]["conditions"].as_array().is_some_and(|cs| {
        cs.iter()
            .any(|c| c["type"] == kind && c["status"] == "True")
    })
}

/// `capi.scale-down` made by Cluster API itself, not impersonated: an
/// operator scales a live tenant's node group to 0 (`kubectl scale
/// machinedeployment`, the scale subresource); Cluster API's own
/// controllers (v1.10.1) then delete the Machine, drain its node through
/// the tenant's API (the Pod holding a claim evicted), wait for its volume
/// to detach, delete its KubevirtMachine (the VM goes) and its Node. The
/// gate refuses none of it, and a node going frees no disk: the claim's
/// volume stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_api_drains_the_node_of_a_scaled_down_live_tenant_and_the_gate_refuses_none_of_it()
{
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::Node;
    use k8s_openapi::api::storage::v1::VolumeAttachment;
    use kube::runtime::{WatchStreamExt, watcher};
    let env = env();
    let cp = env.cp;
    let t = Tenant::create(cp, &cp.unique("scaled")).await;
    t.wait_custody().await;
    t.with_held_claims(&["data"]).await;
    let disks = env.sim.volumes_of(&t.namespace, &t.name);
    assert_eq!(disks.len(), 1, "{disks:?}");
    // Cluster API knows the Machine's node (its cluster cache connected:
    // `Running`, with a nodeRef), as it must to drain it.
    let machine = common::wait::eventually(
        "the tenant's Machine Running",
        Duration::from_secs(120),
        || async {
            match t.machines().await.as_slice() {
                [(name, phase, _)] if phase == "Running" => Ok(name.clone()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let attached: Vec<String> = Api::<VolumeAttachment>::all(t.api.clone())
        .list(&ListParams::default())
        .await
        .expect("list the tenant's VolumeAttachments")
        .items
        .into_iter()
        .filter(|va| va.status.as_ref().is_some_and(|s| s.attached))
        .filter_map(|va| va.metadata.name)
        .collect();
    assert_eq!(
        attached.len(),
        1,
        "the claim's volume is attached to the node: {attached:?}"
    );

    // Watches opened first: the Machine to its end, the Pod to its eviction.
    let machines: Api<DynamicObject> = Api::namespaced_with(
        t.management.clone(),
        &t.namespace,
        &common::tenant::machine_resource(),
    );
    let seen = std::sync::Arc::new(std::sync::Mutex::new((false, false, false)));
    let into = seen.clone();
    let config = watcher::Config::default().fields(&format!("metadata.name={machine}"));
    let machine_watch = tokio::spawn(async move {
        let mut events = std::pin::pin!(watcher(machines, config).default_backoff());
        while let Some(e) = events.next().await {
            let mut s = into.lock().unwrap();
            match e {
                Ok(watcher::Event::Apply(m) | watcher::Event::InitApply(m)) => {
                    s.0 |= condition_true(&m, "DrainingSucceeded");
                    s.1 |= condition_true(&m, "VolumeDetachSucceeded");
                }
                Ok(watcher::Event::Delete(_)) => {
                    s.2 = true;
                    return;
                }
                _ => {}
            }
        }
    });
    let pods: Api<Pod> = Api::namespaced(t.api.clone(), "apps");
    let pod_watch = tokio::spawn(async move {
        let mut pods = std::pin::pin!(
            watcher(
                pods,
                watcher::Config::default().fields("metadata.name=holder")
            )
            .default_backoff()
            .applied_objects()
        );
        while let Some(p) = pods.next().await {
            let evicted = p
                .ok()
                .and_then(|p| p.status)
                .and_then(|s| s.conditions)
                .is_some_and(|cs| {
                    cs.iter().any(|c| {
                        c.type_ == "DisruptionTarget"
                            && c.reason.as_deref() == Some("EvictionByEvictionAPI")
                    })
                });
            if evicted {
                return;
            }
        }
    });

    Api::<DynamicObject>::namespaced_with(
        t.management.clone(),
        &t.namespace,
        &resource(
            "cluster.x-k8s.io",
            "v1beta1",
            "MachineDeployment",
            "machinedeployments",
        ),
    )
    .patch_scale(
        &format!("{}-md0", t.name),
        &PatchParams::default(),
        &merge(json!({"spec": {"replicas": 0}})),
    )
    .await
    .expect("scale the node group down");

    common::wait::eventually(
        "Cluster API to delete the scaled-down Machine",
        Duration::from_secs(180),
        || async {
            match *seen.lock().unwrap() {
                (_, _, true) => Ok(()),
                s => Err(format!("drained, volumes detached, gone: {s:?}")),
            }
        },
    )
    .await;
    machine_watch.await.expect("the Machine's watch");
    let (drained, detached, _) = *seen.lock().unwrap();
    assert!(
        drained && detached,
        "Cluster API drained the node and waited for its volume before the Machine went: drained {drained}, detached {detached}"
    );
    tokio::time::timeout(Duration::from_secs(5), pod_watch)
        .await
        .expect("the holder Pod was evicted by the drain")
        .expect("the Pod's watch");
    let nodes: Api<Node> = Api::all(t.api.clone());
    common::wait::eventually(
        "Cluster API to delete the Machine's Node",
        Duration::from_secs(60),
        || async {
            match nodes.get_opt(common::tenant::SIM_NODE).await {
                Ok(None) => Ok(()),
                other => Err(format!("{:?}", other.map(|n| n.is_some()))),
            }
        },
    )
    .await;
    let log = common::capi::core(cp, common::capi::Core::COZYSTACK)
        .await
        .log();
    let refusals: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("volume-gate") && l.contains(&t.namespace))
        .collect();
    assert!(
        refusals.is_empty(),
        "the gate refused Cluster API on this tenant: {refusals:?}"
    );
    assert_eq!(
        env.sim.volumes_of(&t.namespace, &t.name),
        disks,
        "a node going frees no disk"
    );
    assert!(t.machines().await.is_empty(), "no Machine left");
}
