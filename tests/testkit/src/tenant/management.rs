//! The tenant on the management cluster beyond its releases: the disks
//! behind its volumes (the infra layer, and those the worker keeps), its
//! namespace, and parents with nothing behind them that hold a teardown.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use serde_json::json;

use super::{Tenant, datavolume_resource};
use crate::wait::eventually;

/// The tenant's objects on the management side of its volumes (the infra
/// layer): DataVolumes and PVCs labelled for it in its namespace, and the
/// management PVs bound to those PVCs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InfraObjects {
    pub datavolumes: Vec<String>,
    pub claims: Vec<String>,
    pub volumes: Vec<String>,
}

impl InfraObjects {
    pub fn is_empty(&self) -> bool {
        self.datavolumes.is_empty() && self.claims.is_empty() && self.volumes.is_empty()
    }
}

impl Tenant {
    /// The DataVolumes in the tenant's namespace of the management cluster.
    pub fn datavolumes(&self) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.management.clone(),
            &self.namespace,
            &datavolume_resource(),
        )
    }

    /// What the management cluster holds of the tenant's disks now; with
    /// `also`, the objects of that earlier look too (labels can be removed,
    /// a PV outlives its claim).
    pub async fn infra_objects(&self, also: Option<&InfraObjects>) -> InfraObjects {
        let dvs = self
            .datavolumes()
            .list_metadata(&ListParams::default())
            .await
            .expect("list DataVolumes")
            .items;
        let labelled = |labels: &Option<BTreeMap<String, String>>| {
            labels
                .as_ref()
                .and_then(|l| l.get("cluster.x-k8s.io/cluster-name"))
                .is_some_and(|v| v == &self.name)
        };
        let earlier = also.cloned().unwrap_or_default();
        let mut out = InfraObjects::default();
        for d in dvs {
            let name = d.metadata.name.clone().unwrap_or_default();
            if labelled(&d.metadata.labels) || earlier.datavolumes.contains(&name) {
                out.datavolumes.push(name);
            }
        }
        let pvcs: Api<PersistentVolumeClaim> =
            Api::namespaced(self.management.clone(), &self.namespace);
        for c in pvcs
            .list(&ListParams::default())
            .await
            .expect("list PVCs")
            .items
        {
            let name = c.metadata.name.clone().unwrap_or_default();
            if labelled(&c.metadata.labels) || earlier.claims.contains(&name) {
                out.claims.push(name);
            }
        }
        let pvs: Api<PersistentVolume> = Api::all(self.management.clone());
        for pv in pvs
            .list(&ListParams::default())
            .await
            .expect("list PVs")
            .items
        {
            let name = pv.metadata.name.clone().unwrap_or_default();
            let claim = pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref());
            let ours = claim.is_some_and(|r| {
                r.namespace.as_deref() == Some(self.namespace.as_str())
                    && r.name.as_ref().is_some_and(|n| out.claims.contains(n))
            });
            if ours || earlier.volumes.contains(&name) {
                out.volumes.push(name);
            }
        }
        out
    }

    /// The management PVs the worker keeps for this tenant: found as an
    /// operator finds them (README), by the `kept-namespace` label.
    pub async fn kept_disks(&self) -> Vec<PersistentVolume> {
        let keys = crate::keys();
        Api::<PersistentVolume>::all(self.management.clone())
            .list(
                &ListParams::default()
                    .labels(&format!("{}={}", keys.kept_namespace, self.namespace)),
            )
            .await
            .expect("list kept PVs")
            .items
    }

    /// Deletes the tenant's namespace in the management cluster.
    pub async fn delete_namespace(&self) {
        let namespaces: Api<Namespace> = Api::all(self.management.clone());
        namespaces
            .delete(&self.namespace, &DeleteParams::default())
            .await
            .expect("delete the tenant namespace");
    }

    /// Waits until the tenant's namespace is gone (see [`wait_namespace_gone`]).
    pub async fn wait_namespace_gone(&self, timeout: Duration) {
        wait_namespace_gone(&self.management, &self.namespace, timeout).await
    }
}

/// Waits until namespace `namespace` is gone, saying what the namespace
/// controller reports left if it does not go.
pub async fn wait_namespace_gone(management: &kube::Client, namespace: &str, timeout: Duration) {
    let namespaces: Api<Namespace> = Api::all(management.clone());
    eventually(&format!("namespace {namespace} gone"), timeout, || {
        let namespaces = namespaces.clone();
        async move {
            match namespaces
                .get_opt(namespace)
                .await
                .map_err(|e| e.to_string())?
            {
                None => Ok(()),
                Some(n) => Err(format!(
                    "terminating: {:?}",
                    n.status
                        .and_then(|s| s.conditions)
                        .unwrap_or_default()
                        .iter()
                        .map(|c| c.message.clone().unwrap_or_default())
                        .collect::<Vec<_>>()
                )),
            }
        }
    })
    .await
}

/// A disk of tenant `r` that no inventory names: a DataVolume labelled for it
/// in namespace `ns` of the management cluster. A tenant with no API behind
/// it and such a disk is never released by the worker (with no inventory,
/// the disk's reclaim policy is unknown; docs/design.md §5b): tests use it
/// to hold a parent with nothing else behind it in teardown. (With no disk
/// at all, the worker would release it at once.)
pub async fn unreleasable_disk(client: &kube::Client, ns: &str, r: &str) {
    let dvs: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &datavolume_resource());
    let disk = json!({"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
        "metadata": {"name": format!("{r}-disk"), "labels": {"cluster.x-k8s.io/cluster-name": r}},
        "spec": {"source": {"blank": {}}, "storage": {"resources": {"requests": {"storage": "1Gi"}}}}});
    dvs.create(
        &PostParams::default(),
        &serde_json::from_value(disk).unwrap(),
    )
    .await
    .expect("create the tenant's unreleasable DataVolume");
}

/// Deletes the disk [`unreleasable_disk`] made, so the tenant can be released.
pub async fn delete_unreleasable_disk(client: &kube::Client, ns: &str, r: &str) {
    let dvs: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &datavolume_resource());
    dvs.delete(&format!("{r}-disk"), &DeleteParams::default())
        .await
        .expect("delete the tenant's unreleasable DataVolume");
}

/// A parent release `r` with Cozystack's labels and nothing behind it (its
/// spec suspended: no chart runs), taken into custody at creation by the
/// mutating webhook.
pub async fn bare_parent(hrs: &Api<DynamicObject>, r: &str) {
    let profile = crate::profile();
    let parent = json!({"apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
        "metadata": {"name": r, "labels": profile.parent.match_labels},
        "spec": crate::flux::inert_spec("kubernetes")});
    let created = hrs
        .create(
            &PostParams::default(),
            &serde_json::from_value(parent).unwrap(),
        )
        .await
        .expect("create parent");
    assert!(
        created
            .metadata
            .finalizers
            .unwrap_or_default()
            .contains(&profile.custody_finalizer),
        "the mutating webhook put {r} in custody at creation"
    );
}

/// A parent release in custody with no tenant API behind it, only a disk
/// no inventory names ([`unreleasable_disk`]): the worker never releases
/// it, so once deleted it stays in teardown, not done.
pub async fn paper_parent(hrs: &Api<DynamicObject>, r: &str) {
    let ns = hrs.namespace().expect("namespaced").to_string();
    unreleasable_disk(&hrs.clone().into_client(), &ns, r).await;
    bare_parent(hrs, r).await;
}
