//! The gate's decisions (`docs/design.md` §4) as pure functions of the request and
//! the tenant's state. No I/O here: the HTTP layer gathers the facts, these
//! functions judge them, and unit tests cover every row.

use std::collections::BTreeMap;

use crate::profile::{GroupKind, Profile, tenant_from_name};
use crate::record::{Keys, Record};

/// What an admitted object is to the gate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A tenant's parent release; `tenant` is its name (R).
    Parent { tenant: String },
    /// The tenant's CSI driver release.
    CsiRelease { tenant: String },
    /// Another child release of the tenant (networking the driver needs, addons).
    Child { tenant: String },
    /// Something the driver or the release phase needs.
    Guarded { tenant: String, role: String },
    /// An object of the tenant's parent release (what Helm's uninstall
    /// deletes), in `namespace` (the parent's), wherever the object is.
    ReleaseObject { tenant: String, namespace: String },
    /// Nothing the gate protects.
    Unrelated,
}

impl Target {
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Target::Parent { tenant }
            | Target::CsiRelease { tenant }
            | Target::Child { tenant }
            | Target::Guarded { tenant, .. }
            | Target::ReleaseObject { tenant, .. } => Some(tenant),
            Target::Unrelated => None,
        }
    }

    /// A metric/log label.
    pub fn label(&self) -> &'static str {
        match self {
            Target::Parent { .. } => "parent",
            Target::CsiRelease { .. } => "csi-release",
            Target::Child { .. } => "child",
            Target::Guarded { .. } => "guarded",
            Target::ReleaseObject { .. } => "release-object",
            Target::Unrelated => "unrelated",
        }
    }
}

/// Every identity an object has for the gate, most specific first.
///
/// One object can be several things at once: a HelmRelease a parent by its
/// labels, the CSI release by its name and a child by its label; a Cluster
/// `R-extra` labelled `cluster.x-k8s.io/cluster-name: R` is guarded for `R`
/// by its label whatever its name says. Each identity is judged and the
/// strictest answer wins, so no identity can hide another (a Cluster once
/// went through as "parent absent" for tenant `R-extra`, because only the
/// first guarded entry that yielded a tenant was looked at).
pub fn identities(profile: &Profile, kind: &GroupKind, name: &str, labels: &BTreeMap<String, String>) -> Vec<Target> {
    let mut out: Vec<Target> = Vec::new();
    let mut push = |t: Target| {
        // One identity per tenant: the first (the strictest) stands for it,
        // except that a parent is its own tenant and is always kept.
        let dup = out.iter().any(|o| !matches!(o, Target::Parent { .. }) && o.tenant() == t.tenant());
        if !dup {
            out.push(t);
        }
    };
    if *kind == profile.parent_kind() {
        if profile.is_parent(labels) {
            push(Target::Parent { tenant: name.to_string() });
        }
        // The name decides what a CSI release is: a label can be rewritten
        // to point at another (or no) tenant, a name cannot.
        if let Some(tenant) = tenant_from_name(&profile.csi_release, name) {
            push(Target::CsiRelease { tenant });
        }
        if let Some(tenant) = labels.get(&profile.child_label).filter(|t| !t.is_empty()) {
            push(Target::Child { tenant: tenant.clone() });
        }
        return out;
    }
    for g in profile.guarded.iter().filter(|g| g.group == kind.group && g.kind == kind.kind) {
        let tenant = match (&g.name, &g.label) {
            (Some(pattern), _) => tenant_from_name(pattern, name),
            (None, Some(label)) => labels.get(label).filter(|t| !t.is_empty()).cloned(),
            (None, None) => None,
        };
        if let Some(tenant) = tenant {
            push(Target::Guarded { tenant, role: g.role.clone() });
        }
    }
    out
}

/// What an object primarily is (its first identity), for logs and metrics.
pub fn classify(profile: &Profile, kind: &GroupKind, name: &str, labels: &BTreeMap<String, String>) -> Target {
    identities(profile, kind, name, labels).into_iter().next().unwrap_or(Target::Unrelated)
}

