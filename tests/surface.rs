//! The reviewed surface (`docs/reliability.md`, "The reviewed surface"):
//! every row of its table walked on the real API server, with the shipped
//! webhook configurations, as someone who may edit a tenant's namespace
//! (`mallory`), unless the row says otherwise. A row with no case here, or
//! a case with no row, fails the test; so does every row whose answer is
//! not the one the table states. All rows are walked before the test
//! fails, so a red run lists every row that is wrong.

use volume_gate_testkit as common;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::time::Duration;

use common::tenant::{Tenant, datavolume_resource, kcp_resource, resource, tcp_resource};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, Role, RoleBinding};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use serde_json::{Value, json};

fn env() -> &'static common::Env {
    common::gated_short()
}

use common::editor::MALLORY;
const CHILD: &str = "cozystack.io/target-cluster-name";
const CAPI: &str = "cluster.x-k8s.io/cluster-name";
const RELEASE_NAME: &str = "meta.helm.sh/release-name";
const RELEASE_NAMESPACE: &str = "meta.helm.sh/release-namespace";

fn dry_delete() -> DeleteParams {
    DeleteParams {
        dry_run: true,
        ..Default::default()
    }
}

fn dry_patch() -> PatchParams {
    PatchParams::default().dry_run()
}

fn merge(v: Value) -> Patch<Value> {
    Patch::Merge(v)
}

fn capi(kind: &str, plural: &str) -> ApiResource {
    resource("cluster.x-k8s.io", "v1beta1", kind, plural)
}

fn hrs(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &common::gate::helmrelease_resource())
}

fn dynamic(client: &kube::Client, ns: &str, ar: &ApiResource) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, ar)
}

/// The ids of the table between the `surface` markers of
/// `docs/reliability.md`, in order.
fn table_ids() -> Vec<String> {
    let doc = std::fs::read_to_string(common::cluster::repo_root().join("docs/reliability.md"))
        .expect("docs/reliability.md");
    let body = doc
        .split_once("<!-- surface:begin -->")
        .and_then(|(_, rest)| rest.split_once("<!-- surface:end -->"))
        .map(|(table, _)| table)
        .expect("the surface table between its markers");
    body.lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .map(|l| l.split('`').next().unwrap_or_default().to_string())
        .collect()
}

/// The webhook's decisions, read from its log: one JSON line each.
struct Decisions {
    log: std::path::PathBuf,
}

impl Decisions {
    fn text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn offset(&self) -> usize {
        self.text().len()
    }

    /// The decision lines after `offset`, each with the offset just past it.
    fn since(&self, offset: usize) -> Vec<(usize, Value)> {
        let text = self.text();
        let mut at = offset;
        let mut out = Vec::new();
        for line in text.get(offset..).unwrap_or_default().split_inclusive('\n') {
            at += line.len();
            if let Ok(v) = serde_json::from_str::<Value>(line.trim_end())
                && v["message"] == "admission decision"
            {
                out.push((at, v));
            }
        }
        out
    }

    /// Waits until a decision after `offset` matches `what`; returns the
    /// lines before it and the offset just past it. The log is written in
    /// order by one thread, so a request reviewed before the matching one
    /// has its line before it.
    async fn until(&self, offset: usize, what: impl Fn(&Value) -> bool) -> (Vec<Value>, usize) {
        common::wait::eventually(
            "a decision in the webhook's log",
            Duration::from_secs(90),
            || {
                let lines = self.since(offset);
                let found = lines.iter().position(|(_, l)| what(l));
                async move {
                    match found {
                        Some(i) => Ok((
                            lines[..i].iter().map(|(_, l)| l.clone()).collect(),
                            lines[i].0,
                        )),
                        None => Err(format!("{} decisions since, none matching", lines.len())),
                    }
                }
            },
        )
        .await
    }
}

/// Every row's result, and what each needs to tell "sent" from "not sent".
struct Walk {
    results: BTreeMap<String, Result<(), String>>,
    decisions: Decisions,
    /// A request reviewed by exactly one webhook (a dry-run DELETE of the
    /// live tenant's admin kubeconfig by mallory, allowed outside teardown
    /// and changing nothing): its log line marks how far the log has come.
    barrier: (Api<Secret>, String),
}

