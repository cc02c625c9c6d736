//! What reaches a tenant's API server under Cozystack's own network
//! policies (issue 40): the worker frees a tenant's volumes through the
//! tenant's API server, which runs as Pods in the tenant's namespace, and
//! the tenant application's Cilium policies decide who may connect to
//! them. Cilium does not run on this machine, so no packet is filtered
//! here: the policies are rendered from Cozystack's own tenant chart
//! (v1.6.1's module, `tests/cozystack/build.sh`; the file is the same at
//! v1.6.2) by the real `helm`, and their ingress rules are evaluated, as
//! Cilium evaluates an endpoint selector, for the worker's Pod in the
//! namespace each documented install creates (the README's commands, the
//! kustomize base, Cozystack's Package operator).

use volume_gate_testkit as common;

use std::collections::BTreeMap;

use serde_json::Value;

/// A Pod's identity as Cilium sees it: its namespace, that namespace's
/// labels, and its own labels.
struct Endpoint {
    namespace: String,
    namespace_labels: BTreeMap<String, String>,
}

/// Whether an `endpointSelector`'s `matchLabels` select `e`. Cilium
/// writes a namespace's labels as `k8s:io.cilium.k8s.namespace.labels.<key>`
/// and the namespace as `k8s:io.kubernetes.pod.namespace`; any other key
/// is a label of the Pod, which the worker's selectors here never name.
fn selects(match_labels: &serde_json::Map<String, Value>, e: &Endpoint) -> bool {
    match_labels.iter().all(|(k, v)| {
        let v = v.as_str().unwrap_or_default();
        let k = k.strip_prefix("k8s:").unwrap_or(k);
        if let Some(label) = k.strip_prefix("io.cilium.k8s.namespace.labels.") {
            e.namespace_labels.get(label).map(String::as_str) == Some(v)
        } else if k == "io.kubernetes.pod.namespace" {
            e.namespace == v
        } else {
            false
        }
    })
}

/// Whether an ingress rule admits `e`: one of its `fromEndpoints`
/// selectors selects it, or it admits the `cluster` entity (every endpoint
/// of the cluster).
fn admits(rule: &Value, e: &Endpoint) -> bool {
    let from_cluster = rule["fromEntities"]
        .as_array()
        .is_some_and(|a| a.iter().any(|x| x == "cluster"));
    let by_selector = rule["fromEndpoints"].as_array().is_some_and(|a| {
        a.iter()
            .any(|s| s["matchLabels"].as_object().is_some_and(|m| selects(m, e)))
    });
    from_cluster || by_selector
}

/// The policy named `name` of the rendered tenant chart.
fn policy<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("{kind} {name} not rendered"))
}

/// Cozystack's tenant chart rendered as the tenant `tenant-<name>` under
/// `tenant-root`, its policies among the documents.
fn tenant_policies(name: &str) -> Vec<Value> {
    let chart = common::cozystack::controller_dir().join("charts/tenant");
    let out = common::chart::helm(&[
        "template",
        &format!("tenant-{name}"),
        chart.to_str().unwrap(),
        "--namespace",
        "tenant-root",
        "--set-string",
        "_cluster.oidc-enabled=false",
    ]);
    assert!(
        out.status.success(),
        "helm template of Cozystack's tenant chart: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_saphyr::from_multiple::<Value>(&String::from_utf8(out.stdout).unwrap())
        .unwrap()
        .into_iter()
        .filter(|d| !d.is_null())
        .collect()
}

/// The labels the README's install gives the namespace it creates: every
/// `kubectl label namespace volume-gate K=V` in its install block.
fn readme_namespace_labels() -> BTreeMap<String, String> {
    let readme = std::fs::read_to_string(common::cluster::repo_root().join("README.md")).unwrap();
    let mut labels = BTreeMap::new();
    for line in readme.lines() {
        if let Some(rest) = line
            .trim()
            .strip_prefix("kubectl label namespace volume-gate ")
        {
            for kv in rest.split_whitespace().take_while(|w| !w.starts_with('#')) {
                if let Some((k, v)) = kv.split_once('=') {
                    labels.insert(k.to_string(), v.to_string());
                }
            }
        }
    }
    labels
}

/// The kustomize base's Namespace labels.
fn base_namespace_labels() -> BTreeMap<String, String> {
    let docs = common::chart::kustomize("manifests");
    let ns = &docs[&("Namespace".into(), String::new(), "volume-gate".into())];
    serde_json::from_value(ns["metadata"]["labels"].clone()).unwrap()
}

#[test]
fn every_documented_install_reaches_a_tenant_api_under_the_tenants_own_network_policy() {
    let tenant = "tenant-netcheck";
    let docs = tenant_policies("netcheck");
    // The tenant namespace's Pods are selected by `<tenant>-ingress`: it
    // admits the API server, kube-system, parent tenants, and namespaces
    // labelled cozystack.io/system=true.
    let ingress = policy(
        &docs,
        "CiliumClusterwideNetworkPolicy",
        &format!("{tenant}-ingress"),
    );
    assert_eq!(
        ingress["spec"]["endpointSelector"]["matchLabels"]["k8s:io.kubernetes.pod.namespace"],
        tenant
    );
    let rules = ingress["spec"]["ingress"].as_array().unwrap();
    let admitted_by_ingress = |e: &Endpoint| rules.iter().any(|r| admits(r, e));
    let label = common::cozystack::SYSTEM_NAMESPACE_LABEL;
    let installs = [
        (
            "the README's install",
            "volume-gate",
            readme_namespace_labels(),
        ),
        ("the kustomize base", "volume-gate", base_namespace_labels()),
        (
            // internal/operator/package_reconciler.go reconcileNamespaces:
            // every Package namespace not named tenant-* gets the label.
            "a Cozystack Package (docs/install.md)",
            "cozy-volume-gate",
            BTreeMap::from([(label.to_string(), "true".to_string())]),
        ),
    ];
    for (install, namespace, labels) in installs {
        assert_eq!(
            labels.get(label).map(String::as_str),
            Some("true"),
            "{install} labels its namespace {label}=true: {labels:?}"
        );
        let worker = Endpoint {
            namespace: namespace.into(),
            namespace_labels: labels,
        };
        assert!(
            admitted_by_ingress(&worker),
            "{install}: {tenant}-ingress does not admit the worker in {namespace}"
        );
    }
    // Without the label, that policy admits no one of an unlabelled
    // namespace: the label is what it admits the worker by.
    let unlabelled = Endpoint {
        namespace: "volume-gate".into(),
        namespace_labels: BTreeMap::new(),
    };
    assert!(!admitted_by_ingress(&unlabelled));
    // Policies add up, and the tenant chart also admits every endpoint of
    // the cluster into its namespace (`allow-external-communication`:
    // `fromEntities: [world, cluster]`), so an unlabelled namespace is
    // admitted too as Cozystack ships it (docs/install.md says so); the
    // label keeps the worker admitted by `<tenant>-ingress` alone.
    let external = policy(&docs, "CiliumNetworkPolicy", "allow-external-communication");
    assert_eq!(external["metadata"]["namespace"], tenant);
    assert!(
        external["spec"]["ingress"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| admits(r, &unlabelled)),
        "Cozystack's tenant chart no longer admits the whole cluster: the label is then the only way in"
    );
}