/// The label keys that decide what an object of `kind` is for the gate:
/// the parent labels and the child label on releases, the labels guarded
/// entries of that kind are known by.
pub fn identity_labels<'a>(profile: &'a Profile, kind: &GroupKind) -> Vec<&'a str> {
    let mut keys: Vec<&str> = Vec::new();
    if *kind == profile.parent_kind() {
        keys.extend(profile.parent.match_labels.keys().map(String::as_str));
        keys.push(&profile.child_label);
    }
    keys.extend(profile.guarded.iter().filter(|g| g.group == kind.group && g.kind == kind.kind).filter_map(|g| g.label.as_deref()));
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// The parent release an object belongs to, from Helm's ownership
/// annotations or helm-controller's labels: `(namespace, release)`. An
/// object in a namespace belongs to a release of that namespace only (a
/// tenant may annotate its own objects, not make them another's); a
/// cluster-scoped one names its release's namespace.
pub fn release_of(profile: &Profile, request_namespace: &str, labels: &BTreeMap<String, String>, annotations: &BTreeMap<String, String>) -> Option<(String, String)> {
    let r = &profile.release;
    let by = |name: Option<&String>, namespace: Option<&String>| {
        let name = name.filter(|n| !n.is_empty())?;
        let namespace = if request_namespace.is_empty() { namespace.filter(|n| !n.is_empty())?.clone() } else { request_namespace.to_string() };
        Some((namespace, name.clone()))
    };
    by(annotations.get(&r.name_annotation), annotations.get(&r.namespace_annotation))
        .or_else(|| by(labels.get(&r.name_label), labels.get(&r.namespace_label)))
}

/// The object as part of a parent release, unless another identity already
/// stands for the same tenant.
pub fn with_release_identity(mut ids: Vec<Target>, request_namespace: &str, release: Option<(String, String)>) -> Vec<Target> {
    if let Some((namespace, tenant)) = release {
        let same_tenant = |t: &Target| !matches!(t, Target::Parent { .. }) && t.tenant() == Some(tenant.as_str()) && namespace == request_namespace;
        if !ids.iter().any(same_tenant) {
            ids.push(Target::ReleaseObject { tenant, namespace });
        }
    }
    ids
}

/// The label and annotation keys that make an object part of a release.
pub fn release_keys(profile: &Profile) -> [&str; 4] {
    let r = &profile.release;
    [&r.name_annotation, &r.namespace_annotation, &r.name_label, &r.namespace_label]
}

/// The parent's state as read for a decision.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParentFacts {
    pub namespace: String,
    pub name: String,
    /// The parent has a deletionTimestamp.
    pub deleting: bool,
    /// Its namespace has a deletionTimestamp; `None` when not read.
    pub namespace_deleting: Option<bool>,
    /// The custody finalizer is on it.
    pub in_custody: bool,
    pub record: Record,
}

impl ParentFacts {
    /// The facts of a parent release `tenant` seen as `view` (its namespace
    /// not read yet).
    pub fn of(profile: &Profile, keys: &Keys, tenant: &str, view: &ObjectMetaView) -> Self {
        ParentFacts {
            namespace: view.namespace.clone(),
            name: tenant.to_string(),
            deleting: view.deleting,
            namespace_deleting: None,
            in_custody: view.finalizers.contains(&profile.custody_finalizer),
            record: Record::from_annotations(keys, &view.annotations),
        }
    }

    pub fn teardown(&self) -> bool {
        self.deleting || self.namespace_deleting == Some(true)
    }
}

/// Whether the decision for `target` needs the namespace read, given the
/// parent: only when "not in teardown" could lead to an allow.
pub fn needs_namespace(target: &Target, parent: &ParentFacts) -> bool {
    matches!(target, Target::Child { .. } | Target::Guarded { .. } | Target::ReleaseObject { .. })
        && !parent.deleting
        && !parent.record.is_done()
        && parent.namespace_deleting.is_none()
}

/// A short, stable reason for logs and metrics.
pub type Reason = &'static str;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Allow { reason: Reason, warnings: Vec<String> },
    Deny { reason: Reason, code: u16, message: String },
}

impl Verdict {
    pub fn allow(reason: Reason) -> Self {
        Verdict::Allow { reason, warnings: Vec::new() }
    }

