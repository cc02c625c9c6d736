//! The Helm chart (`manifests/chart/volume-gate`) rendered by the real
//! `helm` (built by `tests/helm/build.sh`) and the kustomize base by the
//! harness's `kubectl kustomize`, as documents keyed by kind, namespace and
//! name.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;

use serde_json::Value;

use super::cluster::{kubectl_binary, repo_root, run_build_script};

pub const CHART: &str = "manifests/chart/volume-gate";

/// (kind, namespace, name).
pub type Key = (String, String, String);

pub fn key(doc: &Value) -> Key {
    (
        doc["kind"].as_str().unwrap_or("").to_string(),
        doc["metadata"]["namespace"]
            .as_str()
            .unwrap_or("")
            .to_string(),
        doc["metadata"]["name"].as_str().unwrap_or("").to_string(),
    )
}

/// The `helm` CLI, built on first use into the harness cache.
pub fn helm_binary() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| run_build_script("tests/helm/build.sh"))
        .join("helm")
}

/// Runs `helm ARGS` with a home of its own (no user config, no repos).
pub fn helm(args: &[&str]) -> Output {
    let home = helm_home();
    std::fs::create_dir_all(&home).unwrap();
    Command::new(helm_binary())
        .args(args)
        .current_dir(repo_root())
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_DATA_HOME", home.join("data"))
        .output()
        .expect("run helm")
}

fn parse(yaml: &str) -> BTreeMap<Key, Value> {
    let docs: Vec<Value> = serde_saphyr::from_multiple(yaml).expect("rendered YAML");
    let mut out = BTreeMap::new();
    for d in docs.into_iter().filter(|d| !d.is_null()) {
        let k = key(&d);
        assert!(out.insert(k.clone(), d).is_none(), "{k:?} rendered twice");
    }
    out
}

