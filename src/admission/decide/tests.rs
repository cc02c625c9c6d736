//! Every row of the decision table and every guard, named for the behaviour.

use super::*;
use crate::admission::request::SpecView;
use crate::record::{Inventory, Volume};

const NS: &str = "tenant-acme";
const R: &str = "kubernetes-prod";
const WORKER: &str = "system:serviceaccount:volume-gate:volume-gate-worker";

fn profile() -> Profile {
    Profile::cozystack()
}

fn keys() -> Keys {
    Keys::new(&profile().annotation_prefix)
}

fn hr() -> GroupKind {
    GroupKind::new("helm.toolkit.fluxcd.io", "HelmRelease")
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn parent_labels() -> BTreeMap<String, String> {
    profile().parent.match_labels.clone()
}

fn child_labels() -> BTreeMap<String, String> {
    labels(&[("cozystack.io/target-cluster-name", R)])
}

fn now() -> jiff::Timestamp {
    "2026-12-02T10:00:00Z".parse().unwrap()
}

fn inventory(left: usize, freed: usize) -> String {
    let vols = (0..left + freed)
        .map(|i| Volume {
            pv: format!("pvc-{i}"),
            driver: Some("csi.example".into()),
            handle: Some(format!("disk-{i}")),
            capacity: Some("1Gi".into()),
            reclaim: "Delete".into(),
            claim: Some(format!("default/c{i}")),
            gone: i >= left,
            infra: None,
        })
        .collect();
    Inventory::new("2026-12-02T09:00:00Z".into(), vols).encode()
}

/// Parent state builder: `facts().deleting().phase("Blocked")`.
struct Facts(ParentFacts, BTreeMap<String, String>);

fn facts() -> Facts {
    Facts(
        ParentFacts {
            namespace: NS.into(),
            name: R.into(),
            deleting: false,
            namespace_deleting: Some(false),
            in_custody: true,
            record: Record::default(),
        },
        BTreeMap::new(),
    )
}

impl Facts {
    fn deleting(mut self) -> Self {
        self.0.deleting = true;
        self
    }
    fn namespace_deleting(mut self) -> Self {
        self.0.namespace_deleting = Some(true);
        self
    }
    fn namespace_unread(mut self) -> Self {
        self.0.namespace_deleting = None;
        self
    }
    fn no_custody(mut self) -> Self {
        self.0.in_custody = false;
        self
    }
    fn ann(mut self, key: &str, value: &str) -> Self {
        self.1
            .insert(format!("volumes.cozystack.io/{key}"), value.into());
        self
    }
    fn phase(self, p: &str) -> Self {
        self.ann("phase", p)
    }
    fn overridden(self) -> Self {
        self.ann("override", "tenant abandoned, ticket 42")
            .ann("override-by", "alice")
            .ann("override-at", "2026-12-02T09:59:00Z")
    }
    fn build(mut self) -> ParentFacts {
        self.0.record = Record::from_annotations(&keys(), &self.1);
        self.0
    }
}

fn subject<'a>(kind: &'a GroupKind, name: &'a str) -> Subject<'a> {
    Subject {
        kind,
        namespace: NS,
        name,
        action: "delete",
    }
}

fn delete(target: &Target, name: &str, parent: Option<ParentFacts>) -> Verdict {
    let kind = hr();
    decide_dependent_delete(&profile(), target, subject(&kind, name), parent.as_ref())
}

fn csi() -> Target {
    Target::CsiRelease { tenant: R.into() }
}

fn child() -> Target {
    Target::Child { tenant: R.into() }
}

fn guarded() -> Target {
    Target::Guarded {
        tenant: R.into(),
        role: "the tenant's API server".into(),
    }
}

fn assert_denied(v: &Verdict, reason: &str) -> String {
    match v {
        Verdict::Deny {
            reason: r,
            message,
            code,
        } => {
            assert_eq!(*r, reason, "{message}");
            assert_eq!(*code, 403);
            message.clone()
        }
        other => panic!("expected deny {reason}, got {other:?}"),
    }
}

fn assert_allowed(v: &Verdict, reason: &str) {
    assert!(
        matches!(v, Verdict::Allow { reason: r, .. } if *r == reason),
        "expected allow {reason}, got {v:?}"
    );
}

// ---- classification ----

#[test]
fn parent_is_recognised_by_its_labels_not_its_name() {
    let p = profile();
    assert_eq!(
        classify(&p, &hr(), R, &parent_labels()),
        Target::Parent { tenant: R.into() }
    );
    assert_eq!(classify(&p, &hr(), R, &BTreeMap::new()), Target::Unrelated);
}

#[test]
fn sharding_key_plays_no_part_in_recognising_a_parent() {
    let mut l = parent_labels();
    l.insert("sharding.fluxcd.io/key".into(), "shard2".into());
    assert_eq!(
        classify(&profile(), &hr(), R, &l),
        Target::Parent { tenant: R.into() }
    );
}

#[test]
fn csi_release_is_the_child_named_r_csi() {
    let p = profile();
    assert_eq!(
        classify(&p, &hr(), "kubernetes-prod-csi", &child_labels()),
        csi()
    );
    assert_eq!(
        classify(&p, &hr(), "kubernetes-prod-cilium", &child_labels()),
        child()
    );
}

#[test]
fn csi_release_is_known_by_its_name_whatever_its_label_says() {
    let relabelled = labels(&[("cozystack.io/target-cluster-name", "kubernetes-other")]);
    assert_eq!(
        classify(&profile(), &hr(), "kubernetes-prod-csi", &relabelled),
        csi()
    );
}

#[test]
fn relabelling_a_dependent_away_from_its_tenant_is_judged_as_its_delete() {
    let p = profile();
    let moved = labels(&[("cozystack.io/target-cluster-name", "kubernetes-other")]);
    let other = Target::Child {
        tenant: "kubernetes-other".into(),
    };
    assert_eq!(
        relabel_targets(&p, &hr(), "kubernetes-prod-cilium", &child_labels(), &moved),
        vec![child(), other]
    );
    assert_eq!(
        relabel_targets(
            &p,
            &hr(),
            "kubernetes-prod-cilium",
            &child_labels(),
            &BTreeMap::new()
        ),
        vec![child()]
    );
    let machine = GroupKind::new("cluster.x-k8s.io", "Machine");
    let capi = labels(&[("cluster.x-k8s.io/cluster-name", R)]);
    assert!(matches!(
        relabel_targets(&p, &machine, "m", &capi, &BTreeMap::new()).as_slice(),
        [Target::Guarded { .. }]
    ));
    // A CSI release relabelled in any way is judged as the CSI release: held until done.
    let mut as_parent = parent_labels();
    as_parent.extend(child_labels());
    assert_eq!(
        relabel_targets(
            &p,
            &hr(),
            "kubernetes-prod-csi",
            &child_labels(),
            &as_parent
        ),
        vec![csi()]
    );
    assert_eq!(
        relabel_targets(
            &p,
            &hr(),
            "kubernetes-prod-csi",
            &child_labels(),
            &BTreeMap::new()
        ),
        vec![csi()]
    );
}

#[test]
fn adding_a_label_that_decides_what_an_object_is_counts_as_a_relabel() {
    // The attack: `kubectl label hr R-csi apps.cozystack.io/application.kind=Kubernetes`
    // made the CSI release match no webhook; its DELETE then went unreviewed.
    let p = profile();
    let kind_only = {
        let mut l = child_labels();
        l.insert(
            "apps.cozystack.io/application.kind".into(),
            "Kubernetes".into(),
        );
        l
    };
    assert_eq!(
        relabel_targets(
            &p,
            &hr(),
            "kubernetes-prod-csi",
            &child_labels(),
            &kind_only
        ),
        vec![csi()]
    );
    assert_eq!(
        relabel_targets(
            &p,
            &hr(),
            "kubernetes-prod-coredns",
            &child_labels(),
            &kind_only
        ),
        vec![child()]
    );
    // Adding the parent labels to a child makes it look like a parent in
    // custody: judged as the child's delete.
    let mut as_parent = parent_labels();
    as_parent.extend(child_labels());
    assert_eq!(
        relabel_targets(
            &p,
            &hr(),
            "kubernetes-prod-cilium",
            &child_labels(),
            &as_parent
        ),
        vec![child()]
    );
    // Making an unrelated release a child of a tenant is judged for that tenant.
    assert_eq!(
        relabel_targets(&p, &hr(), "podinfo", &BTreeMap::new(), &child_labels()),
        vec![child()]
    );
}

#[test]
fn updates_that_keep_what_an_object_is_are_not_relabels() {
    let p = profile();
    let mut more = child_labels();
    more.insert("extra".into(), "x".into());
    more.insert("sharding.fluxcd.io/key".into(), "shard2".into());
    assert_eq!(
        relabel_targets(&p, &hr(), "kubernetes-prod-cilium", &child_labels(), &more),
        vec![]
    );
    assert_eq!(
        relabel_targets(&p, &hr(), "kubernetes-prod-csi", &child_labels(), &more),
        vec![]
    );
    assert_eq!(
        relabel_targets(&p, &hr(), R, &parent_labels(), &BTreeMap::new()),
        vec![],
        "parents have guards of their own"
    );
    // A label of another kind's identity is no identity of a release.
    let capi = labels(&[("cluster.x-k8s.io/cluster-name", R)]);
    assert_eq!(
        relabel_targets(&p, &hr(), "podinfo", &BTreeMap::new(), &capi),
        vec![]
    );
}

#[test]
fn every_identity_of_an_object_is_found_so_none_hides_another() {
    let p = profile();
    // A Cluster named like another (absent) tenant but labelled for R: both.
    let cluster = GroupKind::new("cluster.x-k8s.io", "Cluster");
    let capi = labels(&[("cluster.x-k8s.io/cluster-name", R)]);
    let ids = identities(&p, &cluster, &format!("{R}-extra"), &capi);
    let tenants: Vec<_> = ids.iter().filter_map(Target::tenant).collect();
    assert_eq!(tenants, vec![format!("{R}-extra").as_str(), R]);
    // The tenant's own Cluster relabelled for another: still R's by its name.
    let other = labels(&[("cluster.x-k8s.io/cluster-name", "kubernetes-other")]);
    let tenants: Vec<String> = identities(&p, &cluster, R, &other)
        .iter()
        .filter_map(Target::tenant)
        .map(str::to_string)
        .collect();
    assert_eq!(tenants, vec![R.to_string(), "kubernetes-other".to_string()]);
    // A child dressed as a parent is still the child of R.
    let mut as_parent = parent_labels();
    as_parent.extend(child_labels());
    assert_eq!(
        identities(&p, &hr(), "kubernetes-prod-cilium", &as_parent),
        vec![
            Target::Parent {
                tenant: "kubernetes-prod-cilium".into()
            },
            child()
        ]
    );
    // The CSI release labelled as another tenant's child: both tenants.
    let moved = labels(&[("cozystack.io/target-cluster-name", "kubernetes-other")]);
    assert_eq!(
        identities(&p, &hr(), "kubernetes-prod-csi", &moved),
        vec![
            csi(),
            Target::Child {
                tenant: "kubernetes-other".into()
            }
        ]
    );
}

#[test]
fn every_guarded_entry_of_the_cozystack_profile_is_reachable() {
    // One case per entry, in the profile's order: the entry must yield R
    // even where an earlier entry of the same kind also matches.
    let p = profile();
    for (i, g) in p.guarded.iter().enumerate() {
        let kind = GroupKind::new(&g.group, &g.kind);
        let mut spec = SpecView::default();
        let (name, l) = match (&g.name, &g.label, &g.field) {
            (Some(pattern), None, None) => (pattern.replace("{tenant}", R), BTreeMap::new()),
            // Named for some other tenant, labelled for R.
            (None, Some(label), None) => (format!("{R}-extra-{i}"), labels(&[(label.as_str(), R)])),
            // Named for some other tenant, unlabelled, of R's cluster.
            (None, None, Some(_)) => {
                spec.cluster_name = Some(serde_json::json!(R));
                (format!("{R}-extra-{i}"), BTreeMap::new())
            }
            other => panic!("guarded[{i}] {other:?}"),
        };
        let ids = identities_of(&p, &kind, &name, &l, &spec);
        assert!(
            ids.iter().any(
                |t| matches!(t, Target::Guarded { tenant, role } if tenant == R && *role == g.role)
            ),
            "guarded[{i}] ({} {name}) not reached: {ids:?}",
            g.kind
        );
    }
}

#[test]
fn csi_release_without_its_label_is_still_the_csi_release() {
    assert_eq!(
        classify(&profile(), &hr(), "kubernetes-prod-csi", &BTreeMap::new()),
        csi()
    );
}

#[test]
fn guarded_dependencies_are_recognised_by_name_or_label() {
    let p = profile();
    let cases = [
        (
            GroupKind::new("controlplane.cluster.x-k8s.io", "KamajiControlPlane"),
            R.to_string(),
            BTreeMap::new(),
        ),
        (
            GroupKind::new("kamaji.clastix.io", "TenantControlPlane"),
            R.to_string(),
            BTreeMap::new(),
        ),
        (
            GroupKind::new("", "Secret"),
            format!("{R}-admin-kubeconfig"),
            BTreeMap::new(),
        ),
        (
            GroupKind::new("apps", "Deployment"),
            format!("{R}-kcsi-controller"),
            BTreeMap::new(),
        ),
        (
            GroupKind::new("cluster.x-k8s.io", "Cluster"),
            R.to_string(),
            BTreeMap::new(),
        ),
        (
            GroupKind::new("cluster.x-k8s.io", "MachineDeployment"),
            "md-0".to_string(),
            labels(&[("cluster.x-k8s.io/cluster-name", R)]),
        ),
        (
            GroupKind::new("cluster.x-k8s.io", "Machine"),
            "m-1".to_string(),
            labels(&[("cluster.x-k8s.io/cluster-name", R)]),
        ),
    ];
    for (kind, name, l) in cases {
        match classify(&p, &kind, &name, &l) {
            Target::Guarded { tenant, .. } => assert_eq!(tenant, R, "{kind}"),
            other => panic!("{kind} {name}: {other:?}"),
        }
    }
}

#[test]
fn unrelated_objects_are_not_gated() {
    let p = profile();
    assert_eq!(
        classify(&p, &GroupKind::new("", "Secret"), "other", &BTreeMap::new()),
        Target::Unrelated
    );
    assert_eq!(
        classify(
            &p,
            &GroupKind::new("", "ConfigMap"),
            &format!("{R}-admin-kubeconfig"),
            &BTreeMap::new()
        ),
        Target::Unrelated
    );
    assert_eq!(
        classify(
            &p,
            &GroupKind::new("cluster.x-k8s.io", "Machine"),
            "m",
            &BTreeMap::new()
        ),
        Target::Unrelated
    );
}

// ---- DELETE of the parent ----

#[test]
fn parent_delete_is_allowed_when_in_custody() {
    let kind = hr();
    let v = decide_parent_delete(&profile(), subject(&kind, R), &facts().build());
    assert_allowed(&v, "in-custody");
}

#[test]
fn parent_delete_is_allowed_when_done_even_without_custody() {
    let kind = hr();
    let v = decide_parent_delete(
        &profile(),
        subject(&kind, R),
        &facts().no_custody().phase("Released").build(),
    );
    assert_allowed(&v, "done");
    let v = decide_parent_delete(
        &profile(),
        subject(&kind, R),
        &facts().no_custody().overridden().build(),
    );
    assert_allowed(&v, "done");
}

#[test]
fn parent_delete_is_refused_before_custody() {
    let kind = hr();
    let v = decide_parent_delete(&profile(), subject(&kind, R), &facts().no_custody().build());
    let msg = assert_denied(&v, "not-in-custody");
    assert!(msg.contains("retry shortly"), "{msg}");
    assert!(msg.contains("volumes.cozystack.io/release"), "{msg}");
}

// ---- parent absent ----

#[test]
fn any_dependent_delete_is_allowed_with_a_warning_when_the_parent_is_absent() {
    for t in [csi(), child(), guarded()] {
        match delete(&t, "x", None) {
            Verdict::Allow {
                reason: "parent-absent",
                warnings,
            } => {
                assert_eq!(warnings.len(), 1);
                assert!(warnings[0].contains(R), "{warnings:?}");
            }
            other => panic!("{t:?}: {other:?}"),
        }
    }
}

// ---- the CSI release ----

#[test]
fn csi_release_delete_is_allowed_once_released() {
    assert_allowed(
        &delete(
            &csi(),
            "kubernetes-prod-csi",
            Some(facts().deleting().phase("Released").build()),
        ),
        "done",
    );
}

#[test]
fn csi_release_delete_is_allowed_once_an_override_is_stamped() {
    assert_allowed(
        &delete(
            &csi(),
            "kubernetes-prod-csi",
            Some(facts().deleting().overridden().build()),
        ),
        "done",
    );
}

#[test]
fn csi_release_delete_is_refused_while_volumes_remain() {
    let f = facts()
        .deleting()
        .phase("Blocked")
        .ann("message", "driver stopped")
        .ann("volumes", &inventory(3, 2))
        .build();
    let msg = assert_denied(
        &delete(&csi(), "kubernetes-prod-csi", Some(f)),
        "csi-release-held",
    );
    for want in [
        "tenant kubernetes-prod",
        "tenant-acme",
        "phase Blocked (driver stopped)",
        "3 of 5 volumes left",
        "pvc-0 (driver csi.example, volumeHandle disk-0)",
        "kubectl annotate helmreleases.helm.toolkit.fluxcd.io -n tenant-acme kubernetes-prod volumes.cozystack.io/override=",
    ] {
        assert!(msg.contains(want), "missing {want:?} in: {msg}");
    }
}

#[test]
fn csi_release_delete_is_refused_outside_teardown_too() {
    let msg = assert_denied(
        &delete(&csi(), "kubernetes-prod-csi", Some(facts().build())),
        "csi-release-held",
    );
    assert!(msg.contains("volumes not inventoried yet"), "{msg}");
}

#[test]
fn an_unstamped_override_does_not_release_the_csi_release() {
    let f = facts().deleting().ann("override", "please").build();
    assert_denied(
        &delete(&csi(), "kubernetes-prod-csi", Some(f)),
        "csi-release-held",
    );
}

#[test]
fn a_garbled_phase_does_not_release_the_csi_release() {
    let f = facts().deleting().phase("released").build();
    assert_denied(
        &delete(&csi(), "kubernetes-prod-csi", Some(f)),
        "csi-release-held",
    );
}

// ---- other children ----

#[test]
fn child_delete_is_refused_during_teardown_until_done() {
    assert_denied(
        &delete(
            &child(),
            "kubernetes-prod-cilium",
            Some(facts().deleting().build()),
        ),
        "teardown-held",
    );
    assert_denied(
        &delete(
            &child(),
            "kubernetes-prod-cilium",
            Some(facts().namespace_deleting().build()),
        ),
        "teardown-held",
    );
}

#[test]
fn child_delete_is_allowed_during_teardown_once_done() {
    assert_allowed(
        &delete(
            &child(),
            "kubernetes-prod-cilium",
            Some(facts().deleting().phase("Released").build()),
        ),
        "done",
    );
}

#[test]
fn child_delete_is_allowed_outside_teardown_so_addons_can_be_toggled() {
    assert_allowed(
        &delete(
            &child(),
            "kubernetes-prod-ingress-nginx",
            Some(facts().build()),
        ),
        "not-in-teardown",
    );
}

#[test]
fn child_delete_is_never_allowed_on_an_unread_namespace() {
    let v = delete(
        &child(),
        "kubernetes-prod-cilium",
        Some(facts().namespace_unread().build()),
    );
    assert!(
        matches!(
            v,
            Verdict::Deny {
                reason: "cannot-judge",
                ..
            }
        ),
        "{v:?}"
    );
}

// ---- guarded dependencies ----

#[test]
fn guarded_delete_is_refused_during_teardown_until_done() {
    let msg = assert_denied(
        &delete(
            &guarded(),
            R,
            Some(facts().deleting().phase("Releasing").build()),
        ),
        "teardown-held",
    );
    assert!(msg.contains("the tenant's API server"), "{msg}");
    assert_denied(
        &delete(&guarded(), R, Some(facts().namespace_deleting().build())),
        "teardown-held",
    );
}

#[test]
fn guarded_delete_is_allowed_outside_teardown_or_once_done() {
    assert_allowed(
        &delete(&guarded(), R, Some(facts().build())),
        "not-in-teardown",
    );
    assert_allowed(
        &delete(&guarded(), R, Some(facts().deleting().overridden().build())),
        "done",
    );
}

#[test]
fn namespace_is_read_only_when_it_could_lead_to_an_allow() {
    let unread = facts().namespace_unread();
    assert!(needs_namespace(&child(), &unread.build()));
    assert!(!needs_namespace(
        &child(),
        &facts().namespace_unread().deleting().build()
    ));
    assert!(!needs_namespace(
        &guarded(),
        &facts().namespace_unread().phase("Released").build()
    ));
    assert!(!needs_namespace(
        &csi(),
        &facts().namespace_unread().build()
    ));
}

// ---- UPDATE/CREATE guards ----

fn meta(l: BTreeMap<String, String>) -> ObjectMetaView {
    ObjectMetaView {
        namespace: NS.into(),
        name: R.into(),
        labels: l,
        finalizers: vec![
            "finalizers.fluxcd.io".into(),
            "volumes.cozystack.io/release".into(),
        ],
        ..Default::default()
    }
}

fn with_ann(mut m: ObjectMetaView, key: &str, value: &str) -> ObjectMetaView {
    m.annotations
        .insert(format!("volumes.cozystack.io/{key}"), value.into());
    m
}

fn user(name: &str) -> Requester<'_> {
    Requester {
        username: name,
        is_worker: name == WORKER,
    }
}

