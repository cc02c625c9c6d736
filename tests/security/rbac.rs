//! Least privilege: the RBAC shipped in `manifests/base`, resolved to one
//! grant per (group, resource, verb, scope) and ServiceAccount, against the
//! grants reviewed by hand here, and both asked of the real API server's
//! authorizer (SubjectAccessReviews).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use serde_json::Value;

use crate::common;
use crate::common::gate::{NAMESPACE, WEBHOOK_SA, WORKER_SA};

/// A tenant namespace and parent the probes ask about (neither need exist).
const PROBE_NAMESPACE: &str = "tenant-sar-probe";
const TENANT: &str = "kubernetes-x";

/// The profile's names the tables below need.
struct Names {
    /// `TENANT`'s admin kubeconfig Secret.
    kubeconfig: String,
    /// The API group of the override verb.
    override_group: String,
}

impl Names {
    fn of_profile() -> Names {
        let profile = common::profile();
        Names {
            kubeconfig: profile.kubeconfig_secret_name(TENANT),
            override_group: profile.override_permission.group,
        }
    }
}

/// Asserts that the shipped RBAC is what was reviewed ([`justified`]): no
/// more, no less.
pub fn assert_shipped_is_reviewed(shipped: &BTreeMap<String, BTreeSet<Grant>>) {
    let reviewed = justified();
    for (user, expected) in &reviewed {
        let got = shipped.get(user).cloned().unwrap_or_default();
        let grown: Vec<_> = got.difference(expected).collect();
        let shrunk: Vec<_> = expected.difference(&got).collect();
        assert!(
            grown.is_empty() && shrunk.is_empty(),
            "{user}: the RBAC in manifests/base changed without this test's review.\n  new grants: {grown:?}\n  gone: {shrunk:?}"
        );
    }
    assert_eq!(
        shipped.keys().collect::<Vec<_>>(),
        reviewed.keys().collect::<Vec<_>>(),
        "RBAC binds only the two ServiceAccounts"
    );
}

/// The shipped grants the API server does not give as shipped: a
/// cluster-wide grant must hold in any namespace and across all of them, a
/// namespaced one there and nowhere else; and the worker must read the
/// admin kubeconfig by name. One line per failure.
pub async fn ineffective_grants(
    admin: &kube::Client,
    shipped: &BTreeMap<String, BTreeSet<Grant>>,
) -> Vec<String> {
    let mut failures = Vec::new();
    for (sa, grants) in [
        (WORKER_SA, &shipped[&sa_user(WORKER_SA)]),
        (WEBHOOK_SA, &shipped[&sa_user(WEBHOOK_SA)]),
    ] {
        for (group, resource, verb, scope) in grants {
            match scope {
                // A cluster-wide grant: in any namespace and across all of them.
                None => {
                    for ns in [Some(PROBE_NAMESPACE), None] {
                        if !sar(admin, sa, (group, resource, "", verb, ns, "")).await {
                            failures.push(format!(
                                "{sa} should be allowed {verb} {group}/{resource} in {ns:?}"
                            ));
                        }
                    }
                }
                // A namespaced grant: there, and nowhere else.
                Some(ns) => {
                    if !sar(admin, sa, (group, resource, "", verb, Some(ns), "")).await {
                        failures.push(format!(
                            "{sa} should be allowed {verb} {group}/{resource} in {ns}"
                        ));
                    }
                    for other in [Some("kube-system"), Some(PROBE_NAMESPACE), None] {
                        if sar(admin, sa, (group, resource, "", verb, other, "")).await {
                            failures.push(format!("{sa} must not be allowed {verb} {group}/{resource} in {other:?} (granted in {ns} only)"));
                        }
                    }
                }
            }
        }
    }
    // The worker reads the admin kubeconfig by name.
    let kubeconfig = Names::of_profile().kubeconfig;
    let by_name = (
        "",
        "secrets",
        "",
        "get",
        Some(PROBE_NAMESPACE),
        kubeconfig.as_str(),
    );
    if !sar(admin, WORKER_SA, by_name).await {
        failures.push("worker should get the admin kubeconfig Secret by name".into());
    }
    failures
}