/// `helm template volume-gate CHART -n NAMESPACE --set ...`: the documents,
/// or helm's error output.
pub fn try_template(namespace: &str, sets: &[&str]) -> Result<BTreeMap<Key, Value>, String> {
    let mut args = vec!["template", "volume-gate", CHART, "--namespace", namespace];
    for s in sets {
        args.extend(["--set", s]);
    }
    let out = helm(&args);
    if out.status.success() {
        Ok(parse(&String::from_utf8(out.stdout).unwrap()))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

pub fn template(namespace: &str, sets: &[&str]) -> BTreeMap<Key, Value> {
    try_template(namespace, sets).unwrap_or_else(|e| panic!("helm template {sets:?}: {e}"))
}

/// `kubectl kustomize DIR` with the kubectl built beside the harness.
pub fn kustomize(dir: &str) -> BTreeMap<Key, Value> {
    let out = Command::new(kubectl_binary())
        .arg("kustomize")
        .arg(repo_root().join(dir))
        .output()
        .expect("kubectl kustomize");
    assert!(
        out.status.success(),
        "kustomize {dir}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    parse(&String::from_utf8(out.stdout).unwrap())
}

/// The Helm home the tests use (see [`helm`]).
fn helm_home() -> PathBuf {
    super::scratch::dir("helm")
}

/// A Helm 4 post-renderer plugin, `point-at-local`, that does to the
/// chart's rendering what `manifests::point_at_local` does to the kustomize
/// base's: each webhook's `clientConfig.service` becomes a `url` on the
/// loopback address given as its argument (the API server here reaches no
/// Service: no ClusterIP routing, no cluster DNS), and in cert-manager mode
/// the serving Certificate also names `127.0.0.1`, so the API server can
/// verify it at that address. Everything else is the chart's.
pub fn install_point_at_local_plugin() -> &'static str {
    const NAME: &str = "point-at-local";
    let dir = helm_home().join("data/plugins").join(NAME);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("plugin.yaml"),
        format!(
            "apiVersion: v1\nname: {NAME}\nversion: 0.1.0\ntype: postrenderer/v1\nruntime: subprocess\n\
             runtimeConfig:\n  platformCommand:\n    - command: \"${{HELM_PLUGIN_DIR}}/rewrite.sh\"\n"
        ),
    )
    .unwrap();
    let script = dir.join("rewrite.sh");
    std::fs::write(
        &script,
        r#"#!/usr/bin/env bash
# stdin: the rendered manifests; $1: https://127.0.0.1:PORT
set -euo pipefail
base="${1:?base URL}"
# A `service:` block (name, namespace, path, port, one per line, deeper
# than `service:`) becomes `url:` at the same indentation; a certificate
# with `dnsNames` also names 127.0.0.1, the address the API server calls.
awk -v base="$base" '
  function indent(line) { match(line, /^ */); return RLENGTH }
  in_service && indent($0) > depth {
    if ($1 == "path:") path = $2
    next
  }
  in_service {
    printf "%*surl: \"%s%s\"\n", depth, "", base, path
    in_service = 0
  }
  /^ *service:$/ { in_service = 1; depth = indent($0); path = ""; next }
  /^ *dnsNames:$/ { printf "%*sipAddresses: [\"127.0.0.1\"]\n", indent($0), "" }
  { print }
  END { if (in_service) printf "%*surl: \"%s%s\"\n", depth, "", base, path }
'
"#,
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    NAME
}

/// Runs `helm ARGS`, which must succeed; its output.
pub fn helm_ok(what: &str, args: &[&str]) -> String {
    let out = helm(args);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "helm {what}: {text}");
    text
}

/// The worker's arguments as the chart's Deployment in `namespace` has
/// them, but for the admin address (loopback here); without the role.
pub async fn worker_args_of_the_deployment(client: &kube::Client, namespace: &str) -> Vec<String> {
    use k8s_openapi::api::apps::v1::Deployment;
    let d = kube::Api::<Deployment>::namespaced(client.clone(), namespace)
        .get("volume-gate-worker")
        .await
        .expect("the chart's worker Deployment");
    let args = d.spec.template.spec.unwrap().containers[0]
        .args
        .clone()
        .unwrap();
    assert_eq!(args[0], "worker");
    args.into_iter()
        .skip(1)
        .filter(|a| !a.starts_with("--admin-listen"))
        .collect()
}

/// `ValidatingWebhookConfiguration` or `MutatingWebhookConfiguration`.
pub fn webhook_configuration(kind: &str, plural: &str) -> kube::core::ApiResource {
    kube::core::ApiResource::from_gvk_with_plural(
        &kube::core::GroupVersionKind::gvk("admissionregistration.k8s.io", "v1", kind),
        plural,
    )
}

/// Both webhook configuration resources, `(kind, resource)`.
/// Every alert the chart's PrometheusRule renders, in its order (whatever
/// scrapes it: the shapes differ only in their expressions).
pub const ALERTS: [&str; 7] = [
    "VolumeGateTenantBlocked",
    "VolumeGateResidue",
    "VolumeGateWebhookUnavailable",
    "VolumeGateWorkerDown",
    "VolumeGateNoLeader",
    "VolumeGateCertificateExpiring",
    "VolumeGateReconcileErrors",
];

pub const WEBHOOK_CONFIGURATIONS: [(&str, &str); 2] = [
    (
        "ValidatingWebhookConfiguration",
        "validatingwebhookconfigurations",
    ),
    (
        "MutatingWebhookConfiguration",
        "mutatingwebhookconfigurations",
    ),
];

/// `helm VERB volume-gate CHART` into `namespace` of the management cluster
/// of `kubeconfig`, through the `point-at-local` post-renderer aimed at
/// `base` (`https://127.0.0.1:PORT`), then `extra`; must succeed.
pub fn helm_local(
    verb: &str,
    namespace: &str,
    kubeconfig: &std::path::Path,
    base: &str,
    extra: &[&str],
) -> String {
    let plugin = install_point_at_local_plugin();
    let kubeconfig = kubeconfig.to_str().expect("a UTF-8 kubeconfig path");
    let mut args = vec![
        verb,
        "volume-gate",
        CHART,
        "--namespace",
        namespace,
        "--kubeconfig",
        kubeconfig,
        "--post-renderer",
        plugin,
        "--post-renderer-args",
        base,
    ];
    args.extend_from_slice(extra);
    helm_ok(verb, &args)
}