    pub fn allowed(&self) -> bool {
        matches!(self, Verdict::Allow { .. })
    }

    pub fn reason(&self) -> Reason {
        match self {
            Verdict::Allow { reason, .. } | Verdict::Deny { reason, .. } => reason,
        }
    }
}

/// Refused by policy (HTTP 403 in the Status the client sees).
fn forbid(reason: Reason, message: String) -> Verdict {
    Verdict::Deny { reason, code: 403, message: format!("volume-gate: {message}") }
}

/// Could not judge: refused, never allowed.
pub fn cannot_judge(message: impl std::fmt::Display) -> Verdict {
    Verdict::Deny { reason: "cannot-judge", code: 400, message: format!("volume-gate: {message}") }
}

/// The object being deleted, for messages.
#[derive(Clone, Copy, Debug)]
pub struct Subject<'a> {
    pub kind: &'a GroupKind,
    pub namespace: &'a str,
    pub name: &'a str,
    /// What is refused: "delete", or "relabel" for an update that would
    /// move the object away from its tenant.
    pub action: &'static str,
}

impl std::fmt::Display for Subject<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.namespace.is_empty() {
            write!(f, "{} {}", self.kind.kind, self.name)
        } else {
            write!(f, "{} {}/{}", self.kind.kind, self.namespace, self.name)
        }
    }
}

/// DELETE of the parent itself, judged from the object being deleted.
pub fn decide_parent_delete(profile: &Profile, subject: Subject<'_>, parent: &ParentFacts) -> Verdict {
    if parent.record.is_done() {
        return Verdict::allow("done");
    }
    if parent.in_custody {
        return Verdict::allow("in-custody");
    }
    forbid(
        "not-in-custody",
        format!(
            "refusing to {} {subject}: tenant {} is not yet in custody (the finalizer {} is missing), so nothing \
             would free its volumes before the CSI driver is removed. The volume-gate worker adds it within seconds; \
             retry shortly. If this persists, check that the volume-gate worker is running.",
            subject.action, parent.name, profile.custody_finalizer
        ),
    )
}

/// DELETE of a child or guarded dependency; `parent` is `None` when the
/// tenant's parent does not exist (custody already ended, or an orphan).
pub fn decide_dependent_delete(
    profile: &Profile,
    target: &Target,
    subject: Subject<'_>,
    parent: Option<&ParentFacts>,
) -> Verdict {
    let Some(tenant) = target.tenant() else {
        return Verdict::allow("unrelated");
    };
    let Some(parent) = parent else {
        return Verdict::Allow {
            reason: "parent-absent",
            warnings: vec![format!(
                "volume-gate: tenant {tenant} has no parent release in namespace {}; deleting {subject} without \
                 checking that its volumes were released",
                subject.namespace
            )],
        };
    };
    if parent.record.is_done() {
        return Verdict::allow("done");
    }
    let held = |reason: Reason, what: &str, when: &str| {
        forbid(
            reason,
            format!(
                "refusing to {action} {subject} ({what}): tenant {tenant} in namespace {ns} {when}, and its volumes are \
                 not released yet: {summary}. The CSI driver is the only thing that frees them; this will be \
                 allowed once the volume-release phase records them gone. To abandon the volumes instead, an \
                 authorized person records an override: {cmd}",
                action = subject.action,
                ns = parent.namespace,
                summary = parent.record.summary(),
                cmd = profile.override_command(&parent.namespace, tenant),
            ),
        )
    };
    match target {
        Target::CsiRelease { .. } => held(
            "csi-release-held",
            "the tenant's CSI driver release",
            if parent.teardown() { "is being torn down" } else { "exists" },
        ),
        Target::Child { .. } | Target::Guarded { .. } | Target::ReleaseObject { .. } if parent.teardown() => {
            let what = match target {
                Target::Guarded { role, .. } => role.as_str(),
                Target::ReleaseObject { .. } => "an object of the tenant's parent release, such as the CSI controller's identity",
                _ => "a child release the driver may need",
            };
            held("teardown-held", what, "is being torn down")
        }
        Target::Child { .. } | Target::Guarded { .. } | Target::ReleaseObject { .. } if parent.namespace_deleting.is_none() && !parent.deleting => {
            // The caller skipped the namespace read: never allow on a guess.
            cannot_judge(format!("refusing to {} {subject}: the state of namespace {} was not read", subject.action, parent.namespace))
        }
        Target::Child { .. } => Verdict::allow("not-in-teardown"),
        Target::Guarded { .. } | Target::ReleaseObject { .. } => Verdict::allow("not-in-teardown"),
        Target::Parent { .. } | Target::Unrelated => Verdict::allow("unrelated"),
    }
}

