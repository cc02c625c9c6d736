//! The gate's decisions (`docs/design.md` §4) as pure functions of the request and
//! the tenant's state. No I/O here: the HTTP layer gathers the facts, these
//! functions judge them, and unit tests cover every row.

use std::collections::BTreeMap;

use crate::admission::request::SpecView;
use crate::names::is_subdomain as is_object_name;
use crate::profile::{GroupKind, Profile, flux_release_kind, tenant_from_name};
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
    /// A disk of the tenant on the management side (an infra object, such
    /// as a DataVolume, or its PVC) known by the profile's infra labels.
    /// Its DELETE frees the disk and is allowed; changing those labels
    /// would hide it from the phase when the tenant API cannot answer, and
    /// is held until done.
    InfraDisk { tenant: String },
    /// A disk the worker kept on the management side for a tenant (its PV,
    /// labelled `kept`), whose acknowledgement the mutating webhook stamps;
    /// `tenant` is its `kept-for`.
    KeptDisk { tenant: String },
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
            | Target::ReleaseObject { tenant, .. }
            | Target::InfraDisk { tenant }
            | Target::KeptDisk { tenant } => Some(tenant),
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
            Target::InfraDisk { .. } => "infra-disk",
            Target::KeptDisk { .. } => "kept-disk",
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
pub fn identities(
    profile: &Profile,
    kind: &GroupKind,
    name: &str,
    labels: &BTreeMap<String, String>,
) -> Vec<Target> {
    identities_of(profile, kind, name, labels, &SpecView::default())
}

/// The fields of an object's spec that name its tenant where a label can
/// be removed first: a release's kubeConfig Secret (it installs into that
/// tenant), a machine's Cluster API `clusterName`.
fn spec_tenants(
    profile: &Profile,
    kind: &GroupKind,
    spec: &SpecView,
) -> Vec<(Option<String>, String)> {
    let mut out = Vec::new();
    if *kind == flux_release_kind()
        && let Some(secret) = spec
            .kube_config
            .as_ref()
            .and_then(|k| k.pointer("/secretRef/name"))
            .and_then(serde_json::Value::as_str)
        && let Some(tenant) = tenant_from_name(&profile.kubeconfig.secret_name, secret)
    {
        out.push((None, tenant));
    }
    if let Some(cluster) = spec
        .cluster_name
        .as_ref()
        .and_then(serde_json::Value::as_str)
        .filter(|c| !c.is_empty())
    {
        for g in profile.guarded.iter().filter(|g| {
            g.group == kind.group
                && g.kind == kind.kind
                && g.field.as_deref() == Some(crate::profile::CLUSTER_NAME_FIELD)
        }) {
            out.push((Some(g.role.clone()), cluster.to_string()));
        }
    }
    out
}