fn refusal_of<T>(r: Result<T, kube::Error>) -> Result<String, String> {
    match r {
        Ok(_) => Err("allowed".into()),
        Err(kube::Error::Api(s)) => Ok(s.message),
        Err(e) => Err(format!("failed: {e}")),
    }
}

impl Walk {
    fn record(&mut self, id: &str, result: Result<(), String>) {
        let previous = self.results.insert(id.to_string(), result);
        assert!(previous.is_none(), "row {id} walked twice");
    }

    /// The gate refused it, and the refusal names each of `needles`.
    fn refused<T>(&mut self, id: &str, r: Result<T, kube::Error>, needles: &[&str]) {
        let result = refusal_of(r).and_then(|m| {
            if !m.contains("volume-gate") {
                return Err(format!("refused, but not by the gate: {m}"));
            }
            match needles.iter().find(|n| !m.contains(**n)) {
                Some(n) => Err(format!("the refusal does not name {n:?}: {m}")),
                None => Ok(()),
            }
        });
        self.record(id, result);
    }

    /// RBAC refused it before any webhook.
    fn forbidden<T>(r: Result<T, kube::Error>) -> Result<(), String> {
        match refusal_of(r) {
            Ok(m) if !m.contains("volume-gate") && m.contains("forbidden") => Ok(()),
            Ok(m) => Err(format!("not an RBAC refusal: {m}")),
            Err(e) => Err(e),
        }
    }

    /// Allowed, and reviewed: the webhook logged an allow for `name`.
    async fn allowed<T>(
        &mut self,
        id: &str,
        name: &str,
        request: impl Future<Output = Result<T, kube::Error>>,
    ) {
        let result = self
            .allowed_where(request, |lines| {
                lines
                    .iter()
                    .any(|l| {
                        l["name"] == name
                            && l["verdict"] == "allowed"
                            && l["endpoint"] == "validate"
                    })
                    .then_some(())
                    .ok_or_else(|| format!("allowed, but the gate never judged {name}"))
            })
            .await;
        self.record(id, result);
    }

    /// Allowed, and never sent to the gate.
    async fn unsent<T>(
        &mut self,
        id: &str,
        name: &str,
        request: impl Future<Output = Result<T, kube::Error>>,
    ) {
        let result = self
            .allowed_where(request, |lines| {
                match lines
                    .iter()
                    .find(|l| l["name"] == name && l["user"] == MALLORY)
                {
                    Some(l) => Err(format!("sent to the gate: {l}")),
                    None => Ok(()),
                }
            })
            .await;
        self.record(id, result);
    }

    /// Allowed, and `check` holds of the decisions logged while it was sent.
    async fn allowed_where<T>(
        &self,
        request: impl Future<Output = Result<T, kube::Error>>,
        check: impl Fn(&[Value]) -> Result<(), String>,
    ) -> Result<(), String> {
        let offset = self.settle().await;
        let result = request.await.map(drop).map_err(|e| format!("refused: {e}"));
        let (lines, _) = self.pass_barrier(offset).await;
        result.and_then(|()| check(&lines))
    }

    /// Sends the barrier request and returns the decisions logged between
    /// `offset` and it.
    async fn pass_barrier(&self, offset: usize) -> (Vec<Value>, usize) {
        let (api, name) = &self.barrier;
        api.delete(name, &dry_delete())
            .await
            .expect("the barrier request is allowed");
        self.decisions
            .until(offset, |l| {
                l["name"] == name.as_str() && l["user"] == MALLORY && l["operation"] == "DELETE"
            })
            .await
    }

    /// The log offset past every decision of the requests sent so far.
    async fn settle(&self) -> usize {
        self.pass_barrier(self.decisions.offset()).await.1
    }

    fn finish(self) {
        let table = table_ids();
        let walked: BTreeSet<&String> = self.results.keys().collect();
        let rows: BTreeSet<&String> = table.iter().collect();
        let mut problems: Vec<String> = Vec::new();
        for id in rows.difference(&walked) {
            problems.push(format!(
                "{id}: a row of docs/reliability.md with no case in tests/surface.rs"
            ));
        }
        for id in walked.difference(&rows) {
            problems.push(format!("{id}: a case with no row in docs/reliability.md"));
        }
        for (id, r) in &self.results {
            if let Err(e) = r {
                problems.push(format!("{id}: {e}"));
            }
        }
        assert_eq!(
            rows.len(),
            table.len(),
            "the table repeats an id: {table:?}"
        );
        assert!(
            problems.is_empty(),
            "{} of {} rows are wrong:\n{}",
            problems.len(),
            table.len(),
            problems.join("\n")
        );
    }
}

