//! The reviewed surface (`docs/reliability.md`, "The reviewed surface"):
//! every row of its table walked on the real API server, with the shipped
//! webhook configurations, as someone who may edit a tenant's namespace
//! (`mallory`), unless the row says otherwise.
//!
//! The walk is a table too: [`rows_before_teardown`] and [`rows`] hold one
//! [`Row`] per row of the document (its id, the request as data, what a
//! refusal must name), and the answer each must get is read from the
//! document's own columns ("the gate is sent": `not sent`; "answer":
//! `refused…` or `allowed…`), so the document and the test cannot say two
//! things. The few rows that are a procedure rather than one request (the
//! garbage collector's delete, a namespace deletion, two identities) are
//! [`Scenario`]s with their own check. A row with no case here, or a case
//! with no row, fails the test; so does every row whose answer is not the
//! one the table states. All rows are walked before the test fails, so a
//! red run lists every row that is wrong.

use volume_gate_testkit as common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::tenant::{Tenant, datavolume_resource, kcp_resource, resource, tcp_resource};
use k8s_openapi::api::core::v1::ConfigMap;
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

fn hr() -> ApiResource {
    common::gate::helmrelease_resource()
}

fn core(kind: &str, plural: &str) -> ApiResource {
    resource("", "v1", kind, plural)
}

fn hrs(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &hr())
}

fn dynamic(client: &kube::Client, ns: &str, ar: &ApiResource) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, ar)
}

/// The answer a row of the document states, from its columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    /// "answer" begins `refused`: the gate refuses it.
    Refused,
    /// "answer" begins `allowed`, and the gate is sent it: the gate
    /// judged it and allowed it.
    Allowed,
    /// "the gate is sent" begins `not sent`: allowed, and never sent.
    Unsent,
    /// Anything else: the row's scenario says what holds.
    Stated,
}

/// The rows of the table between the `surface` markers of
/// `docs/reliability.md`, in order: each id and the answer it states.
fn table() -> Vec<(String, Answer)> {
    let doc = std::fs::read_to_string(common::cluster::repo_root().join("docs/reliability.md"))
        .expect("docs/reliability.md");
    let body = doc
        .split_once("<!-- surface:begin -->")
        .and_then(|(_, rest)| rest.split_once("<!-- surface:end -->"))
        .map(|(table, _)| table)
        .expect("the surface table between its markers");
    body.lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let id = cells[1].trim_matches('`').to_string();
            let (sent, answer) = (cells[4], cells[5]);
            let stated = if sent.starts_with("not sent") {
                Answer::Unsent
            } else if answer.starts_with("refused") {
                Answer::Refused
            } else if answer.starts_with("allowed") {
                Answer::Allowed
            } else {
                Answer::Stated
            };
            (id, stated)
        })
        .collect()
}

/// Who sends a row's request.
#[derive(Clone, Copy, Debug)]
enum Who {
    /// May edit both tenants' namespaces (`common::editor`).
    Mallory,
    /// A cluster admin.
    Admin,
    /// Kubernetes' namespace controller, as it deletes a namespace's contents.
    NamespaceController,
}

/// A row's request, as data: every one is a dry run.
enum Send {
    Delete {
        who: Who,
        ar: ApiResource,
        ns: String,
        name: String,
    },
    DeleteCollection {
        who: Who,
        ar: ApiResource,
        ns: String,
        labels: String,
    },
    Patch {
        who: Who,
        ar: ApiResource,
        ns: String,
        name: String,
        body: Value,
    },
    PatchStatus {
        who: Who,
        ar: ApiResource,
        ns: String,
        name: String,
        body: Value,
    },
    PatchScale {
        who: Who,
        ar: ApiResource,
        ns: String,
        name: String,
        body: Value,
    },
    /// A procedure rather than one request, with its own check.
    Scenario(Scenario),
}

/// The rows that are a procedure.
enum Scenario {
    /// `csi.owner`: the garbage collector's DELETE of the CSI release.
    CsiOwner,
    /// `parent.visible-record`: the owner-visible mirror forged for real,
    /// and the CSI release still refused.
    VisibleRecord,
    /// `marker.namespace`: the namespace whose markers name no tenant goes.
    MarkerNamespace,
    /// `large.release-object`: both writes of a 1 MiB release object.
    LargeReleaseObject,
    /// `kcsi-clusterrole.delete`: mallory forbidden by RBAC, an admin by the gate.
    ClusterRoleDelete,
    /// `datavolume.delete-by-hand`: a person's delete of a disk goes through.
    DiskDeleteByHand,
}