/// As [`identities`], with the spec fields that name a tenant too
/// ([`spec_tenants`]): a child that installs into a tenant with its admin
/// kubeconfig is its child whatever its labels; a machine of a tenant's
/// Cluster API cluster is guarded whatever its labels.
pub fn identities_of(
    profile: &Profile,
    kind: &GroupKind,
    name: &str,
    labels: &BTreeMap<String, String>,
    spec: &SpecView,
) -> Vec<Target> {
    let from_spec = spec_tenants(profile, kind, spec);
    let mut out: Vec<Target> = Vec::new();
    let mut push = |t: Target| {
        // A marker that names no tenant that can exist protects nothing.
        if !t.tenant().is_some_and(is_object_name) {
            return;
        }
        // One identity per tenant: the first (the strictest) stands for it,
        // except that a parent is its own tenant and is always kept.
        let dup = out
            .iter()
            .any(|o| !matches!(o, Target::Parent { .. }) && o.tenant() == t.tenant());
        if !dup {
            out.push(t);
        }
    };
    let is_release = *kind == flux_release_kind();
    if *kind == profile.parent_kind() && profile.is_parent(labels) {
        push(Target::Parent {
            tenant: name.to_string(),
        });
    }
    if is_release {
        // The name decides what a CSI release is: a label can be rewritten
        // to point at another (or no) tenant, a name cannot.
        if let Some(tenant) = profile
            .csi_release
            .as_ref()
            .and_then(|csi| tenant_from_name(csi, name))
        {
            push(Target::CsiRelease { tenant });
        }
        if let Some(tenant) = profile
            .child_label
            .as_ref()
            .and_then(|l| labels.get(l))
            .filter(|t| !t.is_empty())
        {
            push(Target::Child {
                tenant: tenant.clone(),
            });
        }
        for (_, tenant) in from_spec.iter().cloned() {
            push(Target::Child { tenant });
        }
    }
    if is_release || *kind == profile.parent_kind() {
        return out;
    }
    for g in profile
        .guarded
        .iter()
        .filter(|g| g.group == kind.group && g.kind == kind.kind)
    {
        let tenant = match (&g.name, &g.label) {
            (Some(pattern), _) => tenant_from_name(pattern, name),
            (None, Some(label)) => labels.get(label).filter(|t| !t.is_empty()).cloned(),
            // By a field: `from_spec`, below.
            (None, None) => None,
        };
        if let Some(tenant) = tenant {
            push(Target::Guarded {
                tenant,
                role: g.role.clone(),
            });
        }
    }
    for (role, tenant) in from_spec {
        if let Some(role) = role {
            push(Target::Guarded { tenant, role });
        }
    }
    if let Some(infra) = profile
        .infra
        .as_ref()
        .filter(|_| is_infra_kind(profile, kind))
    {
        for (key, template) in &infra.labels {
            if let Some(tenant) = labels.get(key).and_then(|v| tenant_from_name(template, v)) {
                push(Target::InfraDisk { tenant });
            }
        }
    }
    out
}

/// The kinds the profile's infra labels mark as a tenant's disk: the infra
/// object (DataVolume) and the PVC it makes, which carries its labels.
pub fn is_infra_kind(profile: &Profile, kind: &GroupKind) -> bool {
    profile.infra.as_ref().is_some_and(|i| {
        (kind.group == i.group && kind.kind == i.kind)
            || (kind.group.is_empty() && kind.kind == "PersistentVolumeClaim")
    })
}

/// What an object primarily is (its first identity), for logs and metrics.
pub fn classify(
    profile: &Profile,
    kind: &GroupKind,
    name: &str,
    labels: &BTreeMap<String, String>,
) -> Target {
    identities(profile, kind, name, labels)
        .into_iter()
        .next()
        .unwrap_or(Target::Unrelated)
}

/// The label keys that decide what an object of `kind` is for the gate:
/// the parent labels and the child label on releases, the labels guarded
/// entries of that kind are known by.
pub fn identity_labels<'a>(profile: &'a Profile, kind: &GroupKind) -> Vec<&'a str> {
    let mut keys: Vec<&str> = Vec::new();
    if *kind == profile.parent_kind() {
        keys.extend(profile.parent.match_labels.keys().map(String::as_str));
    }
    if *kind == flux_release_kind() {
        keys.extend(profile.child_label.as_deref());
    }
    keys.extend(
        profile
            .guarded
            .iter()
            .filter(|g| g.group == kind.group && g.kind == kind.kind)
            .filter_map(|g| g.label.as_deref()),
    );
    if let Some(infra) = profile
        .infra
        .as_ref()
        .filter(|_| is_infra_kind(profile, kind))
    {
        keys.extend(infra.labels.keys().map(String::as_str));
    }
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// A parent release, as `(namespace, release)`.
pub type ReleaseOwner = (String, String);

/// The parent release an object belongs to, from Helm's ownership
/// annotations or helm-controller's labels: `(namespace, release)`. An
/// object in a namespace belongs to a release of that namespace only (a
/// tenant may annotate its own objects, not make them another's); a
/// cluster-scoped one names its release's namespace.
pub fn release_of(
    profile: &Profile,
    request_namespace: &str,
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
) -> Option<(String, String)> {
    let r = profile.release.as_ref()?;
    // A name or namespace that cannot exist names no release to protect.
    let by = |name: Option<&String>, namespace: Option<&String>| {
        let name = name.filter(|n| is_object_name(n))?;
        let namespace = if request_namespace.is_empty() {
            namespace.filter(|n| is_object_name(n))?.clone()
        } else {
            request_namespace.to_string()
        };
        Some((namespace, name.clone()))
    };
    by(
        annotations.get(&r.name_annotation),
        annotations.get(&r.namespace_annotation),
    )
    .or_else(|| by(labels.get(&r.name_label), labels.get(&r.namespace_label)))
}