fn guard(old: &ObjectMetaView, new: &ObjectMetaView, who: &str) -> UpdateVerdict {
    guard_update(
        &profile(),
        &keys(),
        Change {
            old: Some(old),
            new,
        },
        user(who),
        now(),
    )
}

fn assert_guard_denied(v: UpdateVerdict, reason: &str) -> String {
    match v {
        UpdateVerdict::Final(d) => assert_denied(&d, reason),
        other => panic!("expected {reason}, got {other:?}"),
    }
}

#[test]
fn record_keys_change_only_for_the_worker() {
    let old = meta(parent_labels());
    for key in ["phase", "released-at", "message", "volumes"] {
        let new = with_ann(old.clone(), key, "Released");
        let msg = assert_guard_denied(guard(&old, &new, "alice"), "record-forged");
        assert!(msg.contains(key) && msg.contains("alice"), "{msg}");
        assert_eq!(
            guard(&old, &new, WORKER),
            UpdateVerdict::Final(Verdict::allow("guards-passed"))
        );
    }
}

#[test]
fn a_record_forged_at_create_is_refused() {
    let new = with_ann(meta(parent_labels()), "phase", "Released");
    let v = guard_update(
        &profile(),
        &keys(),
        Change {
            old: None,
            new: &new,
        },
        user("alice"),
        now(),
    );
    assert_guard_denied(v, "record-forged");
}

