//! Steps 4 and 5 in the tenant cluster: stop new claims, delete every claim
//! and the Pods holding them, delete the snapshots. Each is idempotent: a
//! pass resumed after a crash finds them being deleted or gone.

use std::collections::{BTreeSet, HashSet};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{
    Namespace, PersistentVolume, PersistentVolumeClaim, Pod, ResourceQuota, ResourceQuotaSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, ObjectMeta, PostParams,
};
use kube::core::GroupVersionKind;

use super::claims::{self, ClaimKey};

/// Name of the quota that stops new claims in a tenant being released.
pub const FREEZE_QUOTA: &str = "volume-gate-freeze";

/// Every PV of the tenant cluster, as it is now.
pub(super) async fn list_pvs(tc: &kube::Client) -> Result<Vec<PersistentVolume>, kube::Error> {
    Ok(Api::<PersistentVolume>::all(tc.clone())
        .list(&ListParams::default())
        .await?
        .items)
}

/// A quota of zero claims in every namespace: a StatefulSet or an ephemeral
/// volume cannot bring a claim back (and with it a new disk) while the
/// tenant's volumes are released. The tenant is being deleted anyway.
pub(super) async fn freeze_claims(tc: &kube::Client) -> Result<(), kube::Error> {
    let namespaces = Api::<Namespace>::all(tc.clone())
        .list_metadata(&ListParams::default())
        .await?;
    for ns in namespaces.items {
        let Some(name) = ns.metadata.name else {
            continue;
        };
        if ns.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let quota = ResourceQuota {
            metadata: ObjectMeta {
                name: Some(FREEZE_QUOTA.into()),
                labels: Some(
                    [(
                        "app.kubernetes.io/managed-by".to_string(),
                        "volume-gate".to_string(),
                    )]
                    .into(),
                ),
                ..Default::default()
            },
            spec: Some(ResourceQuotaSpec {
                hard: Some([("persistentvolumeclaims".to_string(), Quantity("0".into()))].into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        match Api::<ResourceQuota>::namespaced(tc.clone(), &name)
            .create(&PostParams::default(), &quota)
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            // A namespace that started terminating meanwhile takes no new objects.
            Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains("being terminated") => {
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Deletes every claim (one deletecollection per namespace); returns them.
pub(super) async fn delete_claims(tc: &kube::Client) -> Result<HashSet<ClaimKey>, kube::Error> {
    let list = Api::<PersistentVolumeClaim>::all(tc.clone())
        .list_metadata(&ListParams::default())
        .await?;
    let claims: HashSet<ClaimKey> = list
        .items
        .iter()
        .map(|c| {
            (
                c.metadata.namespace.clone().unwrap_or_default(),
                c.metadata.name.clone().unwrap_or_default(),
            )
        })
        .collect();
    let namespaces: BTreeSet<&str> = list
        .items
        .iter()
        .filter(|c| c.metadata.deletion_timestamp.is_none())
        .filter_map(|c| c.metadata.namespace.as_deref())
        .collect();
    for ns in namespaces {
        Api::<PersistentVolumeClaim>::namespaced(tc.clone(), ns)
            .delete_collection(&DeleteParams::background(), &ListParams::default())
            .await?;
    }
    Ok(claims)
}

/// Deletes the Pods that mount any of `claims`, matched in code; returns how many.
pub(super) async fn delete_holding_pods(
    tc: &kube::Client,
    claims: &HashSet<ClaimKey>,
) -> Result<usize, kube::Error> {
    if claims.is_empty() {
        return Ok(0);
    }
    let pods = Api::<Pod>::all(tc.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let alive: Vec<Pod> = pods
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();
    let holding = claims::pods_holding(&alive, claims);
    let count = holding.len();
    delete_pods(tc, holding, 16).await?;
    Ok(count)
}

/// Deletes the Pods `pods` (`namespace/name`) through `client`, `at_once`
/// at a time; a Pod already gone counts as deleted. The management side
/// frees the Pods that mount a dead tenant's disks with it too.
pub(super) async fn delete_pods(
    client: &kube::Client,
    pods: Vec<ClaimKey>,
    at_once: usize,
) -> Result<(), kube::Error> {
    futures::stream::iter(pods)
        .map(|(ns, name)| {
            let api = Api::<Pod>::namespaced(client.clone(), &ns);
            async move {
                match api.delete(&name, &DeleteParams::default()).await {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                    Err(e) => Err(e),
                }
            }
        })
        .buffer_unordered(at_once)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Deletes every VolumeSnapshot when the API exists; returns the contents to
/// wait for (those with deletionPolicy Delete). An absent API is skipped.
pub(super) async fn release_snapshots(
    tc: &kube::Client,
) -> Result<Option<(Api<DynamicObject>, HashSet<String>)>, kube::Error> {
    let group = match kube::discovery::group(tc, "snapshot.storage.k8s.io").await {
        Ok(g) => g,
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(None),
        Err(kube::Error::Discovery(_)) => return Ok(None),
        Err(e) => return Err(e),
    };
    let version = group.preferred_version_or_latest().to_string();
    let snap = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("snapshot.storage.k8s.io", &version, "VolumeSnapshot"),
        "volumesnapshots",
    );
    let content = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("snapshot.storage.k8s.io", &version, "VolumeSnapshotContent"),
        "volumesnapshotcontents",
    );
    let snapshots = Api::<DynamicObject>::all_with(tc.clone(), &snap)
        .list(&ListParams::default())
        .await?;
    for s in snapshots
        .items
        .iter()
        .filter(|s| s.metadata.deletion_timestamp.is_none())
    {
        let (Some(ns), Some(name)) = (s.metadata.namespace.as_deref(), s.metadata.name.as_deref())
        else {
            continue;
        };
        match Api::<DynamicObject>::namespaced_with(tc.clone(), ns, &snap)
            .delete(name, &DeleteParams::background())
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    let contents_api = Api::<DynamicObject>::all_with(tc.clone(), &content);
    let contents = contents_api.list(&ListParams::default()).await?;
    let waited = contents
        .items
        .iter()
        .filter(|c| {
            c.data
                .pointer("/spec/deletionPolicy")
                .and_then(|v| v.as_str())
                != Some("Retain")
        })
        .filter_map(|c| c.metadata.name.clone())
        .collect();
    Ok(Some((contents_api, waited)))
}