/// An UPDATE that adds, rewrites or removes a label that decides what an
/// object is can take it away from its tenant, or out of what a webhook is
/// sent, as surely as a DELETE: a CSI release given a parent's kind label
/// once matched no webhook, and its DELETE then went through unreviewed.
/// Returns every dependent identity the object has before or after the
/// change, each to be judged like its delete (the CSI release is held until
/// done, the rest during teardown); none when no such label changes.
/// Parents are judged by [`guard_update`].
pub fn relabel_targets(profile: &Profile, kind: &GroupKind, name: &str, old: &BTreeMap<String, String>, new: &BTreeMap<String, String>) -> Vec<Target> {
    let before = identities(profile, kind, name, old);
    let after = identities(profile, kind, name, new);
    let relabelled = identity_labels(profile, kind).iter().any(|k| old.get(*k) != new.get(*k)) || before != after;
    if !relabelled {
        return Vec::new();
    }
    let mut out: Vec<Target> = Vec::new();
    for t in before.into_iter().chain(after) {
        if !matches!(t, Target::Parent { .. } | Target::Unrelated) && !out.contains(&t) {
            out.push(t);
        }
    }
    out
}

/// The strictest of several verdicts on one request: the first refusal, or
/// an allow carrying every warning.
pub fn strictest(verdicts: Vec<Verdict>) -> Verdict {
    let mut reason = None;
    let mut all_warnings = Vec::new();
    for v in verdicts {
        match v {
            Verdict::Deny { .. } => return v,
            Verdict::Allow { reason: r, warnings } => {
                reason.get_or_insert(r);
                all_warnings.extend(warnings);
            }
        }
    }
    Verdict::Allow { reason: reason.unwrap_or("unrelated"), warnings: all_warnings }
}

/// Who is asking, from the request's userInfo.
#[derive(Clone, Copy, Debug)]
pub struct Requester<'a> {
    pub username: &'a str,
    pub is_worker: bool,
}

/// Metadata of the object before and after a CREATE or UPDATE.
#[derive(Clone, Copy, Debug)]
pub struct Change<'a> {
    pub old: Option<&'a ObjectMetaView>,
    pub new: &'a ObjectMetaView,
}

/// The parts of ObjectMeta the guards look at.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ObjectMetaView {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub finalizers: Vec<String>,
    pub deleting: bool,
}

/// What the validating guards conclude on an UPDATE/CREATE of a release.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpdateVerdict {
    /// Decided without asking anyone.
    Final(Verdict),
    /// Allowed if a SubjectAccessReview for the override verb allows the
    /// requester on this tenant.
    NeedsOverridePermission { namespace: String, tenant: String },
}

fn annotation<'a>(meta: Option<&'a ObjectMetaView>, key: &str) -> Option<&'a str> {
    meta.and_then(|m| m.annotations.get(key)).map(String::as_str)
}