struct Row {
    id: &'static str,
    send: Send,
    /// What a refusal must name, besides `volume-gate`.
    names: Vec<String>,
}

fn row(id: &'static str, send: Send, names: &[&str]) -> Row {
    Row {
        id,
        send,
        names: names.iter().map(|s| s.to_string()).collect(),
    }
}

fn delete(who: Who, ar: ApiResource, ns: &str, name: &str) -> Send {
    Send::Delete {
        who,
        ar,
        ns: ns.into(),
        name: name.into(),
    }
}

fn patch(who: Who, ar: ApiResource, ns: &str, name: &str, body: Value) -> Send {
    Send::Patch {
        who,
        ar,
        ns: ns.into(),
        name: name.into(),
        body,
    }
}

fn patch_status(who: Who, ar: ApiResource, ns: &str, name: &str, body: Value) -> Send {
    Send::PatchStatus {
        who,
        ar,
        ns: ns.into(),
        name: name.into(),
        body,
    }
}

/// The clients the rows are sent with.
struct Clients {
    mallory: kube::Client,
    admin: kube::Client,
    namespace_controller: kube::Client,
}

impl Clients {
    fn of(&self, who: Who) -> &kube::Client {
        match who {
            Who::Mallory => &self.mallory,
            Who::Admin => &self.admin,
            Who::NamespaceController => &self.namespace_controller,
        }
    }
}

impl Send {
    /// The name the webhook's log line carries.
    fn name(&self) -> &str {
        match self {
            Send::Delete { name, .. }
            | Send::Patch { name, .. }
            | Send::PatchStatus { name, .. }
            | Send::PatchScale { name, .. } => name,
            Send::DeleteCollection { .. } | Send::Scenario(_) => "",
        }
    }

    async fn send(&self, c: &Clients) -> Result<(), kube::Error> {
        match self {
            Send::Delete { who, ar, ns, name } => dynamic(c.of(*who), ns, ar)
                .delete(name, &dry_delete())
                .await
                .map(drop),
            Send::DeleteCollection {
                who,
                ar,
                ns,
                labels,
            } => dynamic(c.of(*who), ns, ar)
                .delete_collection(&dry_delete(), &ListParams::default().labels(labels))
                .await
                .map(drop),
            Send::Patch {
                who,
                ar,
                ns,
                name,
                body,
            } => dynamic(c.of(*who), ns, ar)
                .patch(name, &dry_patch(), &merge(body.clone()))
                .await
                .map(drop),
            Send::PatchStatus {
                who,
                ar,
                ns,
                name,
                body,
            } => dynamic(c.of(*who), ns, ar)
                .patch_status(name, &dry_patch(), &merge(body.clone()))
                .await
                .map(drop),
            Send::PatchScale {
                who,
                ar,
                ns,
                name,
                body,
            } => dynamic(c.of(*who), ns, ar)
                .patch_scale(name, &dry_patch(), &merge(body.clone()))
                .await
                .map(drop),
            Send::Scenario(_) => unreachable!("a scenario is run, not sent"),
        }
    }
}

/// What the rows name: the two tenants and what was made for the walk.
struct World {
    /// The live tenant, holding a claim.
    l: Tenant,
    /// The tenant held in teardown.
    h: Tenant,
    /// A namespace of objects whose markers name no tenant.
    markers_ns: String,
    /// The live tenant's disk on the management side.
    dv: String,
    /// The held tenant's Machine (Cluster API's, of its MachineDeployment).
    machine: String,
    /// A tenant in teardown that no pass could inventory.
    paper: String,
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
    barrier: (Api<DynamicObject>, String),
}

fn refusal_of<T>(r: Result<T, kube::Error>) -> Result<String, String> {
    match r {
        Ok(_) => Err("allowed".into()),
        Err(kube::Error::Api(s)) => Ok(s.message),
        Err(e) => Err(format!("failed: {e}")),
    }
}

/// The gate refused it, and the refusal names each of `names`.
fn refused_naming<T>(r: Result<T, kube::Error>, names: &[String]) -> Result<(), String> {
    refusal_of(r).and_then(|m| {
        if !m.contains("volume-gate") {
            return Err(format!("refused, but not by the gate: {m}"));
        }
        match names.iter().find(|n| !m.contains(n.as_str())) {
            Some(n) => Err(format!("the refusal does not name {n:?}: {m}")),
            None => Ok(()),
        }
    })
}