/// What the API server allows either ServiceAccount of what it must not
/// ([`denied_worker`], [`denied_webhook`]). One line per failure.
pub async fn unjustified_permissions(admin: &kube::Client) -> Vec<String> {
    let names = Names::of_profile();
    let mut failures = Vec::new();
    for (sa, denied) in [
        (WORKER_SA, denied_worker(&names)),
        (WEBHOOK_SA, denied_webhook(&names)),
    ] {
        for (group, resource, sub, verb, ns, name) in denied {
            if sar(admin, sa, (group, resource, sub, verb, ns, name)).await {
                let what = if sub.is_empty() {
                    resource.to_string()
                } else {
                    format!("{resource}/{sub}")
                };
                failures.push(format!(
                    "{sa} must not be allowed {verb} {group}/{what} {name:?} in {ns:?}"
                ));
            }
        }
    }
    failures
}

/// One permission: (apiGroup, resource, verb, namespace). `namespace` is
/// `None` for a grant that holds cluster-wide (ClusterRoleBinding).
pub type Grant = (String, String, String, Option<String>);

fn sa_user(sa: &str) -> String {
    format!("system:serviceaccount:{NAMESPACE}:{sa}")
}

/// The grants of `manifests/base/*-rbac.yaml`, per ServiceAccount user,
/// resolved through the bindings in those files.
pub fn shipped_grants() -> BTreeMap<String, BTreeSet<Grant>> {
    let dir = common::cluster::repo_root().join("manifests/base");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .ends_with("-rbac.yaml")
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no *-rbac.yaml in {}", dir.display());
    let mut docs = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let parsed: Vec<Value> =
            serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        docs.extend(parsed.into_iter().filter(|d| !d.is_null()));
    }
    // Roles by (kind, namespace, name).
    let mut roles: BTreeMap<(String, String, String), Vec<Value>> = BTreeMap::new();
    for d in &docs {
        let kind = d["kind"].as_str().unwrap_or("");
        if kind == "ClusterRole" || kind == "Role" {
            let ns = if kind == "Role" {
                d["metadata"]["namespace"]
                    .as_str()
                    .expect("Role namespace")
                    .to_string()
            } else {
                String::new()
            };
            roles.insert(
                (
                    kind.into(),
                    ns,
                    d["metadata"]["name"].as_str().unwrap().into(),
                ),
                d["rules"].as_array().cloned().unwrap_or_default(),
            );
        }
    }
    let mut grants: BTreeMap<String, BTreeSet<Grant>> = BTreeMap::new();
    for d in &docs {
        let kind = d["kind"].as_str().unwrap_or("");
        if kind != "ClusterRoleBinding" && kind != "RoleBinding" {
            continue;
        }
        let binding_ns = d["metadata"]["namespace"].as_str().map(String::from);
        let role_kind = d["roleRef"]["kind"].as_str().unwrap();
        let role_ns = if role_kind == "Role" {
            binding_ns.clone().unwrap()
        } else {
            String::new()
        };
        let key = (
            role_kind.to_string(),
            role_ns,
            d["roleRef"]["name"].as_str().unwrap().to_string(),
        );
        let rules = roles.get(&key).unwrap_or_else(|| {
            panic!(
                "binding {} refers to an unshipped {key:?}",
                d["metadata"]["name"]
            )
        });
        let scope = if kind == "ClusterRoleBinding" {
            None
        } else {
            binding_ns.clone()
        };
        for s in d["subjects"].as_array().unwrap() {
            assert_eq!(
                s["kind"], "ServiceAccount",
                "only ServiceAccounts are bound by the base: {s}"
            );
            let user = format!(
                "system:serviceaccount:{}:{}",
                s["namespace"].as_str().unwrap(),
                s["name"].as_str().unwrap()
            );
            for rule in rules {
                assert!(
                    rule["resourceNames"].is_null(),
                    "resourceNames are not modelled by this test yet: {rule}"
                );
                assert!(
                    rule["nonResourceURLs"].is_null(),
                    "nonResourceURLs are not modelled by this test yet: {rule}"
                );
                for g in rule["apiGroups"].as_array().unwrap() {
                    for r in rule["resources"].as_array().unwrap() {
                        for v in rule["verbs"].as_array().unwrap() {
                            grants.entry(user.clone()).or_default().insert((
                                g.as_str().unwrap().into(),
                                r.as_str().unwrap().into(),
                                v.as_str().unwrap().into(),
                                scope.clone(),
                            ));
                        }
                    }
                }
            }
        }
    }
    grants
}