#[test]
fn custody_finalizer_is_removed_only_by_the_worker() {
    let old = meta(parent_labels());
    let mut new = old.clone();
    new.finalizers
        .retain(|f| f != "volumes.cozystack.io/release");
    let msg = assert_guard_denied(
        guard(
            &old,
            &new,
            "system:serviceaccount:flux-system:helm-controller",
        ),
        "custody-finalizer-removed",
    );
    assert!(msg.contains("kubectl annotate"), "{msg}");
    assert_eq!(
        guard(&old, &new, WORKER),
        UpdateVerdict::Final(Verdict::allow("guards-passed"))
    );
}

#[test]
fn other_finalizers_may_be_removed_by_anyone() {
    let old = meta(parent_labels());
    let mut new = old.clone();
    new.finalizers.retain(|f| f != "finalizers.fluxcd.io");
    assert_eq!(
        guard(&old, &new, "helm-controller"),
        UpdateVerdict::Final(Verdict::allow("guards-passed"))
    );
}

#[test]
fn removing_the_tenant_labels_is_refused() {
    let old = meta(parent_labels());
    let new = meta(BTreeMap::new());
    assert_guard_denied(guard(&old, &new, "mallory"), "parent-labels-removed");
}

#[test]
fn updates_to_non_parents_pass() {
    let old = meta(child_labels());
    let new = with_ann(old.clone(), "phase", "Released");
    assert_eq!(
        guard(&old, &new, "alice"),
        UpdateVerdict::Final(Verdict::allow("not-a-parent"))
    );
}