/// RBAC refused it before any webhook.
fn forbidden<T>(r: Result<T, kube::Error>) -> Result<(), String> {
    match refusal_of(r) {
        Ok(m) if !m.contains("volume-gate") && m.contains("forbidden") => Ok(()),
        Ok(m) => Err(format!("not an RBAC refusal: {m}")),
        Err(e) => Err(e),
    }
}

impl Walk {
    fn record(&mut self, id: &str, result: Result<(), String>) {
        let previous = self.results.insert(id.to_string(), result);
        assert!(previous.is_none(), "row {id} walked twice");
    }

    /// Walks one row: sends it and checks the answer the document states.
    async fn walk(&mut self, row: Row, stated: &BTreeMap<String, Answer>, c: &Clients, w: &World) {
        let Some(&answer) = stated.get(row.id) else {
            self.record(
                row.id,
                Err("a case with no row in docs/reliability.md".into()),
            );
            return;
        };
        let result = match (&row.send, answer) {
            (Send::Scenario(s), _) => self.scenario(s, c, w).await,
            (_, Answer::Stated) => {
                Err("the document states no answer the walk can check; make it a scenario".into())
            }
            (send, Answer::Refused) => refused_naming(send.send(c).await, &row.names),
            (send, Answer::Allowed) => {
                let name = send.name().to_string();
                self.allowed_where(send.send(c), |lines| {
                    lines
                        .iter()
                        .any(|l| {
                            l["name"] == name.as_str()
                                && l["verdict"] == "allowed"
                                && l["endpoint"] == "validate"
                        })
                        .then_some(())
                        .ok_or_else(|| format!("allowed, but the gate never judged {name}"))
                })
                .await
            }
            (send, Answer::Unsent) => {
                let name = send.name().to_string();
                self.allowed_where(send.send(c), |lines| {
                    match lines
                        .iter()
                        .find(|l| l["name"] == name.as_str() && l["user"] == MALLORY)
                    {
                        Some(l) => Err(format!("sent to the gate: {l}")),
                        None => Ok(()),
                    }
                })
                .await
            }
        };
        self.record(row.id, result);
    }

    async fn scenario(&self, s: &Scenario, c: &Clients, w: &World) -> Result<(), String> {
        let (m, admin) = (&c.mallory, &c.admin);
        match s {
            Scenario::CsiOwner => csi_owned_by_a_deleted_object(self, m, admin, &w.l).await,
            Scenario::VisibleRecord => {
                // The record's mirror where the Application API shows it:
                // the owner's to write, read by nothing; the CSI release
                // stays held.
                let mirror = format!(
                    "{}{}",
                    common::profile().parent.visible_annotation_prefix,
                    common::keys().phase
                );
                let forged = hrs(m, &w.l.namespace)
                    .patch(
                        &w.l.name,
                        &PatchParams::default(),
                        &merge(json!({"metadata": {"annotations": {&mirror: "Released"}}})),
                    )
                    .await;
                let held = refusal_of(
                    hrs(m, &w.l.namespace)
                        .delete(
                            &common::profile()
                                .csi_release_name(&w.l.name)
                                .expect("Cozystack has a CSI release"),
                            &dry_delete(),
                        )
                        .await,
                );
                match (forged, held) {
                    (Ok(_), Ok(msg))
                        if msg.contains("volume-gate") && msg.contains("not released") =>
                    {
                        Ok(())
                    }
                    (Err(e), _) => Err(format!("the mirror's write was refused: {e}")),
                    (_, Ok(msg)) => Err(format!("the CSI release refused otherwise: {msg}")),
                    (_, Err(e)) => Err(format!("the CSI release after a forged mirror: {e}")),
                }
            }
            Scenario::MarkerNamespace => {
                Api::<k8s_openapi::api::core::v1::Namespace>::all(admin.clone())
                    .delete(&w.markers_ns, &DeleteParams::default())
                    .await
                    .map_err(|e| format!("delete namespace {}: {e}", w.markers_ns))?;
                common::tenant::wait_namespace_gone(admin, &w.markers_ns, Duration::from_secs(120))
                    .await;
                Ok(())
            }
            Scenario::LargeReleaseObject => {
                let cms = dynamic(m, &w.h.namespace, &core("ConfigMap", "configmaps"));
                let unmark = cms.patch("large", &dry_patch(), &merge(unmark())).await;
                let deleted = cms.delete("large", &dry_delete()).await;
                refused_naming(unmark, &[]).and_then(|()| {
                    refused_naming(
                        deleted,
                        &["an object of the tenant's parent release".into()],
                    )
                })
            }
            Scenario::ClusterRoleDelete => {
                let kcsi = format!("{}-kcsi", w.h.name);
                let roles = |c: &kube::Client| {
                    Api::<DynamicObject>::all_with(
                        c.clone(),
                        &resource(
                            "rbac.authorization.k8s.io",
                            "v1",
                            "ClusterRole",
                            "clusterroles",
                        ),
                    )
                };
                let by_mallory = forbidden(roles(m).delete(&kcsi, &dry_delete()).await);
                let by_admin = refused_naming(
                    roles(admin).delete(&kcsi, &dry_delete()).await,
                    &["parent release".into()],
                );
                by_mallory.and(by_admin)
            }
            Scenario::DiskDeleteByHand => {
                let r = "kubernetes-paper";
                dynamic(admin, &w.paper, &datavolume_resource())
                    .delete(&format!("{r}-disk"), &dry_delete())
                    .await
                    .map(drop)
                    .map_err(|e| format!("refused: {e}"))
            }
        }
    }