fn g(group: &str, resource: &str, verb: &str, ns: Option<&str>) -> Grant {
    (
        group.into(),
        resource.into(),
        verb.into(),
        ns.map(String::from),
    )
}

/// What the RBAC comments justify, reviewed by hand. Growing the shipped RBAC
/// fails this test until this list (and its review) grows too.
fn justified() -> BTreeMap<String, BTreeSet<Grant>> {
    let hr = "helm.toolkit.fluxcd.io";
    let vg = Some(NAMESPACE);
    let worker = [
        // Watch parents (metadata only); patch: the finalizer and the record.
        g(hr, "helmreleases", "get", None),
        g(hr, "helmreleases", "list", None),
        g(hr, "helmreleases", "watch", None),
        g(hr, "helmreleases", "patch", None),
        // A namespace being deleted puts its tenants in teardown.
        g("", "namespaces", "list", None),
        g("", "namespaces", "watch", None),
        // R-admin-kubeconfig, by name only.
        g("", "secrets", "get", None),
        // Kamaji's TenantControlPlane R, by name: where the tenant's API is.
        g("kamaji.clastix.io", "tenantcontrolplanes", "get", None),
        // The infra layer: what is left of the disks behind the tenant's
        // volumes; deleted only when the tenant API is unreachable, only
        // inventoried Delete volumes labelled for the tenant.
        g("cdi.kubevirt.io", "datavolumes", "list", None),
        g("cdi.kubevirt.io", "datavolumes", "delete", None),
        g("", "persistentvolumeclaims", "list", None),
        g("", "persistentvolumes", "list", None),
        g("", "persistentvolumes", "watch", None),
        // Keeping a disk: reclaim policy Retain on its management PV.
        g("", "persistentvolumes", "patch", None),
        // The management storage's snapshots behind a tenant's snapshots
        // and their contents, waited for before Released; never written.
        g("snapshot.storage.k8s.io", "volumesnapshots", "list", None),
        g("snapshot.storage.k8s.io", "volumesnapshots", "watch", None),
        g(
            "snapshot.storage.k8s.io",
            "volumesnapshotcontents",
            "list",
            None,
        ),
        g(
            "snapshot.storage.k8s.io",
            "volumesnapshotcontents",
            "watch",
            None,
        ),
        // The VM attachment Pods that hold those disks' PVCs.
        g("", "pods", "list", None),
        g("", "pods", "delete", None),
        // Events for every transition.
        g("events.k8s.io", "events", "create", None),
        g("events.k8s.io", "events", "patch", None),
        // Leader election, in its own namespace only.
        g("coordination.k8s.io", "leases", "get", vg),
        g("coordination.k8s.io", "leases", "create", vg),
        g("coordination.k8s.io", "leases", "update", vg),
        g("coordination.k8s.io", "leases", "patch", vg),
    ];
    let webhook = [
        g(hr, "helmreleases", "get", None),
        g("", "namespaces", "get", None),
        g(
            "authorization.k8s.io",
            "subjectaccessreviews",
            "create",
            None,
        ),
    ];
    BTreeMap::from([
        (sa_user(WORKER_SA), worker.into_iter().collect()),
        (sa_user(WEBHOOK_SA), webhook.into_iter().collect()),
    ])
}

/// An access asked about: (group, resource, subresource, verb, namespace,
/// name); in the tables below, what neither identity may do.
type Denied<'a> = (&'a str, &'a str, &'a str, &'a str, Option<&'a str>, &'a str);