fn release_markers(t: &Tenant) -> Value {
    json!({RELEASE_NAME: t.name, RELEASE_NAMESPACE: t.namespace})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_of_the_reviewed_surface_gets_the_answer_the_table_states() {
    let env = env();
    let cp = env.cp;
    let admin = cp.management_client().await;
    let l = Tenant::create(cp, &cp.unique("surface-live")).await;
    let h = Tenant::create(cp, &cp.unique("surface-held")).await;
    for t in [&l, &h] {
        t.wait_custody().await;
        t.wait_cluster_bound().await;
    }
    l.with_held_claims(&["data"]).await;
    let markers_ns = cp.unique("surface-markers");
    cp.namespace(&markers_ns).await;
    let m = common::editor::mallory(cp, &[&l.namespace, &h.namespace]).await;
    let gate = env
        .gate
        .as_ref()
        .expect("gated")
        .lock()
        .unwrap()
        .webhook
        .log
        .clone();
    let (lc, hc) = (l.name.clone(), h.name.clone());
    let mut walk = Walk {
        results: BTreeMap::new(),
        decisions: Decisions { log: gate },
        barrier: (
            Api::namespaced(m.clone(), &l.namespace),
            common::profile().kubeconfig_secret_name(&lc),
        ),
    };

    // ---- H before its teardown: what an editor may do while it lives ----
    let kcsi = format!("{hc}-kcsi");
    let unmark = merge(json!({"metadata": {
        "annotations": {RELEASE_NAME: null, RELEASE_NAMESPACE: null},
        "labels": {"helm.toolkit.fluxcd.io/name": null, "helm.toolkit.fluxcd.io/namespace": null}}}));
    let sas: Api<ServiceAccount> = Api::namespaced(m.clone(), &h.namespace);
    walk.allowed(
        "kcsi-sa.unmark",
        &kcsi,
        sas.patch(&kcsi, &PatchParams::default(), &unmark),
    )
    .await;
    // driver-config, as Cozystack's chart makes it, and a release object
    // as large as a ConfigMap can be (six times that in a review's JSON).
    let h_cms: Api<ConfigMap> = Api::namespaced(admin.clone(), &h.namespace);
    for (name, data) in [
        (
            "driver-config",
            json!({"infraStorageClassEnforcement": "allowAll: true"}),
        ),
        ("large", json!({"padding": "<".repeat(1000 * 1024)})),
    ] {
        let cm = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "annotations": release_markers(&h)}, "data": data});
        h_cms
            .create(&PostParams::default(), &serde_json::from_value(cm).unwrap())
            .await
            .unwrap_or_else(|e| panic!("create ConfigMap {name}: {e}"));
    }
    Api::<ConfigMap>::namespaced(m.clone(), &h.namespace)
        .patch("driver-config", &PatchParams::default(), &unmark)
        .await
        .expect("outside teardown an object may leave its release");
    // A child and a MachineDeployment taken out of everything that marks
    // them (labels, Helm's and Flux's markers) while the tenant lives.
    let unlabel = |label: &str| {
        merge(json!({"metadata": {
            "annotations": {RELEASE_NAME: null, RELEASE_NAMESPACE: null},
            "labels": {label: null, "helm.toolkit.fluxcd.io/name": null, "helm.toolkit.fluxcd.io/namespace": null}}}))
    };
    let cilium = format!("{hc}-cilium");
    walk.allowed(
        "child.unlabel",
        &cilium,
        hrs(&m, &h.namespace).patch(&cilium, &PatchParams::default(), &unlabel(CHILD)),
    )
    .await;
    let md0 = format!("{hc}-md0");
    walk.allowed(
        "machinedeployment.unlabel",
        &md0,
        dynamic(
            &m,
            &h.namespace,
            &capi("MachineDeployment", "machinedeployments"),
        )
        .patch(&md0, &PatchParams::default(), &unlabel(CAPI)),
    )
    .await;
    // The Cluster API objects the fixture chart does not make.
    for (ar, name) in [
        (capi("Cluster", "clusters"), hc.clone()),
        (capi("Machine", "machines"), format!("{hc}-md0-m1")),
    ] {
        let mut o = DynamicObject::new(&name, &ar).within(&h.namespace);
        o.metadata.labels = Some(BTreeMap::from([(CAPI.to_string(), hc.clone())]));
        o.data = json!({"spec": {"clusterName": hc}});
        dynamic(&admin, &h.namespace, &ar)
            .create(&PostParams::default(), &o)
            .await
            .unwrap_or_else(|e| panic!("create {} {name}: {e}", ar.kind));
    }
    h.hold_in_teardown(&env.sim).await;

    // ---- The CSI release of the live tenant ----
    let l_hrs = hrs(&m, &l.namespace);
    let csi = common::profile().csi_release_name(&lc);
    walk.refused(
        "csi.delete",
        l_hrs.delete(&csi, &dry_delete()).await,
        &["CSI driver release", &csi],
    );
    walk.refused(
        "csi.deletecollection",
        l_hrs
            .delete_collection(
                &dry_delete(),
                &ListParams::default().labels(&format!("{CHILD}={lc}")),
            )
            .await,
        &["CSI driver release"],
    );
    walk.refused(
        "csi.relabel",
        l_hrs
            .patch(
                &csi,
                &dry_patch(),
                &merge(json!({"metadata": {"labels": {CHILD: null}}})),
            )
            .await,
        &["relabel", &csi],
    );
    for (id, spec, says) in [
        (
            "csi.release-name",
            json!({"releaseName": "moved"}),
            "its Helm release name",
        ),
        (
            "csi.target-namespace",
            json!({"targetNamespace": "default"}),
            "its target namespace",
        ),
        (
            "csi.storage-namespace",
            json!({"storageNamespace": "default"}),
            "its storage namespace",
        ),
        (
            "csi.chart",
            json!({"chartRef": {"name": "chart-demo"}}),
            "the chart it installs",
        ),
        (
            "csi.kubeconfig",
            json!({"kubeConfig": {"secretRef": {"name": common::profile().kubeconfig_secret_name("kubernetes-other")}}}),
            "the cluster it installs into",
        ),
        (
            "csi.remediation",
            json!({"upgrade": {"remediation": {"strategy": "uninstall", "retries": 1}}}),
            "uninstalls it on a failure",
        ),
        (
            "csi.tests",
            json!({"test": {"enable": true}, "install": {"remediation": {"retries": -1}}}),
            "uninstalls it on a failure",
        ),
    ] {
        walk.refused(
            id,
            l_hrs
                .patch(&csi, &dry_patch(), &merge(json!({"spec": spec})))
                .await,
            &["CSI driver release", says],
        );
    }
    let forged_status = |release: &str| {
        merge(json!({"status": {"storageNamespace": "kube-system",
            "history": [{"name": release, "namespace": "kube-system", "chartName": "csi", "chartVersion": "1.0.0",
                         "configDigest": "sha256:0", "digest": "sha256:0", "firstDeployed": "2026-01-01T00:00:00Z",
                         "lastDeployed": "2026-01-01T00:00:00Z", "status": "deployed", "version": 9}]}}))
    };
    walk.refused(
        "csi.status",
        l_hrs
            .patch_status(&csi, &dry_patch(), &forged_status("cilium"))
            .await,
        &["only its controller", "cozy-fluxcd:flux"],
    );
    walk.unsent(
        "csi.values",
        &csi,
        l_hrs.patch(
            &csi,
            &dry_patch(),
            &merge(json!({"spec": {"values": {"extra": 1}}})),
        ),
    )
    .await;
    walk.unsent(
        "csi.suspend",
        &csi,
        l_hrs.patch(
            &csi,
            &dry_patch(),
            &merge(json!({"spec": {"suspend": true}})),
        ),
    )
    .await;
    walk.unsent(
        "csi.finalizer",
        &csi,
        l_hrs.patch(
            &csi,
            &dry_patch(),
            &merge(json!({"metadata": {"finalizers": null}})),
        ),
    )
    .await;
    walk.record(
        "csi.owner",
        csi_owned_by_a_deleted_object(&walk, &m, &admin, &l).await,
    );

    // ---- Other children ----
    let coredns = format!("{lc}-coredns");
    walk.allowed(
        "child.delete-live",
        &coredns,
        l_hrs.delete(&coredns, &dry_delete()),
    )
    .await;
    walk.allowed(
        "child.release-name-live",
        &coredns,
        l_hrs.patch(
            &coredns,
            &dry_patch(),
            &merge(json!({"spec": {"releaseName": "moved"}})),
        ),
    )
    .await;
    walk.refused(
        "child.status",
        l_hrs
            .patch_status(&coredns, &dry_patch(), &forged_status("csi"))
            .await,
        &["only its controller"],
    );
    let h_hrs = hrs(&m, &h.namespace);
    let h_coredns = format!("{hc}-coredns");
    walk.refused(
        "child.delete",
        h_hrs.delete(&h_coredns, &dry_delete()).await,
        &["is being torn down"],
    );
    walk.refused(
        "child.relabel",
        h_hrs
            .patch(
                &h_coredns,
                &dry_patch(),
                &merge(json!({"metadata": {"labels": {CHILD: null}}})),
            )
            .await,
        &["relabel", "is being torn down"],
    );
    walk.refused(
        "child.unlabelled-delete",
        h_hrs.delete(&cilium, &dry_delete()).await,
        &["is being torn down"],
    );
    walk.refused(
        "child.release-name",
        h_hrs
            .patch(
                &h_coredns,
                &dry_patch(),
                &merge(json!({"spec": {"releaseName": "moved"}})),
            )
            .await,
        &["its Helm release name", "is being torn down"],
    );
    // A release of no tenant whose status is made to name the tenant's own
    // Helm release: helm-controller would uninstall that one.
    let plain = json!({"apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
        "metadata": {"name": "plain"}, "spec": common::flux::inert_spec("demo")});
    hrs(&admin, &l.namespace)
        .create(
            &PostParams::default(),
            &serde_json::from_value(plain).unwrap(),
        )
        .await
        .expect("create a release of no tenant");
    walk.refused(
        "other.status",
        l_hrs
            .patch_status("plain", &dry_patch(), &forged_status(&lc))
            .await,
        &["only its controller"],
    );

    // ---- The parent ----
    walk.unsent("parent.delete", &lc, l_hrs.delete(&lc, &dry_delete()))
        .await;
    for (id, spec, says) in [
        (
            "parent.chart",
            json!({"chartRef": {"name": "chart-demo"}}),
            "the chart it installs",
        ),
        (
            "parent.release-name",
            json!({"releaseName": "moved"}),
            "its Helm release name",
        ),
    ] {
        walk.refused(
            id,
            l_hrs
                .patch(&lc, &dry_patch(), &merge(json!({"spec": spec})))
                .await,
            &[says, "would be uninstalled", "delete the HelmRelease"],
        );
    }
    walk.refused(
        "parent.status",
        l_hrs
            .patch_status(&lc, &dry_patch(), &forged_status("kubernetes-other"))
            .await,
        &["only its controller"],
    );
    walk.refused(
        "parent.unlabel",
        l_hrs
            .patch(
                &lc,
                &dry_patch(),
                &merge(
                    json!({"metadata": {"labels": {"apps.cozystack.io/application.kind": null}}}),
                ),
            )
            .await,
        &["tenant labels"],
    );
    walk.refused(
        "parent.record",
        l_hrs
            .patch(
                &lc,
                &dry_patch(),
                &merge(json!({"metadata": {"annotations": {&common::keys().phase: "Released"}}})),
            )
            .await,
        &["written only by the volume-gate worker"],
    );
    // The record's mirror where the Application API shows it: the
    // owner's to write, read by nothing; the CSI release stays held.
    let mirror = format!(
        "{}{}",
        common::profile().parent.visible_annotation_prefix,
        common::keys().phase
    );
    let forged = l_hrs
        .patch(
            &lc,
            &PatchParams::default(),
            &merge(json!({"metadata": {"annotations": {&mirror: "Released"}}})),
        )
        .await;
    let held = refusal_of(
        l_hrs
            .delete(&common::profile().csi_release_name(&lc), &dry_delete())
            .await,
    );
    walk.record(
        "parent.visible-record",
        match (forged, held) {
            (Ok(_), Ok(m)) if m.contains("volume-gate") && m.contains("not released") => Ok(()),
            (Err(e), _) => Err(format!("the mirror's write was refused: {e}")),
            (_, Ok(m)) => Err(format!("the CSI release refused otherwise: {m}")),
            (_, Err(e)) => Err(format!("the CSI release after a forged mirror: {e}")),
        },
    );
    walk.refused(
        "parent.custody",
        l_hrs
            .patch(
                &lc,
                &dry_patch(),
                &merge(json!({"metadata": {"finalizers": [common::flux::FLUX_FINALIZER]}})),
            )
            .await,
        &["custody finalizer"],
    );
    walk.unsent(
        "parent.values",
        &lc,
        l_hrs.patch(
            &lc,
            &dry_patch(),
            &merge(json!({"spec": {"values": {"extra": 1}}})),
        ),
    )
    .await;
    // A release that carried a record before it was labelled a tenant.
    let keys = common::keys();
    let carried = json!({"apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
        "metadata": {"name": "kubernetes-adopted", "annotations": {
            &keys.phase: "Released",
            &keys.override_reason: "carried in",
            &keys.override_by: "alice",
            &keys.override_at: volume_gate::record::now_rfc3339()}},
        "spec": common::flux::inert_spec("kubernetes")});
    hrs(&m, &l.namespace)
        .create(
            &PostParams::default(),
            &serde_json::from_value(carried).unwrap(),
        )
        .await
        .expect("a release of no tenant is not judged at creation");
    walk.refused(
        "adopt.record",
        l_hrs
            .patch(
                "kubernetes-adopted",
                &dry_patch(),
                &merge(json!({"metadata": {"labels": {
                    "apps.cozystack.io/application.kind": "Kubernetes",
                    "apps.cozystack.io/application.group": "apps.cozystack.io"}}})),
            )
            .await,
        &["written only by the volume-gate worker"],
    );

    // ---- Markers that name no tenant, and the namespace they once wedged ----
    let bad: [(ApiResource, &str, Value, Value); 3] = [
        (
            resource("", "v1", "ConfigMap", "configmaps"),
            "bad-release",
            json!({}),
            json!({"annotations": {RELEASE_NAME: "kubernetes-NOT_A_TENANT"}}),
        ),
        (
            common::gate::helmrelease_resource(),
            "bad-child",
            json!({"spec": common::flux::inert_spec("demo")}),
            json!({"labels": {CHILD: "Not_A_Tenant"}}),
        ),
        (
            capi("Machine", "machines"),
            "bad-machine",
            json!({"spec": {"clusterName": "x"}}),
            json!({"labels": {CAPI: "UPPER"}}),
        ),
    ];
    for ((ar, name, body, meta), id) in
        bad.iter()
            .zip(["marker.release", "marker.child", "marker.capi"])
    {
        let mut o = DynamicObject::new(name, ar).within(&markers_ns);
        let meta: kube::api::ObjectMeta = serde_json::from_value(meta.clone()).unwrap();
        o.metadata.labels = meta.labels;
        o.metadata.annotations = meta.annotations;
        o.data = body.clone();
        let api = dynamic(&admin, &markers_ns, ar);
        api.create(&PostParams::default(), &o)
            .await
            .unwrap_or_else(|e| panic!("create {name}: {e}"));
        walk.allowed(id, name, api.delete(name, &dry_delete()))
            .await;
    }
    admin_delete_namespace(&admin, &markers_ns).await;
    common::tenant::wait_namespace_gone(&admin, &markers_ns, Duration::from_secs(120)).await;
    walk.record("marker.namespace", Ok(()));

    // ---- The held tenant's dependencies ----
    let h_cm: Api<ConfigMap> = Api::namespaced(m.clone(), &h.namespace);
    let large_unmark = h_cm.patch("large", &dry_patch(), &unmark).await;
    let large_delete = h_cm.delete("large", &dry_delete()).await;
    walk.record(
        "large.release-object",
        refusal_of(large_unmark)
            .and_then(|m| m.contains("volume-gate").then_some(()).ok_or(m))
            .and_then(|()| refusal_of(large_delete))
            .and_then(|m| {
                m.contains("an object of the tenant's parent release")
                    .then_some(())
                    .ok_or(m)
            }),
    );
    walk.refused(
        "kcsi-sa.delete",
        sas.delete(&kcsi, &dry_delete()).await,
        &["frees disks with", "is being torn down"],
    );
    walk.refused(
        "kcsi-role.delete",
        Api::<Role>::namespaced(admin.clone(), &h.namespace)
            .delete(&kcsi, &dry_delete())
            .await,
        &["frees disks with"],
    );
    walk.refused(
        "kcsi-rolebinding.delete",
        Api::<RoleBinding>::namespaced(admin.clone(), &h.namespace)
            .delete(&kcsi, &dry_delete())
            .await,
        &["frees disks with"],
    );
    let by_mallory = Walk::forbidden(
        Api::<ClusterRole>::all(m.clone())
            .delete(&kcsi, &dry_delete())
            .await,
    );
    let by_admin = refusal_of(
        Api::<ClusterRole>::all(admin.clone())
            .delete(&kcsi, &dry_delete())
            .await,
    )
    .and_then(|m| m.contains("parent release").then_some(()).ok_or(m));
    walk.record("kcsi-clusterrole.delete", by_mallory.and(by_admin));
    let deployments: Api<Deployment> = Api::namespaced(m.clone(), &h.namespace);
    let controller = format!("{hc}-kcsi-controller");
    walk.refused(
        "kcsi-controller.delete",
        deployments.delete(&controller, &dry_delete()).await,
        &["CSI controller"],
    );
    walk.unsent(
        "kcsi-controller.scale",
        &controller,
        deployments.patch_scale(
            &controller,
            &dry_patch(),
            &merge(json!({"spec": {"replicas": 0}})),
        ),
    )
    .await;
    walk.unsent(
        "driver-config.delete",
        "driver-config",
        h_cm.delete("driver-config", &dry_delete()),
    )
    .await;
    let secrets: Api<Secret> = Api::namespaced(m.clone(), &h.namespace);
    let kubeconfig = common::profile().kubeconfig_secret_name(&hc);
    walk.refused(
        "admin-kubeconfig.delete",
        secrets.delete(&kubeconfig, &dry_delete()).await,
        &["admin kubeconfig"],
    );
    walk.unsent(
        "admin-kubeconfig.data",
        &kubeconfig,
        secrets.patch(
            &kubeconfig,
            &dry_patch(),
            &merge(json!({"data": {&common::profile().kubeconfig.keys[0]: common::tenant::base64(b"elsewhere")}})),
        ),
    )
    .await;
    walk.refused(
        "kamajicontrolplane.delete",
        dynamic(&m, &h.namespace, &kcp_resource())
            .delete(&hc, &dry_delete())
            .await,
        &["control plane"],
    );
    let tcps = dynamic(&m, &h.namespace, &tcp_resource());
    walk.refused(
        "tenantcontrolplane.delete",
        tcps.delete(&hc, &dry_delete()).await,
        &["API server"],
    );
    walk.unsent(
        "tenantcontrolplane.endpoint",
        &hc,
        tcps.patch_status(
            &hc,
            &dry_patch(),
            &merge(json!({"status": {"controlPlaneEndpoint": "10.9.9.9:6443"}})),
        ),
    )
    .await;
    walk.refused(
        "cluster.delete",
        dynamic(&m, &h.namespace, &capi("Cluster", "clusters"))
            .delete(&hc, &dry_delete())
            .await,
        &["Cluster API cluster"],
    );
    walk.refused(
        "machinedeployment.delete",
        dynamic(
            &m,
            &h.namespace,
            &capi("MachineDeployment", "machinedeployments"),
        )
        .delete(&md0, &dry_delete())
        .await,
        &["worker machines"],
    );
    walk.refused(
        "machine.relabel",
        dynamic(&m, &h.namespace, &capi("Machine", "machines"))
            .patch(
                &format!("{hc}-md0-m1"),
                &dry_patch(),
                &merge(json!({"metadata": {"labels": {CAPI: null}}})),
            )
            .await,
        &["relabel"],
    );

    // ---- The live tenant's disk on the management side ----
    let dvs = dynamic(&m, &l.namespace, &datavolume_resource());
    let dv = dvs
        .list(&ListParams::default().labels(&format!("{CAPI}={lc}")))
        .await
        .expect("list DataVolumes")
        .items
        .into_iter()
        .next()
        .map(|d| d.metadata.name.unwrap_or_default())
        .expect("the live tenant's claim has a DataVolume");
    walk.refused(
        "datavolume.relabel",
        dvs.patch(
            &dv,
            &dry_patch(),
            &merge(json!({"metadata": {"labels": {CAPI: null}}})),
        )
        .await,
        &["relabel", &dv],
    );
    walk.unsent("datavolume.delete", &dv, dvs.delete(&dv, &dry_delete()))
        .await;
    // A tenant in teardown whose volumes no pass could inventory (no API
    // behind it): nothing says yet which of its disks are to be kept.
    let paper = format!("{}-paper", l.namespace);
    cp.namespace(&paper).await;
    let r = "kubernetes-paper";
    common::tenant::paper_parent(&hrs(&admin, &paper), r).await;
    hrs(&admin, &paper)
        .delete(r, &DeleteParams::default())
        .await
        .expect("delete the paper parent");
    let namespace_controller = cp
        .client_as(
            volume_gate::admission::gate::NAMESPACE_CONTROLLER,
            &["system:serviceaccounts", "system:authenticated"],
        )
        .await;
    walk.refused(
        "datavolume.delete-uninventoried",
        dynamic(&namespace_controller, &paper, &datavolume_resource())
            .delete(&format!("{r}-disk"), &dry_delete())
            .await,
        &["not inventoried", "is being torn down"],
    );
    walk.record(
        "datavolume.delete-by-hand",
        dynamic(&admin, &paper, &datavolume_resource())
            .delete(&format!("{r}-disk"), &dry_delete())
            .await
            .map(drop)
            .map_err(|e| format!("refused: {e}")),
    );

    walk.finish();
}