    /// Allowed, and `check` holds of the decisions logged while it was sent.
    async fn allowed_where(
        &self,
        request: impl std::future::Future<Output = Result<(), kube::Error>>,
        check: impl Fn(&[Value]) -> Result<(), String>,
    ) -> Result<(), String> {
        let offset = self.settle().await;
        let result = request.await.map_err(|e| format!("refused: {e}"));
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

    fn finish(self, table: &[(String, Answer)]) {
        let walked: BTreeSet<&String> = self.results.keys().collect();
        let rows: BTreeSet<&String> = table.iter().map(|(id, _)| id).collect();
        let mut problems: Vec<String> = Vec::new();
        for id in rows.difference(&walked) {
            problems.push(format!(
                "{id}: a row of docs/reliability.md with no case in tests/surface.rs"
            ));
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

/// Takes an object out of its Helm and Flux release markers.
fn unmark() -> Value {
    json!({"metadata": {
        "annotations": {RELEASE_NAME: null, RELEASE_NAMESPACE: null},
        "labels": {"helm.toolkit.fluxcd.io/name": null, "helm.toolkit.fluxcd.io/namespace": null}}})
}

/// Takes an object out of everything that marks it: `label`, and Helm's
/// and Flux's markers.
fn unlabel(label: &str) -> Value {
    json!({"metadata": {
        "annotations": {RELEASE_NAME: null, RELEASE_NAMESPACE: null},
        "labels": {label: null, "helm.toolkit.fluxcd.io/name": null, "helm.toolkit.fluxcd.io/namespace": null}}})
}

fn release_markers(t: &Tenant) -> Value {
    json!({RELEASE_NAME: t.name, RELEASE_NAMESPACE: t.namespace})
}

/// A status that names `release` in its history: helm-controller would
/// uninstall that one.
fn forged_status(release: &str) -> Value {
    json!({"status": {"storageNamespace": "kube-system",
        "history": [{"name": release, "namespace": "kube-system", "chartName": "csi", "chartVersion": "1.0.0",
                     "configDigest": "sha256:0", "digest": "sha256:0", "firstDeployed": "2026-01-01T00:00:00Z",
                     "lastDeployed": "2026-01-01T00:00:00Z", "status": "deployed", "version": 9}]}})
}

/// The rows walked while the held tenant still lives: what an editor may
/// do outside teardown.
fn rows_before_teardown(w: &World) -> Vec<Row> {
    use Who::Mallory;
    let (h, hc) = (&w.h.namespace, &w.h.name);
    vec![
        row(
            "kcsi-sa.unmark",
            patch(
                Mallory,
                core("ServiceAccount", "serviceaccounts"),
                h,
                &format!("{hc}-kcsi"),
                unmark(),
            ),
            &[],
        ),
        row(
            "child.unlabel",
            patch(Mallory, hr(), h, &format!("{hc}-cilium"), unlabel(CHILD)),
            &[],
        ),
        row(
            "machinedeployment.unlabel",
            patch(
                Mallory,
                capi("MachineDeployment", "machinedeployments"),
                h,
                &format!("{hc}-md0"),
                unlabel(CAPI),
            ),
            &[],
        ),
    ]
}

/// Every other row, in the document's order, once the held tenant is in
/// teardown.
fn rows(w: &World) -> Vec<Row> {
    use Who::{Admin, Mallory, NamespaceController};
    let (ln, lc) = (&w.l.namespace, &w.l.name);
    let (hn, hc) = (&w.h.namespace, &w.h.name);
    let csi = common::profile()
        .csi_release_name(lc)
        .expect("Cozystack has a CSI release");
    let spec = |s: Value| json!({"spec": s});
    let csi_spec = |id: &'static str, s: Value, says: &str| {
        row(
            id,
            patch(Mallory, hr(), ln, &csi, spec(s)),
            &["CSI driver release", says],
        )
    };
    let coredns = format!("{lc}-coredns");
    let h_coredns = format!("{hc}-coredns");
    let parent_spec = |id: &'static str, s: Value, says: &str| {
        row(
            id,
            patch(Mallory, hr(), ln, lc, spec(s)),
            &[says, "would be uninstalled", "delete the HelmRelease"],
        )
    };
    let keys = common::keys();
    let kcsi = format!("{hc}-kcsi");
    let kubeconfig = common::profile().kubeconfig_secret_name(hc);
    let no_label = |label: &str| json!({"metadata": {"labels": {label: null}}});
    let marker = |id: &'static str, ar: ApiResource, name: &str| {
        row(id, delete(Admin, ar, &w.markers_ns, name), &[])
    };
    vec![
        // The CSI release of the live tenant.
        row(
            "csi.delete",
            delete(Mallory, hr(), ln, &csi),
            &["CSI driver release", &csi],
        ),
        row(
            "csi.deletecollection",
            Send::DeleteCollection {
                who: Mallory,
                ar: hr(),
                ns: ln.clone(),
                labels: format!("{CHILD}={lc}"),
            },
            &["CSI driver release"],
        ),
        row(
            "csi.relabel",
            patch(Mallory, hr(), ln, &csi, no_label(CHILD)),
            &["relabel", &csi],
        ),
        csi_spec(
            "csi.release-name",
            json!({"releaseName": "moved"}),
            "its Helm release name",
        ),
        csi_spec(
            "csi.target-namespace",
            json!({"targetNamespace": "default"}),
            "its target namespace",
        ),
        csi_spec(
            "csi.storage-namespace",
            json!({"storageNamespace": "default"}),
            "its storage namespace",
        ),
        csi_spec(
            "csi.chart",
            json!({"chartRef": {"name": "chart-demo"}}),
            "the chart it installs",
        ),
        csi_spec(
            "csi.kubeconfig",
            json!({"kubeConfig": {"secretRef": {"name": common::profile().kubeconfig_secret_name("kubernetes-other")}}}),
            "the cluster it installs into",
        ),
        csi_spec(
            "csi.remediation",
            json!({"upgrade": {"remediation": {"strategy": "uninstall", "retries": 1}}}),
            "uninstalls it on a failure",
        ),
        csi_spec(
            "csi.tests",
            json!({"test": {"enable": true}, "install": {"remediation": {"retries": -1}}}),
            "uninstalls it on a failure",
        ),
        row(
            "csi.status",
            patch_status(Mallory, hr(), ln, &csi, forged_status("cilium")),
            &["only its controller", "cozy-fluxcd:flux"],
        ),
        row(
            "csi.values",
            patch(
                Mallory,
                hr(),
                ln,
                &csi,
                spec(json!({"values": {"extra": 1}})),
            ),
            &[],
        ),
        row(
            "csi.suspend",
            patch(Mallory, hr(), ln, &csi, spec(json!({"suspend": true}))),
            &[],
        ),
        row(
            "csi.finalizer",
            patch(
                Mallory,
                hr(),
                ln,
                &csi,
                json!({"metadata": {"finalizers": null}}),
            ),
            &[],
        ),
        row("csi.owner", Send::Scenario(Scenario::CsiOwner), &[]),
        // Other children.
        row(
            "child.delete-live",
            delete(Mallory, hr(), ln, &coredns),
            &[],
        ),
        row(
            "child.release-name-live",
            patch(
                Mallory,
                hr(),
                ln,
                &coredns,
                spec(json!({"releaseName": "moved"})),
            ),
            &[],
        ),
        row(
            "child.delete",
            delete(Mallory, hr(), hn, &h_coredns),
            &["is being torn down"],
        ),
        row(
            "child.relabel",
            patch(Mallory, hr(), hn, &h_coredns, no_label(CHILD)),
            &["relabel", "is being torn down"],
        ),
        row(
            "child.release-name",
            patch(
                Mallory,
                hr(),
                hn,
                &h_coredns,
                spec(json!({"releaseName": "moved"})),
            ),
            &["its Helm release name", "is being torn down"],
        ),
        row(
            "child.unlabelled-delete",
            delete(Mallory, hr(), hn, &format!("{hc}-cilium")),
            &["is being torn down"],
        ),
        row(
            "child.status",
            patch_status(Mallory, hr(), ln, &coredns, forged_status("csi")),
            &["only its controller"],
        ),
        // A release of no tenant whose status is made to name the tenant's
        // own Helm release: helm-controller would uninstall that one.
        row(
            "other.status",
            patch_status(Mallory, hr(), ln, "plain", forged_status(lc)),
            &["only its controller"],
        ),
        // The parent.
        row("parent.delete", delete(Mallory, hr(), ln, lc), &[]),
        parent_spec(
            "parent.chart",
            json!({"chartRef": {"name": "chart-demo"}}),
            "the chart it installs",
        ),
        parent_spec(
            "parent.release-name",
            json!({"releaseName": "moved"}),
            "its Helm release name",
        ),
        row(
            "parent.status",
            patch_status(Mallory, hr(), ln, lc, forged_status("kubernetes-other")),
            &["only its controller"],
        ),
        row(
            "parent.unlabel",
            patch(
                Mallory,
                hr(),
                ln,
                lc,
                no_label("apps.cozystack.io/application.kind"),
            ),
            &["tenant labels"],
        ),
        row(
            "parent.record",
            patch(
                Mallory,
                hr(),
                ln,
                lc,
                json!({"metadata": {"annotations": {&keys.phase: "Released"}}}),
            ),
            &["written only by the volume-gate worker"],
        ),
        row(
            "parent.visible-record",
            Send::Scenario(Scenario::VisibleRecord),
            &[],
        ),
        row(
            "parent.custody",
            patch(
                Mallory,
                hr(),
                ln,
                lc,
                json!({"metadata": {"finalizers": [common::flux::FLUX_FINALIZER]}}),
            ),
            &["custody finalizer"],
        ),
        row(
            "parent.values",
            patch(Mallory, hr(), ln, lc, spec(json!({"values": {"extra": 1}}))),
            &[],
        ),
        // A release that carried a record before it was labelled a tenant.
        row(
            "adopt.record",
            patch(
                Mallory,
                hr(),
                ln,
                "kubernetes-adopted",
                json!({"metadata": {"labels": {
                    "apps.cozystack.io/application.kind": "Kubernetes",
                    "apps.cozystack.io/application.group": "apps.cozystack.io"}}}),
            ),
            &["written only by the volume-gate worker"],
        ),
        // Markers that name no tenant, and the namespace they once wedged.
        marker(
            "marker.release",
            core("ConfigMap", "configmaps"),
            "bad-release",
        ),
        marker("marker.child", hr(), "bad-child"),
        marker("marker.capi", capi("Cluster", "clusters"), "bad-cluster"),
        row(
            "marker.namespace",
            Send::Scenario(Scenario::MarkerNamespace),
            &[],
        ),
        // The held tenant's dependencies.
        row(
            "large.release-object",
            Send::Scenario(Scenario::LargeReleaseObject),
            &[],
        ),
        row(
            "kcsi-sa.delete",
            delete(
                Mallory,
                core("ServiceAccount", "serviceaccounts"),
                hn,
                &kcsi,
            ),
            &["frees disks with", "is being torn down"],
        ),
        row(
            "kcsi-role.delete",
            delete(
                Admin,
                resource("rbac.authorization.k8s.io", "v1", "Role", "roles"),
                hn,
                &kcsi,
            ),
            &["frees disks with"],
        ),
        row(
            "kcsi-rolebinding.delete",
            delete(
                Admin,
                resource(
                    "rbac.authorization.k8s.io",
                    "v1",
                    "RoleBinding",
                    "rolebindings",
                ),
                hn,
                &kcsi,
            ),
            &["frees disks with"],
        ),
        row(
            "kcsi-clusterrole.delete",
            Send::Scenario(Scenario::ClusterRoleDelete),
            &[],
        ),
        row(
            "kcsi-controller.delete",
            delete(
                Mallory,
                resource("apps", "v1", "Deployment", "deployments"),
                hn,
                &format!("{hc}-kcsi-controller"),
            ),
            &["CSI controller"],
        ),
        row(
            "kcsi-controller.scale",
            Send::PatchScale {
                who: Mallory,
                ar: resource("apps", "v1", "Deployment", "deployments"),
                ns: hn.clone(),
                name: format!("{hc}-kcsi-controller"),
                body: json!({"spec": {"replicas": 0}}),
            },
            &[],
        ),
        row(
            "driver-config.delete",
            delete(
                Mallory,
                core("ConfigMap", "configmaps"),
                hn,
                "driver-config",
            ),
            &[],
        ),
        row(
            "admin-kubeconfig.delete",
            delete(Mallory, core("Secret", "secrets"), hn, &kubeconfig),
            &["admin kubeconfig"],
        ),
        row(
            "admin-kubeconfig.data",
            patch(
                Mallory,
                core("Secret", "secrets"),
                hn,
                &kubeconfig,
                json!({"data": {&common::profile().kubeconfig.keys[0]: common::tenant::base64(b"elsewhere")}}),
            ),
            &[],
        ),
        row(
            "kamajicontrolplane.delete",
            delete(Mallory, kcp_resource(), hn, hc),
            &["control plane"],
        ),
        row(
            "tenantcontrolplane.delete",
            delete(Mallory, tcp_resource(), hn, hc),
            &["API server"],
        ),
        row(
            "tenantcontrolplane.endpoint",
            patch_status(
                Mallory,
                tcp_resource(),
                hn,
                hc,
                json!({"status": {"controlPlaneEndpoint": "10.9.9.9:6443"}}),
            ),
            &[],
        ),
        row(
            "cluster.delete",
            delete(Mallory, capi("Cluster", "clusters"), hn, hc),
            &["Cluster API cluster"],
        ),
        row(
            "machinedeployment.delete",
            delete(
                Mallory,
                capi("MachineDeployment", "machinedeployments"),
                hn,
                &format!("{hc}-md0"),
            ),
            &["worker machines"],
        ),
        row(
            "machine.delete",
            delete(Mallory, capi("Machine", "machines"), hn, &w.machine),
            &["worker machines"],
        ),
        row(
            "machine.relabel",
            patch(
                Mallory,
                capi("Machine", "machines"),
                hn,
                &w.machine,
                no_label(CAPI),
            ),
            &["relabel"],
        ),
        // The live tenant's disk on the management side.
        row(
            "datavolume.relabel",
            patch(Mallory, datavolume_resource(), ln, &w.dv, no_label(CAPI)),
            &["relabel", &w.dv],
        ),
        row(
            "datavolume.delete",
            delete(Mallory, datavolume_resource(), ln, &w.dv),
            &[],
        ),
        // A tenant in teardown whose volumes no pass could inventory (no
        // API behind it): nothing says yet which of its disks are to be kept.
        row(
            "datavolume.delete-uninventoried",
            delete(
                NamespaceController,
                datavolume_resource(),
                &w.paper,
                "kubernetes-paper-disk",
            ),
            &["not inventoried", "is being torn down"],
        ),
        row(
            "datavolume.delete-by-hand",
            Send::Scenario(Scenario::DiskDeleteByHand),
            &[],
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_of_the_reviewed_surface_gets_the_answer_the_table_states() {
    let env = env();
    let cp = env.cp;
    let table = table();
    let stated: BTreeMap<String, Answer> = table.iter().cloned().collect();
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
    let namespace_controller = cp
        .client_as(
            volume_gate::admission::gate::NAMESPACE_CONTROLLER,
            &["system:serviceaccounts", "system:authenticated"],
        )
        .await;
    let gate_log = env
        .gate
        .as_ref()
        .expect("gated")
        .lock()
        .unwrap()
        .webhook
        .log
        .clone();
    let clients = Clients {
        mallory: m.clone(),
        admin: admin.clone(),
        namespace_controller,
    };
    let mut walk = Walk {
        results: BTreeMap::new(),
        decisions: Decisions { log: gate_log },
        barrier: (
            dynamic(&m, &l.namespace, &core("Secret", "secrets")),
            common::profile().kubeconfig_secret_name(&l.name),
        ),
    };

    // What the held tenant's rows need: driver-config as Cozystack's chart
    // makes it, and a release object as large as a ConfigMap can be (six
    // times that in a review's JSON).
    let h_cms = dynamic(&admin, &h.namespace, &core("ConfigMap", "configmaps"));
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
    dynamic(&m, &h.namespace, &core("ConfigMap", "configmaps"))
        .patch("driver-config", &PatchParams::default(), &merge(unmark()))
        .await
        .expect("outside teardown an object may leave its release");
    // The held tenant's Machine, as Cluster API made it.
    let machine = h
        .machines()
        .await
        .into_iter()
        .next()
        .map(|(name, _, _)| name)
        .expect("the held tenant has a Machine");
    let dv = dynamic(&m, &l.namespace, &datavolume_resource())
        .list(&ListParams::default().labels(&format!("{CAPI}={}", l.name)))
        .await
        .expect("list DataVolumes")
        .items
        .into_iter()
        .next()
        .map(|d| d.metadata.name.unwrap_or_default())
        .expect("the live tenant's claim has a DataVolume");
    let paper = format!("{}-paper", l.namespace);
    let world = World {
        l,
        h,
        markers_ns,
        dv,
        machine,
        paper,
    };

    for row in rows_before_teardown(&world) {
        walk.walk(row, &stated, &clients, &world).await;
    }
    world.h.hold_in_teardown(&env.sim).await;

    // What the other rows name: a release of no tenant; a release that
    // carried a record before it was labelled a tenant; objects whose
    // markers name no tenant; a tenant in teardown no pass inventoried.
    let w = &world;
    hrs(&admin, &w.l.namespace)
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
                "metadata": {"name": "plain"}, "spec": common::flux::inert_spec("demo")}),
            )
            .unwrap(),
        )
        .await
        .expect("create a release of no tenant");
    let keys = common::keys();
    let carried = json!({"apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
        "metadata": {"name": "kubernetes-adopted", "annotations": {
            &keys.phase: "Released",
            &keys.override_reason: "carried in",
            &keys.override_by: "alice",
            &keys.override_at: volume_gate::record::now_rfc3339()}},
        "spec": common::flux::inert_spec("kubernetes")});
    hrs(&m, &w.l.namespace)
        .create(
            &PostParams::default(),
            &serde_json::from_value(carried).unwrap(),
        )
        .await
        .expect("a release of no tenant is not judged at creation");
    let bad: [(ApiResource, &str, Value, Value); 3] = [
        (
            core("ConfigMap", "configmaps"),
            "bad-release",
            json!({}),
            json!({"annotations": {RELEASE_NAME: "kubernetes-NOT_A_TENANT"}}),
        ),
        (
            hr(),
            "bad-child",
            json!({"spec": common::flux::inert_spec("demo")}),
            json!({"labels": {CHILD: "Not_A_Tenant"}}),
        ),
        // A Cluster: a Machine's label is Cluster API's copy of its
        // spec.clusterName (internal/webhooks/machine.go Default, v1.10.1),
        // and a Machine of no Cluster keeps Cluster API's finalizer for ever.
        (
            capi("Cluster", "clusters"),
            "bad-cluster",
            json!({"spec": {}}),
            json!({"labels": {CAPI: "UPPER"}}),
        ),
    ];
    for (ar, name, body, meta) in &bad {
        let mut o = DynamicObject::new(name, ar).within(&w.markers_ns);
        let meta: kube::api::ObjectMeta = serde_json::from_value(meta.clone()).unwrap();
        o.metadata.labels = meta.labels;
        o.metadata.annotations = meta.annotations;
        o.data = body.clone();
        dynamic(&admin, &w.markers_ns, ar)
            .create(&PostParams::default(), &o)
            .await
            .unwrap_or_else(|e| panic!("create {name}: {e}"));
    }
    cp.namespace(&w.paper).await;
    let r = "kubernetes-paper";
    common::tenant::paper_parent(&hrs(&admin, &w.paper), r).await;
    hrs(&admin, &w.paper)
        .delete(r, &DeleteParams::default())
        .await
        .expect("delete the paper parent");

    let rows = rows(w);
    // A guarded kind is added in one place, the profile's `guarded` list:
    // no rule of the gate names a kind. What proves it guarded is a row
    // here, walked on the real API server with the shipped webhook
    // configurations (what the API server sends is theirs to say).
    let refused_deletes: BTreeSet<(String, String)> = rows
        .iter()
        .filter(|r| stated.get(r.id) == Some(&Answer::Refused))
        .filter_map(|r| match &r.send {
            Send::Delete { ar, .. } => Some((ar.group.clone(), ar.kind.clone())),
            _ => None,
        })
        .collect();
    let unproven: Vec<String> = volume_gate::profile::Profile::cozystack()
        .guarded
        .iter()
        .filter(|g| !refused_deletes.contains(&(g.group.clone(), g.kind.clone())))
        .map(|g| format!("{}/{} ({})", g.group, g.kind, g.role))
        .collect();
    for row in rows {
        walk.walk(row, &stated, &clients, w).await;
    }
    walk.finish(&table);
    assert!(
        unproven.is_empty(),
        "guarded kinds of the profile with no row whose DELETE the table says is refused: {unproven:?}"
    );
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
    let csi = common::profile()
        .csi_release_name(&l.name)
        .expect("Cozystack has a CSI release");
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
