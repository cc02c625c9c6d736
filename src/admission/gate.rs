//! The gate: gathers the facts a decision needs (fresh reads of the parent,
//! its namespace, a SubjectAccessReview) and hands them to the pure
//! decisions of [`super::decide`]. It only reads: admission has no side
//! effects (`docs/design.md` §2).

use std::sync::Arc;

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ApiResource, PostParams};
use kube::core::admission::Operation;
use kube::core::{DynamicObject, PartialObjectMeta};

use super::decide::flux::{self, Release};
use super::decide::{
    self, Change, ObjectMetaView, ParentFacts, Requester, Subject, Target, UpdateVerdict, Verdict,
    cannot_judge, classify,
};
use super::review;
use crate::metrics::Metrics;
use crate::names::is_subdomain as is_object_name;
use crate::profile::Profile;
use crate::record::Keys;

/// Who deletes a namespace's contents once it is being deleted.
pub const NAMESPACE_CONTROLLER: &str = "system:serviceaccount:kube-system:namespace-controller";

/// Everything a decision needs besides the request.
pub struct Gate {
    pub profile: Profile,
    pub keys: Keys,
    pub worker_identity: String,
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
            keys: Keys::new(&profile.annotation_prefix),
            profile,
            worker_identity,
            client,
            metrics,
            parent_resource,
        }
    }

    fn requester<'a>(&self, req: &'a review::Request) -> Requester<'a> {
        let username = req.user_info.username.as_deref().unwrap_or("");
        Requester {
            username,
            is_worker: !username.is_empty() && username == self.worker_identity,
        }
    }

    /// The parent as it is now in the API server: a GET, never a cache, so an
    /// allow never rests on a view that has not seen a deletion yet.
    async fn read_parent(
        &self,
        namespace: &str,
        tenant: &str,
    ) -> Result<Option<ParentFacts>, kube::Error> {
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), namespace, &self.parent_resource);
        self.metrics.api_reads.inc();
        let Some(meta) = api.get_metadata_opt(tenant).await? else {
            return Ok(None);
        };
        Ok(self.parent_facts(namespace, tenant, &meta))
    }

    fn parent_facts(
        &self,
        namespace: &str,
        tenant: &str,
        meta: &PartialObjectMeta<DynamicObject>,
    ) -> Option<ParentFacts> {
        let m = &meta.metadata;
        let view = ObjectMetaView {
            namespace: namespace.to_string(),
            name: tenant.to_string(),
            labels: m.labels.clone().unwrap_or_default(),
            annotations: m.annotations.clone().unwrap_or_default(),
            finalizers: m.finalizers.clone().unwrap_or_default(),
            deleting: m.deletion_timestamp.is_some(),
        };
        self.profile
            .is_parent(&view.labels)
            .then(|| ParentFacts::of(&self.profile, &self.keys, namespace, tenant, &view))
    }

    async fn namespace_deleting(&self, namespace: &str) -> Result<bool, kube::Error> {
        let api: Api<Namespace> = Api::all(self.client.clone());
        self.metrics.api_reads.inc();
        Ok(api
            .get_metadata_opt(namespace)
            .await?
            .is_none_or(|ns| ns.metadata.deletion_timestamp.is_some()))
    }

    /// The validating decision for one request.
    pub async fn validate(&self, req: &review::Request) -> (Target, Verdict) {
        let kind = review::group_kind(req);
        let namespace = req.namespace.as_deref().unwrap_or("");
        let name = review::request_name(req);
        match req.operation {
            Operation::Delete => {
                if name.is_empty() {
                    return (
                        Target::Unrelated,
                        cannot_judge(format!(
                            "DELETE of {kind} in namespace {namespace:?} names no object"
                        )),
                    );
                }
                let Some(old) = req.old_object.as_ref() else {
                    // Without the object its labels are unknown: never guess.
                    let target = classify(&self.profile, &kind, name, &Default::default());
                    return (
                        target,
                        cannot_judge(format!(
                            "DELETE of {kind} {namespace}/{name} carries no oldObject"
                        )),
                    );
                };
                let labels = review::labels_of(Some(old));
                // The namespace controller deletes only in a namespace being
                // deleted: a hint for what to read first, never a fact a
                // verdict rests on.
                let from_ns_controller =
                    req.user_info.username.as_deref() == Some(NAMESPACE_CONTROLLER);
                let subject = Subject::delete(&kind, namespace, name);
                let mut judged = Vec::new();
                let ids = decide::identities_of(&self.profile, &kind, name, &labels, &old.spec);
                let mut ids = decide::with_release_identity(
                    ids,
                    namespace,
                    self.release_of(namespace, name, Some(old)),
                );
                // A namespace being deleted takes what the phase runs on:
                // what has no other identity (Pods, ReplicaSets, Services)
                // is held for the tenants it is named for.
                if from_ns_controller && ids.is_empty() {
                    match self.named_for(&kind, namespace, name, old).await {
                        Ok(tenants) => {
                            for tenant in tenants {
                                if !ids.iter().any(|t| {
                                    !matches!(t, Target::Parent { .. })
                                        && t.tenant() == Some(tenant.as_str())
                                }) {
                                    ids.push(Target::Guarded {
                                        tenant,
                                        role: decide::NAMESPACE_ROAD_ROLE.to_string(),
                                    });
                                }
                            }
                        }
                        Err(e) => {
                            judged.push((
                                Target::Unrelated,
                                cannot_judge(format!(
                                    "refusing to delete {subject}: cannot read the tenants it may be named \
                                     for in namespace {namespace}: {e}"
                                )),
                            ));
                        }
                    }
                }
                for target in ids {
                    let verdict = match &target {
                        Target::Parent { tenant } => {
                            let view = review::meta_view(old, namespace, name);
                            let facts = ParentFacts::of(
                                &self.profile,
                                &self.keys,
                                namespace,
                                tenant,
                                &view,
                            );
                            decide::decide_parent_delete(&self.profile, subject, &facts)
                        }
                        Target::CsiRelease { tenant }
                        | Target::Child { tenant }
                        | Target::Guarded { tenant, .. } => {
                            let tenant = tenant.clone();
                            self.decide_dependent(
                                &target,
                                subject,
                                namespace,
                                &tenant,
                                from_ns_controller,
                            )
                            .await
                        }
                        Target::ReleaseObject {
                            tenant,
                            namespace: parent_namespace,
                        } => {
                            let (tenant, parent_namespace) =
                                (tenant.clone(), parent_namespace.clone());
                            self.decide_dependent(
                                &target,
                                subject,
                                &parent_namespace,
                                &tenant,
                                from_ns_controller && parent_namespace == namespace,
                            )
                            .await
                        }
                        // Deleting a disk frees it, as the driver does, and
                        // a hand deleting one decides so. The namespace
                        // controller deletes everything at once: its deletes
                        // wait until the phase has kept what must stay.
                        Target::InfraDisk { tenant } if from_ns_controller => {
                            let tenant = tenant.clone();
                            self.decide_dependent(
                                &target,
                                subject,
                                namespace,
                                &tenant,
                                from_ns_controller,
                            )
                            .await
                        }
                        Target::InfraDisk { .. } => Verdict::allow("frees-the-disk"),
                        Target::Unrelated => Verdict::allow("unrelated"),
                    };
                    judged.push((target, verdict));
                }
                self.warn_impossible_markers(
                    &kind,
                    &[req.old_object.as_ref()],
                    strictest_of(judged),
                )
            }
            // helm-controller trusts a release's status: only it writes one.
            Operation::Update if req.sub_resource.as_deref() == Some("status") => {
                if kind != self.profile.parent_kind() {
                    return (Target::Unrelated, Verdict::allow("unrelated"));
                }
                let labels = review::labels_of(req.old_object.as_ref());
                (
                    classify(&self.profile, &kind, name, &labels),
                    decide::decide_status_write(
                        &self.profile,
                        Subject::delete(&kind, namespace, name).with_action(decide::STATUS_ACTION),
                        self.requester(req).username,
                    ),
                )
            }
            Operation::Create | Operation::Update => {
                let mut judged = Vec::new();
                // A change that makes helm-controller uninstall the release
                // (first: its refusal says most about such a change).
                if kind == self.profile.parent_kind()
                    && let (Some(old), Some(new)) = (req.old_object.as_ref(), req.object.as_ref())
                {
                    let who = self.requester(req).username;
                    judged.extend(
                        self.judge_removal(&kind, namespace, name, (old, new), who)
                            .await,
                    );
                }
                // A change of what the object is: judged like the delete it enables.
                if req.operation == Operation::Update {
                    let old = review::labels_of(req.old_object.as_ref());
                    let new = review::labels_of(req.object.as_ref());
                    let subject = Subject::delete(&kind, namespace, name).with_action("relabel");
                    let none = review::SpecView::default();
                    let old_spec = req.old_object.as_ref().map_or(&none, |o| &o.spec);
                    let new_spec = req.object.as_ref().map_or(&none, |o| &o.spec);
                    for target in decide::relabel_targets_of(
                        &self.profile,
                        &kind,
                        name,
                        (&old, old_spec),
                        (&new, new_spec),
                    ) {
                        let tenant = target
                            .tenant()
                            .expect("a dependent has a tenant")
                            .to_string();
                        let verdict = self
                            .decide_dependent(&target, subject, namespace, &tenant, false)
                            .await;
                        judged.push((target, verdict));
                    }
                    // Taken out of (or put into) a parent release: judged as
                    // the delete of an object of each release concerned.
                    let (before, after) = (
                        self.release_of(namespace, name, req.old_object.as_ref()),
                        self.release_of(namespace, name, req.object.as_ref()),
                    );
                    if before != after {
                        for (parent_namespace, tenant) in before.into_iter().chain(after) {
                            let target = Target::ReleaseObject {
                                tenant: tenant.clone(),
                                namespace: parent_namespace.clone(),
                            };
                            let verdict = self
                                .decide_dependent(
                                    &target,
                                    subject,
                                    &parent_namespace,
                                    &tenant,
                                    false,
                                )
                                .await;
                            judged.push((target, verdict));
                        }
                    }
                }
                if kind == self.profile.parent_kind() {
                    judged.push(self.guard_release(req, &kind, namespace, name).await);
                }
                let objects = [req.old_object.as_ref(), req.object.as_ref()];
                self.warn_impossible_markers(&kind, &objects, strictest_of(judged))
            }
            _ => (Target::Unrelated, Verdict::allow("unrelated")),
        }
    }

    /// An UPDATE of a release that makes helm-controller remove what it
    /// installed while the object stays (`decide::flux`), judged like the
    /// delete it amounts to under each identity the release has before or
    /// after: the parent and the CSI release until done, another child
    /// during teardown. A move of the chart's source by the platform's own
    /// writers is its upgrade, not a removal
    /// (`decide::source_move_by_platform`).
    async fn judge_removal(
        &self,
        kind: &crate::profile::GroupKind,
        namespace: &str,
        name: &str,
        (old, new): (&review::Object, &review::Object),
        username: &str,
    ) -> Vec<(Target, Verdict)> {
        let removals = flux::removals(
            Release {
                name,
                namespace,
                spec: &old.spec,
            },
            Release {
                name,
                namespace,
                spec: &new.spec,
            },
        );
        if removals.is_empty() {
            return Vec::new();
        }
        let mut targets = decide::identities_of(
            &self.profile,
            kind,
            name,
            &review::labels_of(Some(old)),
            &old.spec,
        );
        for t in decide::identities_of(
            &self.profile,
            kind,
            name,
            &review::labels_of(Some(new)),
            &new.spec,
        ) {
            if !targets.contains(&t) {
                targets.push(t);
            }
        }
        let owners = (
            decide::release_of(
                &self.profile,
                namespace,
                &review::labels_of(Some(old)),
                &review::meta_view(old, namespace, name).annotations,
            ),
            decide::release_of(
                &self.profile,
                namespace,
                &review::labels_of(Some(new)),
                &review::meta_view(new, namespace, name).annotations,
            ),
        );
        let mut judged = Vec::new();
        for target in targets {
            let upgrade = decide::source_move_by_platform(
                &self.profile,
                &target,
                username,
                namespace,
                (owners.0.as_ref(), owners.1.as_ref()),
            );
            let removals: Vec<&str> = removals
                .iter()
                .copied()
                .filter(|r| !(upgrade && *r == flux::CHART))
                .collect();
            if removals.is_empty() {
                judged.push((target, Verdict::allow("platform-source-move")));
                continue;
            }
            let action = decide::removal_action(&removals);
            let subject = Subject::delete(kind, namespace, name).with_action(&action);
            let verdict = match &target {
                Target::Parent { tenant } => {
                    let view = review::meta_view(old, namespace, name);
                    let facts =
                        ParentFacts::of(&self.profile, &self.keys, namespace, tenant, &view);
                    decide::decide_parent_removal(&self.profile, subject, &facts)
                }
                Target::CsiRelease { tenant } | Target::Child { tenant } => {
                    let tenant = tenant.clone();
                    self.decide_dependent(&target, subject, namespace, &tenant, false)
                        .await
                }
                _ => continue,
            };
            judged.push((target, verdict));
        }
        judged
    }

    /// An allow of an object whose tenant markers name no tenant that can
    /// exist says so (`decide::impossible_markers`).
    fn warn_impossible_markers(
        &self,
        kind: &crate::profile::GroupKind,
        objects: &[Option<&review::Object>],
        (target, verdict): (Target, Verdict),
    ) -> (Target, Verdict) {
        let Verdict::Allow {
            reason,
            mut warnings,
        } = verdict
        else {
            return (target, verdict);
        };
        for o in objects.iter().flatten() {
            let m = &o.metadata;
            let markers = decide::impossible_markers(
                &self.profile,
                kind,
                m.labels.as_ref().unwrap_or(&Default::default()),
                m.annotations.as_ref().unwrap_or(&Default::default()),
            );
            for w in decide::impossible_marker_warnings(&markers) {
                if !warnings.contains(&w) {
                    warnings.push(w);
                }
            }
        }
        (target, Verdict::Allow { reason, warnings })
    }

    /// The tenants of `namespace` that `old` (being deleted by the
    /// namespace controller) is named for (`decide::named_for`): each
    /// parent name its name or an owner's could stand for, read by name
    /// (`decide::parent_candidates`; most objects have none, a tenant's a
    /// few).
    async fn named_for(
        &self,
        kind: &crate::profile::GroupKind,
        namespace: &str,
        name: &str,
        old: &review::Object,
    ) -> Result<Vec<String>, kube::Error> {
        let owners: Vec<&str> = old
            .metadata
            .owner_references
            .iter()
            .flatten()
            .map(|o| o.name.as_str())
            .collect();
        let mut names = owners.clone();
        names.push(name);
        if namespace.is_empty() || !is_object_name(namespace) {
            return Ok(Vec::new());
        }
        let mut parents = Vec::new();
        for candidate in decide::parent_candidates(&self.profile, &names) {
            if self.read_parent(namespace, &candidate).await?.is_some() {
                parents.push(candidate);
            }
        }
        Ok(decide::named_for(
            &self.profile,
            kind,
            name,
            &owners,
            &parents,
        ))
    }

    /// The parent release `obj` belongs to, `(namespace, release)`, unless
    /// it is one of that release's teardown hook objects (not held).
    /// `name` is the request's, never the body's.
    fn release_of(
        &self,
        namespace: &str,
        name: &str,
        obj: Option<&review::Object>,
    ) -> Option<(String, String)> {
        let view = review::meta_view(obj?, namespace, name);
        decide::release_of(&self.profile, namespace, &view.labels, &view.annotations)
            .filter(|(_, release)| !self.profile.is_release_hook(name, release))
    }

    /// The guards on CREATE/UPDATE of a release: record, override, custody.
    async fn guard_release(
        &self,
        req: &review::Request,
        kind: &crate::profile::GroupKind,
        namespace: &str,
        name: &str,
    ) -> (Target, Verdict) {
        let Some(new) = req.object.as_ref() else {
            return (
                Target::Unrelated,
                cannot_judge(format!("{kind} {namespace}/{name} carries no object")),
            );
        };
        let new_view = review::meta_view(new, namespace, name);
        let old_view = req
            .old_object
            .as_ref()
            .map(|o| review::meta_view(o, namespace, name));
        let target = classify(&self.profile, kind, &new_view.name, &new_view.labels);
        let who = self.requester(req);
        let change = Change {
            old: old_view.as_ref(),
            new: &new_view,
        };
        let verdict = match decide::guard_update(
            &self.profile,
            &self.keys,
            change,
            who,
            jiff::Timestamp::now(),
        ) {
            UpdateVerdict::Final(v) => v,
            UpdateVerdict::NeedsOverridePermission { namespace, tenant } => {
                self.check_override_permission(req, &namespace, &tenant)
                    .await
            }
        };
        (target, verdict)
    }

    async fn decide_dependent(
        &self,
        target: &Target,
        subject: Subject<'_>,
        namespace: &str,
        tenant: &str,
        namespace_likely_deleting: bool,
    ) -> Verdict {
        // Both go into URL paths: a '/' would read some other object (and a
        // 404 there reads as "no parent"). The API server never sends such
        // names; a forged review gets a refusal (found by fuzzing).
        if !is_object_name(namespace) || !is_object_name(tenant) {
            return cannot_judge(format!(
                "refusing to {} {subject}: {namespace:?}/{tenant:?} is not a namespace and name the API server would send",
                subject.action
            ));
        }
        // When the decision may need the namespace too, both are read at
        // once: the decision then waits for the slower GET, not for both in
        // turn (`docs/benchmarks.md`, benchmark 2). Not when the namespace is
        // most likely being deleted (the namespace controller's own deletes):
        // the parent is then being deleted too and the namespace is moot, so
        // a namespace deletion's burst costs the API server one read per
        // decision. Whatever was read ahead, the namespace is used only where
        // `needs_namespace` says so (read then if it was not), and only then
        // can its error refuse.
        let (parent, read_ahead) =
            if decide::may_need_namespace(target) && !namespace_likely_deleting {
                let (p, n) = tokio::join!(
                    self.read_parent(namespace, tenant),
                    self.namespace_deleting(namespace)
                );
                (p, Some(n))
            } else {
                (self.read_parent(namespace, tenant).await, None)
            };
        let mut parent = match parent {
            Ok(p) => p,
            Err(e) => {
                return cannot_judge(format!(
                    "refusing to {} {subject}: cannot read tenant {namespace}/{tenant}: {e}",
                    subject.action
                ));
            }
        };
        if let Some(p) = parent
            .as_mut()
            .filter(|p| decide::needs_namespace(target, p))
        {
            let deleting = match read_ahead {
                Some(n) => n,
                None => self.namespace_deleting(namespace).await,
            };
            match deleting {
                Ok(deleting) => p.namespace_deleting = Some(deleting),
                Err(e) => {
                    return cannot_judge(format!(
                        "refusing to {} {subject}: cannot read namespace {namespace}: {e}",
                        subject.action
                    ));
                }
            }
        }
        decide::decide_dependent_delete(&self.profile, target, subject, parent.as_ref())
    }

    async fn check_override_permission(
        &self,
        req: &review::Request,
        namespace: &str,
        tenant: &str,
    ) -> Verdict {
        let u = &req.user_info;
        let username = u.username.clone().unwrap_or_default();
        let p = &self.profile.override_permission;
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
        self.metrics.api_reads.inc();
        match api.create(&PostParams::default(), &sar).await {
            Ok(done) => {
                let status = done.status.unwrap_or_default();
                if status.allowed && !status.denied.unwrap_or(false) {
                    Verdict::allow("override-authorized")
                } else {
                    decide::override_refused(
                        &self.profile,
                        &username,
                        namespace,
                        tenant,
                        status.reason.as_deref().unwrap_or(""),
                    )
                }
            }
            Err(e) => cannot_judge(format!(
                "cannot check whether {username} may record an override on {namespace}/{tenant} (SubjectAccessReview failed: {e})"
            )),
        }
    }

    /// The mutating answer for one request: a verdict and its patch.
    pub fn mutate(&self, req: &review::Request) -> (Target, Verdict, Option<json_patch::Patch>) {
        let kind = review::group_kind(req);
        let namespace = req.namespace.as_deref().unwrap_or("");
        if !matches!(req.operation, Operation::Create | Operation::Update)
            || kind != self.profile.parent_kind()
        {
            return (Target::Unrelated, Verdict::allow("unrelated"), None);
        }
        let Some(new) = req.object.as_ref() else {
            return (
                Target::Unrelated,
                cannot_judge(format!(
                    "{kind} {namespace}/{} carries no object",
                    review::request_name(req)
                )),
                None,
            );
        };
        let name = review::request_name(req);
        let new_view = review::meta_view(new, namespace, name);
        let old_view = req
            .old_object
            .as_ref()
            .map(|o| review::meta_view(o, namespace, name));
        let target = classify(&self.profile, &kind, &new_view.name, &new_view.labels);
        let change = Change {
            old: old_view.as_ref(),
            new: &new_view,
        };
        let mutations = decide::mutate(
            &self.profile,
            &self.keys,
            change,
            self.requester(req),
            jiff::Timestamp::now(),
        );
        let reason = if mutations.is_empty() {
            "unchanged"
        } else {
            "mutated"
        };
        let patch = decide::to_json_patch(&self.profile, &self.keys, &mutations);
        (target, Verdict::allow(reason), Some(patch))
    }
}

/// The strictest verdict of those an object's identities got, with the
/// identity that earned it (the first one when all allow).
fn strictest_of(judged: Vec<(Target, Verdict)>) -> (Target, Verdict) {
    let target = judged
        .iter()
        .find(|(_, v)| !v.allowed())
        .or(judged.first())
        .map_or(Target::Unrelated, |(t, _)| t.clone());
    (
        target,
        decide::strictest(judged.into_iter().map(|(_, v)| v).collect()),
    )
}

/// The gate's read paths against a scripted API server: what it reads, and
/// that every failed read is a refusal.
#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
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
    ) -> review::Request {
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

    fn child_delete(name: &str) -> review::Request {
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
    fn release_sa_delete(name: &str) -> review::Request {
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