/// `csi.owner`: R-csi made a dependent of a ConfigMap that mallory then
/// deletes; the garbage collector's DELETE of R-csi is refused by the gate,
/// and R-csi stays.
async fn csi_owned_by_a_deleted_object(
    walk: &Walk,
    m: &kube::Client,
    admin: &kube::Client,
    l: &Tenant,
) -> Result<(), String> {
    let csi = common::profile().csi_release_name(&l.name);
    let cms: Api<ConfigMap> = Api::namespaced(m.clone(), &l.namespace);
    let owner = cms
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "owner"}})).unwrap(),
        )
        .await
        .map_err(|e| format!("create the owner: {e}"))?;
    let uid = owner.metadata.uid.clone().unwrap_or_default();
    let owned = merge(json!({"metadata": {"ownerReferences": [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}]}}));
    hrs(m, &l.namespace)
        .patch(&csi, &PatchParams::default(), &owned)
        .await
        .map_err(|e| format!("an ownerReference is not a removal, yet: {e}"))?;
    let offset = walk.settle().await;
    cms.delete("owner", &DeleteParams::default())
        .await
        .map_err(|e| format!("delete the owner: {e}"))?;
    let refused = |l: &Value| {
        l["name"] == csi.as_str()
            && l["operation"] == "DELETE"
            && l["verdict"] == "denied"
            && l["user"] != MALLORY
    };
    walk.decisions.until(offset, refused).await;
    let still = hrs(admin, &l.namespace)
        .get(&csi)
        .await
        .map_err(|e| format!("R-csi is gone: {e}"))?;
    // Hand it back, so the collector stops trying.
    hrs(admin, &l.namespace)
        .patch(
            &csi,
            &PatchParams::default(),
            &merge(json!({"metadata": {"ownerReferences": null}})),
        )
        .await
        .map_err(|e| format!("remove the ownerReference: {e}"))?;
    match still.metadata.deletion_timestamp {
        None => Ok(()),
        Some(_) => Err("R-csi is being deleted".into()),
    }
}

async fn admin_delete_namespace(admin: &kube::Client, ns: &str) {
    Api::<k8s_openapi::api::core::v1::Namespace>::all(admin.clone())
        .delete(ns, &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("delete namespace {ns}: {e}"));
}
