//! The namespace editor the attacks are tried as (`docs/reliability.md`).

use serde_json::json;

use super::cluster::ControlPlane;

pub const MALLORY: &str = "mallory";

/// The namespace editor: Kubernetes' `edit` on what a tenant namespace
/// holds (releases and their status, Secrets, ConfigMaps, ServiceAccounts,
/// PVCs, Deployments and their scale, Kamaji, Cluster API and CDI objects),
/// without the override verb.
pub async fn mallory(cp: &ControlPlane, namespaces: &[&str]) -> kube::Client {
    let admin = cp.management_client().await;
    for ns in namespaces {
        let role = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "namespace-editors", "namespace": ns},
        "rules": [
            {"apiGroups": ["helm.toolkit.fluxcd.io"], "resources": ["helmreleases", "helmreleases/status"], "verbs": ["*"]},
            {"apiGroups": [""], "resources": ["secrets", "configmaps", "serviceaccounts", "persistentvolumeclaims"], "verbs": ["*"]},
            {"apiGroups": ["apps"], "resources": ["deployments", "deployments/scale"], "verbs": ["*"]},
            {"apiGroups": ["kamaji.clastix.io", "controlplane.cluster.x-k8s.io", "cluster.x-k8s.io", "cdi.kubevirt.io"],
             "resources": ["*"], "verbs": ["*"]},
        ]});
        let binding = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "namespace-editors", "namespace": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "namespace-editors"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "attackers"}]});
        super::manifests::apply(&admin, &role).await;
        super::manifests::apply(&admin, &binding).await;
        for (group, res) in [
            ("helm.toolkit.fluxcd.io", "helmreleases/status"),
            ("", "configmaps"),
            ("apps", "deployments/scale"),
            ("cdi.kubevirt.io", "datavolumes"),
        ] {
            super::tenant::wait_authorized(&admin, "attackers", ns, group, res, "patch").await;
        }
    }
    cp.client_as(MALLORY, &["attackers", "system:authenticated"])
        .await
}
