//! The gate's one judge: every admission rule, as one pure function of the
//! request and of the facts read so far ([`admit`]). It never reads: when a
//! rule needs the parent, its namespace or an access review, it answers
//! [`Admission::Need`] with the reads, and the gate ([`super::gate`]) makes
//! them and asks again with what it found. The decision tests, the
//! scripted-API tests and the fuzz oracle all judge through it, so there is
//! one copy of each rule (`docs/design.md` §4).
//!
//! The rules themselves, one per kind of object and write, are the pure
//! functions of [`super::decide`]; this module is the order they are
//! applied in: which identities an object has, which rule judges each, and
//! the strictest answer of them all.

use std::collections::HashMap;

use kube::core::admission::Operation;

use super::decide::flux::{self, Release};
use super::decide::{
    self, Change, ParentFacts, Requester, Subject, Target, UpdateVerdict, Verdict, cannot_judge,
    classify,
};
use super::request::{self, ObjectMetaView};
use crate::names::is_subdomain as is_object_name;
use crate::profile::{GroupKind, Profile, flux_release_kind};
use crate::record::Keys;

/// Who deletes a namespace's contents once it is being deleted.
pub const NAMESPACE_CONTROLLER: &str = "system:serviceaccount:kube-system:namespace-controller";

/// A read the judge needs before it can answer.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Read {
    /// The parent release `namespace`/`name` as it is now (a GET of its
    /// metadata, never a cache).
    Parent { namespace: String, name: String },
    /// Whether namespace `name` is being deleted (or gone).
    Namespace { name: String },
    /// Whether the requester may record an override on parent
    /// `namespace`/`tenant` (a SubjectAccessReview of the profile's
    /// override permission, for the request's user).
    OverrideAccess { namespace: String, tenant: String },
    /// The parents of `namespace` (a LIST by the parent labels): which of
    /// them name the object by a reference the profile follows
    /// (`guarded[].ref`, Cluster API's `spec.controlPlaneRef`). Read only
    /// for kinds such an entry names.
    Referrers { namespace: String },
}

/// What a SubjectAccessReview answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Access {
    /// Allowed and not denied.
    pub allowed: bool,
    /// The authorizer's reason, possibly empty.
    pub reason: String,
}

/// What the gate has read for one request. A failed read is kept as its
/// error's text: the rule that needed it refuses with it.
#[derive(Clone, Debug, Default)]
pub struct Facts {
    parents: HashMap<(String, String), Result<Option<ObjectMetaView>, String>>,
    namespaces: HashMap<String, Result<bool, String>>,
    access: HashMap<(String, String), Result<Access, String>>,
    referrers: HashMap<String, Result<Vec<(String, serde_json::Value)>, String>>,
}

impl Facts {
    /// The parent release's metadata, `None` when there is no object of
    /// that name.
    pub fn parent(
        &mut self,
        namespace: &str,
        name: &str,
        read: Result<Option<ObjectMetaView>, String>,
    ) {
        self.parents
            .insert((namespace.to_string(), name.to_string()), read);
    }

    /// Whether the namespace is being deleted (a gone one is).
    pub fn namespace(&mut self, name: &str, read: Result<bool, String>) {
        self.namespaces.insert(name.to_string(), read);
    }

    /// The parents of a namespace as listed: each one's name and object.
    pub fn referrers(
        &mut self,
        namespace: &str,
        read: Result<Vec<(String, serde_json::Value)>, String>,
    ) {
        self.referrers.insert(namespace.to_string(), read);
    }

    pub fn access(&mut self, namespace: &str, tenant: &str, read: Result<Access, String>) {
        self.access
            .insert((namespace.to_string(), tenant.to_string()), read);
    }

    /// Whether `read` has been made.
    pub fn has(&self, read: &Read) -> bool {
        match read {
            Read::Parent { namespace, name } => self
                .parents
                .contains_key(&(namespace.clone(), name.clone())),
            Read::Namespace { name } => self.namespaces.contains_key(name),
            Read::OverrideAccess { namespace, tenant } => self
                .access
                .contains_key(&(namespace.clone(), tenant.clone())),
            Read::Referrers { namespace } => self.referrers.contains_key(namespace),
        }
    }

    fn parent_of(
        &self,
        namespace: &str,
        name: &str,
    ) -> Option<&Result<Option<ObjectMetaView>, String>> {
        self.parents.get(&(namespace.to_string(), name.to_string()))
    }
}

/// The judge's answer.
#[derive(Clone, Debug, PartialEq)]
pub enum Admission {
    /// Make these reads (at once), add them to the facts and ask again.
    Need(Vec<Read>),
    /// The answer: the identity that earned it and the verdict.
    Judged(Target, Verdict),
}

/// What the judge knows besides the request and the facts.
#[derive(Clone, Debug)]
pub struct Judge {
    pub profile: Profile,
    pub keys: Keys,
    /// The worker's username: the only writer of the record and custody.
    pub worker_identity: String,
}

/// A rule's answer when it lacks facts: the reads it needs.
type Pending<T> = Result<T, Vec<Read>>;

impl Judge {
    pub fn new(profile: Profile, worker_identity: String) -> Self {
        Judge {
            keys: Keys::new(&profile.annotation_prefix),
            profile,
            worker_identity,
        }
    }