#[test]
fn a_stamped_override_needs_the_override_permission() {
    let old = meta(parent_labels());
    let new = with_ann(
        with_ann(
            with_ann(old.clone(), "override", "abandoned"),
            "override-by",
            "alice",
        ),
        "override-at",
        "2026-12-02T10:00:00Z",
    );
    assert_eq!(
        guard(&old, &new, "alice"),
        UpdateVerdict::NeedsOverridePermission {
            namespace: NS.into(),
            tenant: R.into()
        }
    );
}

#[test]
fn an_override_without_reason_is_refused() {
    let old = meta(parent_labels());
    let new = with_ann(
        with_ann(
            with_ann(old.clone(), "override", "  "),
            "override-by",
            "alice",
        ),
        "override-at",
        "2026-12-02T10:00:00Z",
    );
    assert_guard_denied(guard(&old, &new, "alice"), "override-without-reason");
}

#[test]
fn an_override_stamped_for_someone_else_is_refused() {
    let old = meta(parent_labels());
    let new = with_ann(
        with_ann(
            with_ann(old.clone(), "override", "x"),
            "override-by",
            "root",
        ),
        "override-at",
        "2026-12-02T10:00:00Z",
    );
    assert_guard_denied(guard(&old, &new, "alice"), "stamp-forged");
}

#[test]
fn an_override_with_a_stale_or_garbled_stamp_time_is_refused() {
    let old = meta(parent_labels());
    for at in ["2020-01-01T00:00:00Z", "yesterday", ""] {
        let new = with_ann(
            with_ann(
                with_ann(old.clone(), "override", "x"),
                "override-by",
                "alice",
            ),
            "override-at",
            at,
        );
        assert_guard_denied(guard(&old, &new, "alice"), "stamp-forged");
    }
}

#[test]
fn an_unstamped_override_is_refused() {
    let old = meta(parent_labels());
    let new = with_ann(old.clone(), "override", "x");
    assert_guard_denied(guard(&old, &new, "alice"), "stamp-forged");
}

#[test]
fn forged_stamps_without_an_override_change_are_refused() {
    let old = with_ann(meta(parent_labels()), "override", "x");
    for key in ["override-by", "override-at"] {
        let new = with_ann(old.clone(), key, "mallory");
        let msg = assert_guard_denied(guard(&old, &new, "mallory"), "stamp-forged");
        assert!(msg.contains(key), "{msg}");
    }
    // Not even the worker writes stamps.
    let new = with_ann(old.clone(), "override-by", "x");
    assert_guard_denied(guard(&old, &new, WORKER), "stamp-forged");
}

#[test]
fn withdrawing_an_override_needs_the_permission_and_its_stamps_removed() {
    let old = with_ann(
        with_ann(
            with_ann(meta(parent_labels()), "override", "x"),
            "override-by",
            "alice",
        ),
        "override-at",
        "2026-12-02T09:00:00Z",
    );
    let clean = meta(parent_labels());
    assert_eq!(
        guard(&old, &clean, "bob"),
        UpdateVerdict::NeedsOverridePermission {
            namespace: NS.into(),
            tenant: R.into()
        }
    );
    let stale = with_ann(meta(parent_labels()), "override-by", "alice");
    assert_guard_denied(guard(&old, &stale, "bob"), "stamp-forged");
}

#[test]
fn unrelated_annotation_changes_pass() {
    let old = meta(parent_labels());
    let mut new = old.clone();
    new.annotations
        .insert("reconcile.fluxcd.io/requestedAt".into(), "now".into());
    assert_eq!(
        guard(&old, &new, "alice"),
        UpdateVerdict::Final(Verdict::allow("guards-passed"))
    );
}

#[test]
fn override_refusal_names_the_permission_to_grant() {
    let v = override_refused(&profile(), "bob", NS, R, "");
    let msg = assert_denied(&v, "override-unauthorized");
    assert!(
        msg.contains("\"override\"")
            && msg.contains("\"tenants\"")
            && msg.contains("volumes.cozystack.io"),
        "{msg}"
    );
}

// ---- mutations ----

fn mutations(old: Option<&ObjectMetaView>, new: &ObjectMetaView, who: &str) -> Vec<Mutation> {
    mutate(&profile(), &keys(), Change { old, new }, user(who), now())
}

#[test]
fn custody_finalizer_is_added_to_a_new_parent() {
    let mut new = meta(parent_labels());
    new.finalizers.clear();
    assert_eq!(
        mutations(None, &new, "flux"),
        vec![Mutation::AddFinalizer { create_list: true }]
    );
    new.finalizers.push("finalizers.fluxcd.io".into());
    assert_eq!(
        mutations(Some(&new.clone()), &new, "flux"),
        vec![Mutation::AddFinalizer { create_list: false }]
    );
}

#[test]
fn custody_finalizer_is_not_added_once_deletion_began() {
    let mut new = meta(parent_labels());
    new.finalizers.clear();
    new.deleting = true;
    assert!(mutations(Some(&new.clone()), &new, "flux").is_empty());
}

#[test]
fn a_removed_custody_finalizer_is_left_for_the_guard_to_refuse() {
    let old = meta(parent_labels());
    let mut new = old.clone();
    new.finalizers
        .retain(|f| f != "volumes.cozystack.io/release");
    assert!(mutations(Some(&old), &new, "mallory").is_empty());
}

#[test]
fn children_are_not_mutated() {
    let mut new = meta(child_labels());
    new.finalizers.clear();
    assert!(mutations(None, &new, "flux").is_empty());
}

#[test]
fn an_override_is_stamped_with_the_requester_and_time() {
    let old = meta(parent_labels());
    let new = with_ann(
        with_ann(old.clone(), "override", "abandoned"),
        "override-by",
        "forged",
    );
    assert_eq!(
        mutations(Some(&old), &new, "alice"),
        vec![Mutation::Stamp {
            by: "alice".into(),
            at: "2026-12-02T10:00:00Z".into()
        }]
    );
}

#[test]
fn an_override_set_while_the_parent_labels_go_is_stamped_and_accepted_from_the_worker() {
    // Fuzz finding F1: mutate must judge "parent" as guard_update does
    // (old or new labels), or the guard refuses the webhook's own write.
    let old = meta(parent_labels());
    let new = with_ann(meta(BTreeMap::new()), "override", "abandoned");
    let worker = WORKER;
    let ms = mutations(Some(&old), &new, worker);
    assert_eq!(
        ms,
        vec![Mutation::Stamp {
            by: worker.into(),
            at: "2026-12-02T10:00:00Z".into()
        }]
    );
    let mut doc = serde_json::json!({"metadata": {"annotations": new.annotations}});
    json_patch::patch(&mut doc, &to_json_patch(&profile(), &keys(), &ms)).unwrap();
    let patched: BTreeMap<String, String> =
        serde_json::from_value(doc["metadata"]["annotations"].clone()).unwrap();
    let after = ObjectMetaView {
        annotations: patched,
        ..new
    };
    let v = guard_update(
        &profile(),
        &keys(),
        Change {
            old: Some(&old),
            new: &after,
        },
        user(worker),
        now(),
    );
    assert_eq!(
        v,
        UpdateVerdict::NeedsOverridePermission {
            namespace: NS.into(),
            tenant: R.into()
        }
    );
}

#[test]
fn a_release_that_stops_being_a_parent_gets_no_custody_finalizer() {
    let mut old = meta(parent_labels());
    old.finalizers.clear();
    let mut new = meta(BTreeMap::new());
    new.finalizers.clear();
    assert!(mutations(Some(&old), &new, "flux").is_empty());
}

