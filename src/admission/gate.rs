//! The gate: makes the reads the judge asks for (fresh GETs of the parent
//! and its namespace, a SubjectAccessReview) and asks it again, until it
//! answers. Every rule is the judge's ([`super::judge`]); the gate only
//! reads: admission has no side effects (`docs/design.md` §2).

use std::sync::Arc;

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ApiResource, PostParams};
use kube::core::DynamicObject;

use super::decide::{Target, Verdict, cannot_judge};
use super::judge::{Access, Admission, Facts, Judge, Read};
use super::request::{self, ObjectMetaView};
use crate::metrics::Metrics;
use crate::profile::Profile;
use crate::record::Keys;

pub use super::judge::NAMESPACE_CONTROLLER;

/// How many times the judge is asked for one request. Two rounds of reads
/// are the most a request needs (`docs/design.md` §4); a judge that asks
/// again for what it was given, or keeps asking, is a bug, and the gate
/// refuses rather than loops.
const MAX_ROUNDS: usize = 4;

/// The judge and what it reads through.
pub struct Gate {
    pub judge: Judge,
    pub client: kube::Client,
    pub metrics: Arc<Metrics>,
    parent_resource: ApiResource,
}

impl Gate {
    pub fn new(
        profile: Profile,
        worker_identity: String,
        client: kube::Client,
        metrics: Arc<Metrics>,
    ) -> Self {
        let parent_resource = profile.parent_resource();
        Self {
            judge: Judge::new(profile, worker_identity),
            client,
            metrics,
            parent_resource,
        }
    }

    pub fn profile(&self) -> &Profile {
        &self.judge.profile
    }

    pub fn keys(&self) -> &Keys {
        &self.judge.keys
    }

    /// The validating decision for one request: the judge's, after the
    /// reads it asked for.
    pub async fn validate(&self, req: &request::Request) -> (Target, Verdict) {
        let now = jiff::Timestamp::now();
        let mut facts = Facts::default();
        for _ in 0..MAX_ROUNDS {
            let reads = match self.judge.admit(req, &facts, now) {
                Admission::Judged(target, verdict) => return (target, verdict),
                Admission::Need(reads) => reads,
            };
            if reads.is_empty() || reads.iter().all(|r| facts.has(r)) {
                break;
            }
            let done = futures::future::join_all(
                reads
                    .into_iter()
                    .filter(|r| !facts.has(r))
                    .map(|r| self.read(req, r)),
            )
            .await;
            for fact in done {
                fact(&mut facts);
            }
        }
        (
            Target::Unrelated,
            cannot_judge("the decision asked again for what it had read (a bug in volume-gate)"),
        )
    }

    /// The mutating answer for one request (no read).
    pub fn mutate(&self, req: &request::Request) -> (Target, Verdict, Option<json_patch::Patch>) {
        self.judge.mutate(req, jiff::Timestamp::now())
    }

    /// Makes one read; the returned closure adds it to the facts.
    async fn read(&self, req: &request::Request, read: Read) -> Box<dyn FnOnce(&mut Facts) + Send> {
        self.metrics.api_reads.inc();
        match read {
            Read::Parent { namespace, name } => {
                let got = self.read_parent(&namespace, &name).await;
                Box::new(move |f: &mut Facts| f.parent(&namespace, &name, got))
            }
            Read::Namespace { name } => {
                let got = self.namespace_deleting(&name).await;
                Box::new(move |f: &mut Facts| f.namespace(&name, got))
            }
            Read::OverrideAccess { namespace, tenant } => {
                let got = self.override_access(req, &namespace, &tenant).await;
                Box::new(move |f: &mut Facts| f.access(&namespace, &tenant, got))
            }
            Read::Referrers { namespace } => {
                let got = self.list_parents(&namespace).await;
                Box::new(move |f: &mut Facts| f.referrers(&namespace, got))
            }
        }
    }