    fn requester<'a>(&self, req: &'a request::Request) -> Requester<'a> {
        let username = req.user_info.username.as_deref().unwrap_or("");
        Requester {
            username,
            is_worker: !username.is_empty() && username == self.worker_identity,
        }
    }

    /// The validating decision for one request, given what has been read.
    /// `now` stamps an override's time checks; the gate takes it once per
    /// request.
    pub fn admit(&self, req: &request::Request, facts: &Facts, now: jiff::Timestamp) -> Admission {
        match self.validate(req, facts, now) {
            Ok((target, verdict)) => Admission::Judged(target, verdict),
            Err(mut reads) => {
                reads.sort();
                reads.dedup();
                Admission::Need(reads)
            }
        }
    }

    fn validate(
        &self,
        req: &request::Request,
        facts: &Facts,
        now: jiff::Timestamp,
    ) -> Pending<(Target, Verdict)> {
        let kind = request::group_kind(req);
        let namespace = req.namespace.as_deref().unwrap_or("");
        let name = request::request_name(req);
        match req.operation {
            Operation::Delete => self.validate_delete(req, facts, &kind, namespace, name),
            // helm-controller trusts a release's status: only it writes one.
            Operation::Update if req.sub_resource.as_deref() == Some("status") => {
                if kind != flux_release_kind() || !self.profile.has_releases() {
                    return Ok((Target::Unrelated, Verdict::allow("unrelated")));
                }
                let labels = request::labels_of(req.old_object.as_ref());
                Ok((
                    classify(&self.profile, &kind, name, &labels),
                    decide::decide_status_write(
                        &self.profile,
                        Subject::delete(&kind, namespace, name).with_action(decide::STATUS_ACTION),
                        self.requester(req).username,
                    ),
                ))
            }
            Operation::Create | Operation::Update => {
                self.validate_write(req, facts, &kind, namespace, name, now)
            }
            _ => Ok((Target::Unrelated, Verdict::allow("unrelated"))),
        }
    }

    fn validate_delete(
        &self,
        req: &request::Request,
        facts: &Facts,
        kind: &GroupKind,
        namespace: &str,
        name: &str,
    ) -> Pending<(Target, Verdict)> {
        if name.is_empty() {
            return Ok((
                Target::Unrelated,
                cannot_judge(format!(
                    "DELETE of {kind} in namespace {namespace:?} names no object"
                )),
            ));
        }
        let Some(old) = req.old_object.as_ref() else {
            // Without the object its labels are unknown: never guess.
            let target = classify(&self.profile, kind, name, &Default::default());
            return Ok((
                target,
                cannot_judge(format!(
                    "DELETE of {kind} {namespace}/{name} carries no oldObject"
                )),
            ));
        };
        let labels = request::labels_of(Some(old));
        // The namespace controller deletes only in a namespace being
        // deleted: a hint for what to read first, never a fact a verdict
        // rests on.
        let from_ns_controller = req.user_info.username.as_deref() == Some(NAMESPACE_CONTROLLER);
        let subject = Subject::delete(kind, namespace, name);
        let mut judged = Vec::new();
        let ids = decide::identities_of(&self.profile, kind, name, &labels, &old.spec);
        let mut ids = decide::with_release_identity(
            ids,
            namespace,
            self.release_of(namespace, name, Some(old)),
        );
        // What a parent's reference names (Cluster API's control plane and
        // infrastructure cluster) is that tenant's, whatever it says itself.
        if self.profile.referenced(kind).next().is_some() {
            match facts.referrers.get(namespace) {
                None => {
                    return Err(vec![Read::Referrers {
                        namespace: namespace.to_string(),
                    }]);
                }
                Some(Ok(parents)) => {
                    for (tenant, role) in self.profile.referrers(kind, name, parents) {
                        if !ids.iter().any(|t| t.tenant() == Some(tenant.as_str())) {
                            ids.push(Target::Guarded { tenant, role });
                        }
                    }
                }
                Some(Err(e)) => judged.push((
                    Target::Unrelated,
                    cannot_judge(format!(
                        "refusing to {} {subject}: cannot list the tenants of namespace {namespace} whose \
                         references may name it: {e}",
                        subject.action
                    )),
                )),
            }
        }
        // A namespace being deleted takes what the phase runs on: what has
        // no other identity (Pods, ReplicaSets, Services) is held for the
        // tenants it is named for.
        if from_ns_controller && ids.is_empty() {
            match self.named_for(facts, kind, namespace, name, old)? {
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
                Err(e) => judged.push((
                    Target::Unrelated,
                    cannot_judge(format!(
                        "refusing to delete {subject}: cannot read the tenants it may be named \
                         for in namespace {namespace}: {e}"
                    )),
                )),
            }
        }
        let mut need = Vec::new();
        for target in ids {
            let verdict = match &target {
                Target::Parent { tenant } => {
                    let view = request::meta_view(old, namespace, name);
                    let facts =
                        ParentFacts::of(&self.profile, &self.keys, namespace, tenant, &view);
                    Ok(decide::decide_parent_delete(&self.profile, subject, &facts))
                }
                Target::CsiRelease { tenant }
                | Target::Child { tenant }
                | Target::Guarded { tenant, .. } => self.dependent(
                    facts,
                    &target,
                    subject,
                    namespace,
                    tenant,
                    from_ns_controller,
                ),
                Target::ReleaseObject {
                    tenant,
                    namespace: parent_namespace,
                } => self.dependent(
                    facts,
                    &target,
                    subject,
                    parent_namespace,
                    tenant,
                    from_ns_controller && parent_namespace == namespace,
                ),
                // Deleting a disk frees it, as the driver does, and a hand
                // deleting one decides so. The namespace controller deletes
                // everything at once: its deletes wait until the phase has
                // kept what must stay.
                Target::InfraDisk { tenant } if from_ns_controller => {
                    self.dependent(facts, &target, subject, namespace, tenant, true)
                }
                Target::InfraDisk { .. } => Ok(Verdict::allow("frees-the-disk")),
                // Only the mutating webhook sees kept disks (`mutate`).
                Target::KeptDisk { .. } | Target::Unrelated => Ok(Verdict::allow("unrelated")),
            };
            match verdict {
                Ok(v) => judged.push((target, v)),
                Err(reads) => need.extend(reads),
            }
        }
        if !need.is_empty() {
            return Err(need);
        }
        Ok(self.warn_impossible_markers(kind, &[req.old_object.as_ref()], strictest_of(judged)))
    }

    fn validate_write(
        &self,
        req: &request::Request,
        facts: &Facts,
        kind: &GroupKind,
        namespace: &str,
        name: &str,
        now: jiff::Timestamp,
    ) -> Pending<(Target, Verdict)> {
        let mut judged = Vec::new();
        let mut need = Vec::new();
        let mut take = |target: Target, verdict: Pending<Verdict>| match verdict {
            Ok(v) => judged.push((target, v)),
            Err(reads) => need.extend(reads),
        };
        // A change that makes helm-controller uninstall the release (first:
        // its refusal says most about such a change).
        if *kind == flux_release_kind()
            && self.profile.has_releases()
            && let (Some(old), Some(new)) = (req.old_object.as_ref(), req.object.as_ref())
        {
            let who = self.requester(req).username;
            for (target, verdict) in self.removal(facts, kind, namespace, name, (old, new), who) {
                take(target, verdict);
            }
        }
        // A change of what the object is: judged like the delete it enables.
        if req.operation == Operation::Update {
            let old = request::labels_of(req.old_object.as_ref());
            let new = request::labels_of(req.object.as_ref());
            let subject = Subject::delete(kind, namespace, name).with_action("relabel");
            let none = request::SpecView::default();
            let old_spec = req.old_object.as_ref().map_or(&none, |o| &o.spec);
            let new_spec = req.object.as_ref().map_or(&none, |o| &o.spec);
            for target in decide::relabel_targets_of(
                &self.profile,
                kind,
                name,
                (&old, old_spec),
                (&new, new_spec),
            ) {
                let tenant = target
                    .tenant()
                    .expect("a dependent has a tenant")
                    .to_string();
                let verdict = self.dependent(facts, &target, subject, namespace, &tenant, false);
                take(target, verdict);
            }
            // Taken out of (or put into) a parent release: judged as the
            // delete of an object of each release concerned.
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
                    let verdict =
                        self.dependent(facts, &target, subject, &parent_namespace, &tenant, false);
                    take(target, verdict);
                }
            }
        }
        if *kind == self.profile.parent_kind()
            && let (Some(old), Some(new)) = (req.old_object.as_ref(), req.object.as_ref())
            && let Some(verdict) = decide::decide_reference_move(
                &self.profile,
                &self.keys,
                &request::meta_view(old, namespace, name),
                (&old.spec, &new.spec),
                self.requester(req),
            )
        {
            judged.push((
                Target::Parent {
                    tenant: name.to_string(),
                },
                verdict,
            ));
        }
        if *kind == self.profile.parent_kind() {
            match self.guard_release(req, facts, kind, namespace, name, now) {
                Ok((target, verdict)) => judged.push((target, verdict)),
                Err(reads) => need.extend(reads),
            }
        }
        if !need.is_empty() {
            return Err(need);
        }
        let objects = [req.old_object.as_ref(), req.object.as_ref()];
        Ok(self.warn_impossible_markers(kind, &objects, strictest_of(judged)))
    }

    /// An UPDATE of a release that makes helm-controller remove what it
    /// installed while the object stays (`decide::flux`), judged like the
    /// delete it amounts to under each identity the release has before or
    /// after: the parent and the CSI release until done, another child
    /// during teardown. A move of the chart's source by the platform's own
    /// writers is its upgrade, not a removal
    /// (`decide::source_move_by_platform`).
    fn removal(
        &self,
        facts: &Facts,
        kind: &GroupKind,
        namespace: &str,
        name: &str,
        (old, new): (&request::Object, &request::Object),
        username: &str,
    ) -> Vec<(Target, Pending<Verdict>)> {
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
        let (old_labels, new_labels) =
            (request::labels_of(Some(old)), request::labels_of(Some(new)));
        let mut targets = decide::identities_of(&self.profile, kind, name, &old_labels, &old.spec);
        for t in decide::identities_of(&self.profile, kind, name, &new_labels, &new.spec) {
            if !targets.contains(&t) {
                targets.push(t);
            }
        }
        let owners = (
            decide::release_of(
                &self.profile,
                namespace,
                &old_labels,
                &request::meta_view(old, namespace, name).annotations,
            ),
            decide::release_of(
                &self.profile,
                namespace,
                &new_labels,
                &request::meta_view(new, namespace, name).annotations,
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
                judged.push((target, Ok(Verdict::allow("platform-source-move"))));
                continue;
            }
            let action = decide::removal_action(&removals);
            let subject = Subject::delete(kind, namespace, name).with_action(&action);
            let verdict = match &target {
                Target::Parent { tenant } => {
                    let view = request::meta_view(old, namespace, name);
                    let facts =
                        ParentFacts::of(&self.profile, &self.keys, namespace, tenant, &view);
                    Ok(decide::decide_parent_removal(
                        &self.profile,
                        subject,
                        &facts,
                    ))
                }
                Target::CsiRelease { tenant } | Target::Child { tenant } => {
                    self.dependent(facts, &target, subject, namespace, tenant, false)
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
        kind: &GroupKind,
        objects: &[Option<&request::Object>],
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
    /// few). The inner error is the first failed read's.
    fn named_for(
        &self,
        facts: &Facts,
        kind: &GroupKind,
        namespace: &str,
        name: &str,
        old: &request::Object,
    ) -> Pending<Result<Vec<String>, String>> {
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
            return Ok(Ok(Vec::new()));
        }
        let candidates = decide::parent_candidates(&self.profile, &names);
        let missing: Vec<Read> = candidates
            .iter()
            .map(|c| Read::Parent {
                namespace: namespace.to_string(),
                name: c.clone(),
            })
            .filter(|r| !facts.has(r))
            .collect();
        if !missing.is_empty() {
            return Err(missing);
        }
        let mut parents = Vec::new();
        for candidate in candidates {
            match facts.parent_of(namespace, &candidate) {
                Some(Err(e)) => return Ok(Err(e.clone())),
                Some(Ok(meta)) => {
                    if self
                        .parent_facts(namespace, &candidate, meta.as_ref())
                        .is_some()
                    {
                        parents.push(candidate);
                    }
                }
                None => unreachable!("every candidate was read"),
            }
        }
        Ok(Ok(decide::named_for(
            &self.profile,
            kind,
            name,
            &owners,
            &parents,
        )))
    }

    /// The parent release `obj` belongs to, `(namespace, release)`, unless
    /// it is one of that release's teardown hook objects (not held).
    /// `name` is the request's, never the body's.
    fn release_of(
        &self,
        namespace: &str,
        name: &str,
        obj: Option<&request::Object>,
    ) -> Option<(String, String)> {
        let view = request::meta_view(obj?, namespace, name);
        decide::release_of(&self.profile, namespace, &view.labels, &view.annotations)
            .filter(|(_, release)| !self.profile.is_release_hook(name, release))
    }

    /// The guards on CREATE/UPDATE of a release: record, override, custody.
    fn guard_release(
        &self,
        req: &request::Request,
        facts: &Facts,
        kind: &GroupKind,
        namespace: &str,
        name: &str,
        now: jiff::Timestamp,
    ) -> Pending<(Target, Verdict)> {
        let Some(new) = req.object.as_ref() else {
            return Ok((
                Target::Unrelated,
                cannot_judge(format!("{kind} {namespace}/{name} carries no object")),
            ));
        };
        let new_view = request::meta_view(new, namespace, name);
        let old_view = req
            .old_object
            .as_ref()
            .map(|o| request::meta_view(o, namespace, name));
        let target = classify(&self.profile, kind, &new_view.name, &new_view.labels);
        let who = self.requester(req);
        let change = Change {
            old: old_view.as_ref(),
            new: &new_view,
        };
        let verdict = match decide::guard_update(&self.profile, &self.keys, change, who, now) {
            UpdateVerdict::Final(v) => v,
            UpdateVerdict::NeedsOverridePermission { namespace, tenant } => {
                match facts.access.get(&(namespace.clone(), tenant.clone())) {
                    None => return Err(vec![Read::OverrideAccess { namespace, tenant }]),
                    Some(Ok(access)) if access.allowed => Verdict::allow("override-authorized"),
                    Some(Ok(access)) => decide::override_refused(
                        &self.profile,
                        who.username,
                        &namespace,
                        &tenant,
                        &access.reason,
                    ),
                    Some(Err(e)) => cannot_judge(format!(
                        "cannot check whether {} may record an override on {namespace}/{tenant} \
                         (SubjectAccessReview failed: {e})",
                        who.username
                    )),
                }
            }
        };
        Ok((target, verdict))
    }

    /// The parent's facts from its metadata as read: `None` when there is
    /// no object of that name or it is not a parent (its labels say so).
    fn parent_facts(
        &self,
        namespace: &str,
        tenant: &str,
        meta: Option<&ObjectMetaView>,
    ) -> Option<ParentFacts> {
        let view = meta?;
        self.profile
            .is_parent(&view.labels)
            .then(|| ParentFacts::of(&self.profile, &self.keys, namespace, tenant, view))
    }

    /// A dependent of tenant `namespace`/`tenant` (a child, a guarded
    /// object, an object of its release, a disk) judged on its parent as it
    /// is now and, when "not in teardown" could allow it, its namespace.
    fn dependent(
        &self,
        facts: &Facts,
        target: &Target,
        subject: Subject<'_>,
        namespace: &str,
        tenant: &str,
        namespace_likely_deleting: bool,
    ) -> Pending<Verdict> {
        // Both go into URL paths: a '/' would read some other object (and a
        // 404 there reads as "no parent"). The API server never sends such
        // names; a forged review gets a refusal (found by fuzzing).
        if !is_object_name(namespace) || !is_object_name(tenant) {
            return Ok(cannot_judge(format!(
                "refusing to {} {subject}: {namespace:?}/{tenant:?} is not a namespace and name the API server would send",
                subject.action
            )));
        }
        let namespace_read = Read::Namespace {
            name: namespace.to_string(),
        };
        let parent = match facts.parent_of(namespace, tenant) {
            // When the decision may need the namespace too, both are read at
            // once: the decision then waits for the slower GET, not for both
            // in turn (`docs/benchmarks.md`, benchmark 2). Not when the
            // namespace is most likely being deleted (the namespace
            // controller's own deletes): the parent is then being deleted
            // too and the namespace is moot, so a namespace deletion's burst
            // costs the API server one read per decision. Whatever was read
            // ahead, the namespace is used only where `needs_namespace` says
            // so (read then if it was not), and only then can its error
            // refuse.
            None => {
                let mut reads = vec![Read::Parent {
                    namespace: namespace.to_string(),
                    name: tenant.to_string(),
                }];
                if decide::may_need_namespace(target)
                    && !namespace_likely_deleting
                    && !facts.has(&namespace_read)
                {
                    reads.push(namespace_read);
                }
                return Err(reads);
            }
            Some(Err(e)) => {
                return Ok(cannot_judge(format!(
                    "refusing to {} {subject}: cannot read tenant {namespace}/{tenant}: {e}",
                    subject.action
                )));
            }
            Some(Ok(meta)) => self.parent_facts(namespace, tenant, meta.as_ref()),
        };
        let mut parent = parent;
        if let Some(p) = parent
            .as_mut()
            .filter(|p| decide::needs_namespace(target, p))
        {
            match facts.namespaces.get(namespace) {
                None => return Err(vec![namespace_read]),
                Some(Ok(deleting)) => p.namespace_deleting = Some(*deleting),
                Some(Err(e)) => {
                    return Ok(cannot_judge(format!(
                        "refusing to {} {subject}: cannot read namespace {namespace}: {e}",
                        subject.action
                    )));
                }
            }
        }
        Ok(decide::decide_dependent_delete(
            &self.profile,
            target,
            subject,
            parent.as_ref(),
        ))
    }

    /// The mutating answer for one request: a verdict and its patch. It
    /// needs no read.
    pub fn mutate(
        &self,
        req: &request::Request,
        now: jiff::Timestamp,
    ) -> (Target, Verdict, Option<json_patch::Patch>) {
        let kind = request::group_kind(req);
        let namespace = req.namespace.as_deref().unwrap_or("");
        if !matches!(req.operation, Operation::Create | Operation::Update) {
            return (Target::Unrelated, Verdict::allow("unrelated"), None);
        }
        if kind == GroupKind::new("", "PersistentVolume") {
            return self.acknowledge(req, now);
        }
        if kind != self.profile.parent_kind() {
            return (Target::Unrelated, Verdict::allow("unrelated"), None);
        }
        let Some(new) = req.object.as_ref() else {
            return (
                Target::Unrelated,
                cannot_judge(format!(
                    "{kind} {namespace}/{} carries no object",
                    request::request_name(req)
                )),
                None,
            );
        };
        let name = request::request_name(req);
        let new_view = request::meta_view(new, namespace, name);
        let old_view = req
            .old_object
            .as_ref()
            .map(|o| request::meta_view(o, namespace, name));
        let target = classify(&self.profile, &kind, &new_view.name, &new_view.labels);
        let change = Change {
            old: old_view.as_ref(),
            new: &new_view,
        };
        let mutations = decide::mutate(&self.profile, &self.keys, change, self.requester(req), now);
        self.patched(target, &mutations, "mutated")
    }

    /// The answer of the mutating webhook: allowed, with the patch of
    /// `mutations` (empty: "unchanged").
    fn patched(
        &self,
        target: Target,
        mutations: &[decide::Mutation],
        reason: &'static str,
    ) -> (Target, Verdict, Option<json_patch::Patch>) {
        let reason = if mutations.is_empty() {
            "unchanged"
        } else {
            reason
        };
        let patch = decide::to_json_patch(&self.profile, &self.keys, mutations);
        (target, Verdict::allow(reason), Some(patch))
    }
}

impl Judge {
    /// A PersistentVolume's write, for the stamps of a kept disk's
    /// acknowledgement (`decide::acknowledge`).
    fn acknowledge(
        &self,
        req: &request::Request,
        now: jiff::Timestamp,
    ) -> (Target, Verdict, Option<json_patch::Patch>) {
        let name = request::request_name(req);
        let Some(new) = req.object.as_ref() else {
            return (
                Target::Unrelated,
                cannot_judge(format!("PersistentVolume {name} carries no object")),
                None,
            );
        };
        let new_view = request::meta_view(new, "", name);
        let old_view = req
            .old_object
            .as_ref()
            .map(|o| request::meta_view(o, "", name));
        let target = Target::KeptDisk {
            tenant: new_view
                .annotations
                .get(&self.keys.kept_for)
                .cloned()
                .unwrap_or_default(),
        };
        let change = Change {
            old: old_view.as_ref(),
            new: &new_view,
        };
        let mutations = decide::acknowledge(&self.keys, change, self.requester(req), now);
        self.patched(target, &mutations, "acknowledgement-stamped")
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

/// The judge alone, without any API: the reads it asks for, round by round,
/// and that it never asks twice.
#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::admission::review;

    const NS: &str = "tenant-a";
    const WORKER: &str = "system:serviceaccount:volume-gate:volume-gate-worker";

    fn judge() -> Judge {
        Judge::new(Profile::cozystack(), WORKER.into())
    }

    fn delete(kind: (&str, &str), old: Value, user: &str) -> request::Request {
        let name = old["metadata"]["name"].as_str().unwrap().to_string();
        let body = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": "u-1", "kind": {"group": kind.0, "version": "v1", "kind": kind.1},
            "resource": {"group": kind.0, "version": "v1", "resource": "things"},
            "name": name, "namespace": NS, "operation": "DELETE", "userInfo": {"username": user},
            "oldObject": old, "dryRun": false}});
        review::decode(&serde_json::to_vec(&body).unwrap()).expect("a valid review")
    }

    fn child(name: &str) -> Value {
        json!({"apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
               "metadata": {"name": name, "namespace": NS,
                            "labels": {"cozystack.io/target-cluster-name": "kubernetes-a"}}})
    }

    fn pod(name: &str, owner: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS,
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": owner,
                                 "uid": "u", "controller": true}]}})
    }

    /// Parent `kubernetes-a` as read: live or being deleted, with a phase.
    fn parent(deleting: bool, phase: Option<&str>) -> ObjectMetaView {
        parent_of(&Profile::cozystack(), "kubernetes-a", deleting, phase)
    }

    /// Parent `name` under `profile`, in custody, as read.
    fn parent_of(
        profile: &Profile,
        name: &str,
        deleting: bool,
        phase: Option<&str>,
    ) -> ObjectMetaView {
        let keys = Keys::new(&profile.annotation_prefix);
        ObjectMetaView {
            namespace: NS.into(),
            name: name.into(),
            labels: profile.parent.match_labels.clone(),
            annotations: phase
                .map(|p| [(keys.phase.clone(), p.to_string())].into())
                .unwrap_or_default(),
            finalizers: vec![profile.custody_finalizer.clone()],
            deleting,
        }
    }

    /// Asks the judge until it answers, answering each read from `world`;
    /// returns the answer and the reads of each round. Fails if a round asks
    /// for a read already made.
    fn judged(
        req: &request::Request,
        world: impl Fn(&Read) -> Box<dyn FnOnce(&mut Facts)>,
    ) -> ((Target, Verdict), Vec<Vec<Read>>) {
        judged_by(&judge(), req, world)
    }

    fn judged_by(
        j: &Judge,
        req: &request::Request,
        world: impl Fn(&Read) -> Box<dyn FnOnce(&mut Facts)>,
    ) -> ((Target, Verdict), Vec<Vec<Read>>) {
        let mut facts = Facts::default();
        let mut rounds = Vec::new();
        loop {
            match j.admit(req, &facts, jiff::Timestamp::now()) {
                Admission::Judged(t, v) => return ((t, v), rounds),
                Admission::Need(reads) => {
                    for r in &reads {
                        assert!(!facts.has(r), "asked again for {r:?} after {rounds:?}");
                    }
                    for r in &reads {
                        world(r)(&mut facts);
                    }
                    rounds.push(reads);
                    assert!(rounds.len() <= 3, "more than three rounds: {rounds:?}");
                }
            }
        }
    }

    fn parent_read(name: &str) -> Read {
        Read::Parent {
            namespace: NS.into(),
            name: name.into(),
        }
    }

    fn namespace_read() -> Read {
        Read::Namespace { name: NS.into() }
    }

    #[test]
    fn a_child_outside_teardown_needs_its_parent_and_namespace_in_one_round() {
        let (answer, rounds) = judged(
            &delete(
                ("helm.toolkit.fluxcd.io", "HelmRelease"),
                child("kubernetes-a-coredns"),
                "flux",
            ),
            |r| {
                let r = r.clone();
                Box::new(move |f: &mut Facts| match r {
                    Read::Parent { .. } => {
                        f.parent(NS, "kubernetes-a", Ok(Some(parent(false, None))))
                    }
                    Read::Namespace { .. } => f.namespace(NS, Ok(false)),
                    Read::OverrideAccess { .. } | Read::Referrers { .. } => unreachable!(),
                })
            },
        );
        assert_eq!(answer.1, Verdict::allow("not-in-teardown"));
        assert_eq!(
            rounds,
            [vec![parent_read("kubernetes-a"), namespace_read()]]
        );
    }

    #[test]
    fn the_namespace_controllers_delete_reads_the_namespace_only_in_a_second_round_and_only_if_needed()
     {
        let mut req = delete(
            ("helm.toolkit.fluxcd.io", "HelmRelease"),
            child("kubernetes-a-coredns"),
            NAMESPACE_CONTROLLER,
        );
        req.user_info.username = Some(NAMESPACE_CONTROLLER.into());
        for (deleting, rounds_expected) in [(true, 1), (false, 2)] {
            let (answer, rounds) = judged(&req, |r| {
                let r = r.clone();
                Box::new(move |f: &mut Facts| match r {
                    Read::Parent { .. } => f.parent(
                        NS,
                        "kubernetes-a",
                        Ok(Some(parent(deleting, Some("Releasing")))),
                    ),
                    Read::Namespace { .. } => f.namespace(NS, Ok(true)),
                    Read::OverrideAccess { .. } | Read::Referrers { .. } => unreachable!(),
                })
            });
            assert_eq!(answer.1.reason(), "teardown-held");
            assert_eq!(rounds.len(), rounds_expected, "{rounds:?}");
            assert_eq!(rounds[0], [parent_read("kubernetes-a")]);
        }
    }

    #[test]
    fn a_pod_named_for_a_tenant_takes_its_candidates_then_the_namespace() {
        let req = delete(
            ("", "Pod"),
            pod("kubernetes-a-7d9f-x", "kubernetes-a-7d9f"),
            NAMESPACE_CONTROLLER,
        );
        let (answer, rounds) = judged(&req, |r| {
            let r = r.clone();
            Box::new(move |f: &mut Facts| match r {
                Read::Parent { namespace, name } if name == "kubernetes-a" => {
                    f.parent(&namespace, &name, Ok(Some(parent(false, None))))
                }
                Read::Parent { namespace, name } => f.parent(&namespace, &name, Ok(None)),
                Read::Namespace { name } => f.namespace(&name, Ok(true)),
                Read::OverrideAccess { .. } | Read::Referrers { .. } => unreachable!(),
            })
        });
        assert_eq!(answer.1.reason(), "teardown-held", "{answer:?}");
        assert!(matches!(answer.0, Target::Guarded { ref tenant, .. } if tenant == "kubernetes-a"));
        assert!(
            rounds[0].contains(&parent_read("kubernetes-a")),
            "{rounds:?}"
        );
        assert_eq!(rounds[1], [namespace_read()]);
    }

    #[test]
    fn a_failed_read_is_a_refusal_naming_it() {
        let (answer, _) = judged(
            &delete(
                ("helm.toolkit.fluxcd.io", "HelmRelease"),
                child("kubernetes-a-coredns"),
                "flux",
            ),
            |r| {
                let r = r.clone();
                Box::new(move |f: &mut Facts| match r {
                    Read::Parent { .. } => f.parent(NS, "kubernetes-a", Err("etcd is slow".into())),
                    Read::Namespace { .. } => f.namespace(NS, Ok(false)),
                    Read::OverrideAccess { .. } | Read::Referrers { .. } => unreachable!(),
                })
            },
        );
        let Verdict::Deny { message, .. } = answer.1 else {
            panic!("allowed on a failed read")
        };
        assert!(
            message.contains("cannot read tenant tenant-a/kubernetes-a: etcd is slow"),
            "{message}"
        );
    }

    /// Under the Cluster API profile: Cluster `c1`, opted in, in custody.
    mod cluster_api {
        use super::*;

        fn judge() -> Judge {
            Judge::new(Profile::cluster_api(), WORKER.into())
        }

        fn cluster(deleting: bool, phase: Option<&str>) -> ObjectMetaView {
            parent_of(&Profile::cluster_api(), "c1", deleting, phase)
        }

        /// Cluster `c1`'s object as listed: its control plane reference
        /// names KubeadmControlPlane `cp`.
        fn listed() -> Vec<(String, Value)> {
            vec![(
                "c1".into(),
                json!({"metadata": {"name": "c1"}, "spec": {
                    "controlPlaneRef": {"apiGroup": "controlplane.cluster.x-k8s.io",
                                        "kind": "KubeadmControlPlane", "name": "cp"},
                    "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io",
                                          "kind": "DockerCluster", "name": "infra"}}}),
            )]
        }

        fn world(
            deleting: bool,
            phase: Option<&'static str>,
        ) -> impl Fn(&Read) -> Box<dyn FnOnce(&mut Facts)> {
            move |r| {
                let r = r.clone();
                Box::new(move |f: &mut Facts| match r {
                    Read::Referrers { namespace } => f.referrers(&namespace, Ok(listed())),
                    Read::Parent { namespace, name } => {
                        let got = (name == "c1").then(|| cluster(deleting, phase));
                        f.parent(&namespace, &name, Ok(got));
                    }
                    Read::Namespace { name } => f.namespace(&name, Ok(false)),
                    Read::OverrideAccess { .. } => unreachable!(),
                })
            }
        }

        fn object(name: &str) -> Value {
            json!({"metadata": {"name": name, "namespace": NS}})
        }

        #[test]
        fn the_control_plane_a_deleting_cluster_names_is_held_until_released_whatever_its_name() {
            let req = delete(
                ("controlplane.cluster.x-k8s.io", "KubeadmControlPlane"),
                object("cp"),
                "capi",
            );
            let ((target, verdict), rounds) = judged_by(&judge(), &req, world(true, None));
            assert!(!verdict.allowed(), "{verdict:?}");
            assert!(
                matches!(target, Target::Guarded { ref tenant, .. } if tenant == "c1"),
                "{target:?}"
            );
            assert_eq!(
                rounds[0],
                vec![Read::Referrers {
                    namespace: NS.into()
                }]
            );
            let ((_, verdict), _) = judged_by(&judge(), &req, world(true, Some("Released")));
            assert!(verdict.allowed(), "{verdict:?}");
        }

        #[test]
        fn an_object_no_reference_names_is_not_held_though_named_like_the_cluster() {
            let req = delete(
                ("controlplane.cluster.x-k8s.io", "KubeadmControlPlane"),
                object("c1"),
                "capi",
            );
            let ((target, verdict), rounds) = judged_by(&judge(), &req, world(true, None));
            assert!(verdict.allowed(), "{verdict:?}");
            assert_eq!(target, Target::Unrelated);
            assert_eq!(rounds.len(), 1);
            // Another kind of the group than the reference names.
            let req = delete(
                ("controlplane.cluster.x-k8s.io", "OtherControlPlane"),
                object("cp"),
                "capi",
            );
            assert!(judged_by(&judge(), &req, world(true, None)).0.1.allowed());
        }

        #[test]
        fn a_failed_list_refuses_naming_it() {
            let req = delete(
                ("infrastructure.cluster.x-k8s.io", "DockerCluster"),
                object("infra"),
                "capi",
            );
            let ((_, verdict), _) = judged_by(&judge(), &req, |r| {
                let r = r.clone();
                Box::new(move |f: &mut Facts| {
                    if let Read::Referrers { namespace } = r {
                        f.referrers(&namespace, Err("forbidden".into()));
                    }
                })
            });
            assert!(!verdict.allowed());
            assert!(
                format!("{verdict:?}").contains("cannot list the tenants"),
                "{verdict:?}"
            );
        }

        #[test]
        fn a_machine_is_the_clusters_by_its_cluster_name_without_labels() {
            let machine = json!({"metadata": {"name": "m-1", "namespace": NS}, "spec": {"clusterName": "c1"}});
            let req = delete(("cluster.x-k8s.io", "Machine"), machine, "capi");
            let ((target, verdict), _) = judged_by(&judge(), &req, world(true, None));
            assert!(!verdict.allowed(), "{verdict:?}");
            assert_eq!(target.tenant(), Some("c1"));
        }

        fn update(old: Value, new: Value, user: &str) -> request::Request {
            let body = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
                "uid": "u-2", "kind": {"group": "cluster.x-k8s.io", "version": "v1beta2", "kind": "Cluster"},
                "resource": {"group": "cluster.x-k8s.io", "version": "v1beta2", "resource": "clusters"},
                "name": "c1", "namespace": NS, "operation": "UPDATE", "userInfo": {"username": user},
                "oldObject": old, "object": new, "dryRun": false}});
            review::decode(&serde_json::to_vec(&body).unwrap()).expect("a valid review")
        }

        fn cluster_object(cp: &str, phase: Option<&str>) -> Value {
            let p = Profile::cluster_api();
            let keys = Keys::new(&p.annotation_prefix);
            let annotations: serde_json::Map<String, Value> = phase
                .map(|ph| (keys.phase.clone(), json!(ph)))
                .into_iter()
                .collect();
            json!({"metadata": {"name": "c1", "namespace": NS, "labels": p.parent.match_labels,
                                "annotations": annotations, "finalizers": [p.custody_finalizer]},
                   "spec": {"controlPlaneRef": {"apiGroup": "controlplane.cluster.x-k8s.io",
                                                "kind": "KubeadmControlPlane", "name": cp}}})
        }

        #[test]
        fn moving_a_reference_of_a_cluster_in_custody_is_refused_until_released() {
            let req = update(
                cluster_object("cp", None),
                cluster_object("decoy", None),
                "alice",
            );
            let ((_, verdict), _) = judged_by(&judge(), &req, world(false, None));
            assert_eq!(verdict.reason(), "reference-moved", "{verdict:?}");
            assert!(
                format!("{verdict:?}").contains("spec.controlPlaneRef"),
                "{verdict:?}"
            );
            let req = update(
                cluster_object("cp", Some("Released")),
                cluster_object("decoy", Some("Released")),
                "alice",
            );
            assert!(judged_by(&judge(), &req, world(false, None)).0.1.allowed());
        }

        #[test]
        fn a_status_write_of_a_cluster_is_not_flux_s_to_judge() {
            let mut req = update(
                cluster_object("cp", None),
                cluster_object("cp", None),
                "capi",
            );
            req.sub_resource = Some("status".into());
            assert!(judged_by(&judge(), &req, world(false, None)).0.1.allowed());
        }
    }
}