#[test]
fn a_withdrawn_override_loses_its_stamps() {
    let old = with_ann(
        with_ann(meta(parent_labels()), "override", "x"),
        "override-by",
        "alice",
    );
    let new = with_ann(meta(parent_labels()), "override-by", "alice");
    assert_eq!(
        mutations(Some(&old), &new, "bob"),
        vec![Mutation::Unstamp {
            keys: vec!["volumes.cozystack.io/override-by".into()]
        }]
    );
}

#[test]
fn mutation_then_guard_accepts_an_honest_override() {
    let old = meta(parent_labels());
    let new = with_ann(old.clone(), "override", "abandoned");
    let patch = to_json_patch(&profile(), &keys(), &mutations(Some(&old), &new, "alice"));
    let mut doc = serde_json::json!({"metadata": {"annotations": new.annotations, "finalizers": new.finalizers}});
    json_patch::patch(&mut doc, &patch).unwrap();
    let patched: BTreeMap<String, String> =
        serde_json::from_value(doc["metadata"]["annotations"].clone()).unwrap();
    let after = ObjectMetaView {
        annotations: patched,
        ..new
    };
    assert_eq!(
        guard(&old, &after, "alice"),
        UpdateVerdict::NeedsOverridePermission {
            namespace: NS.into(),
            tenant: R.into()
        }
    );
}

