//! VolumeSnapshots in a tenant cluster: the snapshot API as Cozystack
//! installs it (the real CRDs of the external-snapshotter release the
//! simulator's sidecars are built from), a class of the tenant's driver, and
//! a snapshot taken and waited for.

use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use serde_json::{Value, json};

use super::{Tenant, resource};
use crate::common::wait::eventually;

/// The tenant's CSI driver (the simulator's `--driver`).
pub const DRIVER: &str = "csi.volume-gate.test";

pub const SNAPSHOT_GROUP: &str = "snapshot.storage.k8s.io";

pub fn snapshot_resource() -> ApiResource {
    resource(SNAPSHOT_GROUP, "v1", "VolumeSnapshot", "volumesnapshots")
}

pub fn content_resource() -> ApiResource {
    resource(
        SNAPSHOT_GROUP,
        "v1",
        "VolumeSnapshotContent",
        "volumesnapshotcontents",
    )
}

/// A snapshot taken: its UID and the content bound to it.
pub struct Taken {
    pub uid: String,
    pub content: String,
}

impl Tenant {
    /// Installs the snapshot CRDs in the tenant cluster (as Cozystack's
    /// vsnap-crd release does), waits until the three resources are served,
    /// and makes VolumeSnapshotClass `class` of the tenant's driver,
    /// deletionPolicy Delete, not the default (as Cozystack's
    /// `kubevirt-snapshots`).
    pub async fn install_snapshot_api(&self, class: &str) {
        for crd in crate::common::sim::snapshot_crds() {
            crate::common::manifests::apply_file(&self.api, &crd).await;
        }
        eventually(
            "snapshot.storage.k8s.io/v1 served by the tenant API",
            Duration::from_secs(30),
            || async {
                let list = self
                    .api
                    .list_api_group_resources("snapshot.storage.k8s.io/v1")
                    .await
                    .map_err(|e| e.to_string())?;
                let names: Vec<&str> = list.resources.iter().map(|r| r.name.as_str()).collect();
                if [
                    "volumesnapshots",
                    "volumesnapshotcontents",
                    "volumesnapshotclasses",
                ]
                .iter()
                .all(|n| names.contains(n))
                {
                    Ok(())
                } else {
                    Err(format!("{names:?}"))
                }
            },
        )
        .await;
        let class = json!({
            "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
            "metadata": {"name": class},
            "driver": DRIVER, "deletionPolicy": "Delete",
        });
        crate::common::manifests::apply(&self.api, &class).await;
    }

    /// Creates VolumeSnapshot `ns/name` of claim `claim` in class `class`
    /// and waits until it is ready and bound to a content.
    pub async fn take_snapshot(&self, ns: &str, name: &str, claim: &str, class: &str) -> Taken {
        let snapshots: Api<DynamicObject> =
            Api::namespaced_with(self.api.clone(), ns, &snapshot_resource());
        let mut vs = DynamicObject::new(name, &snapshot_resource()).within(ns);
        vs.data = json!({"spec": {"volumeSnapshotClassName": class, "source": {"persistentVolumeClaimName": claim}}});
        let vs = snapshots
            .create(&PostParams::default(), &vs)
            .await
            .expect("create VolumeSnapshot");
        let uid = vs.metadata.uid.clone().expect("uid");
        let content = eventually(
            "VolumeSnapshot ready and bound",
            Duration::from_secs(90),
            || {
                let snapshots = snapshots.clone();
                async move {
                    let vs = snapshots.get(name).await.map_err(|e| e.to_string())?;
                    let ready = vs
                        .data
                        .pointer("/status/readyToUse")
                        .and_then(Value::as_bool)
                        == Some(true);
                    match vs
                        .data
                        .pointer("/status/boundVolumeSnapshotContentName")
                        .and_then(Value::as_str)
                    {
                        Some(c) if ready => Ok(c.to_string()),
                        _ => Err(format!("status {:?}", vs.data.get("status"))),
                    }
                }
            },
        )
        .await;
        Taken { uid, content }
    }

    /// The management cluster's VolumeSnapshots in the tenant's namespace.
    pub fn infra_snapshots(&self) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.management.clone(),
            &self.namespace,
            &snapshot_resource(),
        )
    }
}
