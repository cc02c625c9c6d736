//! VolumeSnapshots in a tenant cluster: the snapshot API as Cozystack
//! installs it (the real CRDs of the external-snapshotter release the
//! simulator's sidecars are built from), a class of the tenant's driver, and
//! a snapshot taken and waited for.

use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use serde_json::{Value, json};

use super::{Tenant, resource};
use crate::wait::eventually;

/// The tenant's CSI driver (the simulator's `--driver`).
pub const DRIVER: &str = "csi.volume-gate.test";

/// The management storage's Retain VolumeSnapshotClass (the simulator's
/// `infraSnapshotClassRetain`).
pub const INFRA_RETAIN_CLASS: &str = "sim-infra-snapshots-retain";

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
    /// and makes three VolumeSnapshotClasses of the tenant's driver, none
    /// the default (as Cozystack's `kubevirt-snapshots`): `sim-snapshots`
    /// (deletionPolicy Delete), `sim-snapshots-retain` (Retain), and
    /// `sim-snapshots-infra-retain` (Delete, naming the management storage's
    /// Retain class by the KubeVirt driver's `infraSnapshotClassName`
    /// parameter: on that path its snapshots are kept in the management
    /// cluster).
    pub async fn install_snapshot_api(&self) {
        for crd in crate::sim::snapshot_crds() {
            crate::manifests::apply_file(&self.api, &crd).await;
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
        for (name, policy, infra) in [
            ("sim-snapshots", "Delete", None),
            ("sim-snapshots-retain", "Retain", None),
            (
                "sim-snapshots-infra-retain",
                "Delete",
                Some(INFRA_RETAIN_CLASS),
            ),
        ] {
            let mut class = json!({
                "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
                "metadata": {"name": name},
                "driver": DRIVER, "deletionPolicy": policy,
            });
            if let Some(infra) = infra {
                class["parameters"] = json!({"infraSnapshotClassName": infra});
            }
            crate::manifests::apply(&self.api, &class).await;
        }
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

    /// The snapshot API and its classes, claim `data` held by a Pod, and
    /// snapshot `apps/data-snap` of it in `class` taken; returns the
    /// name of the management VolumeSnapshot behind it (the KubeVirt
    /// driver's `snapshot-<tenant VolumeSnapshot UID>`).
    pub async fn with_snapshot(&self, class: &str) -> String {
        self.install_snapshot_api().await;
        self.with_held_claims(&["data"]).await;
        let taken = self.take_snapshot("apps", "data-snap", "data", class).await;
        format!("snapshot-{}", taken.uid)
    }

    /// Asserts that management VolumeSnapshot `name` is still there and not
    /// being deleted.
    pub async fn assert_infra_snapshot_kept(&self, name: &str) {
        let vs = self
            .infra_snapshots()
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("{name} is kept: {e}"));
        assert!(
            vs.metadata.deletion_timestamp.is_none(),
            "{name} is not being deleted: {:?}",
            vs.metadata
        );
    }

    /// The content bound to management VolumeSnapshot `name`: the object
    /// that holds the snapshot on the management storage.
    pub async fn infra_content_of(&self, name: &str) -> String {
        let vs = self
            .infra_snapshots()
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("the management VolumeSnapshot {name}: {e}"));
        vs.data
            .pointer("/status/boundVolumeSnapshotContentName")
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("{name} is bound: {:?}", vs.data.get("status")))
            .to_string()
    }

    /// The management cluster's VolumeSnapshotContents.
    pub fn infra_contents(&self) -> Api<DynamicObject> {
        Api::all_with(self.management.clone(), &content_resource())
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