/// Validating guards for CREATE/UPDATE of a parent release (`docs/design.md` §4).
pub fn guard_update(profile: &Profile, keys: &Keys, change: Change<'_>, who: Requester<'_>, now: jiff::Timestamp) -> UpdateVerdict {
    let Change { old, new } = change;
    let is_parent = profile.is_parent(&new.labels) || old.is_some_and(|o| profile.is_parent(&o.labels));
    if !is_parent {
        return UpdateVerdict::Final(Verdict::allow("not-a-parent"));
    }
    let tenant = new.name.as_str();
    let changed = |key: &str| annotation(old, key) != annotation(Some(new), key);

    // Custody ends only through the worker, which records why.
    let had_finalizer = old.is_some_and(|o| o.finalizers.contains(&profile.custody_finalizer));
    if had_finalizer && !new.finalizers.contains(&profile.custody_finalizer) && !who.is_worker {
        return UpdateVerdict::Final(forbid(
            "custody-finalizer-removed",
            format!(
                "{} may not remove the custody finalizer {} from tenant {}/{tenant}: only the volume-gate worker ends \
                 custody, after the volume-release phase or a recorded override. To abandon the volumes, record an \
                 override instead: {}",
                who.username,
                profile.custody_finalizer,
                new.namespace,
                profile.override_command(&new.namespace, tenant)
            ),
        ));
    }
    // Custody is a stated intent; hiding a parent behind other labels would
    // end it silently.
    if old.is_some_and(|o| profile.is_parent(&o.labels)) && !profile.is_parent(&new.labels) && !who.is_worker {
        return UpdateVerdict::Final(forbid(
            "parent-labels-removed",
            format!(
                "{} may not remove the tenant labels ({}) from {}/{tenant}: the volume gate recognises tenants by them",
                who.username,
                profile.parent_selector(),
                new.namespace
            ),
        ));
    }
    let worker_keys: Vec<&str> = keys.worker_owned().into_iter().filter(|k| changed(k)).collect();
    if !worker_keys.is_empty() && !who.is_worker {
        return UpdateVerdict::Final(forbid(
            "record-forged",
            format!(
                "{} may not change {}: the release record is written only by the volume-gate worker",
                who.username,
                worker_keys.join(", ")
            ),
        ));
    }
    let override_changed = changed(&keys.override_reason);
    if !override_changed {
        let stamps: Vec<&str> = keys.stamped().into_iter().filter(|k| changed(k)).collect();
        if !stamps.is_empty() {
            return UpdateVerdict::Final(forbid(
                "stamp-forged",
                format!(
                    "{} may not change {}: these are stamped by the volume gate when {} changes, never accepted from a client",
                    who.username,
                    stamps.join(", "),
                    keys.override_reason
                ),
            ));
        }
        return UpdateVerdict::Final(Verdict::allow("guards-passed"));
    }
    match annotation(Some(new), &keys.override_reason) {
        Some(reason) if reason.trim().is_empty() => UpdateVerdict::Final(forbid(
            "override-without-reason",
            format!("the override on {}/{tenant} needs a reason: say why these volumes may be abandoned", new.namespace),
        )),
        Some(_) => {
            let by = annotation(Some(new), &keys.override_by);
            let at = annotation(Some(new), &keys.override_at);
            let at_ok = at
                .and_then(|a| a.parse::<jiff::Timestamp>().ok())
                .is_some_and(|t| (now.as_second() - t.as_second()).abs() <= 300);
            if by != Some(who.username) || !at_ok {
                return UpdateVerdict::Final(forbid(
                    "stamp-forged",
                    format!(
                        "the override on {}/{tenant} is not stamped as the volume gate stamps it ({} must be the requester \
                         {}, {} the time of this request): is the mutating webhook installed?",
                        new.namespace, keys.override_by, who.username, keys.override_at
                    ),
                ));
            }
            UpdateVerdict::NeedsOverridePermission { namespace: new.namespace.clone(), tenant: tenant.to_string() }
        }
        None => {
            // Withdrawing an override is as much a decision as recording one.
            if keys.stamped().into_iter().any(|k| annotation(Some(new), k).is_some()) {
                return UpdateVerdict::Final(forbid(
                    "stamp-forged",
                    format!("the override on {}/{tenant} was removed but its stamps were not", new.namespace),
                ));
            }
            UpdateVerdict::NeedsOverridePermission { namespace: new.namespace.clone(), tenant: tenant.to_string() }
        }
    }
}

/// The message when the SubjectAccessReview refuses an override.
pub fn override_refused(profile: &Profile, username: &str, namespace: &str, tenant: &str, why: &str) -> Verdict {
    let p = &profile.override_permission;
    let why = if why.is_empty() { String::new() } else { format!(" ({why})") };
    forbid(
        "override-unauthorized",
        format!(
            "{username} may not record an override for tenant {namespace}/{tenant}: it needs verb {verb:?} on resource \
             {res:?} of group {group:?}{why}. An administrator grants it with a Role rule {{apiGroups: [{group}], \
             resources: [{res}], verbs: [{verb}]}} in namespace {namespace}",
            verb = p.verb,
            res = p.resource,
            group = p.group
        ),
    )
}