/// The role of what a namespace deletion would take from under a tenant's
/// release phase (`named_for`).
pub const NAMESPACE_ROAD_ROLE: &str = "named for the tenant: part of what its release phase runs on (its API \
     server's and CSI controller's Pods, ReplicaSets and Services, its VMs), which a namespace being deleted \
     cannot make again";

/// The parents an object is named for, of `parents` (the parent releases of
/// the request's namespace): its name, or the name of an owner of it, is
/// the parent's or starts with it and a dash (`docs/design.md` §5e). A
/// namespace being deleted takes everything in it, the Pods of the tenant's
/// API server (Kamaji's Deployment `R`, its ReplicaSet `R-<hash>`, Pods
/// `R-<hash>-<id>`) and of its CSI controller (`R-kcsi-controller-...`)
/// among them, and makes nothing new: the namespace controller's deletes of
/// what is named for a tenant wait until it is done, or the phase could
/// reach neither. Neither the parent itself (its DELETE starts the phase),
/// nor its teardown hook's objects, nor Events.
pub fn named_for(
    profile: &Profile,
    kind: &GroupKind,
    name: &str,
    owners: &[&str],
    parents: &[String],
) -> Vec<String> {
    if kind.kind == "Event" {
        return Vec::new();
    }
    let is_for =
        |n: &str, p: &str| n == p || n.strip_prefix(p).is_some_and(|rest| rest.starts_with('-'));
    parents
        .iter()
        .filter(|p| !(*kind == profile.parent_kind() && name == p.as_str()))
        .filter(|p| !profile.is_release_hook(name, p))
        .filter(|p| is_for(name, p) || owners.iter().any(|o| is_for(o, p)))
        .cloned()
        .collect()
}

/// The parent names an object could be named for: every prefix of its name,
/// or of an owner's, that ends before a dash (or is the whole name), starts
/// with the profile's parent name prefix (`kubernetes-`, which every
/// parent's name does) and is a valid object name. Read one by one (a GET
/// each: the webhook may not list releases), they are the `parents` of
/// [`named_for`]. None without a name prefix in the profile.
pub fn parent_candidates(profile: &Profile, names: &[&str]) -> Vec<String> {
    let prefix = profile.parent.name_prefix.as_str();
    if prefix.is_empty() {
        return Vec::new();
    }
    let mut out: Vec<String> = Vec::new();
    for n in names.iter().filter(|n| n.starts_with(prefix)) {
        let ends = n
            .char_indices()
            .filter(|(i, c)| *c == '-' && *i > prefix.len())
            .map(|(i, _)| i)
            .chain([n.len()]);
        for end in ends {
            let candidate = &n[..end];
            if is_object_name(candidate) && !out.iter().any(|o| o == candidate) {
                out.push(candidate.to_string());
            }
        }
    }
    out
}

/// The object as part of a parent release, unless another identity already
/// stands for the same tenant.
pub fn with_release_identity(
    mut ids: Vec<Target>,
    request_namespace: &str,
    release: Option<(String, String)>,
) -> Vec<Target> {
    if let Some((namespace, tenant)) = release {
        let same_tenant = |t: &Target| {
            !matches!(t, Target::Parent { .. })
                && t.tenant() == Some(tenant.as_str())
                && namespace == request_namespace
        };
        if !ids.iter().any(same_tenant) {
            ids.push(Target::ReleaseObject { tenant, namespace });
        }
    }
    ids
}