fn denied_worker(names: &Names) -> Vec<Denied<'_>> {
    let t = Some(PROBE_NAMESPACE);
    let (kubeconfig, override_group) = (names.kubeconfig.as_str(), names.override_group.as_str());
    let hr = "helm.toolkit.fluxcd.io";
    vec![
        // Secrets: get by name only, never discovered or written.
        ("", "secrets", "", "list", None, ""),
        ("", "secrets", "", "list", t, ""),
        ("", "secrets", "", "watch", None, ""),
        ("", "secrets", "", "watch", t, ""),
        ("", "secrets", "", "create", t, ""),
        ("", "secrets", "", "update", t, kubeconfig),
        ("", "secrets", "", "patch", t, kubeconfig),
        ("", "secrets", "", "delete", t, kubeconfig),
        // Releases: patch only, never delete, update or create.
        (hr, "helmreleases", "", "delete", t, TENANT),
        (hr, "helmreleases", "", "deletecollection", t, ""),
        (hr, "helmreleases", "", "update", t, TENANT),
        (hr, "helmreleases", "", "create", t, ""),
        (hr, "helmreleases", "status", "patch", t, TENANT),
        // Nothing destructive in the management cluster but the infra
        // layer's unreachable case (justified above).
        ("", "pods", "", "create", t, ""),
        ("", "pods", "", "update", t, "hp-volume-x"),
        ("", "pods", "", "deletecollection", t, ""),
        ("", "pods", "exec", "create", t, "hp-volume-x"),
        ("", "persistentvolumeclaims", "", "delete", t, "data"),
        ("", "persistentvolumeclaims", "", "get", t, "data"),
        ("", "persistentvolumeclaims", "", "watch", t, ""),
        ("", "persistentvolumes", "", "delete", None, "pv-1"),
        (
            "snapshot.storage.k8s.io",
            "volumesnapshots",
            "",
            "delete",
            t,
            "snap-1",
        ),
        (
            "snapshot.storage.k8s.io",
            "volumesnapshots",
            "",
            "create",
            t,
            "",
        ),
        (
            "snapshot.storage.k8s.io",
            "volumesnapshotcontents",
            "",
            "delete",
            None,
            "snapcontent-1",
        ),
        (
            "snapshot.storage.k8s.io",
            "volumesnapshotcontents",
            "",
            "patch",
            None,
            "snapcontent-1",
        ),
        ("", "persistentvolumes", "", "update", None, "pv-1"),
        ("", "namespaces", "", "patch", None, "tenant-x"),
        ("", "namespaces", "", "update", None, "tenant-x"),
        ("", "namespaces", "", "delete", None, "tenant-x"),
        (
            "controlplane.cluster.x-k8s.io",
            "kamajicontrolplanes",
            "",
            "delete",
            t,
            TENANT,
        ),
        (
            "kamaji.clastix.io",
            "tenantcontrolplanes",
            "",
            "delete",
            t,
            TENANT,
        ),
        ("cdi.kubevirt.io", "datavolumes", "", "create", t, ""),
        ("cdi.kubevirt.io", "datavolumes", "", "patch", t, "pv-1"),
        (
            "cdi.kubevirt.io",
            "datavolumes",
            "",
            "deletecollection",
            t,
            "",
        ),
        // Leases outside its own namespace.
        (
            "coordination.k8s.io",
            "leases",
            "",
            "get",
            Some("kube-system"),
            "kube-controller-manager",
        ),
        (
            "coordination.k8s.io",
            "leases",
            "",
            "update",
            Some("kube-system"),
            "kube-controller-manager",
        ),
        (
            "coordination.k8s.io",
            "leases",
            "",
            "create",
            Some("default"),
            "",
        ),
        (
            "coordination.k8s.io",
            "leases",
            "",
            "update",
            t,
            "volume-gate-worker",
        ),
        ("coordination.k8s.io", "leases", "", "list", None, ""),
        (
            "coordination.k8s.io",
            "leases",
            "",
            "delete",
            Some(NAMESPACE),
            "volume-gate-worker",
        ),
        // No escalation.
        (
            "",
            "serviceaccounts",
            "token",
            "create",
            Some(NAMESPACE),
            "volume-gate-webhook",
        ),
        ("", "users", "", "impersonate", None, "admin"),
        ("", "groups", "", "impersonate", None, "system:masters"),
        (
            "rbac.authorization.k8s.io",
            "clusterrolebindings",
            "",
            "create",
            None,
            "",
        ),
        (
            "rbac.authorization.k8s.io",
            "clusterroles",
            "",
            "escalate",
            None,
            "cluster-admin",
        ),
        (
            "rbac.authorization.k8s.io",
            "clusterroles",
            "",
            "bind",
            None,
            "cluster-admin",
        ),
        (
            "admissionregistration.k8s.io",
            "validatingwebhookconfigurations",
            "",
            "delete",
            None,
            "volume-gate",
        ),
        (
            "admissionregistration.k8s.io",
            "mutatingwebhookconfigurations",
            "",
            "patch",
            None,
            "volume-gate",
        ),
        (
            "authorization.k8s.io",
            "subjectaccessreviews",
            "",
            "create",
            None,
            "",
        ),
        // The override is a person's decision, never the worker's.
        (override_group, "tenants", "", "override", t, TENANT),
    ]
}