/// One JSON Patch operation, as the mutating webhook returns it.
#[derive(Clone, Debug, PartialEq)]
pub enum Mutation {
    /// Add the custody finalizer (creating the list when absent).
    AddFinalizer { create_list: bool },
    /// Stamp who recorded the override and when.
    Stamp { by: String, at: String },
    /// Remove the stamps of a withdrawn override.
    Unstamp { keys: Vec<String> },
}

/// Mutations for CREATE/UPDATE of a release (`docs/design.md` §2, §3).
pub fn mutate(profile: &Profile, keys: &Keys, change: Change<'_>, who: Requester<'_>, now: jiff::Timestamp) -> Vec<Mutation> {
    let Change { old, new } = change;
    // The same test as `guard_update`: a write that removes the parent
    // labels is still judged (and stamped) as a write to a parent, or the
    // guard would refuse the webhook's own missing stamps (fuzz finding F1).
    let parent_now = profile.is_parent(&new.labels);
    if !parent_now && !old.is_some_and(|o| profile.is_parent(&o.labels)) {
        return Vec::new();
    }
    let mut out = Vec::new();
    // Custody starts before deletion, never during it, and only on what is
    // a parent after the write. A removal is not quietly undone here: the
    // validating guard refuses it, loudly.
    let removal = old.is_some_and(|o| o.finalizers.contains(&profile.custody_finalizer));
    if parent_now && !new.deleting && !removal && !new.finalizers.contains(&profile.custody_finalizer) {
        out.push(Mutation::AddFinalizer { create_list: new.finalizers.is_empty() });
    }
    if annotation(old, &keys.override_reason) != annotation(Some(new), &keys.override_reason) {
        if annotation(Some(new), &keys.override_reason).is_some() {
            out.push(Mutation::Stamp {
                by: who.username.to_string(),
                at: crate::record::rfc3339(now),
            });
        } else {
            let present: Vec<String> =
                keys.stamped().into_iter().filter(|k| new.annotations.contains_key(*k)).map(str::to_string).collect();
            if !present.is_empty() {
                out.push(Mutation::Unstamp { keys: present });
            }
        }
    }
    out
}

/// Renders mutations as RFC 6902 operations.
pub fn to_json_patch(profile: &Profile, keys: &Keys, mutations: &[Mutation]) -> json_patch::Patch {
    use json_patch::{AddOperation, PatchOperation, RemoveOperation};
    use json_patch::jsonptr::PointerBuf;
    use serde_json::{Value, json};
    let annotation_path = |key: &str| PointerBuf::from_tokens(["metadata", "annotations", key]);
    let mut ops = Vec::new();
    for m in mutations {
        match m {
            Mutation::AddFinalizer { create_list: true } => ops.push(PatchOperation::Add(AddOperation {
                path: PointerBuf::from_tokens(["metadata", "finalizers"]),
                value: json!([profile.custody_finalizer]),
            })),
            Mutation::AddFinalizer { create_list: false } => ops.push(PatchOperation::Add(AddOperation {
                path: PointerBuf::from_tokens(["metadata", "finalizers", "-"]),
                value: Value::String(profile.custody_finalizer.clone()),
            })),
            Mutation::Stamp { by, at } => {
                // The override annotation exists, so the map does too.
                ops.push(PatchOperation::Add(AddOperation { path: annotation_path(&keys.override_by), value: json!(by) }));
                ops.push(PatchOperation::Add(AddOperation { path: annotation_path(&keys.override_at), value: json!(at) }));
            }
            Mutation::Unstamp { keys } => {
                for k in keys {
                    ops.push(PatchOperation::Remove(RemoveOperation { path: annotation_path(k) }));
                }
            }
        }
    }
    json_patch::Patch(ops)
}

#[cfg(test)]
mod tests;
