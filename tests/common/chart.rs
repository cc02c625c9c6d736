//! The Helm chart (`manifests/chart/volume-gate`) rendered by the real
//! `helm` (built by `tests/helm/build.sh`) and the kustomize base by the
//! harness's `kubectl kustomize`, as documents keyed by kind, namespace and
//! name.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;

use serde_json::Value;

use super::cluster::{harness_binary, repo_root, run_build_script};

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
    let home = std::env::temp_dir().join(format!("volume-gate-helm-{}", std::process::id()));
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

/// `kubectl kustomize DIR` with the harness's kubectl.
pub fn kustomize(dir: &str) -> BTreeMap<Key, Value> {
    let out = Command::new(harness_binary())
        .args(["kubectl", "kustomize"])
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
