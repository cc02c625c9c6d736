//! Security properties on the real control plane, with the gate installed
//! from `manifests/`: least privilege (checked by the API server's own
//! authorizer), no secret material in any log, hostile kubeconfig Secrets,
//! two workers racing for the Lease, the webhook killed under load, the
//! serving certificate rotated under load, and forged override stamps.
//!
//! Every test but the RBAC one takes `common::serial()`: they kill, restart
//! or race shared processes, or rely on the webhook answering.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::gate::{
    NAMESPACE, WEBHOOK_SA, WORKER_SA, binary, free_port, helmrelease_resource, http_get,
};
use common::process::Process;
use common::tenant::{STORAGE_CLASS, Tenant, base64, kcp_resource};
use common::wait::eventually;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, DynamicObject, ObjectMeta, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use volume_gate::record::Phase;

fn env() -> &'static common::Env {
    common::gated()
}

fn gate() -> std::sync::MutexGuard<'static, common::gate::Gate> {
    env()
        .gate
        .as_ref()
        .expect("gated env")
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// Prints how long a test ran (after taking the serial lock), for the report.
struct Timed(&'static str, Instant);

impl Timed {
    fn start(name: &'static str) -> Self {
        Timed(name, Instant::now())
    }
}

impl Drop for Timed {
    fn drop(&mut self) {
        eprintln!(
            "[timing] {}: {:.1}s",
            self.0,
            self.1.elapsed().as_secs_f64()
        );
    }
}

// ---------------------------------------------------------------------------
// 1. Least privilege
// ---------------------------------------------------------------------------

/// One permission: (apiGroup, resource, verb, namespace). `namespace` is
/// `None` for a grant that holds cluster-wide (ClusterRoleBinding).
type Grant = (String, String, String, Option<String>);

fn sa_user(sa: &str) -> String {
    format!("system:serviceaccount:{NAMESPACE}:{sa}")
}

/// The grants of `manifests/base/*-rbac.yaml`, per ServiceAccount user,
/// resolved through the bindings in those files.
fn shipped_grants() -> BTreeMap<String, BTreeSet<Grant>> {
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

/// What neither identity may do. (group, resource, subresource, verb, namespace, name)
type Denied = (
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    Option<&'static str>,
    &'static str,
);

fn denied_worker() -> Vec<Denied> {
    let t = Some("tenant-sar-probe");
    let hr = "helm.toolkit.fluxcd.io";
    vec![
        // Secrets: get by name only, never discovered or written.
        ("", "secrets", "", "list", None, ""),
        ("", "secrets", "", "list", t, ""),
        ("", "secrets", "", "watch", None, ""),
        ("", "secrets", "", "watch", t, ""),
        ("", "secrets", "", "create", t, ""),
        (
            "",
            "secrets",
            "",
            "update",
            t,
            "kubernetes-x-admin-kubeconfig",
        ),
        (
            "",
            "secrets",
            "",
            "patch",
            t,
            "kubernetes-x-admin-kubeconfig",
        ),
        (
            "",
            "secrets",
            "",
            "delete",
            t,
            "kubernetes-x-admin-kubeconfig",
        ),
        // Releases: patch only, never delete, update or create.
        (hr, "helmreleases", "", "delete", t, "kubernetes-x"),
        (hr, "helmreleases", "", "deletecollection", t, ""),
        (hr, "helmreleases", "", "update", t, "kubernetes-x"),
        (hr, "helmreleases", "", "create", t, ""),
        (hr, "helmreleases", "status", "patch", t, "kubernetes-x"),
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
            "kubernetes-x",
        ),
        (
            "kamaji.clastix.io",
            "tenantcontrolplanes",
            "",
            "delete",
            t,
            "kubernetes-x",
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
        (
            "volumes.cozystack.io",
            "tenants",
            "",
            "override",
            t,
            "kubernetes-x",
        ),
    ]
}

fn denied_webhook() -> Vec<Denied> {
    let t = Some("tenant-sar-probe");
    let hr = "helm.toolkit.fluxcd.io";
    vec![
        // It only reads: no writes to releases.
        (hr, "helmreleases", "", "patch", t, "kubernetes-x"),
        (hr, "helmreleases", "", "update", t, "kubernetes-x"),
        (hr, "helmreleases", "", "delete", t, "kubernetes-x"),
        (hr, "helmreleases", "", "create", t, ""),
        (hr, "helmreleases", "", "list", None, ""),
        (hr, "helmreleases", "", "watch", None, ""),
        // No Secrets at all.
        ("", "secrets", "", "get", t, "kubernetes-x-admin-kubeconfig"),
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
        (
            "volumes.cozystack.io",
            "tenants",
            "",
            "override",
            t,
            "kubernetes-x",
        ),
    ]
}

async fn sar(
    client: &kube::Client,
    sa: &str,
    group: &str,
    resource: &str,
    subresource: &str,
    verb: &str,
    namespace: Option<&str>,
    name: &str,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_accounts_have_exactly_the_justified_permissions_and_nothing_else() {
    let _timed =
        Timed::start("service_accounts_have_exactly_the_justified_permissions_and_nothing_else");
    let env = env();
    let admin = env.cp.management_client().await;

    // The shipped RBAC is what was reviewed: no more, no less.
    let shipped = shipped_grants();
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

    // Every shipped grant is effective at the real API server...
    let mut failures = Vec::new();
    for (sa, grants) in [
        (WORKER_SA, &shipped[&sa_user(WORKER_SA)]),
        (WEBHOOK_SA, &shipped[&sa_user(WEBHOOK_SA)]),
    ] {
        for (group, resource, verb, scope) in grants {
            match scope {
                // A cluster-wide grant: in any namespace and across all of them.
                None => {
                    for ns in [Some("tenant-sar-probe"), None] {
                        if !sar(&admin, sa, group, resource, "", verb, ns, "").await {
                            failures.push(format!(
                                "{sa} should be allowed {verb} {group}/{resource} in {ns:?}"
                            ));
                        }
                    }
                }
                // A namespaced grant: there, and nowhere else.
                Some(ns) => {
                    if !sar(&admin, sa, group, resource, "", verb, Some(ns), "").await {
                        failures.push(format!(
                            "{sa} should be allowed {verb} {group}/{resource} in {ns}"
                        ));
                    }
                    for other in [Some("kube-system"), Some("tenant-sar-probe"), None] {
                        if sar(&admin, sa, group, resource, "", verb, other, "").await {
                            failures.push(format!("{sa} must not be allowed {verb} {group}/{resource} in {other:?} (granted in {ns} only)"));
                        }
                    }
                }
            }
        }
    }
    // The worker reads the admin kubeconfig by name.
    if !sar(
        &admin,
        WORKER_SA,
        "",
        "secrets",
        "",
        "get",
        Some("tenant-sar-probe"),
        "kubernetes-x-admin-kubeconfig",
    )
    .await
    {
        failures.push("worker should get the admin kubeconfig Secret by name".into());
    }

    // ...and nothing that is not justified is.
    for (sa, denied) in [(WORKER_SA, denied_worker()), (WEBHOOK_SA, denied_webhook())] {
        for (group, resource, sub, verb, ns, name) in denied {
            if sar(&admin, sa, group, resource, sub, verb, ns, name).await {
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
    assert!(
        failures.is_empty(),
        "least privilege violated:\n  {}",
        failures.join("\n  ")
    );
}

// ---------------------------------------------------------------------------
// 2. No secret material in logs
// ---------------------------------------------------------------------------

fn all_files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Whether a log file is written by volume-gate itself (webhook, workers).
fn is_volume_gate_log(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with("volume-gate-"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_contains_tokens_kubeconfig_credentials_or_pem_blocks() {
    let _s = common::serial();
    let _timed = Timed::start("no_log_contains_tokens_kubeconfig_credentials_or_pem_blocks");
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("nolog")).await;
    t.wait_custody().await;
    t.tenant_namespace("apps").await;
    for c in ["data-a", "data-b"] {
        t.claim("apps", c, STORAGE_CLASS).await;
    }
    t.pod("apps", "two-claims", &["data-a", "data-b"]).await;
    t.statefulset("apps", "db", 1).await;
    t.wait_settled(3, 2).await;
    assert_eq!(env.sim.volumes_of(&t.namespace, &t.name).len(), 3);
    t.delete_parent().await;
    t.wait_parent_gone(Duration::from_secs(180)).await;
    assert!(
        env.sim.volumes_of(&t.namespace, &t.name).is_empty(),
        "the teardown freed every volume"
    );

    // The secrets: ServiceAccount tokens the gate runs with...
    let mut secrets: Vec<(String, String)> = Vec::new();
    for f in std::fs::read_dir(&env.cp.state).unwrap().flatten() {
        let name = f.file_name().to_string_lossy().to_string();
        if name.starts_with("sa-") && name.ends_with(".kubeconfig") {
            let kc: Value = serde_json::from_slice(&std::fs::read(f.path()).unwrap()).unwrap();
            for u in kc["users"].as_array().unwrap() {
                let token = u["user"]["token"].as_str().expect("SA token").to_string();
                assert!(token.len() > 100, "a real token");
                secrets.push((format!("token of {name}"), token));
            }
        }
    }
    for sa in [WORKER_SA, WEBHOOK_SA] {
        assert!(
            secrets.iter().any(|(n, _)| n.contains(sa)),
            "found the {sa} token: {:?}",
            secrets.iter().map(|s| &s.0).collect::<Vec<_>>()
        );
    }
    // ...the tenant admin kubeconfig's credentials, as they sit in the file
    // and in the Secret...
    let tenant_kc_text = std::fs::read_to_string(&t.cluster.kubeconfig).unwrap();
    let tenant_kc: Value = serde_saphyr::from_str(&tenant_kc_text).unwrap();
    for u in tenant_kc["users"].as_array().unwrap() {
        for field in ["client-key-data", "client-certificate-data"] {
            let v = u["user"][field]
                .as_str()
                .unwrap_or_else(|| panic!("tenant kubeconfig has {field}"));
            secrets.push((format!("tenant kubeconfig {field}"), v.to_string()));
        }
    }
    let secret_b64 = base64(tenant_kc_text.as_bytes());
    let mid = secret_b64.len() / 2 / 4 * 4;
    secrets.push((
        "the admin kubeconfig Secret's data (base64 of the file)".into(),
        secret_b64[mid..mid + 64].to_string(),
    ));
    // ...and any PEM block (private keys, certificates).
    secrets.push(("a PEM block".into(), "-----BEGIN".into()));

    // Every log: volume-gate's, the simulator's, and all of the control plane's.
    let mut logs: BTreeMap<String, String> = BTreeMap::new();
    for f in all_files_under(&env.cp.state.join("logs")) {
        logs.insert(
            f.display().to_string(),
            String::from_utf8_lossy(&std::fs::read(&f).unwrap()).to_string(),
        );
    }
    {
        let gate = gate();
        logs.insert("webhook (Gate::webhook_log)".into(), gate.webhook_log());
        logs.insert("workers (Gate::worker_log)".into(), gate.worker_log());
    }
    logs.insert("simulator (Simulator::log)".into(), env.sim.log());
    assert!(
        logs.keys().any(|k| k.contains("volume-gate-webhook")),
        "the webhook's log is among them: {:?}",
        logs.keys()
    );
    assert!(
        logs.keys().any(|k| k.contains("volume-gate-worker")),
        "a worker's log is among them: {:?}",
        logs.keys()
    );
    let worker_log = &logs["workers (Gate::worker_log)"];
    assert!(
        worker_log.contains(&t.name),
        "the worker logged this teardown (the scan looks at the right logs)"
    );

    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    for (log, text) in &logs {
        for (what, needle) in &secrets {
            if let Some(at) = text.find(needle.as_str()) {
                let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
                // The line, with the secret itself redacted: a failure must not leak it further.
                let line = text[line_start..]
                    .lines()
                    .next()
                    .unwrap_or("")
                    .replace(needle.as_str(), "<REDACTED>");
                let excerpt: String = line.chars().take(200).collect();
                let finding = format!("{log}: contains {what}; line starts {excerpt:?}");
                if log.starts_with("webhook (")
                    || log.starts_with("workers (")
                    || is_volume_gate_log(Path::new(log))
                {
                    ours.push(finding);
                } else {
                    theirs.push(finding);
                }
            }
        }
    }
    assert!(
        ours.is_empty(),
        "volume-gate logged secret material:\n  {}",
        ours.join("\n  ")
    );
    assert!(
        theirs.is_empty(),
        "secret material in logs not written by volume-gate (harness/simulator/Kubernetes):\n  {}",
        theirs.join("\n  ")
    );
}

// ---------------------------------------------------------------------------
// 3. Hostile kubeconfig Secrets
// ---------------------------------------------------------------------------

/// Replaces the admin kubeconfig with `bytes` under `super-admin.svc` and
/// drops `super-admin.conf`, so no other key can stand in for it.
async fn set_kubeconfig_bytes(t: &Tenant, bytes: &[u8]) {
    let patch = json!({"data": {"super-admin.svc": base64(bytes), "super-admin.conf": null}});
    Api::<Secret>::namespaced(t.management.clone(), &t.namespace)
        .patch(
            &format!("{}-admin-kubeconfig", t.name),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .expect("patch the admin kubeconfig Secret");
}

/// Puts the tenant's real kubeconfig back under both keys.
async fn restore_kubeconfig(t: &Tenant) {
    let kc = std::fs::read(&t.cluster.kubeconfig).unwrap();
    let patch = json!({"data": {"super-admin.svc": base64(&kc), "super-admin.conf": base64(&kc)}});
    Api::<Secret>::namespaced(t.management.clone(), &t.namespace)
        .patch(
            &format!("{}-admin-kubeconfig", t.name),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .expect("restore the admin kubeconfig Secret");
}

fn tenant_kubeconfig(t: &Tenant) -> Value {
    serde_saphyr::from_str(&std::fs::read_to_string(&t.cluster.kubeconfig).unwrap()).unwrap()
}

/// Waits for the next record (see `Tenant::wait_phase`) that is Blocked with
/// a message containing `needle`, and returns the message.
async fn wait_blocked_with(t: &Tenant, needle: &str, timeout: Duration) -> String {
    let record = t
        .history
        .next_record(&format!("Blocked naming {needle:?}"), timeout, |r| {
            r.phase == Some(Phase::Blocked)
                && r.message.as_deref().is_some_and(|m| m.contains(needle))
        })
        .await;
    record.message.unwrap_or_default()
}

/// The worker is still the same running process and answers /readyz.
async fn assert_worker_alive(pid_before: Option<u32>, after: &str) {
    let (alive, pid, admin) = {
        let gate = gate();
        let w = gate.worker.as_ref().expect("a worker");
        (w.alive(), w.pid(), gate.worker_admin)
    };
    assert!(
        alive,
        "the worker died after {after}; its log:\n{}",
        gate().worker_log()
    );
    assert_eq!(pid, pid_before, "the worker was not replaced after {after}");
    let (code, body) = http_get(admin, "/readyz")
        .await
        .unwrap_or_else(|e| panic!("worker /readyz after {after}: {e}"));
    assert_eq!(code, 200, "worker /readyz after {after}: {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_kubeconfig_secrets_block_with_a_clear_message_and_the_worker_survives() {
    let _s = common::serial();
    let _timed = Timed::start(
        "hostile_kubeconfig_secrets_block_with_a_clear_message_and_the_worker_survives",
    );
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("hostile")).await;
    t.wait_custody().await;
    t.tenant_namespace("apps").await;
    t.claim("apps", "data", STORAGE_CLASS).await;
    t.pod("apps", "holder", &["data"]).await;
    // The simulator is connected to this tenant (its kubelet ran the Pod) and
    // keeps that connection while the API answers: it does not re-read the
    // Secret, so whatever runs the exec plugin below is not the simulator.
    t.wait_settled(1, 1).await;
    let secret = format!("{}/{}-admin-kubeconfig", t.namespace, t.name);
    let worker_pid = gate().worker.as_ref().and_then(|w| w.pid());
    assert!(worker_pid.is_some());

    // (a) Garbage bytes, not YAML, not even UTF-8, with a canary inside.
    let canary = format!("vg-canary-{}", env.cp.unique("c"));
    let mut garbage: Vec<u8> = (0u32..4096)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8 | 0x80)
        .collect();
    garbage.extend_from_slice(canary.as_bytes());
    garbage.extend_from_slice(b"\xff\xfe: [{{{");
    set_kubeconfig_bytes(&t, &garbage).await;
    t.delete_parent().await;
    let m = wait_blocked_with(&t, "unparseable", Duration::from_secs(60)).await;
    assert!(m.contains(&secret), "(a) names the Secret: {m}");
    assert!(
        !m.contains(&canary),
        "(a) the message does not echo the Secret's content: {m}"
    );
    assert_worker_alive(worker_pid, "garbage bytes").await;

    // (b) A 900 KiB body.
    let mut huge = b"apiVersion: v1\nkind: Config\n".to_vec();
    huge.extend(std::iter::repeat_n(b'#', 900 * 1024));
    set_kubeconfig_bytes(&t, &huge).await;
    let m = wait_blocked_with(&t, "bytes", Duration::from_secs(60)).await;
    assert!(
        m.contains(&secret) && m.contains("unparseable"),
        "(b) names the Secret and the problem: {m}"
    );
    assert!(
        m.len() < 2000,
        "(b) the message is one line, not the body: {} bytes",
        m.len()
    );
    assert_worker_alive(worker_pid, "a 900 KiB kubeconfig").await;

    // (c) A server where nothing listens.
    let mut refused = tenant_kubeconfig(&t);
    for c in refused["clusters"].as_array_mut().unwrap() {
        c["cluster"]["server"] = json!("https://127.0.0.1:1");
    }
    set_kubeconfig_bytes(&t, &serde_json::to_vec(&refused).unwrap()).await;
    let m = wait_blocked_with(&t, "127.0.0.1:1", Duration::from_secs(60)).await;
    assert!(
        m.contains("not ready") || m.contains("did not answer"),
        "(c) says the tenant API does not answer: {m}"
    );
    assert!(
        m.to_lowercase().contains("refused") || m.contains("Connect"),
        "(c) says why (connection refused): {m}"
    );
    assert_worker_alive(worker_pid, "an unreachable server").await;

    // (d) An exec plugin that would run a shell command in the worker.
    let pwned = PathBuf::from(format!(
        "/tmp/volume-gate-pwned-{}-{}",
        std::process::id(),
        env.cp.unique("p")
    ));
    let _ = std::fs::remove_file(&pwned);
    let mut exec = tenant_kubeconfig(&t);
    for u in exec["users"].as_array_mut().unwrap() {
        u["user"] = json!({"exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": "/bin/sh",
            // Records who ran it: the parent of the shell is the process that obeyed the plugin.
            "args": ["-c", format!("echo $PPID > {}", pwned.display())],
            "interactiveMode": "Never",
        }});
    }
    set_kubeconfig_bytes(&t, &serde_json::to_vec(&exec).unwrap()).await;
    let m = wait_blocked_with(&t, "exec plugin", Duration::from_secs(60)).await;
    assert!(
        m.contains(&secret) && m.contains("unparseable"),
        "(d) names the Secret and the problem: {m}"
    );
    // One more full pass with the same Secret, so a delayed execution would show.
    let attempt = |m: &str| {
        m.split("(attempt ")
            .nth(1)
            .and_then(|s| s.split(';').next())
            .and_then(|n| n.parse::<u32>().ok())
    };
    let first = attempt(&m).expect("attempt number in the message");
    wait_blocked_with(
        &t,
        &format!("(attempt {}", first + 1),
        Duration::from_secs(60),
    )
    .await;
    if let Ok(who) = std::fs::read_to_string(&pwned) {
        panic!(
            "the exec plugin ran (file {} created by the child of PID {}; worker PID {worker_pid:?}, simulator PID {:?})",
            pwned.display(),
            who.trim(),
            env.sim.process.pid()
        );
    }
    assert_worker_alive(worker_pid, "an exec plugin").await;
    let log = gate().worker_log();
    assert!(
        !log.contains(&canary) && !log.contains("volume-gate-pwned"),
        "the worker log does not echo Secret contents"
    );

    // The same worker then does its job once the Secret is sound again.
    restore_kubeconfig(&t).await;
    t.wait_parent_gone(Duration::from_secs(120)).await;
    assert!(
        env.sim.volumes_of(&t.namespace, &t.name).is_empty(),
        "released after the hostile Secrets"
    );
    assert!(!pwned.exists());
    assert_worker_alive(worker_pid, "the release").await;
}

// ---------------------------------------------------------------------------
// 4. Two workers racing
// ---------------------------------------------------------------------------

async fn lease_holder(admin: &kube::Client) -> Option<String> {
    Api::<Lease>::namespaced(admin.clone(), NAMESPACE)
        .get_opt("volume-gate-worker")
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
        .filter(|h| !h.is_empty())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_worker_never_acts_while_the_leader_lives() {
    let _s = common::serial();
    let _timed = Timed::start("a_second_worker_never_acts_while_the_leader_lives");
    let env = env();
    let admin = env.cp.management_client().await;
    let leader = eventually("a Lease holder", Duration::from_secs(30), || async {
        lease_holder(&admin)
            .await
            .ok_or_else(|| "no holder".to_string())
    })
    .await;
    assert!(
        leader.starts_with("test-worker-"),
        "the fixture's worker leads: {leader}"
    );
    let leader_pid = gate().worker.as_ref().and_then(|w| w.pid());

    // The racer: the fixture's worker command line, its own admin port and identity.
    let racer_admin = free_port();
    let racer_log = env
        .cp
        .state
        .join("logs")
        .join(format!("volume-gate-{}.log", env.cp.unique("racer")));
    let mut cmd = Command::new(binary());
    cmd.arg("worker")
        .arg(format!("--admin-listen=127.0.0.1:{racer_admin}"))
        .args(common::gate::test_worker_args())
        .arg("--identity=racer")
        .env(
            "KUBECONFIG",
            env.cp
                .state
                .join(format!("sa-{NAMESPACE}-{WORKER_SA}.kubeconfig")),
        )
        .env("POD_NAMESPACE", NAMESPACE)
        .env("RUST_LOG", "info");
    let racer = Process::start("racer", cmd, racer_log);
    eventually(
        "the racer is up and waiting for the Lease",
        Duration::from_secs(60),
        || async {
            assert!(racer.alive(), "the racer exited: {}", racer.log_text());
            let ready = matches!(http_get(racer_admin, "/readyz").await, Ok((200, _)));
            if ready && racer.log_text().contains("waiting to lead") {
                Ok(())
            } else {
                Err(racer.log_text())
            }
        },
    )
    .await;

    // Watch the Lease for the whole deletion.
    let stop = Arc::new(AtomicBool::new(false));
    let seen: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
    let watcher = {
        let (stop, seen, admin) = (stop.clone(), seen.clone(), admin.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let h = lease_holder(&admin).await;
                seen.lock().unwrap().push(h);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };

    let t = Tenant::create(env.cp, &env.cp.unique("race")).await;
    t.wait_custody().await;
    t.tenant_namespace("apps").await;
    for c in ["a", "b"] {
        t.claim("apps", c, STORAGE_CLASS).await;
    }
    t.pod("apps", "holder", &["a", "b"]).await;
    t.wait_settled(2, 1).await;
    t.delete_parent().await;
    t.wait_parent_gone(Duration::from_secs(180)).await;
    assert!(
        env.sim.volumes_of(&t.namespace, &t.name).is_empty(),
        "the tenant was fully released"
    );

    stop.store(true, Ordering::SeqCst);
    watcher.await.unwrap();
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.len() >= 10,
        "the Lease was sampled throughout: {} samples",
        seen.len()
    );
    let holders: BTreeSet<Option<String>> = seen.iter().cloned().collect();
    assert_eq!(
        holders,
        BTreeSet::from([Some(leader.clone())]),
        "exactly one holder, the first worker, all along"
    );

    assert!(
        racer.alive(),
        "the racer stayed up on standby: {}",
        racer.log_text()
    );
    let log = racer.log_text();
    assert!(
        !log.contains("leading: starting the controller"),
        "the racer never led:\n{log}"
    );
    for needle in [
        t.name.as_str(),
        "custody ended",
        "InventoryTaken",
        "ReleaseStarted",
        "claims and holding pods deleted",
        "reconcile",
    ] {
        assert!(
            !log.contains(needle),
            "the racer never acted ({needle:?} in its log):\n{log}"
        );
    }
    let leader_log = gate().worker_log();
    assert!(
        leader_log
            .lines()
            .any(|l| l.contains("custody ended") && l.contains(&t.name)),
        "the leader ended custody of {} itself",
        t.name
    );

    racer.kill(libc::SIGTERM);
    assert!(!racer.alive());
    assert_eq!(
        lease_holder(&admin).await.as_deref(),
        Some(leader.as_str()),
        "stopping the standby left the Lease alone"
    );
    let still = gate().worker.as_ref().map(|w| (w.alive(), w.pid()));
    assert_eq!(still, Some((true, leader_pid)), "the leader kept running");
}

// ---------------------------------------------------------------------------
// 5. The webhook killed under load
// ---------------------------------------------------------------------------

/// Starts a webhook as the fixture does: same port, admin port, certificates,
/// ServiceAccount kubeconfig and log.
fn start_webhook_like_the_fixture(
    cp: &common::cluster::ControlPlane,
    gate: &common::gate::Gate,
) -> Process {
    let mut cmd = Command::new(binary());
    cmd.arg("webhook")
        .arg(format!("--listen=127.0.0.1:{}", gate.webhook_port))
        .arg(format!("--admin-listen=127.0.0.1:{}", gate.webhook_admin))
        .arg("--tls-cert")
        .arg(gate.certs.join("tls.crt"))
        .arg("--tls-key")
        .arg(gate.certs.join("tls.key"))
        .arg("--cert-reload-interval=500ms")
        .env(
            "KUBECONFIG",
            cp.state
                .join(format!("sa-{NAMESPACE}-{WEBHOOK_SA}.kubeconfig")),
        )
        .env("RUST_LOG", "info");
    Process::start("webhook", cmd, gate.webhook.log.clone())
}

#[derive(Default, Debug)]
struct Attempts {
    succeeded: Vec<String>,
    refused: usize,
    webhook_down: usize,
    other: Vec<String>,
}

async fn delete_attempt(api: &Api<DynamicObject>, name: &str, what: &str, out: &Mutex<Attempts>) {
    let r = api.delete(name, &DeleteParams::default()).await;
    let mut a = out.lock().unwrap();
    match r {
        Ok(_) => a.succeeded.push(what.to_string()),
        Err(e) => {
            let m = e.to_string();
            if m.contains("volume-gate: refusing to delete") {
                a.refused += 1;
            } else if m.contains("failed calling webhook") {
                a.webhook_down += 1;
            } else {
                a.other.push(format!("{what}: {m}"));
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_killed_under_load_lets_nothing_through_and_a_restarted_one_refuses_again() {
    let _s = common::serial();
    let _timed = Timed::start(
        "a_webhook_killed_under_load_lets_nothing_through_and_a_restarted_one_refuses_again",
    );
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("wkill")).await;
    t.wait_custody().await;
    // Hold the tenant in teardown, not done: its API cannot be reached, and
    // it holds a disk no inventory names.
    common::tenant::unreleasable_disk(&t.management, &t.namespace, &t.name).await;
    t.point_kubeconfig_at("https://127.0.0.1:1").await;
    t.delete_parent().await;
    t.wait_phase(Phase::Blocked, Duration::from_secs(60)).await;

    let csi = format!("{}-csi", t.name);
    let hrs = t.hr_api();
    let kcps: Api<DynamicObject> =
        Api::namespaced_with(t.management.clone(), &t.namespace, &kcp_resource());
    let attempts: Arc<Mutex<Attempts>> = Arc::default();
    let load = {
        let (hrs, kcps, csi, name, attempts) = (
            hrs.clone(),
            kcps.clone(),
            csi.clone(),
            t.name.clone(),
            attempts.clone(),
        );
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut n = 0usize;
            while Instant::now() < deadline {
                delete_attempt(&hrs, &csi, "HelmRelease R-csi", &attempts).await;
                delete_attempt(&kcps, &name, "KamajiControlPlane R", &attempts).await;
                n += 2;
            }
            n
        })
    };
    eventually(
        "refusals while the webhook is up",
        Duration::from_secs(10),
        || async {
            let a = attempts.lock().unwrap();
            if a.refused >= 6 {
                Ok(())
            } else {
                Err(format!("{a:?}"))
            }
        },
    )
    .await;
    let old_pid = {
        let gate = gate();
        let pid = gate.webhook.pid();
        gate.webhook.kill(libc::SIGKILL);
        pid
    };
    let total = load.await.unwrap();
    let a = std::mem::take(&mut *attempts.lock().unwrap());
    assert!(
        a.succeeded.is_empty(),
        "DELETEs got through the gate: {:?} ({a:?})",
        a.succeeded
    );
    assert!(
        a.other.is_empty(),
        "every attempt was refused by the gate or failed closed: {:?}",
        a.other
    );
    assert!(
        a.refused >= 6 && a.webhook_down >= 1,
        "both refusals (up) and failures (down) were seen: {a:?}"
    );
    assert_eq!(a.refused + a.webhook_down, total);
    for (api, name) in [(&hrs, csi.as_str()), (&kcps, t.name.as_str())] {
        let o = api
            .get_opt(name)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{name} still exists"));
        assert!(
            o.metadata.deletion_timestamp.is_none(),
            "{name} was not marked for deletion"
        );
    }
    eprintln!(
        "webhook kill: {} attempts, {} refused, {} failed closed",
        total, a.refused, a.webhook_down
    );

    // A new webhook, started as the fixture starts it, refuses again.
    {
        let mut gate = gate();
        let fresh = start_webhook_like_the_fixture(env.cp, &gate);
        assert_ne!(fresh.pid(), old_pid);
        gate.webhook = fresh;
    }
    let admin_port = gate().webhook_admin;
    eventually(
        "restarted webhook /readyz",
        Duration::from_secs(60),
        || async {
            assert!(
                gate().webhook.alive(),
                "the restarted webhook exited: {}",
                gate().webhook_log()
            );
            match http_get(admin_port, "/readyz").await {
                Ok((200, _)) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let msg = eventually(
        "the restarted webhook refuses the CSI release delete",
        Duration::from_secs(30),
        || async {
            match hrs.delete(&csi, &DeleteParams::default()).await {
                Ok(_) => panic!("the CSI release delete was allowed after the restart"),
                Err(e) if e.to_string().contains("volume-gate: refusing to delete") => {
                    Ok(e.to_string())
                }
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await;
    assert!(
        msg.contains("CSI driver release")
            && msg.contains(&t.name)
            && msg.contains("kubectl annotate"),
        "{msg}"
    );
    let err = kcps
        .delete(&t.name, &DeleteParams::default())
        .await
        .expect_err("KamajiControlPlane delete refused");
    assert!(
        err.to_string().contains("volume-gate: refusing to delete"),
        "{err}"
    );

    // And the gate works end to end again: the tenant finishes once
    // reachable and its disk that no inventory names is gone.
    restore_kubeconfig(&t).await;
    common::tenant::delete_unreleasable_disk(&t.management, &t.namespace, &t.name).await;
    t.wait_parent_gone(Duration::from_secs(120)).await;
}

// ---------------------------------------------------------------------------
// 6. Certificate rotated under load
// ---------------------------------------------------------------------------

async fn served_leaf(port: u16, ca: &Path) -> Result<Vec<u8>, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(ca).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    // A full handshake every time: it shows the certificate served now.
    config.resumption = rustls::client::Resumption::disabled();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let tls = connector
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .map_err(|e| format!("TLS handshake: {e}"))?;
    let leaf = tls
        .get_ref()
        .1
        .peer_certificates()
        .ok_or("no peer certificate")?[0]
        .to_vec();
    Ok(leaf)
}

fn leaf_in(path: &Path) -> Vec<u8> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    CertificateDer::from_pem_file(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotating_the_serving_certificate_under_load_fails_no_admission() {
    let _s = common::serial();
    let _timed = Timed::start("rotating_the_serving_certificate_under_load_fails_no_admission");
    let env = env();
    let (port, certs) = {
        let gate = gate();
        (gate.webhook_port, gate.certs.clone())
    };
    let ns = env.cp.unique("rotation");
    env.cp.namespace(&ns).await;
    let api: Api<DynamicObject> = Api::namespaced_with(
        env.cp.management_client().await,
        &ns,
        &helmrelease_resource(),
    );
    let mut parent = DynamicObject::new("kubernetes-rotation", &helmrelease_resource());
    parent.metadata = ObjectMeta {
        name: Some("kubernetes-rotation".into()),
        labels: Some(BTreeMap::from([
            (
                "apps.cozystack.io/application.kind".to_string(),
                "Kubernetes".to_string(),
            ),
            (
                "apps.cozystack.io/application.group".to_string(),
                "apps.cozystack.io".to_string(),
            ),
            (
                "apps.cozystack.io/application.name".to_string(),
                "rotation".to_string(),
            ),
        ])),
        ..Default::default()
    };
    parent.data = json!({"spec": common::flux::inert_spec("kubernetes")});

    let old_leaf = leaf_in(&certs.join("tls.crt"));
    assert_eq!(
        served_leaf(port, &certs.join("ca.crt")).await.unwrap(),
        old_leaf,
        "the webhook serves tls.crt before the rotation"
    );

    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicUsize::new(0));
    let failures: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut streams = Vec::new();
    for _ in 0..2 {
        let (api, parent, stop, ok, failures) = (
            api.clone(),
            parent.clone(),
            stop.clone(),
            ok.clone(),
            failures.clone(),
        );
        streams.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                match api
                    .create(
                        &PostParams {
                            dry_run: true,
                            ..Default::default()
                        },
                        &parent,
                    )
                    .await
                {
                    Ok(o)
                        if o.metadata
                            .finalizers
                            .as_deref()
                            .unwrap_or_default()
                            .iter()
                            .any(|f| f == "volumes.cozystack.io/release") =>
                    {
                        ok.fetch_add(1, Ordering::SeqCst);
                    }
                    Ok(o) => failures
                        .lock()
                        .unwrap()
                        .push(format!("no custody finalizer: {:?}", o.metadata.finalizers)),
                    Err(e) => failures.lock().unwrap().push(e.to_string()),
                }
            }
        }));
    }
    eventually("the stream flows", Duration::from_secs(30), || async {
        let n = ok.load(Ordering::SeqCst);
        if n >= 20 {
            Ok(())
        } else {
            Err(format!(
                "{n} successes, failures {:?}",
                failures.lock().unwrap()
            ))
        }
    })
    .await;

    let out = Command::new(binary())
        .args([
            "certs",
            "generate",
            "--reuse-ca",
            "--san",
            "127.0.0.1",
            "--out",
        ])
        .arg(&certs)
        .output()
        .expect("run volume-gate certs generate --reuse-ca");
    assert!(
        out.status.success(),
        "certs generate --reuse-ca: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let new_leaf = leaf_in(&certs.join("tls.crt"));
    assert_ne!(new_leaf, old_leaf, "a new serving certificate was written");
    let rotated_at = Instant::now();
    eventually(
        "the webhook serves the new certificate",
        Duration::from_secs(30),
        || async {
            match served_leaf(port, &certs.join("ca.crt")).await {
                Ok(leaf) if leaf == new_leaf => Ok(()),
                Ok(_) => Err("still the old certificate".into()),
                Err(e) => Err(e),
            }
        },
    )
    .await;
    eprintln!(
        "new certificate served {:?} after the rotation",
        rotated_at.elapsed()
    );
    let at_switch = ok.load(Ordering::SeqCst);
    let switched = Instant::now();
    // Load continues across several more reload ticks (500 ms) of the webhook.
    eventually(
        "the stream keeps flowing after the switch",
        Duration::from_secs(30),
        || async {
            let n = ok.load(Ordering::SeqCst);
            if n >= at_switch + 30 && switched.elapsed() >= Duration::from_secs(2) {
                Ok(())
            } else {
                Err(format!("{} since the switch", n - at_switch))
            }
        },
    )
    .await;
    eprintln!(
        "rotation: {at_switch} admissions before the switch, {} after",
        ok.load(Ordering::SeqCst) - at_switch
    );
    stop.store(true, Ordering::SeqCst);
    for s in streams {
        s.await.unwrap();
    }
    let total = ok.load(Ordering::SeqCst);
    let failures = failures.lock().unwrap().clone();
    assert!(
        failures.is_empty(),
        "{} failed admissions across the rotation (of {}): {failures:?}",
        failures.len(),
        total + failures.len()
    );
    assert!(
        total >= 50,
        "at least 50 admissions across the rotation, got {total}"
    );
    assert!(gate().webhook.alive(), "the webhook was not restarted");
    assert!(
        gate()
            .webhook_log()
            .contains("serving certificate reloaded"),
        "the webhook reloaded, without a restart"
    );
    // The next connection shows it, with a fresh handshake.
    assert_eq!(
        served_leaf(port, &certs.join("ca.crt")).await.unwrap(),
        new_leaf
    );
}

// ---------------------------------------------------------------------------
// 7. Forged input through the real API server
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn override_stamps_come_from_the_requester_and_an_empty_reason_is_refused() {
    let _s = common::serial();
    let _timed =
        Timed::start("override_stamps_come_from_the_requester_and_an_empty_reason_is_refused");
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("stamps")).await;
    t.wait_custody().await;
    // Held in teardown: no API, and a disk no inventory names.
    common::tenant::unreleasable_disk(&t.management, &t.namespace, &t.name).await;
    t.point_kubeconfig_at("https://127.0.0.1:1").await;
    t.delete_parent().await;
    t.wait_phase(Phase::Blocked, Duration::from_secs(60)).await;

    t.grant_override("stamp-admins").await;
    let user = env.cp.unique("carol");
    let carol = env
        .cp
        .client_as(&user, &["stamp-admins", "system:authenticated"])
        .await;
    let api: Api<DynamicObject> =
        Api::namespaced_with(carol.clone(), &t.namespace, &helmrelease_resource());
    let key = |k: &str| format!("volumes.cozystack.io/{k}");

    // An empty (or blank) reason is refused, even from someone allowed.
    for reason in ["", "   "] {
        let err = t
            .annotate_override(&carol, reason)
            .await
            .expect_err("override without a reason refused");
        assert!(
            err.to_string().contains("needs a reason"),
            "{reason:?}: {err}"
        );
    }
    let annotations = t
        .parent()
        .await
        .unwrap()
        .metadata
        .annotations
        .unwrap_or_default();
    assert!(
        !annotations.contains_key(&key("override")),
        "nothing recorded: {annotations:?}"
    );

    // Forging the stamps in the same patch: the webhook writes its own.
    let forged = json!({"metadata": {"annotations": {
        key("override"): "tenant abandoned (ticket 7)",
        key("override-by"): "somebody-else",
        key("override-at"): "2001-01-01T00:00:00Z",
    }}});
    let before = jiff::Timestamp::now();
    api.patch(&t.name, &PatchParams::default(), &Patch::Merge(&forged))
        .await
        .expect("an authorized override is accepted");
    let annotations = t
        .parent()
        .await
        .unwrap()
        .metadata
        .annotations
        .unwrap_or_default();
    assert_eq!(
        annotations.get(&key("override-by")).map(String::as_str),
        Some(user.as_str()),
        "stamped from userInfo: {annotations:?}"
    );
    let at: jiff::Timestamp = annotations
        .get(&key("override-at"))
        .expect("override-at")
        .parse()
        .expect("RFC 3339");
    assert!(
        (at.as_second() - before.as_second()).abs() <= 60,
        "override-at is the time of the request, not the forged one: {at}"
    );

    let record = t
        .wait_phase(Phase::Overridden, Duration::from_secs(60))
        .await;
    assert_eq!(
        record.override_.and_then(|o| o.by).as_deref(),
        Some(user.as_str())
    );
    let message = record.message.unwrap_or_default();
    assert!(
        message.contains(&user) && !message.contains("somebody-else"),
        "{message}"
    );
    let note = t
        .wait_event("Warning", "Overridden", |note| note.contains(&user))
        .await;
    assert!(!note.contains("somebody-else"), "{note}");
    t.wait_parent_gone(Duration::from_secs(120)).await;
}