/// The markers on an object that would name its tenant but name none that
/// can exist (not a DNS-1123 subdomain): `(key, value)`. Such an object
/// protects no volume; the gate allows what it asks and says so in a
/// warning, rather than refusing everyone, the namespace controller
/// included, on a value no one can judge (one such ConfigMap once kept a
/// namespace Terminating).
pub fn impossible_markers(
    profile: &Profile,
    kind: &GroupKind,
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
) -> Vec<(String, String)> {
    let mut keys: Vec<&str> = identity_labels(profile, kind)
        .into_iter()
        .filter(|k| !profile.parent.match_labels.contains_key(*k))
        .collect();
    let r = profile.release.as_ref();
    keys.extend(
        r.into_iter()
            .flat_map(|r| [r.name_label.as_str(), r.namespace_label.as_str()]),
    );
    let infra = profile
        .infra
        .as_ref()
        .filter(|_| is_infra_kind(profile, kind));
    let mut out: Vec<(String, String)> = keys
        .into_iter()
        .filter_map(|k| labels.get_key_value(k))
        .filter(|(k, v)| {
            // An infra label's value is the tenant within its template.
            let tenant = match infra.and_then(|i| i.labels.get(*k)) {
                Some(template) => tenant_from_name(template, v),
                None => Some(v.to_string()),
            };
            !tenant.is_some_and(|t| is_object_name(&t))
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    out.extend(
        r.into_iter()
            .flat_map(|r| [&r.name_annotation, &r.namespace_annotation])
            .filter_map(|k| annotations.get_key_value(k))
            .filter(|(_, v)| !is_object_name(v))
            .map(|(k, v)| (k.clone(), v.clone())),
    );
    out
}

/// The warning an allow carries for each marker that names no tenant.
pub fn impossible_marker_warnings(markers: &[(String, String)]) -> Vec<String> {
    markers
        .iter()
        .map(|(k, v)| {
            format!(
                "volume-gate: {k}={:?} names no tenant that can exist (not a DNS-1123 name), so this object protects \
                 no volume and is not held",
                crate::text::bounded(v, 80)
            )
        })
        .collect()
}

/// The label and annotation keys that make an object part of a release
/// (none where the parent is no Helm release).
pub fn release_keys(profile: &Profile) -> Vec<&str> {
    profile
        .release
        .iter()
        .flat_map(|r| {
            [
                r.name_annotation.as_str(),
                r.namespace_annotation.as_str(),
                r.name_label.as_str(),
                r.namespace_label.as_str(),
            ]
        })
        .collect()
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
    /// The facts of parent release `namespace`/`tenant` seen as `view` (its
    /// namespace not read yet). The namespace is the request's, never one
    /// the object's body claims.
    pub fn of(
        profile: &Profile,
        keys: &Keys,
        namespace: &str,
        tenant: &str,
        view: &ObjectMetaView,
    ) -> Self {
        ParentFacts {
            namespace: namespace.to_string(),
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

/// Whether the decision for `target` can need the namespace read (before
/// the parent is known): the targets for which "not in teardown" can lead
/// to an allow.
pub fn may_need_namespace(target: &Target) -> bool {
    matches!(
        target,
        Target::Child { .. }
            | Target::Guarded { .. }
            | Target::ReleaseObject { .. }
            | Target::InfraDisk { .. }
    )
}

/// Whether the decision for `target` needs the namespace read, given the
/// parent: only when "not in teardown" could lead to an allow.
pub fn needs_namespace(target: &Target, parent: &ParentFacts) -> bool {
    may_need_namespace(target)
        && !parent.deleting
        && !parent.record.is_done()
        && parent.namespace_deleting.is_none()
}

/// A short, stable reason for logs and metrics.
pub type Reason = &'static str;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Allow {
        reason: Reason,
        warnings: Vec<String>,
    },
    Deny {
        reason: Reason,
        code: u16,
        message: String,
    },
}

impl Verdict {
    pub fn allow(reason: Reason) -> Self {
        Verdict::Allow {
            reason,
            warnings: Vec::new(),
        }
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
    Verdict::Deny {
        reason,
        code: 403,
        message: format!("volume-gate: {message}"),
    }
}

/// Could not judge: refused, never allowed.
pub fn cannot_judge(message: impl std::fmt::Display) -> Verdict {
    Verdict::Deny {
        reason: "cannot-judge",
        code: 400,
        message: format!("volume-gate: {message}"),
    }
}

/// The object being deleted, for messages.
#[derive(Clone, Copy, Debug)]
pub struct Subject<'a> {
    pub kind: &'a GroupKind,
    pub namespace: &'a str,
    pub name: &'a str,
    /// What is refused: "delete", "relabel" for an update that would move
    /// the object away from its tenant, or the change of a release that
    /// makes its controller remove what it installed.
    pub action: &'a str,
}

impl<'a> Subject<'a> {
    pub fn delete(kind: &'a GroupKind, namespace: &'a str, name: &'a str) -> Self {
        Subject {
            kind,
            namespace,
            name,
            action: "delete",
        }
    }

    pub fn with_action(self, action: &'a str) -> Self {
        Subject { action, ..self }
    }
}

/// The action of a release change that makes helm-controller remove what
/// it installed (`flux::removals`), for a refusal: "change its chart of".
pub fn removal_action(removals: &[&str]) -> String {
    format!(
        "change {} (helm-controller then uninstalls what the release installed) of",
        removals.join(" and ")
    )
}

/// The action of a status write by anyone but the release's controller.
pub const STATUS_ACTION: &str = "rewrite the status (helm-controller uninstalls a release whose recorded current \
     release or storage namespace no longer matches its spec) of";

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
pub fn decide_parent_delete(
    profile: &Profile,
    subject: Subject<'_>,
    parent: &ParentFacts,
) -> Verdict {
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

/// A change of the parent release that makes helm-controller uninstall it
/// while the object stays (`flux::removals`, or its status rewritten): the
/// pre-delete hook and the uninstall then take away the CSI driver and the
/// control plane with no deletionTimestamp, so the volume-release phase,
/// which only a deletionTimestamp starts, would never run. Held until done.
pub fn decide_parent_removal(
    profile: &Profile,
    subject: Subject<'_>,
    parent: &ParentFacts,
) -> Verdict {
    if parent.record.is_done() {
        return Verdict::allow("done");
    }
    forbid(
        "parent-removal-held",
        format!(
            "refusing to {} {subject}: tenant {} would be uninstalled, its pre-delete hook included, while its \
             HelmRelease stays, and the volume-release phase starts only when the HelmRelease is deleted; its \
             volumes are not released yet: {}. To delete the tenant, delete the HelmRelease: its volumes are then \
             released first. To abandon them, an authorized person records an override: {}",
            subject.action,
            parent.name,
            parent.record.summary(),
            profile.override_command(&parent.namespace, &parent.name)
        ),
    )
}

/// Whether a move of `target`'s chart source is the platform's own
/// upgrade rather than a retarget (`docs/design.md` §4, "Who moves a
/// chart's source"): a parent's, set by one of the profile's
/// `writers.parentSources` (Cozystack's cozystack-controller and
/// cozystack-api, which take it from the ApplicationDefinition); a child's,
/// applied by the release controller to an object its parent release
/// (`tenant`, in the request's namespace) owns before and after the write,
/// that is, the parent chart's own upgrade rendering it. `owners` are the
/// parent releases Helm's ownership names on the object before and after.
pub fn source_move_by_platform(
    profile: &Profile,
    target: &Target,
    username: &str,
    namespace: &str,
    owners: (Option<&ReleaseOwner>, Option<&ReleaseOwner>),
) -> bool {
    match target {
        Target::Parent { .. } => profile.writers.sets_parent_sources(username),
        Target::CsiRelease { tenant } | Target::Child { tenant } => {
            let parent = (namespace.to_string(), tenant.clone());
            profile.writers.is_release_controller(username)
                && owners.0 == Some(&parent)
                && owners.1 == Some(&parent)
        }
        _ => false,
    }
}

/// A write of a release's status by `username`. helm-controller trusts the
/// status it finds: a current release or storage namespace there that no
/// longer matches the spec makes it uninstall the release the status names
/// (`decide::flux`), which can be another release in the same storage
/// namespace, another tenant's parent included. Only the controller writes
/// a status; anyone else is refused, whatever the release.
pub fn decide_status_write(profile: &Profile, subject: Subject<'_>, username: &str) -> Verdict {
    if profile.writers.is_release_controller(username) {
        return Verdict::allow("controller");
    }
    forbid(
        "status-forged",
        format!(
            "{username} may not {} {subject}: only its controller ({}) writes a release's status",
            subject.action,
            profile.writers.release_controllers.join(", ")
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
        // Deleting a disk frees it, as the driver does; but in teardown only
        // once the phase has inventoried the tenant's volumes and kept the
        // disks that must stay (§5c): until then nothing says which those are.
        Target::InfraDisk { .. } if subject.action == "delete" && parent.teardown() => {
            if parent.record.inventory.is_some() {
                Verdict::allow("frees-the-disk")
            } else {
                held(
                    "infra-disk-uninventoried",
                    "a disk of the tenant on the management side: the volume-release phase has not inventoried \
                     the tenant's volumes yet, so nothing says yet whether this disk is one to keep",
                    "is being torn down",
                )
            }
        }
        Target::InfraDisk { .. }
            if subject.action == "delete" && parent.namespace_deleting.is_none() =>
        {
            cannot_judge(format!(
                "refusing to delete {subject}: the state of namespace {} was not read",
                parent.namespace
            ))
        }
        Target::InfraDisk { .. } if subject.action == "delete" => Verdict::allow("frees-the-disk"),
        Target::InfraDisk { .. } => held(
            "infra-disk-held",
            "a disk of the tenant on the management side: its labels are how the volume-release phase finds it \
             when the tenant API cannot answer",
            if parent.teardown() {
                "is being torn down"
            } else {
                "exists"
            },
        ),
        Target::CsiRelease { .. } => held(
            "csi-release-held",
            "the tenant's CSI driver release",
            if parent.teardown() {
                "is being torn down"
            } else {
                "exists"
            },
        ),
        Target::Child { .. } | Target::Guarded { .. } | Target::ReleaseObject { .. }
            if parent.teardown() =>
        {
            let what = match target {
                Target::Guarded { role, .. } => role.as_str(),
                Target::ReleaseObject { .. } => {
                    "an object of the tenant's parent release, such as the CSI controller's identity"
                }
                _ => "a child release the driver may need",
            };
            held("teardown-held", what, "is being torn down")
        }
        Target::Child { .. } | Target::Guarded { .. } | Target::ReleaseObject { .. }
            if parent.namespace_deleting.is_none() && !parent.deleting =>
        {
            // The caller skipped the namespace read: never allow on a guess.
            cannot_judge(format!(
                "refusing to {} {subject}: the state of namespace {} was not read",
                subject.action, parent.namespace
            ))
        }
        Target::Child { .. } => Verdict::allow("not-in-teardown"),
        Target::Guarded { .. } | Target::ReleaseObject { .. } => Verdict::allow("not-in-teardown"),
        Target::Parent { .. } | Target::KeptDisk { .. } | Target::Unrelated => {
            Verdict::allow("unrelated")
        }
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
pub fn relabel_targets(
    profile: &Profile,
    kind: &GroupKind,
    name: &str,
    old: &BTreeMap<String, String>,
    new: &BTreeMap<String, String>,
) -> Vec<Target> {
    let none = SpecView::default();
    relabel_targets_of(profile, kind, name, (old, &none), (new, &none))
}

/// As [`relabel_targets`], the spec fields that name a tenant included:
/// changing one (a machine's `clusterName`) is a relabel too.
pub fn relabel_targets_of(
    profile: &Profile,
    kind: &GroupKind,
    name: &str,
    (old, old_spec): (&BTreeMap<String, String>, &SpecView),
    (new, new_spec): (&BTreeMap<String, String>, &SpecView),
) -> Vec<Target> {
    let before = identities_of(profile, kind, name, old, old_spec);
    let after = identities_of(profile, kind, name, new, new_spec);
    let relabelled = identity_labels(profile, kind)
        .iter()
        .any(|k| old.get(*k) != new.get(*k))
        || before != after;
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
            Verdict::Allow {
                reason: r,
                warnings,
            } => {
                reason.get_or_insert(r);
                all_warnings.extend(warnings);
            }
        }
    }
    Verdict::Allow {
        reason: reason.unwrap_or("unrelated"),
        warnings: all_warnings,
    }
}

mod acknowledge;
pub mod flux;
mod update;
pub use crate::admission::request::ObjectMetaView;
pub use acknowledge::acknowledge;
pub use update::{
    Change, Mutation, Requester, UpdateVerdict, decide_reference_move, guard_update, mutate,
    override_refused, to_json_patch,
};

#[cfg(test)]
mod tests;