#[test]
fn json_patch_escapes_annotation_keys_and_appends_finalizers() {
    let ms = vec![
        Mutation::AddFinalizer { create_list: false },
        Mutation::Stamp {
            by: "a".into(),
            at: "t".into(),
        },
    ];
    let text = serde_json::to_string(&to_json_patch(&profile(), &keys(), &ms)).unwrap();
    assert!(
        text.contains(r#""path":"/metadata/finalizers/-""#),
        "{text}"
    );
    assert!(
        text.contains(r#""path":"/metadata/annotations/volumes.cozystack.io~1override-by""#),
        "{text}"
    );
    let mut doc = serde_json::json!({"metadata": {"finalizers": ["f"], "annotations": {"volumes.cozystack.io/override": "x"}}});
    json_patch::patch(&mut doc, &to_json_patch(&profile(), &keys(), &ms)).unwrap();
    assert_eq!(
        doc["metadata"]["finalizers"][1],
        "volumes.cozystack.io/release"
    );
    assert_eq!(
        doc["metadata"]["annotations"]["volumes.cozystack.io/override-by"],
        "a"
    );
}

#[test]
fn json_patch_creates_the_finalizer_list_when_absent() {
    let patch = to_json_patch(
        &profile(),
        &keys(),
        &[Mutation::AddFinalizer { create_list: true }],
    );
    let mut doc = serde_json::json!({"metadata": {}});
    json_patch::patch(&mut doc, &patch).unwrap();
    assert_eq!(
        doc["metadata"]["finalizers"],
        serde_json::json!(["volumes.cozystack.io/release"])
    );
}

// ---- objects of the parent release ----

fn helm_owned(release: &str, namespace: &str) -> BTreeMap<String, String> {
    labels(&[
        ("meta.helm.sh/release-name", release),
        ("meta.helm.sh/release-namespace", namespace),
    ])
}

#[test]
fn an_object_of_the_parent_release_is_known_by_helms_annotations_or_fluxs_labels() {
    let p = profile();
    let none = BTreeMap::new();
    assert_eq!(
        release_of(&p, NS, &none, &helm_owned(R, NS)),
        Some((NS.into(), R.into()))
    );
    let flux = labels(&[
        ("helm.toolkit.fluxcd.io/name", R),
        ("helm.toolkit.fluxcd.io/namespace", NS),
    ]);
    assert_eq!(
        release_of(&p, NS, &flux, &none),
        Some((NS.into(), R.into()))
    );
    // A cluster-scoped object (ClusterRole, ClusterRoleBinding) names its release's namespace.
    assert_eq!(
        release_of(&p, "", &none, &helm_owned(R, NS)),
        Some((NS.into(), R.into()))
    );
    assert_eq!(
        release_of(&p, "", &none, &labels(&[("meta.helm.sh/release-name", R)])),
        None,
        "no namespace, no release"
    );
    // A namespaced object belongs to a release of its own namespace only.
    assert_eq!(
        release_of(&p, "tenant-mallory", &none, &helm_owned(R, NS)),
        Some(("tenant-mallory".into(), R.into()))
    );
    assert_eq!(release_of(&p, NS, &none, &none), None);
}

#[test]
fn a_release_object_is_judged_for_its_release_unless_another_identity_stands_for_that_tenant() {
    let owned = Some((NS.to_string(), R.to_string()));
    let ro = Target::ReleaseObject {
        tenant: R.into(),
        namespace: NS.into(),
    };
    assert_eq!(
        with_release_identity(vec![], NS, owned.clone()),
        vec![ro.clone()]
    );
    assert_eq!(
        with_release_identity(vec![child()], NS, owned.clone()),
        vec![child()],
        "a child of R is already held for R"
    );
    assert_eq!(with_release_identity(vec![], "", owned.clone()), vec![ro]);
    let other = Target::Child {
        tenant: "kubernetes-other".into(),
    };
    assert_eq!(
        with_release_identity(vec![other.clone()], NS, owned).len(),
        2
    );
}

#[test]
fn a_release_object_is_held_during_teardown_only() {
    let ro = Target::ReleaseObject {
        tenant: R.into(),
        namespace: NS.into(),
    };
    let m = assert_denied(
        &delete(
            &ro,
            "kubernetes-prod-kcsi",
            Some(facts().deleting().build()),
        ),
        "teardown-held",
    );
    assert!(
        m.contains("parent release") && m.contains("kubectl annotate"),
        "{m}"
    );
    assert_allowed(
        &delete(&ro, "kubernetes-prod-kcsi", Some(facts().build())),
        "not-in-teardown",
    );
    assert_allowed(
        &delete(
            &ro,
            "kubernetes-prod-kcsi",
            Some(facts().deleting().phase("Released").build()),
        ),
        "done",
    );
    assert!(needs_namespace(&ro, &facts().namespace_unread().build()));
}

#[test]
fn a_tenants_disk_may_be_deleted_but_its_infra_labels_are_held_until_done() {
    let p = profile();
    let dv = GroupKind::new("cdi.kubevirt.io", "DataVolume");
    let pvc = GroupKind::new("", "PersistentVolumeClaim");
    let capi = labels(&[("cluster.x-k8s.io/cluster-name", R)]);
    let disk = Target::InfraDisk { tenant: R.into() };
    for kind in [&dv, &pvc] {
        assert_eq!(identities(&p, kind, "pvc-1", &capi), vec![disk.clone()]);
        assert_eq!(
            identities(&p, kind, "pvc-1", &BTreeMap::new()),
            Vec::<Target>::new(),
            "an unlabelled claim is nobody's disk"
        );
        // Removing, changing or adding the label is a relabel of the disk.
        assert_eq!(
            relabel_targets(&p, kind, "pvc-1", &capi, &BTreeMap::new()),
            vec![disk.clone()]
        );
        let other = labels(&[("cluster.x-k8s.io/cluster-name", "kubernetes-other")]);
        assert_eq!(
            relabel_targets(&p, kind, "pvc-1", &capi, &other),
            vec![
                disk.clone(),
                Target::InfraDisk {
                    tenant: "kubernetes-other".into()
                }
            ]
        );
        let mut annotated = capi.clone();
        annotated.insert(
            "cdi.kubevirt.io/storage.import.source".into(),
            "none".into(),
        );
        assert!(relabel_targets(&p, kind, "pvc-1", &capi, &annotated).is_empty());
    }
    // Without an infra layer a PVC is nothing to the gate.
    let flat = Profile {
        infra: None,
        ..profile()
    };
    assert!(identities(&flat, &pvc, "pvc-1", &capi).is_empty());

    let relabel = |parent: Option<ParentFacts>| {
        decide_dependent_delete(
            &p,
            &disk,
            Subject {
                kind: &dv,
                namespace: NS,
                name: "pvc-1",
                action: "relabel",
            },
            parent.as_ref(),
        )
    };
    // Held while the tenant lives (before teardown, too: a label removed
    // then hides the disk later) and during teardown, with the way out named.
    for parent in [facts().build(), facts().deleting().build()] {
        let v = relabel(Some(parent));
        assert_eq!(v.reason(), "infra-disk-held", "{v:?}");
        let Verdict::Deny { message, .. } = v else {
            unreachable!()
        };
        assert!(message.contains("refusing to relabel DataVolume tenant-acme/pvc-1"));
        assert!(message.contains("override"), "{message}");
    }
    assert_eq!(
        relabel(Some(facts().deleting().phase("Released").build())).reason(),
        "done"
    );
    assert_eq!(relabel(None).reason(), "parent-absent");
    // Its delete frees the disk: allowed outside teardown, and in teardown
    // once the phase has inventoried the tenant's volumes (and kept the
    // disks that must stay); before that, held (§5c).
    assert_eq!(
        delete(&disk, "pvc-1", Some(facts().build())).reason(),
        "frees-the-disk"
    );
    assert_eq!(
        delete(
            &disk,
            "pvc-1",
            Some(facts().deleting().ann("volumes", &inventory(1, 0)).build())
        )
        .reason(),
        "frees-the-disk"
    );
    for teardown in [
        facts().deleting().build(),
        facts().namespace_deleting().build(),
    ] {
        let v = delete(&disk, "pvc-1", Some(teardown));
        let message = assert_denied(&v, "infra-disk-uninventoried");
        assert!(message.contains("not inventoried"), "{message}");
    }
    assert_eq!(
        delete(&disk, "pvc-1", Some(facts().namespace_unread().build())).reason(),
        "cannot-judge"
    );
    assert_eq!(
        delete(
            &disk,
            "pvc-1",
            Some(facts().deleting().phase("Released").build())
        )
        .reason(),
        "done"
    );
}

// ---- Issue 27: markers that name no tenant, becoming a parent, removals ----

#[test]
fn markers_that_name_no_possible_tenant_make_no_identity_and_are_warned_of() {
    let p = profile();
    let cm = GroupKind::new("", "ConfigMap");
    let dv = GroupKind::new("cdi.kubevirt.io", "DataVolume");
    let machine = GroupKind::new("cluster.x-k8s.io", "Machine");
    for (kind, labels_, annotations) in [
        (
            hr(),
            labels(&[("cozystack.io/target-cluster-name", "Not_A-Tenant")]),
            BTreeMap::new(),
        ),
        (
            machine.clone(),
            labels(&[("cluster.x-k8s.io/cluster-name", "UPPER")]),
            BTreeMap::new(),
        ),
        (
            dv.clone(),
            labels(&[("cluster.x-k8s.io/cluster-name", "-dash")]),
            BTreeMap::new(),
        ),
        (
            cm.clone(),
            BTreeMap::new(),
            labels(&[("meta.helm.sh/release-name", "kubernetes-a/../b")]),
        ),
        (
            cm.clone(),
            labels(&[("helm.toolkit.fluxcd.io/name", "kubernetes-a_")]),
            BTreeMap::new(),
        ),
    ] {
        assert!(
            identities(&p, &kind, "obj", &labels_).is_empty(),
            "{kind} {labels_:?}"
        );
        assert_eq!(release_of(&p, NS, &labels_, &annotations), None);
        let markers = impossible_markers(&p, &kind, &labels_, &annotations);
        assert_eq!(markers.len(), 1, "{kind} {labels_:?} {annotations:?}");
        let w = impossible_marker_warnings(&markers);
        assert!(
            w[0].contains("names no tenant that can exist") && w[0].contains(&markers[0].0),
            "{w:?}"
        );
    }
    // A possible tenant is an identity, and no warning.
    let ok = labels(&[("cozystack.io/target-cluster-name", R)]);
    assert_eq!(
        identities(&p, &hr(), "kubernetes-prod-cilium", &ok),
        vec![child()]
    );
    assert!(impossible_markers(&p, &hr(), &ok, &BTreeMap::new()).is_empty());
    // A cluster-scoped object's release namespace is a marker too.
    let ns_marker = labels(&[
        ("meta.helm.sh/release-name", R),
        ("meta.helm.sh/release-namespace", "Tenant X"),
    ]);
    assert_eq!(release_of(&p, "", &BTreeMap::new(), &ns_marker), None);
    assert_eq!(
        impossible_markers(&p, &cm, &BTreeMap::new(), &ns_marker).len(),
        1
    );
    // A name that derives an impossible tenant is simply not one.
    assert!(identities(&p, &hr(), "a--csi", &BTreeMap::new()).is_empty());
}

#[test]
fn becoming_a_parent_carries_no_record_in() {
    // A release labelled a parent later is judged as if created one: what it
    // carried before it was a tenant was never judged.
    let before = with_ann(meta(BTreeMap::new()), "phase", "Released");
    let after = with_ann(meta(parent_labels()), "phase", "Released");
    let msg = assert_guard_denied(guard(&before, &after, "mallory"), "record-forged");
    assert!(msg.contains("volumes.cozystack.io/phase"), "{msg}");
    let binding = with_ann(meta(BTreeMap::new()), "cluster", "{}");
    let as_parent = with_ann(meta(parent_labels()), "cluster", "{}");
    assert_guard_denied(guard(&binding, &as_parent, "mallory"), "record-forged");
    // An override carried in needs the requester's own stamps and then the
    // override permission, as at creation.
    let stamped = |by: &str| {
        let m = with_ann(meta(BTreeMap::new()), "override", "carried in");
        let m = with_ann(m, "override-by", by);
        with_ann(m, "override-at", "2026-12-02T10:00:00Z")
    };
    let mut now_parent = stamped("alice");
    now_parent.labels = parent_labels();
    assert_guard_denied(
        guard(&stamped("alice"), &now_parent, "mallory"),
        "stamp-forged",
    );
    let mut own = stamped("mallory");
    own.labels = parent_labels();
    assert_eq!(
        guard(&stamped("mallory"), &own, "mallory"),
        UpdateVerdict::NeedsOverridePermission {
            namespace: NS.into(),
            tenant: R.into()
        }
    );
    // The mutating webhook stamps it as at creation.
    let carried = with_ann(meta(BTreeMap::new()), "override", "carried in");
    let mut labelled = carried.clone();
    labelled.labels = parent_labels();
    let m = mutate(
        &profile(),
        &keys(),
        Change {
            old: Some(&carried),
            new: &labelled,
        },
        user("mallory"),
        now(),
    );
    assert!(
        m.contains(&Mutation::Stamp {
            by: "mallory".into(),
            at: "2026-12-02T10:00:00Z".into()
        }),
        "{m:?}"
    );
    // An ordinary parent update is unchanged by this.
    let old = with_ann(meta(parent_labels()), "phase", "Releasing");
    let mut new = old.clone();
    new.annotations.insert("other".into(), "x".into());
    assert_eq!(
        guard(&old, &new, "alice"),
        UpdateVerdict::Final(Verdict::allow("guards-passed"))
    );
}

#[test]
fn a_parent_change_that_uninstalls_it_is_held_until_done() {
    let kind = hr();
    let action = removal_action(&["the chart it installs"]);
    let s = subject(&kind, R).with_action(&action);
    for parent in [
        facts().build(),
        facts().deleting().build(),
        facts().deleting().phase("Blocked").build(),
    ] {
        let v = decide_parent_removal(&profile(), s, &parent);
        let msg = assert_denied(&v, "parent-removal-held");
        for needle in [
            "refusing to change the chart it installs",
            "HelmRelease tenant-acme/kubernetes-prod",
            "pre-delete hook",
            "delete the HelmRelease",
            "override",
        ] {
            assert!(msg.contains(needle), "{needle:?}: {msg}");
        }
    }
    for done in [
        facts().deleting().phase("Released").build(),
        facts().deleting().overridden().build(),
    ] {
        assert_eq!(
            decide_parent_removal(&profile(), s, &done),
            Verdict::allow("done")
        );
    }
}

#[test]
fn a_child_or_csi_release_change_that_uninstalls_it_is_judged_like_its_delete() {
    let kind = hr();
    let action = removal_action(&["its Helm release name"]);
    let retarget = |target: &Target, parent: ParentFacts| {
        decide_dependent_delete(
            &profile(),
            target,
            subject(&kind, "kubernetes-prod-csi").with_action(&action),
            Some(&parent),
        )
    };
    // The CSI release: until done, teardown or not.
    let msg = assert_denied(&retarget(&csi(), facts().build()), "csi-release-held");
    assert!(
        msg.contains("refusing to change its Helm release name"),
        "{msg}"
    );
    assert_eq!(
        retarget(&csi(), facts().deleting().phase("Released").build()).reason(),
        "done"
    );
    // Another child: during teardown only.
    assert_eq!(
        retarget(&child(), facts().build()),
        Verdict::allow("not-in-teardown")
    );
    assert_denied(
        &retarget(&child(), facts().namespace_deleting().build()),
        "teardown-held",
    );
}

#[test]
fn only_the_controller_writes_a_releases_status() {
    let kind = hr();
    let s = subject(&kind, "kubernetes-prod-csi").with_action(STATUS_ACTION);
    assert_eq!(
        decide_status_write(&profile(), s, "system:serviceaccount:cozy-fluxcd:flux"),
        Verdict::allow("controller")
    );
    for who in ["mallory", WORKER, "system:admin"] {
        let msg = assert_denied(&decide_status_write(&profile(), s, who), "status-forged");
        assert!(
            msg.contains(who)
                && msg.contains("cozy-fluxcd:flux")
                && msg.contains("rewrite the status"),
            "{msg}"
        );
    }
}

#[test]
fn a_child_by_its_kubeconfig_and_a_machine_by_its_cluster_name_whatever_their_labels() {
    let p = profile();
    let spec = |v: serde_json::Value| -> SpecView { serde_json::from_value(v).unwrap() };
    // A release that installs into the tenant with its admin kubeconfig is
    // its child, its child label removed or not.
    let installs = spec(
        serde_json::json!({"kubeConfig": {"secretRef": {"name": format!("{R}-admin-kubeconfig"), "key": "super-admin.svc"}}}),
    );
    assert_eq!(
        identities_of(
            &p,
            &hr(),
            "kubernetes-prod-cilium",
            &BTreeMap::new(),
            &installs
        ),
        vec![child()]
    );
    assert_eq!(
        identities_of(
            &p,
            &hr(),
            "kubernetes-prod-cilium",
            &child_labels(),
            &installs
        ),
        vec![child()],
        "one identity per tenant"
    );
    // A machine of the tenant's cluster, by Cluster API's own field.
    let md = GroupKind::new("cluster.x-k8s.io", "MachineDeployment");
    let of_cluster = spec(serde_json::json!({"clusterName": R, "replicas": 1}));
    assert_eq!(
        identities_of(&p, &md, "md0", &BTreeMap::new(), &of_cluster),
        vec![Target::Guarded {
            tenant: R.into(),
            role: "the tenant's worker machines, which run the driver".into()
        }]
    );
    // Other kinds' clusterName, and names of no tenant, are nothing.
    let cm = GroupKind::new("", "ConfigMap");
    assert!(identities_of(&p, &cm, "x", &BTreeMap::new(), &of_cluster).is_empty());
    let bad = spec(serde_json::json!({"clusterName": "Not_A_Tenant"}));
    assert!(identities_of(&p, &md, "md0", &BTreeMap::new(), &bad).is_empty());
    // Changing the field is a relabel, judged like the delete.
    let moved = spec(serde_json::json!({"clusterName": "kubernetes-other"}));
    let targets = relabel_targets_of(
        &p,
        &md,
        "md0",
        (&BTreeMap::new(), &of_cluster),
        (&BTreeMap::new(), &moved),
    );
    assert_eq!(targets.len(), 2, "{targets:?}");
    // Removing the label while the field stays: still judged (the label
    // decides identity), the tenant unchanged.
    let labelled = labels(&[("cluster.x-k8s.io/cluster-name", R)]);
    assert_eq!(
        relabel_targets_of(
            &p,
            &md,
            "md0",
            (&labelled, &of_cluster),
            (&BTreeMap::new(), &of_cluster)
        ),
        vec![Target::Guarded {
            tenant: R.into(),
            role: "the tenant's worker machines, which run the driver".into()
        }]
    );
}

// ---- who moves a chart's source; who replaces a parent whole ----

const FLUX: &str = "system:serviceaccount:cozy-fluxcd:flux";
const COZYSTACK_CONTROLLER: &str = "system:serviceaccount:cozy-system:cozystack-controller";
const COZYSTACK_API: &str = "system:serviceaccount:cozy-system:cozystack-api";

#[test]
fn a_parents_source_is_moved_by_the_platforms_source_writers_only() {
    let p = profile();
    let parent = Target::Parent { tenant: R.into() };
    for who in [COZYSTACK_CONTROLLER, COZYSTACK_API] {
        assert!(
            source_move_by_platform(&p, &parent, who, NS, (None, None)),
            "{who}"
        );
    }
    // helm-controller applies no parent: a parent is no release's object.
    for who in [FLUX, "alice", WORKER, "system:admin"] {
        assert!(
            !source_move_by_platform(&p, &parent, who, NS, (None, None)),
            "{who}"
        );
    }
}

#[test]
fn a_childs_source_is_moved_by_the_release_controller_applying_its_own_parent_release() {
    let p = profile();
    let owner = (NS.to_string(), R.to_string());
    let other = (NS.to_string(), "kubernetes-other".to_string());
    let elsewhere = ("tenant-elsewhere".to_string(), R.to_string());
    for target in [
        Target::CsiRelease { tenant: R.into() },
        Target::Child { tenant: R.into() },
    ] {
        assert!(source_move_by_platform(
            &p,
            &target,
            FLUX,
            NS,
            (Some(&owner), Some(&owner))
        ));
        // Anyone else moving it, whoever owns it: a retarget.
        for who in [COZYSTACK_CONTROLLER, COZYSTACK_API, "alice", WORKER] {
            assert!(
                !source_move_by_platform(&p, &target, who, NS, (Some(&owner), Some(&owner))),
                "{who}"
            );
        }
        // The release controller applying another release (one that took
        // the object over, or is taking it), or none: a retarget.
        for owners in [
            (Some(&owner), Some(&other)),
            (Some(&other), Some(&owner)),
            (Some(&other), Some(&other)),
            (None, Some(&owner)),
            (Some(&owner), None),
            (None, None),
            (Some(&elsewhere), Some(&elsewhere)),
        ] {
            assert!(
                !source_move_by_platform(&p, &target, FLUX, NS, owners),
                "{target:?} {owners:?}"
            );
        }
    }
    // Nothing else is a release whose source moves.
    let guarded = Target::Guarded {
        tenant: R.into(),
        role: "x".into(),
    };
    assert!(!source_move_by_platform(
        &p,
        &guarded,
        FLUX,
        NS,
        (Some(&owner), Some(&owner))
    ));
}

fn recorded_parent() -> ObjectMetaView {
    let mut m = meta(parent_labels());
    for (k, v) in [
        ("volumes.cozystack.io/phase", "Blocked"),
        ("volumes.cozystack.io/message", "1 volume left"),
        ("volumes.cozystack.io/override", "abandoned, ticket 7"),
        ("volumes.cozystack.io/override-by", "alice"),
        ("volumes.cozystack.io/override-at", "2026-12-02T09:59:00Z"),
        ("apps.cozystack.io-volumes.cozystack.io/phase", "Blocked"),
        ("unrelated.example/x", "y"),
    ] {
        m.annotations.insert(k.into(), v.into());
    }
    m
}

/// What cozystack-api writes on an Application update: the object rebuilt
/// from the Application, finalizers and unprefixed annotations gone.
fn rebuilt(old: &ObjectMetaView) -> ObjectMetaView {
    ObjectMetaView {
        annotations: old
            .annotations
            .iter()
            .filter(|(k, _)| k.starts_with("apps.cozystack.io-"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        finalizers: Vec::new(),
        ..old.clone()
    }
}

#[test]
fn a_parent_replaced_whole_by_cozystack_api_keeps_its_record_override_and_custody() {
    let old = recorded_parent();
    let new = rebuilt(&old);
    let ms = mutations(Some(&old), &new, COZYSTACK_API);
    let mut carried: Vec<(String, String)> = old
        .annotations
        .iter()
        .filter(|(k, _)| k.starts_with("volumes.cozystack.io/"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    carried.sort();
    assert_eq!(
        ms,
        vec![
            Mutation::AddFinalizer { create_list: true },
            Mutation::Carry {
                annotations: carried,
                create_map: false,
            },
        ],
        "no stamp, no unstamp: the override did not change"
    );
    // Applied, the write keeps what the stored object had, and the guards
    // then see no change of the record, the override or custody.
    let mut doc = serde_json::json!({"metadata": {"annotations": new.annotations}});
    json_patch::patch(&mut doc, &to_json_patch(&profile(), &keys(), &ms)).unwrap();
    let mut after = new.clone();
    after.annotations = serde_json::from_value(doc["metadata"]["annotations"].clone()).unwrap();
    after.finalizers = serde_json::from_value(doc["metadata"]["finalizers"].clone()).unwrap();
    for (k, v) in old
        .annotations
        .iter()
        .filter(|(k, _)| !k.starts_with("unrelated"))
    {
        assert_eq!(after.annotations.get(k), Some(v), "{k}");
    }
    assert!(!after.annotations.contains_key("unrelated.example/x"));
    assert_eq!(
        guard(&old, &after, COZYSTACK_API),
        UpdateVerdict::Final(Verdict::allow("guards-passed"))
    );
    // With no annotations left at all, the map is made first.
    let mut bare = new.clone();
    bare.annotations.clear();
    let ms = mutations(Some(&old), &bare, COZYSTACK_API);
    let mut doc = serde_json::json!({"metadata": {}});
    json_patch::patch(&mut doc, &to_json_patch(&profile(), &keys(), &ms)).unwrap();
    assert_eq!(
        doc["metadata"]["annotations"]["volumes.cozystack.io/phase"],
        "Blocked"
    );
    assert_eq!(
        doc["metadata"]["annotations"]["apps.cozystack.io-volumes.cozystack.io/phase"], "Blocked",
        "the owner's mirror too"
    );
}

#[test]
fn a_parent_replaced_whole_by_anyone_else_is_refused_not_repaired() {
    let old = recorded_parent();
    let new = rebuilt(&old);
    for who in ["alice", FLUX, COZYSTACK_CONTROLLER] {
        assert!(
            !mutations(Some(&old), &new, who)
                .iter()
                .any(|m| matches!(m, Mutation::Carry { .. })),
            "{who}"
        );
        assert!(
            matches!(guard(&old, &new, who), UpdateVerdict::Final(v) if !v.allowed()),
            "{who}"
        );
    }
}

#[test]
fn a_replacer_that_changes_the_record_rather_than_dropping_it_is_still_judged() {
    let old = recorded_parent();
    let mut new = rebuilt(&old);
    new.annotations
        .insert("volumes.cozystack.io/phase".into(), "Released".into());
    let ms = mutations(Some(&old), &new, COZYSTACK_API);
    let mut doc = serde_json::json!({"metadata": {"annotations": new.annotations}});
    json_patch::patch(&mut doc, &to_json_patch(&profile(), &keys(), &ms)).unwrap();
    assert_eq!(
        doc["metadata"]["annotations"]["volumes.cozystack.io/phase"],
        "Released"
    );
    let mut after = new.clone();
    after.annotations = serde_json::from_value(doc["metadata"]["annotations"].clone()).unwrap();
    after.finalizers.push("volumes.cozystack.io/release".into());
    let verdict = guard(&old, &after, COZYSTACK_API);
    assert!(
        matches!(&verdict, UpdateVerdict::Final(v) if v.reason() == "record-forged"),
        "{verdict:?}"
    );
}

#[test]
fn nothing_is_carried_onto_what_was_not_a_parent() {
    let mut old = recorded_parent();
    old.labels.clear();
    let new = rebuilt(&old);
    assert!(mutations(Some(&old), &new, COZYSTACK_API).is_empty());
}

// ---- what a namespace deletion takes from under the phase ----

#[test]
fn what_is_named_for_a_tenant_is_found_by_its_name_or_its_owners() {
    let p = profile();
    let parents = vec![
        R.to_string(),
        format!("{R}-b"),
        "kubernetes-other".to_string(),
    ];
    let gk = |g: &str, k: &str| GroupKind::new(g, k);
    let named =
        |kind: GroupKind, name: &str, owners: &[&str]| named_for(&p, &kind, name, owners, &parents);
    // Kamaji's control plane: Deployment R, ReplicaSet R-<hash>, Pods.
    assert_eq!(named(gk("apps", "Deployment"), R, &[]), [R]);
    assert_eq!(
        named(gk("apps", "ReplicaSet"), &format!("{R}-7d9f"), &[R]),
        [R]
    );
    assert_eq!(
        named(
            gk("", "Pod"),
            &format!("{R}-7d9f-x2x"),
            &[&format!("{R}-7d9f")]
        ),
        [R]
    );
    // Its Service and EndpointSlices.
    assert_eq!(named(gk("", "Service"), R, &[]), [R]);
    assert_eq!(
        named(
            gk("discovery.k8s.io", "EndpointSlice"),
            &format!("{R}-abcde"),
            &[R]
        ),
        [R]
    );
    // A VM's launcher Pod, named otherwise, by its owner.
    assert_eq!(
        named(
            gk("", "Pod"),
            "virt-launcher-md0-x",
            &[&format!("{R}-md0-x")]
        ),
        [R]
    );
    // A name that could be two tenants' is both's.
    assert_eq!(
        named(gk("", "Pod"), &format!("{R}-b-kcsi-controller-1-2"), &[]),
        [R.to_string(), format!("{R}-b")]
    );
    // Not the parent itself (its DELETE starts the phase), but a child
    // release named for it is.
    assert!(named(hr(), R, &[]).is_empty());
    assert_eq!(named(hr(), &format!("{R}-csi"), &[]), [R]);
    // Not the teardown hook's own objects, not Events, not strangers.
    assert!(named(gk("", "ServiceAccount"), &format!("{R}-cleanup"), &[]).is_empty());
    assert!(named(gk("batch", "Job"), &format!("{R}-pre-cleanup"), &[]).is_empty());
    assert!(named(gk("", "Event"), &format!("{R}.17a3"), &[]).is_empty());
    assert!(named(gk("", "Pod"), "kubernetes-prodx-1", &[]).is_empty());
    assert!(named(gk("", "Pod"), "etcd-0", &["etcd"]).is_empty());
    // The parents a name could stand for: each prefix before a dash that
    // is a parent's kind of name; none for names without the prefix.
    assert_eq!(
        parent_candidates(&p, &["virt-launcher-x", "kubernetes-a-md0-x"]),
        ["kubernetes-a", "kubernetes-a-md0", "kubernetes-a-md0-x"]
    );
    assert_eq!(
        parent_candidates(&p, &["kubernetes-a-7d9f-x", "kubernetes-a-7d9f"]),
        ["kubernetes-a", "kubernetes-a-7d9f", "kubernetes-a-7d9f-x"]
    );
    assert!(parent_candidates(&p, &["etcd-0", "etcd"]).is_empty());
    assert!(parent_candidates(&p, &["kubernetes-"]).is_empty());
}

#[test]
fn the_namespace_roads_holds_wait_for_done_and_only_in_teardown() {
    let p = profile();
    let target = Target::Guarded {
        tenant: R.into(),
        role: NAMESPACE_ROAD_ROLE.into(),
    };
    let gk = GroupKind::new("", "Pod");
    let s = Subject {
        kind: &gk,
        namespace: NS,
        name: "kubernetes-prod-7d9f-x2x",
        action: "delete",
    };
    let msg = assert_denied(
        &decide_dependent_delete(&p, &target, s, Some(&facts().namespace_deleting().build())),
        "teardown-held",
    );
    assert!(msg.contains("release phase runs on"), "{msg}");
    assert_eq!(
        decide_dependent_delete(
            &p,
            &target,
            s,
            Some(&facts().namespace_deleting().phase("Released").build())
        ),
        Verdict::allow("done")
    );
    assert_eq!(
        decide_dependent_delete(&p, &target, s, None).reason(),
        "parent-absent"
    );
}
