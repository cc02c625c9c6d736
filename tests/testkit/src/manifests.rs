//! The shipped `manifests/`, read as the kustomize base lists them, and
//! applied to the real API server so RBAC and webhook configuration are
//! tested as shipped.

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::Scope;
use serde_json::Value;

use super::cluster::repo_root;

/// Every document of the base, in kustomization order.
pub fn base_documents() -> Vec<Value> {
    let dir = repo_root().join("manifests/base");
    let k: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(dir.join("kustomization.yaml")).unwrap())
            .unwrap();
    let mut docs = Vec::new();
    for r in k["resources"].as_array().expect("resources") {
        let path = dir.join(r.as_str().unwrap());
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let parsed: Vec<Value> = serde_saphyr::from_multiple(&text)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        docs.extend(parsed.into_iter().filter(|d| !d.is_null()));
    }
    docs
}

pub fn kind_of(doc: &Value) -> &str {
    doc["kind"].as_str().unwrap_or("")
}

/// What the control-plane tests run as local processes instead of Pods.
pub fn is_workload(doc: &Value) -> bool {
    matches!(
        kind_of(doc),
        "Deployment" | "Service" | "PodDisruptionBudget"
    )
}

pub fn is_webhook_configuration(doc: &Value) -> bool {
    matches!(
        kind_of(doc),
        "ValidatingWebhookConfiguration" | "MutatingWebhookConfiguration"
    )
}

/// The one change the tests make to the shipped webhook configurations:
/// the API server reaches the webhook at `base_url` (a local process)
/// instead of through the Service, and trusts `ca_bundle_b64`.
pub fn point_at_local(doc: &Value, base_url: &str, ca_bundle_b64: &str) -> Value {
    let mut doc = doc.clone();
    for hook in doc["webhooks"].as_array_mut().expect("webhooks") {
        let path = hook["clientConfig"]["service"]["path"]
            .as_str()
            .expect("service path")
            .to_string();
        hook["clientConfig"] =
            serde_json::json!({"url": format!("{base_url}{path}"), "caBundle": ca_bundle_b64});
    }
    doc
}

/// Server-side applies one document.
pub async fn apply(client: &kube::Client, doc: &Value) {
    let api_version = doc["apiVersion"].as_str().expect("apiVersion");
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let gvk = GroupVersionKind::gvk(group, version, kind_of(doc));
    let (ar, caps) = kube::discovery::pinned_kind(client, &gvk)
        .await
        .unwrap_or_else(|e| panic!("discover {gvk:?}: {e}"));
    let name = doc["metadata"]["name"].as_str().expect("name");
    let api: Api<DynamicObject> = match caps.scope {
        Scope::Namespaced => Api::namespaced_with(
            client.clone(),
            doc["metadata"]["namespace"].as_str().unwrap_or("default"),
            &ar,
        ),
        Scope::Cluster => Api::all_with(client.clone(), &ar),
    };
    api.patch(
        name,
        &PatchParams::apply("volume-gate-tests").force(),
        &Patch::Apply(doc),
    )
    .await
    .unwrap_or_else(|e| panic!("apply {} {name}: {e}", kind_of(doc)));
}

/// Applies every document of a multi-document YAML file.
pub async fn apply_file(client: &kube::Client, path: &std::path::Path) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    for d in docs.iter().filter(|d| !d.is_null()) {
        apply(client, d).await;
    }
}