    /// The parents of a namespace as they are now (a LIST by the parent
    /// labels, never a cache): each one's name and object, whose
    /// references the judge follows.
    async fn list_parents(
        &self,
        namespace: &str,
    ) -> Result<Vec<(String, serde_json::Value)>, String> {
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), namespace, &self.parent_resource);
        let selector = self.judge.profile.parent_selector();
        let list = api
            .list(&kube::api::ListParams::default().labels(&selector))
            .await
            .map_err(|e| e.to_string())?;
        Ok(list
            .items
            .into_iter()
            .filter_map(|o| {
                let name = o.metadata.name.clone()?;
                Some((name, serde_json::to_value(&o).ok()?))
            })
            .collect())
    }

    /// The parent as it is now in the API server: a GET, never a cache, so an
    /// allow never rests on a view that has not seen a deletion yet.
    async fn read_parent(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<ObjectMetaView>, String> {
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), namespace, &self.parent_resource);
        let meta = api
            .get_metadata_opt(name)
            .await
            .map_err(|e| e.to_string())?;
        Ok(meta.map(|meta| {
            let m = meta.metadata;
            ObjectMetaView {
                namespace: namespace.to_string(),
                name: name.to_string(),
                labels: m.labels.unwrap_or_default(),
                annotations: m.annotations.unwrap_or_default(),
                finalizers: m.finalizers.unwrap_or_default(),
                deleting: m.deletion_timestamp.is_some(),
            }
        }))
    }

    async fn namespace_deleting(&self, namespace: &str) -> Result<bool, String> {
        let api: Api<Namespace> = Api::all(self.client.clone());
        Ok(api
            .get_metadata_opt(namespace)
            .await
            .map_err(|e| e.to_string())?
            .is_none_or(|ns| ns.metadata.deletion_timestamp.is_some()))
    }

    /// Whether the request's user may record an override on the tenant: a
    /// SubjectAccessReview of the profile's override permission.
    async fn override_access(
        &self,
        req: &request::Request,
        namespace: &str,
        tenant: &str,
    ) -> Result<Access, String> {
        let u = &req.user_info;
        let p = &self.judge.profile.override_permission;
        let sar = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: u.username.clone(),
                groups: u.groups.clone(),
                uid: u.uid.clone(),
                extra: u.extra.clone(),
                resource_attributes: Some(ResourceAttributes {
                    namespace: Some(namespace.to_string()),
                    name: Some(tenant.to_string()),
                    group: Some(p.group.clone()),
                    resource: Some(p.resource.clone()),
                    verb: Some(p.verb.clone()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let api: Api<SubjectAccessReview> = Api::all(self.client.clone());
        let done = api
            .create(&PostParams::default(), &sar)
            .await
            .map_err(|e| e.to_string())?;
        let status = done.status.unwrap_or_default();
        Ok(Access {
            allowed: status.allowed && !status.denied.unwrap_or(false),
            reason: status.reason.unwrap_or_default(),
        })
    }
}

/// The gate's read paths against a scripted API server: what it reads, and
/// that every failed read is a refusal.
#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::admission::review;
    use crate::testing::{FakeApi, partial_metadata};

    const WORKER: &str = "system:serviceaccount:volume-gate:volume-gate-worker";
    const NS: &str = "tenant-a";
    const PARENT: &str =
        "/apis/helm.toolkit.fluxcd.io/v2/namespaces/tenant-a/helmreleases/kubernetes-a";
    const NAMESPACE: &str = "/api/v1/namespaces/tenant-a";
    const SAR: &str = "/apis/authorization.k8s.io/v1/subjectaccessreviews";

    fn gate(api: &Arc<FakeApi>) -> Gate {
        Gate::new(
            Profile::cozystack(),
            WORKER.into(),
            api.client(),
            Metrics::new(),
        )
    }

    fn review(
        operation: &str,
        object: Option<Value>,
        old: Option<Value>,
        name: &str,
        user: &str,
    ) -> request::Request {
        let kind =
            json!({"group": "helm.toolkit.fluxcd.io", "version": "v2", "kind": "HelmRelease"});
        let body = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": "u-1", "kind": kind, "resource": {"group": "helm.toolkit.fluxcd.io", "version": "v2", "resource": "helmreleases"},
            "name": name, "namespace": NS, "operation": operation, "userInfo": {"username": user},
            "object": object, "oldObject": old, "dryRun": false}});
        review::decode(&serde_json::to_vec(&body).unwrap()).expect("a valid review")
    }

    fn release(name: &str, labels: Value, annotations: Value) -> Value {
        json!({"apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
               "metadata": {"name": name, "namespace": NS, "labels": labels, "annotations": annotations}})
    }

    fn parent_labels() -> Value {
        json!({"apps.cozystack.io/application.kind": "Kubernetes", "apps.cozystack.io/application.group": "apps.cozystack.io"})
    }

    fn child_delete(name: &str) -> request::Request {
        let old = release(
            name,
            json!({"cozystack.io/target-cluster-name": "kubernetes-a"}),
            json!({}),
        );
        review("DELETE", None, Some(old), name, "flux")
    }

    /// The parent as a metadata read returns it.
    fn parent(deleting: bool, annotations: Value) -> Value {
        let mut meta = json!({"name": "kubernetes-a", "namespace": NS, "labels": parent_labels(),
                              "annotations": annotations, "finalizers": ["volumes.cozystack.io/release"]});
        if deleting {
            meta["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        }
        partial_metadata(meta)
    }

    fn reads(api: &FakeApi) -> Vec<String> {
        api.calls().iter().map(|c| c.line()).collect()
    }

    #[tokio::test]
    async fn a_child_outside_teardown_is_allowed_only_after_reading_the_parent_and_its_namespace() {
        let api = FakeApi::new();
        api.get(PARENT, parent(false, json!({})));
        api.get(NAMESPACE, partial_metadata(json!({"name": NS})));
        let (target, verdict) = gate(&api)
            .validate(&child_delete("kubernetes-a-coredns"))
            .await;
        assert_eq!(
            target,
            Target::Child {
                tenant: "kubernetes-a".into()
            }
        );
        assert_eq!(verdict, Verdict::allow("not-in-teardown"));
        // Both read, at once (in either order).
        let mut seen = reads(&api);
        seen.sort();
        let mut both = [format!("GET {PARENT}"), format!("GET {NAMESPACE}")];
        both.sort();
        assert_eq!(seen, both);
    }

    #[tokio::test]
    async fn a_namespace_read_that_fails_refuses_only_when_the_decision_needs_it() {
        // Released: the namespace is moot, its failed read changes nothing.
        let api = FakeApi::new();
        api.get(
            PARENT,
            parent(true, json!({"volumes.cozystack.io/phase": "Released"})),
        );
        api.fail("GET", NAMESPACE, 500);
        let (_, verdict) = gate(&api)
            .validate(&child_delete("kubernetes-a-coredns"))
            .await;
        assert!(verdict.allowed(), "{verdict:?}");
        // Not in teardown: the allow would rest on it, so it refuses.
        let api = FakeApi::new();
        api.get(PARENT, parent(false, json!({})));
        api.fail("GET", NAMESPACE, 500);
        let (_, verdict) = gate(&api)
            .validate(&child_delete("kubernetes-a-coredns"))
            .await;
        let Verdict::Deny { message, .. } = verdict else {
            panic!("allowed on a failed namespace read")
        };
        assert!(
            message.contains("cannot read namespace tenant-a"),
            "{message}"
        );
    }

    #[tokio::test]
    async fn a_namespace_deletion_holds_the_pods_named_for_a_tenant_until_it_is_done() {
        let hrs = "/apis/helm.toolkit.fluxcd.io/v2/namespaces/tenant-a/helmreleases";
        let pod = |name: &str, owner: &str| {
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS,
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": owner,
                                     "uid": "u", "controller": true}]}})
        };
        let delete = |obj: Value| {
            let name = obj["metadata"]["name"].as_str().unwrap().to_string();
            let mut req = review("DELETE", None, Some(obj), &name, NAMESPACE_CONTROLLER);
            req.kind.group = String::new();
            req.kind.kind = "Pod".into();
            req
        };
        // The tenant API server's Pod, by its ReplicaSet: held in teardown.
        // Every name it could be named for is read (a 404 is no parent).
        let api = FakeApi::new();
        api.get(
            PARENT,
            parent(true, json!({"volumes.cozystack.io/phase": "Releasing"})),
        );
        let (target, verdict) = gate(&api)
            .validate(&delete(pod("virt-x", "kubernetes-a-7d9f")))
            .await;
        assert_eq!(verdict.reason(), "teardown-held", "{verdict:?}");
        assert!(matches!(target, Target::Guarded { ref tenant, .. } if tenant == "kubernetes-a"));
        let read: Vec<String> = api.calls().into_iter().map(|c| c.path).collect();
        assert!(
            read.contains(&format!("{hrs}/kubernetes-a-7d9f"))
                && read.contains(&PARENT.to_string()),
            "{read:?}"
        );
        // Done: allowed.
        let api = FakeApi::new();
        api.get(
            PARENT,
            parent(true, json!({"volumes.cozystack.io/phase": "Released"})),
        );
        let (_, verdict) = gate(&api)
            .validate(&delete(pod("kubernetes-a-7d9f-x", "kubernetes-a-7d9f")))
            .await;
        assert!(verdict.allowed(), "{verdict:?}");
        // Named for no tenant (no parent answers): allowed; and nothing is
        // read for a name that cannot be a parent's.
        let api = FakeApi::new();
        let (_, verdict) = gate(&api)
            .validate(&delete(pod("kubernetes-b-1", "kubernetes-b")))
            .await;
        assert_eq!(verdict.reason(), "unrelated");
        let api = FakeApi::new();
        let (_, verdict) = gate(&api).validate(&delete(pod("etcd-0", "etcd"))).await;
        assert_eq!(verdict.reason(), "unrelated");
        assert!(api.calls().is_empty(), "{:?}", reads(&api));
        // A failed read refuses.
        let api = FakeApi::new();
        api.fail("GET", PARENT, 500);
        let (_, verdict) = gate(&api)
            .validate(&delete(pod("kubernetes-a-7d9f-x", "kubernetes-a-7d9f")))
            .await;
        assert!(!verdict.allowed(), "{verdict:?}");
    }

    #[tokio::test]
    async fn the_namespace_controllers_deletes_read_the_namespace_only_when_needed() {
        // In a namespace deletion the parent is being deleted: one read.
        let api = FakeApi::new();
        api.get(
            PARENT,
            parent(true, json!({"volumes.cozystack.io/phase": "Releasing"})),
        );
        let mut req = child_delete("kubernetes-a-coredns");
        req.user_info.username = Some(NAMESPACE_CONTROLLER.into());
        let (_, verdict) = gate(&api).validate(&req).await;
        assert_eq!(verdict.reason(), "teardown-held");
        assert_eq!(reads(&api), [format!("GET {PARENT}")]);
        // The name is a hint, not a fact: with the parent live the namespace
        // is still read (after the parent) before anything is allowed.
        let api = FakeApi::new();
        api.get(PARENT, parent(false, json!({})));
        api.get(
            NAMESPACE,
            partial_metadata(json!({"name": NS, "deletionTimestamp": "2026-01-01T00:00:00Z"})),
        );
        let (_, verdict) = gate(&api).validate(&req).await;
        assert_eq!(verdict.reason(), "teardown-held");
        assert_eq!(
            reads(&api),
            [format!("GET {PARENT}"), format!("GET {NAMESPACE}")]
        );
        let api = FakeApi::new();
        api.get(PARENT, parent(false, json!({})));
        api.get(NAMESPACE, partial_metadata(json!({"name": NS})));
        let (_, verdict) = gate(&api).validate(&req).await;
        assert_eq!(verdict, Verdict::allow("not-in-teardown"));
    }

    #[tokio::test]
    async fn a_child_in_a_deleting_namespace_is_refused_naming_the_tenant() {
        let api = FakeApi::new();
        api.get(PARENT, parent(false, json!({})));
        api.get(
            NAMESPACE,
            partial_metadata(json!({"name": NS, "deletionTimestamp": "2026-01-01T00:00:00Z"})),
        );
        let (_, verdict) = gate(&api)
            .validate(&child_delete("kubernetes-a-coredns"))
            .await;
        let Verdict::Deny {
            reason, message, ..
        } = verdict
        else {
            panic!("allowed")
        };
        assert_eq!(reason, "teardown-held");
        assert!(
            message.contains("tenant kubernetes-a in namespace tenant-a is being torn down"),
            "{message}"
        );
    }

    /// A DELETE of ServiceAccount `name` that helm-controller installed with
    /// release kubernetes-a.
    fn release_sa_delete(name: &str) -> request::Request {
        let old = json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": NS,
            "labels": {"helm.toolkit.fluxcd.io/name": "kubernetes-a", "helm.toolkit.fluxcd.io/namespace": NS}}});
        let body = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "ServiceAccount"},
            "resource": {"group": "", "version": "v1", "resource": "serviceaccounts"},
            "name": name, "namespace": NS, "operation": "DELETE", "userInfo": {"username": "helm-controller"},
            "oldObject": old, "dryRun": false}});
        review::decode(&serde_json::to_vec(&body).unwrap()).expect("a valid review")
    }

    #[tokio::test]
    async fn the_teardown_hooks_own_objects_are_not_held_by_name_while_the_drivers_identity_is() {
        let api = FakeApi::new();
        api.get(
            PARENT,
            parent(true, json!({"volumes.cozystack.io/phase": "Releasing"})),
        );
        // The CSI controller's own ServiceAccount is held by its name, with
        // or without the release's markers.
        let held = FakeApi::new();
        held.get(
            PARENT,
            parent(true, json!({"volumes.cozystack.io/phase": "Releasing"})),
        );
        let (target, verdict) = gate(&held)
            .validate(&release_sa_delete("kubernetes-a-kcsi"))
            .await;
        assert_eq!(
            target,
            Target::Guarded {
                tenant: "kubernetes-a".into(),
                role: "the identity the tenant's CSI controller frees disks with".into(),
            }
        );
        assert_eq!(verdict.reason(), "teardown-held");
        let (target, verdict) = gate(&api)
            .validate(&release_sa_delete("kubernetes-a-metrics"))
            .await;
        assert_eq!(
            target,
            Target::ReleaseObject {
                tenant: "kubernetes-a".into(),
                namespace: NS.into()
            }
        );
        assert_eq!(verdict.reason(), "teardown-held");
        // Helm deletes the hook's ServiceAccount when the hook fails
        // (hook-failed) and before it runs again (before-hook-creation).
        let (target, verdict) = gate(&api)
            .validate(&release_sa_delete("kubernetes-a-cleanup"))
            .await;
        assert_eq!(
            (target, verdict),
            (Target::Unrelated, Verdict::allow("unrelated"))
        );
        // The release object's decision read the parent and, at once, the
        // namespace (whose answer a deleting parent makes moot); the hook's
        // object needed no read.
        let mut seen = reads(&api);
        seen.sort();
        let mut first = [format!("GET {PARENT}"), format!("GET {NAMESPACE}")];
        first.sort();
        assert_eq!(seen, first, "the hook's object needs no read");
    }

    #[tokio::test]
    async fn a_failed_parent_read_is_a_refusal_and_nothing_more_is_read() {
        let api = FakeApi::new();
        api.fail("GET", PARENT, 500);
        let (_, verdict) = gate(&api).validate(&child_delete("kubernetes-a-csi")).await;
        let Verdict::Deny { message, .. } = verdict else {
            panic!("allowed on a failed read")
        };
        assert!(
            message.contains("cannot read tenant tenant-a/kubernetes-a"),
            "{message}"
        );
        assert_eq!(reads(&api), [format!("GET {PARENT}")]);
    }

    #[tokio::test]
    async fn a_failed_namespace_read_is_a_refusal() {
        let api = FakeApi::new();
        api.get(PARENT, parent(false, json!({})));
        api.fail("GET", NAMESPACE, 503);
        let (_, verdict) = gate(&api)
            .validate(&child_delete("kubernetes-a-coredns"))
            .await;
        let Verdict::Deny { message, .. } = verdict else {
            panic!("allowed on a failed read")
        };
        assert!(
            message.contains("cannot read namespace tenant-a"),
            "{message}"
        );
    }

    #[tokio::test]
    async fn the_csi_release_is_refused_until_done_and_allowed_after_without_a_namespace_read() {
        let api = FakeApi::new();
        api.get(
            PARENT,
            parent(true, json!({"volumes.cozystack.io/phase": "Releasing"})),
        );
        let (_, verdict) = gate(&api).validate(&child_delete("kubernetes-a-csi")).await;
        assert_eq!(verdict.reason(), "csi-release-held");
        api.get(
            PARENT,
            parent(true, json!({"volumes.cozystack.io/phase": "Released"})),
        );
        let (_, verdict) = gate(&api).validate(&child_delete("kubernetes-a-csi")).await;
        assert_eq!(verdict, Verdict::allow("done"));
        assert!(
            api.calls_to("GET", NAMESPACE).is_empty(),
            "{:?}",
            reads(&api)
        );
    }

    #[tokio::test]
    async fn a_child_without_a_parent_is_allowed_with_a_warning() {
        let api = FakeApi::new();
        let (_, verdict) = gate(&api).validate(&child_delete("kubernetes-a-csi")).await;
        let Verdict::Allow { reason, warnings } = verdict else {
            panic!("refused")
        };
        assert_eq!(reason, "parent-absent");
        assert!(
            warnings[0].contains("tenant kubernetes-a has no parent release"),
            "{warnings:?}"
        );
    }

    #[tokio::test]
    async fn a_parent_delete_is_judged_from_the_review_alone() {
        let api = FakeApi::new();
        let mut old = release("kubernetes-a", parent_labels(), json!({}));
        old["metadata"]["finalizers"] = json!(["volumes.cozystack.io/release"]);
        let (target, verdict) = gate(&api)
            .validate(&review("DELETE", None, Some(old), "kubernetes-a", "alice"))
            .await;
        assert_eq!(
            target,
            Target::Parent {
                tenant: "kubernetes-a".into()
            }
        );
        assert!(verdict.allowed());
        assert!(api.calls().is_empty(), "{:?}", reads(&api));
    }

    /// An override by a person: allowed only when a SubjectAccessReview
    /// made for this request allows it; a failed review is a refusal.
    #[tokio::test]
    async fn an_override_rests_on_a_subject_access_review() {
        let old = release("kubernetes-a", parent_labels(), json!({}));
        let new = release(
            "kubernetes-a",
            parent_labels(),
            json!({
                "volumes.cozystack.io/override": "abandoned",
                "volumes.cozystack.io/override-by": "alice",
                "volumes.cozystack.io/override-at": crate::record::now_rfc3339(),
            }),
        );
        let req = review("UPDATE", Some(new), Some(old), "kubernetes-a", "alice");
        for (status, body, allowed) in [
            (201, json!({"status": {"allowed": true}}), true),
            (
                201,
                json!({"status": {"allowed": false, "reason": "no RBAC"}}),
                false,
            ),
            (
                201,
                json!({"status": {"allowed": true, "denied": true}}),
                false,
            ),
            (500, crate::testing::status_body(500), false),
        ] {
            let api = FakeApi::new();
            let mut sar = body.clone();
            sar["apiVersion"] = json!("authorization.k8s.io/v1");
            sar["kind"] = json!("SubjectAccessReview");
            sar["spec"] = json!({});
            api.on(
                "POST",
                SAR,
                status,
                if status == 201 { sar } else { body.clone() },
            );
            let (_, verdict) = gate(&api).validate(&req).await;
            assert_eq!(verdict.allowed(), allowed, "{status} {body}: {verdict:?}");
            let calls = api.calls_to("POST", SAR);
            assert_eq!(calls.len(), 1);
            let attrs = &calls[0].body["spec"]["resourceAttributes"];
            assert_eq!(
                (attrs["verb"].as_str(), attrs["name"].as_str()),
                (Some("override"), Some("kubernetes-a")),
                "{attrs}"
            );
            assert_eq!(calls[0].body["spec"]["user"], "alice");
        }
    }

    fn csi_release(spec: Value) -> Value {
        let mut r = release(
            "kubernetes-a-csi",
            json!({"cozystack.io/target-cluster-name": "kubernetes-a"}),
            json!({}),
        );
        r["spec"] = spec;
        r
    }

    fn spec(release_name: &str) -> Value {
        json!({"releaseName": release_name, "targetNamespace": "kube-system", "storageNamespace": "kube-system",
               "chartRef": {"kind": "ExternalArtifact", "name": "chart-csi"}, "values": {"big": "x"}})
    }

    #[tokio::test]
    async fn a_spec_change_that_uninstalls_the_csi_release_is_refused_and_an_upgrade_is_not_even_read()
     {
        let api = FakeApi::new();
        api.get(PARENT, parent(false, json!({})));
        api.get(NAMESPACE, partial_metadata(json!({"name": NS})));
        let retarget = review(
            "UPDATE",
            Some(csi_release(spec("other"))),
            Some(csi_release(spec("csi"))),
            "kubernetes-a-csi",
            "mallory",
        );
        let (target, verdict) = gate(&api).validate(&retarget).await;
        assert_eq!(
            target,
            Target::CsiRelease {
                tenant: "kubernetes-a".into()
            }
        );
        let Verdict::Deny {
            reason, message, ..
        } = verdict
        else {
            panic!("a retarget of the CSI release was allowed")
        };
        assert_eq!(reason, "csi-release-held");
        assert!(
            message.contains("change its Helm release name"),
            "{message}"
        );
        // New values, the same chart and target: nothing to judge, nothing read.
        let api = FakeApi::new();
        let mut values = spec("csi");
        values["values"] = json!({"big": "y"});
        let upgrade = review(
            "UPDATE",
            Some(csi_release(values)),
            Some(csi_release(spec("csi"))),
            "kubernetes-a-csi",
            "mallory",
        );
        let (_, verdict) = gate(&api).validate(&upgrade).await;
        assert!(verdict.allowed(), "{verdict:?}");
        assert!(api.calls().is_empty(), "{:?}", reads(&api));
    }

    #[tokio::test]
    async fn a_parent_retarget_is_refused_from_the_review_alone() {
        let api = FakeApi::new();
        let mut old = release("kubernetes-a", parent_labels(), json!({}));
        old["spec"] = json!({"chartRef": {"kind": "ExternalArtifact", "name": "kubernetes"}});
        let mut new = old.clone();
        new["spec"]["chartRef"]["name"] = json!("empty");
        let (target, verdict) = gate(&api)
            .validate(&review(
                "UPDATE",
                Some(new),
                Some(old),
                "kubernetes-a",
                "mallory",
            ))
            .await;
        assert_eq!(
            target,
            Target::Parent {
                tenant: "kubernetes-a".into()
            }
        );
        assert_eq!(verdict.reason(), "parent-removal-held");
        assert!(api.calls().is_empty(), "{:?}", reads(&api));
    }

    #[tokio::test]
    async fn a_status_write_by_anyone_but_the_controller_is_refused_without_a_read() {
        let api = FakeApi::new();
        let obj = csi_release(spec("csi"));
        let mut req = review(
            "UPDATE",
            Some(obj.clone()),
            Some(obj),
            "kubernetes-a-csi",
            "mallory",
        );
        req.sub_resource = Some("status".into());
        let (_, verdict) = gate(&api).validate(&req).await;
        assert_eq!(verdict.reason(), "status-forged");
        req.user_info.username = Some("system:serviceaccount:cozy-fluxcd:flux".into());
        let (_, verdict) = gate(&api).validate(&req).await;
        assert!(verdict.allowed(), "{verdict:?}");
        assert!(api.calls().is_empty(), "{:?}", reads(&api));
    }

    #[tokio::test]
    async fn a_delete_whose_marker_names_no_tenant_is_allowed_with_a_warning_and_nothing_read() {
        let api = FakeApi::new();
        let old = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm", "namespace": NS,
            "annotations": {"meta.helm.sh/release-name": "kubernetes-a/b", "meta.helm.sh/release-namespace": NS}}});
        let body = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
            "resource": {"group": "", "version": "v1", "resource": "configmaps"},
            "name": "cm", "namespace": NS, "operation": "DELETE",
            "userInfo": {"username": "system:serviceaccount:kube-system:namespace-controller"},
            "oldObject": old, "dryRun": false}});
        let req = review::decode(&serde_json::to_vec(&body).unwrap()).unwrap();
        let (_, verdict) = gate(&api).validate(&req).await;
        let Verdict::Allow { warnings, .. } = verdict else {
            panic!("refused: {verdict:?}")
        };
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("meta.helm.sh/release-name"),
            "{warnings:?}"
        );
        assert!(api.calls().is_empty(), "{:?}", reads(&api));
    }

    #[tokio::test]
    async fn only_the_namespace_controllers_disk_deletes_wait_for_the_inventory() {
        let dv = json!({"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume", "metadata": {"name": "pvc-1",
            "namespace": NS, "labels": {"cluster.x-k8s.io/cluster-name": "kubernetes-a"}}});
        let delete = |user: &str| {
            let body = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
                "uid": "u-1", "kind": {"group": "cdi.kubevirt.io", "version": "v1beta1", "kind": "DataVolume"},
                "resource": {"group": "cdi.kubevirt.io", "version": "v1beta1", "resource": "datavolumes"},
                "name": "pvc-1", "namespace": NS, "operation": "DELETE", "userInfo": {"username": user},
                "oldObject": dv, "dryRun": false}});
            review::decode(&serde_json::to_vec(&body).unwrap()).unwrap()
        };
        // In teardown, no inventory yet: the namespace controller waits.
        let api = FakeApi::new();
        api.get(
            PARENT,
            parent(true, json!({"volumes.cozystack.io/phase": "Blocked"})),
        );
        let (_, verdict) = gate(&api).validate(&delete(NAMESPACE_CONTROLLER)).await;
        assert_eq!(verdict.reason(), "infra-disk-uninventoried");
        // A hand, or the driver, frees the disk, with nothing read.
        let api = FakeApi::new();
        let (_, verdict) = gate(&api)
            .validate(&delete("system:serviceaccount:tenant-a:kubernetes-a-kcsi"))
            .await;
        assert_eq!(verdict, Verdict::allow("frees-the-disk"));
        assert!(api.calls().is_empty(), "{:?}", reads(&api));
    }
}
