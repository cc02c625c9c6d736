//! Who may reach and act on the tenant: its admin kubeconfig Secret, and
//! overrides (recording one, and the RBAC that allows it).

use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DynamicObject, PostParams};
use serde_json::{Value, json};

use super::{Tenant, kubeconfig_data};
use crate::cluster::repo_root;
use crate::gate::helmrelease_resource;
use crate::manifests;
use crate::wait::eventually;

impl Tenant {
    /// Points the admin kubeconfig Secret at `server` (e.g. an address where
    /// nothing answers), keeping its credentials.
    pub async fn point_kubeconfig_at(&self, server: &str) {
        let text = std::fs::read_to_string(&self.cluster.kubeconfig).expect("tenant kubeconfig");
        let moved = text.replace(&self.cluster.server, server);
        assert_ne!(moved, text, "kubeconfig server replaced");
        let secrets: Api<Secret> = Api::namespaced(self.management.clone(), &self.namespace);
        let patch = json!({"data": kubeconfig_data(moved.as_bytes())});
        secrets
            .patch(
                &crate::profile().kubeconfig_secret_name(&self.name),
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .expect("patch kubeconfig Secret");
    }

    /// Records an override as `client`'s user: `kubectl annotate`.
    pub async fn annotate_override(
        &self,
        client: &kube::Client,
        reason: &str,
    ) -> Result<(), kube::Error> {
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), &self.namespace, &helmrelease_resource());
        let key = crate::keys().override_reason;
        let patch = json!({"metadata": {"annotations": {key: reason}}});
        api.patch(
            &self.name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .map(|_| ())
    }

    /// Grants `group` the override verb on this tenant's namespace, from the
    /// shipped example Role.
    pub async fn grant_override(&self, group: &str) {
        let path = repo_root().join("manifests/examples/override-role.yaml");
        let text = std::fs::read_to_string(&path).expect("override-role.yaml");
        let docs: Vec<Value> =
            serde_saphyr::from_multiple(&text).expect("parse override-role.yaml");
        for mut d in docs.into_iter().filter(|d| !d.is_null()) {
            d["metadata"]["namespace"] = json!(self.namespace);
            if d["kind"] == "RoleBinding" {
                d["subjects"][0]["name"] = json!(group);
            }
            manifests::apply(&self.management, &d).await;
        }
        wait_authorized(
            &self.management,
            group,
            &self.namespace,
            "helm.toolkit.fluxcd.io",
            "helmreleases",
            "patch",
        )
        .await;
        self.wait_override_authorized(group).await;
    }

    /// Waits until RBAC lets `group` use the override verb here.
    async fn wait_override_authorized(&self, group: &str) {
        let permission = crate::profile().override_permission;
        wait_authorized(
            &self.management,
            group,
            &self.namespace,
            &permission.group,
            &permission.resource,
            &permission.verb,
        )
        .await;
    }

    /// Grants `group` the override verb in every namespace, from the shipped
    /// example ClusterRole: what a tenant whose namespace is being deleted
    /// needs (a Role there goes with the namespace).
    pub async fn grant_override_everywhere(&self, group: &str) {
        let path = repo_root().join("manifests/examples/override-clusterrole.yaml");
        let text = std::fs::read_to_string(&path).expect("override-clusterrole.yaml");
        let docs: Vec<Value> =
            serde_saphyr::from_multiple(&text).expect("parse override-clusterrole.yaml");
        for mut d in docs.into_iter().filter(|d| !d.is_null()) {
            if d["kind"] == "ClusterRoleBinding" {
                d["subjects"][0]["name"] = json!(group);
            }
            manifests::apply(&self.management, &d).await;
        }
        self.wait_override_authorized(group).await;
    }
}

/// RBAC reaches the API server's authorizer through an informer: waits until
/// a SubjectAccessReview for a member of `group` is allowed.
pub async fn wait_authorized(
    client: &kube::Client,
    group: &str,
    namespace: &str,
    api_group: &str,
    resource: &str,
    verb: &str,
) {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
    };
    let api: Api<SubjectAccessReview> = Api::all(client.clone());
    let sar = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some("rbac-probe".into()),
            groups: Some(vec![group.to_string(), "system:authenticated".into()]),
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(namespace.into()),
                group: Some(api_group.into()),
                resource: Some(resource.into()),
                verb: Some(verb.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    eventually(
        &format!("group {group} may {verb} {resource}.{api_group} in {namespace}"),
        Duration::from_secs(30),
        || {
            let (api, sar) = (api.clone(), sar.clone());
            async move {
                let r = api
                    .create(&PostParams::default(), &sar)
                    .await
                    .map_err(|e| e.to_string())?;
                if r.status.is_some_and(|s| s.allowed) {
                    Ok(())
                } else {
                    Err("not yet".into())
                }
            }
        },
    )
    .await
}