fn denied_webhook(names: &Names) -> Vec<Denied<'_>> {
    let t = Some(PROBE_NAMESPACE);
    let (kubeconfig, override_group) = (names.kubeconfig.as_str(), names.override_group.as_str());
    let hr = "helm.toolkit.fluxcd.io";
    vec![
        // It only reads: no writes to releases.
        (hr, "helmreleases", "", "patch", t, TENANT),
        (hr, "helmreleases", "", "update", t, TENANT),
        (hr, "helmreleases", "", "delete", t, TENANT),
        (hr, "helmreleases", "", "create", t, ""),
        (hr, "helmreleases", "", "list", None, ""),
        (hr, "helmreleases", "", "watch", None, ""),
        // No Secrets at all.
        ("", "secrets", "", "get", t, kubeconfig),
        ("", "secrets", "", "list", None, ""),
        ("", "secrets", "", "list", t, ""),
        ("", "secrets", "", "watch", None, ""),
        // No side effects: no Events.
        ("events.k8s.io", "events", "", "create", t, ""),
        ("", "events", "", "create", t, ""),
        ("events.k8s.io", "events", "", "patch", t, "e"),
        ("", "namespaces", "", "list", None, ""),
        ("", "namespaces", "", "update", None, "tenant-x"),
        ("", "namespaces", "", "delete", None, "tenant-x"),
        (
            "coordination.k8s.io",
            "leases",
            "",
            "get",
            Some(NAMESPACE),
            "volume-gate-worker",
        ),
        (
            "coordination.k8s.io",
            "leases",
            "",
            "update",
            Some(NAMESPACE),
            "volume-gate-worker",
        ),
        ("", "pods", "", "create", t, ""),
        (
            "",
            "serviceaccounts",
            "token",
            "create",
            Some(NAMESPACE),
            "volume-gate-worker",
        ),
        (
            "",
            "users",
            "",
            "impersonate",
            None,
            "system:serviceaccount:volume-gate:volume-gate-worker",
        ),
        (
            "authorization.k8s.io",
            "localsubjectaccessreviews",
            "",
            "create",
            t,
            "",
        ),
        (
            "rbac.authorization.k8s.io",
            "rolebindings",
            "",
            "create",
            t,
            "",
        ),
        (override_group, "tenants", "", "override", t, TENANT),
    ]
}

/// Whether the API server's authorizer allows ServiceAccount `sa` of the
/// gate's namespace `verb` on `group/resource[/subresource]` `name` in
/// `namespace` (a SubjectAccessReview).
async fn sar(
    client: &kube::Client,
    sa: &str,
    (group, resource, subresource, verb, namespace, name): Denied<'_>,
) -> bool {
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(sa_user(sa)),
            groups: Some(vec![
                "system:serviceaccounts".into(),
                format!("system:serviceaccounts:{NAMESPACE}"),
                "system:authenticated".into(),
            ]),
            resource_attributes: Some(ResourceAttributes {
                group: Some(group.into()),
                resource: Some(resource.into()),
                subresource: (!subresource.is_empty()).then(|| subresource.into()),
                verb: Some(verb.into()),
                namespace: namespace.map(String::from),
                name: (!name.is_empty()).then(|| name.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = Api::<SubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .unwrap_or_else(|e| panic!("SubjectAccessReview {sa} {verb} {group}/{resource}: {e}"));
    let status = answer.status.expect("SubjectAccessReview status");
    status.allowed && !status.denied.unwrap_or(false)
}
