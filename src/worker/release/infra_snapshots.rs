//! The management layer of a tenant's snapshots (`docs/design.md` §5b).
//!
//! On the KubeVirt path a tenant snapshot is, behind it, a VolumeSnapshot of
//! the DataVolume's PVC in the tenant's management namespace (the driver's
//! CreateSnapshot), and the management storage holds the snapshot for as
//! long as that VolumeSnapshot's **VolumeSnapshotContent** exists: the
//! snapshot controllers there free it by deleting the content (deletionPolicy
//! Delete), and keep it with the content (Retain, or a content whose
//! VolumeSnapshot went first: external-snapshotter's `syncContent` never
//! deletes a content whose VolumeSnapshot is gone). So once the disks are
//! freed, the phase looks at contents, not VolumeSnapshots: a content of
//! the tenant being deleted is waited for; one that stays is named in
//! `Released`; a VolumeSnapshot held by a finalizer after its content is
//! gone holds nothing on storage.
//!
//! A content is the tenant's when its VolumeSnapshot (by name and UID, in
//! the tenant's namespace) carries the tenant's infra labels, or when its
//! source is one of the tenant's disks (the management PVs' volumeHandles
//! the inventory recorded), which finds it after its VolumeSnapshot is gone.
//! The phase never writes either kind: nothing here can be steered into
//! deleting anything.

use std::collections::{BTreeSet, HashMap, HashSet};

use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use kube::core::GroupVersionKind;
use serde_json::Value;

use super::outcome::{self, Outcome};
use super::wait::{NoProgress, wait_gone};
use crate::profile::InfraSpec;
use crate::record::{Inventory, Phase, Update};
use crate::text::{count, listed};
use crate::worker::{Context, TenantRef};

/// A VolumeSnapshot in the tenant's management namespace, as listed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SnapshotSeen {
    pub name: String,
    pub uid: String,
    /// Carries the tenant's infra labels: the tenant's driver made it.
    pub labelled: bool,
    pub deleting: bool,
    /// `status.boundVolumeSnapshotContentName`.
    pub content: Option<String>,
}

/// A VolumeSnapshotContent, as listed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContentSeen {
    pub name: String,
    pub deleting: bool,
    /// `spec.deletionPolicy` is `Delete`.
    pub delete: bool,
    /// `spec.volumeSnapshotRef`: namespace, name, UID (empty when unset).
    pub namespace: String,
    pub snapshot: String,
    pub snapshot_uid: String,
    /// `spec.source.volumeHandle`: the disk it is a snapshot of.
    pub source: Option<String>,
    /// The storage holds the snapshot, or may yet ([`holds_snapshot`]).
    pub held: bool,
}

/// What the management cluster holds of the tenant's snapshots.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Contents being deleted, or to be (their VolumeSnapshot is being
    /// deleted and their policy is Delete): the snapshot on storage is freed
    /// when each goes.
    pub going: BTreeSet<String>,
    /// Labelled VolumeSnapshots being deleted with no content found and
    /// none named: waited for themselves.
    pub unbound_going: BTreeSet<String>,
    /// Labelled VolumeSnapshots not being deleted: the tenant's driver did
    /// not delete them.
    pub not_deleted: Vec<String>,
    /// VolumeSnapshots of the tenant's disks without its labels (taken in
    /// the management cluster, not by its driver), not being deleted.
    pub others: Vec<String>,
    /// Contents that stay with their VolumeSnapshot gone or going:
    /// deletionPolicy Retain, or a VolumeSnapshot gone before them.
    pub left: Vec<String>,
    /// With only part of the tenant's disks known (a truncated inventory,
    /// a disk whose handle was never seen): contents in the tenant's
    /// namespace that hold a snapshot, whose VolumeSnapshot is gone and
    /// whose disk is not among those known. They may be of the tenant's
    /// disks; named, not counted as kept.
    pub unlisted: Vec<String>,
}

impl Plan {
    pub fn kept(&self) -> usize {
        self.not_deleted.len() + self.others.len() + self.left.len()
    }
}

/// Decides, from the VolumeSnapshots of the tenant's namespace and all
/// VolumeSnapshotContents, what is waited for and what is kept (see the
/// module's documentation). `handles` are the tenant's disks' volumeHandles,
/// all of them when `complete`.
pub fn plan(
    namespace: &str,
    snapshots: &[SnapshotSeen],
    contents: &[ContentSeen],
    handles: &HashSet<&str>,
    complete: bool,
) -> Plan {
    let by_name: HashMap<&str, &SnapshotSeen> =
        snapshots.iter().map(|s| (s.name.as_str(), s)).collect();
    let existing: HashSet<&str> = contents.iter().map(|c| c.name.as_str()).collect();
    let mut out = Plan::default();
    let mut matched: HashSet<&str> = HashSet::new();
    for c in contents.iter().filter(|c| c.namespace == namespace) {
        // Bound both ways, as the snapshot controller requires: the
        // content names the VolumeSnapshot, by UID once it has one.
        let vs = by_name
            .get(c.snapshot.as_str())
            .filter(|s| c.snapshot_uid.is_empty() || s.uid == c.snapshot_uid);
        let of_disk = c.source.as_deref().is_some_and(|h| handles.contains(h));
        if !(of_disk || vs.is_some_and(|s| s.labelled)) {
            if !complete && vs.is_none() && c.held {
                out.unlisted.push(c.name.clone());
            }
            continue;
        }
        if let Some(s) = vs {
            matched.insert(s.name.as_str());
        }
        let live = vs.filter(|s| !s.deleting);
        match live {
            // A snapshot still wanted (or still being taken).
            Some(s) if !c.deleting && s.labelled => out.not_deleted.push(s.name.clone()),
            Some(s) if !c.deleting => out.others.push(s.name.clone()),
            // Nothing on storage, and nothing will be: DeleteSnapshot done.
            _ if !c.held => {}
            // Retain: the storage keeps it, whatever becomes of the objects.
            _ if !c.delete => out.left.push(c.name.clone()),
            // The csi-snapshotter frees it and then lets the content go;
            // a content whose VolumeSnapshot is being deleted is deleted by
            // the snapshot controller first.
            _ if c.deleting || vs.is_some() => {
                out.going.insert(c.name.clone());
            }
            // Its VolumeSnapshot is gone: the snapshot controller leaves it.
            _ => out.left.push(c.name.clone()),
        }
    }
    for s in snapshots
        .iter()
        .filter(|s| s.labelled && !matched.contains(s.name.as_str()))
    {
        match &s.content {
            // Never finished: nothing on storage yet, or not known to be.
            _ if !s.deleting => out.not_deleted.push(s.name.clone()),
            // Its content is gone: the snapshot on storage is freed,
            // whatever holds the VolumeSnapshot.
            Some(c) if !existing.contains(c.as_str()) => {}
            _ => {
                out.unbound_going.insert(s.name.clone());
            }
        }
    }
    for v in [
        &mut out.not_deleted,
        &mut out.others,
        &mut out.left,
        &mut out.unlisted,
    ] {
        v.sort();
        v.dedup();
    }
    out
}

/// Why a labelled management VolumeSnapshot not being deleted is kept.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kept {
    /// The tenant's driver did not delete it: its content is Retain (or
    /// it never finished taking it).
    Retain,
    /// The tenant API is dead: whether its content was Retain is unknown.
    TenantDead,
}

/// The part of the `Released` message that names the snapshots kept, if
/// any ("but 1 snapshot kept: VolumeSnapshot … in the management cluster,
/// not deleted by the tenant's driver (…)").
pub fn kept_note(plan: &Plan, why: Kept) -> Option<String> {
    let named = |kind: &str, names: &[String]| {
        let plural = if names.len() == 1 { "" } else { "s" };
        format!("{kind}{plural} {}", listed(names, 5))
    };
    let mut parts = Vec::new();
    if !plan.not_deleted.is_empty() {
        let names = named("VolumeSnapshot", &plan.not_deleted);
        parts.push(match why {
            Kept::Retain => format!(
                "{names} in the management cluster, not deleted by the tenant's driver (a tenant content \
                 with deletionPolicy Retain, or a snapshot it never finished taking)"
            ),
            Kept::TenantDead => format!(
                "{names} in the management cluster, whose tenant content's deletionPolicy the unreachable \
                 tenant API cannot tell (delete it there if the data is not wanted)"
            ),
        });
    }
    if !plan.others.is_empty() {
        parts.push(format!(
            "{} of its disks, taken in the management cluster and not by its driver",
            named("VolumeSnapshot", &plan.others)
        ));
    }
    if !plan.left.is_empty() {
        parts.push(format!(
            "{} left on the management storage (deletionPolicy Retain, or its VolumeSnapshot deleted before \
             it; if the data is not wanted, set its deletionPolicy to Delete, then delete it: a Retain content \
             deleted leaves the snapshot on storage with nothing naming it)",
            named("VolumeSnapshotContent", &plan.left)
        ));
    }
    let unlisted = (!plan.unlisted.is_empty()).then(|| {
        format!(
            "the record does not know every disk of the tenant (its inventory is truncated, or a disk's \
             handle was never seen), so {} in its namespace whose VolumeSnapshot is gone may be of its disks \
             (compare spec.source.volumeHandle with the tenant's disks)",
            named("VolumeSnapshotContent", &plan.unlisted)
        )
    });
    let kept = (!parts.is_empty()).then(|| {
        format!(
            "but {} kept: {}",
            count(plan.kept(), "snapshot"),
            parts.join("; ")
        )
    });
    match (kept, unlisted) {
        (Some(k), Some(u)) => Some(format!("{k}; and {u}")),
        (Some(k), None) => Some(k),
        (None, Some(u)) => Some(format!("but {u}")),
        (None, None) => None,
    }
}

fn snapshot_resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("snapshot.storage.k8s.io", "v1", kind),
        plural,
    )
}

/// The management cluster's VolumeSnapshots in the tenant's namespace.
fn snapshots_api(ctx: &Context, t: &TenantRef) -> Api<DynamicObject> {
    Api::namespaced_with(
        ctx.client.clone(),
        &t.namespace,
        &snapshot_resource("VolumeSnapshot", "volumesnapshots"),
    )
}

/// The management cluster's VolumeSnapshotContents (cluster-scoped).
fn contents_api(ctx: &Context) -> Api<DynamicObject> {
    Api::all_with(
        ctx.client.clone(),
        &snapshot_resource("VolumeSnapshotContent", "volumesnapshotcontents"),
    )
}

fn text(o: &DynamicObject, pointer: &str) -> Option<String> {
    o.data
        .pointer(pointer)
        .and_then(Value::as_str)
        .map(str::to_string)
}

/// Whether content `o` holds a snapshot on storage, or may yet. The
/// csi-snapshotter sets `status.snapshotHandle` once CreateSnapshot has
/// returned and keeps creating until then, even while the content or its
/// VolumeSnapshot is being deleted; it clears the handle once DeleteSnapshot
/// has succeeded, then lets the content go. So only a content without a
/// handle that is being deleted, marked `volumesnapshot-being-deleted` and
/// not `volumesnapshot-being-created` (the sidecar's "remove the finalizer
/// only" case, `shouldDelete`) is known to hold nothing.
fn holds_snapshot(o: &DynamicObject) -> bool {
    let annotated = |key: &str| {
        o.metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(key))
    };
    let done = o.metadata.deletion_timestamp.is_some()
        && annotated("snapshot.storage.kubernetes.io/volumesnapshot-being-deleted")
        && !annotated("snapshot.storage.kubernetes.io/volumesnapshot-being-created");
    text(o, "/status/snapshotHandle").is_some() || !done
}

/// Lists the VolumeSnapshots of the tenant's namespace and all
/// VolumeSnapshotContents, and plans; `None` when the management cluster
/// does not serve snapshot.storage.k8s.io/v1.
async fn list_and_plan(
    ctx: &Context,
    t: &TenantRef,
    spec: &InfraSpec,
    inv: &Inventory,
) -> Result<Option<Plan>, kube::Error> {
    let snapshots = match snapshots_api(ctx, t).list(&ListParams::default()).await {
        Ok(l) => l.items,
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(None),
        Err(e) => return Err(e),
    };
    let snapshots: Vec<SnapshotSeen> = snapshots
        .iter()
        .map(|o| SnapshotSeen {
            name: o.metadata.name.clone().unwrap_or_default(),
            uid: o.metadata.uid.clone().unwrap_or_default(),
            labelled: spec.is_tenants(&o.metadata.labels.clone().unwrap_or_default(), &t.name),
            deleting: o.metadata.deletion_timestamp.is_some(),
            content: text(o, "/status/boundVolumeSnapshotContentName"),
        })
        .collect();
    let handles: HashSet<&str> = inv
        .volumes
        .iter()
        .filter_map(|v| v.infra.as_ref()?.handle.as_deref())
        .collect();
    let complete = !inv.truncated
        && inv
            .volumes
            .iter()
            .all(|v| v.infra.as_ref().is_none_or(|r| r.handle.is_some()));
    if snapshots.is_empty() && handles.is_empty() && complete {
        // No snapshot in the namespace and no disk a content could be of:
        // the cluster's contents are not listed.
        return Ok(Some(Plan::default()));
    }
    let contents = contents_api(ctx).list(&ListParams::default()).await?.items;
    let contents: Vec<ContentSeen> = contents
        .iter()
        .map(|o| ContentSeen {
            name: o.metadata.name.clone().unwrap_or_default(),
            deleting: o.metadata.deletion_timestamp.is_some(),
            delete: text(o, "/spec/deletionPolicy").as_deref() == Some("Delete"),
            namespace: text(o, "/spec/volumeSnapshotRef/namespace").unwrap_or_default(),
            snapshot: text(o, "/spec/volumeSnapshotRef/name").unwrap_or_default(),
            snapshot_uid: text(o, "/spec/volumeSnapshotRef/uid").unwrap_or_default(),
            source: text(o, "/spec/source/volumeHandle"),
            held: holds_snapshot(o),
        })
        .collect();
    Ok(Some(plan(
        &t.namespace,
        &snapshots,
        &contents,
        &handles,
        complete,
    )))
}

/// The disks are gone: waits for the management storage to free the
/// tenant's snapshots being deleted (their contents watched until none has
/// gone for `--wait-bound`); the outcome ([`outcome::released`], naming the
/// ones kept, or [`outcome::snapshots_remain`]) follows from what is left.
pub(super) async fn snapshots_settle(
    ctx: &Context,
    t: &TenantRef,
    spec: &InfraSpec,
    inv: Inventory,
    note: Option<String>,
    why: Kept,
) -> Result<Outcome, kube::Error> {
    let Some(plan) = list_and_plan(ctx, t, spec, &inv).await? else {
        return Ok(outcome::released(inv, note, None));
    };
    let kept = kept_note(&plan, why);
    if plan.going.is_empty() && plan.unbound_going.is_empty() {
        return Ok(outcome::released(inv, note, kept));
    }
    let waited: Vec<String> = plan
        .going
        .iter()
        .map(|c| format!("VolumeSnapshotContent {c}"))
        .chain(
            plan.unbound_going
                .iter()
                .map(|s| format!("VolumeSnapshot {s} (no content)")),
        )
        .collect();
    ctx.write_record(
        t,
        &Update {
            phase: Some(Phase::Releasing),
            message: Some(format!(
                "the disks are freed; waiting for the management storage to free {}: {}",
                count(waited.len(), "snapshot"),
                listed(&waited, 5)
            )),
            inventory: Some(inv.clone()),
            ..Default::default()
        },
    )
    .await?;
    let bound = ctx.settings.wait_bound;
    let mut left: Vec<String> = wait_gone(
        contents_api(ctx),
        plan.going.into_iter().collect(),
        bound,
        &NoProgress,
    )
    .await?
    .into_iter()
    .map(|c| format!("VolumeSnapshotContent {c}"))
    .collect();
    if left.is_empty() && !plan.unbound_going.is_empty() {
        left = wait_gone(
            snapshots_api(ctx, t),
            plan.unbound_going.into_iter().collect(),
            bound,
            &NoProgress,
        )
        .await?
        .into_iter()
        .map(|s| format!("VolumeSnapshot {s} (no content)"))
        .collect();
    }
    if left.is_empty() {
        return Ok(outcome::released(inv, note, kept));
    }
    left.sort();
    Ok(outcome::snapshots_remain(inv, &left, bound))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NS: &str = "tenant-a";

    fn vs(name: &str, labelled: bool, deleting: bool, content: Option<&str>) -> SnapshotSeen {
        SnapshotSeen {
            name: name.into(),
            uid: format!("uid-{name}"),
            labelled,
            deleting,
            content: content.map(str::to_string),
        }
    }

    fn vsc(name: &str, of: &str, delete: bool, deleting: bool, source: &str) -> ContentSeen {
        ContentSeen {
            name: name.into(),
            deleting,
            delete,
            namespace: NS.into(),
            snapshot: of.into(),
            snapshot_uid: format!("uid-{of}"),
            source: Some(source.into()),
            held: true,
        }
    }

    fn handles() -> HashSet<&'static str> {
        ["disk-1"].into_iter().collect()
    }

    #[test]
    fn a_content_being_deleted_is_waited_for_and_its_snapshot_is_not() {
        let p = plan(
            NS,
            &[vs("s", true, true, Some("c"))],
            &[vsc("c", "s", true, true, "disk-1")],
            &handles(),
            true,
        );
        assert_eq!(p.going, BTreeSet::from(["c".to_string()]));
        assert!(p.unbound_going.is_empty() && p.kept() == 0, "{p:?}");
    }

    #[test]
    fn a_snapshot_held_after_its_content_is_gone_holds_nothing() {
        // A foreign finalizer on the VolumeSnapshot: the content, and the
        // snapshot on storage, went before it.
        let p = plan(NS, &[vs("s", true, true, Some("c"))], &[], &handles(), true);
        assert_eq!(p, Plan::default());
    }

    #[test]
    fn a_deleted_snapshot_of_a_delete_content_is_waited_for_until_the_controller_deletes_it() {
        let p = plan(
            NS,
            &[vs("s", true, true, Some("c"))],
            &[vsc("c", "s", true, false, "disk-1")],
            &handles(),
            true,
        );
        assert_eq!(p.going, BTreeSet::from(["c".to_string()]));
    }

    #[test]
    fn a_retain_content_stays_and_is_named_whether_its_snapshot_is_going_or_gone() {
        for snapshots in [vec![vs("s", true, true, Some("c"))], vec![]] {
            let p = plan(
                NS,
                &snapshots,
                &[vsc("c", "s", false, false, "disk-1")],
                &handles(),
                true,
            );
            assert_eq!(p.left, vec!["c".to_string()], "{snapshots:?}");
            assert!(p.going.is_empty() && p.unbound_going.is_empty());
        }
    }

    #[test]
    fn an_orphan_delete_content_is_left_as_the_snapshot_controller_leaves_it() {
        let p = plan(
            NS,
            &[],
            &[vsc("c", "gone", true, false, "disk-1")],
            &handles(),
            true,
        );
        assert_eq!(p.left, vec!["c".to_string()]);
    }

    #[test]
    fn a_content_that_holds_nothing_on_storage_is_not_waited_for() {
        // DeleteSnapshot succeeded; a foreign finalizer holds the content.
        let freed = ContentSeen {
            held: false,
            ..vsc("c", "s", true, true, "disk-1")
        };
        let p = plan(
            NS,
            &[vs("s", true, true, Some("c"))],
            &[freed],
            &handles(),
            true,
        );
        assert_eq!(p, Plan::default());
    }

    #[test]
    fn a_retain_content_deleted_by_hand_still_leaves_its_snapshot_on_storage() {
        let p = plan(
            NS,
            &[],
            &[vsc("c", "s", false, true, "disk-1")],
            &handles(),
            true,
        );
        assert_eq!(p.left, vec!["c".to_string()]);
        assert!(p.going.is_empty());
    }

    #[test]
    fn a_live_snapshot_is_kept_by_who_made_it() {
        let p = plan(
            NS,
            &[
                vs("mine", true, false, Some("c1")),
                vs("theirs", false, false, Some("c2")),
            ],
            &[
                vsc("c1", "mine", true, false, "disk-1"),
                vsc("c2", "theirs", true, false, "disk-1"),
            ],
            &handles(),
            true,
        );
        assert_eq!(p.not_deleted, vec!["mine".to_string()]);
        assert_eq!(p.others, vec!["theirs".to_string()]);
    }

    #[test]
    fn what_is_not_the_tenants_is_not_looked_at() {
        let mut elsewhere = vsc("c3", "s", false, false, "disk-1");
        elsewhere.namespace = "tenant-b".into();
        let p = plan(
            NS,
            &[
                vs("other", false, true, None),
                vs("s", true, true, Some("c-s")),
            ],
            &[
                // Another disk, no labelled snapshot.
                vsc("c1", "other", false, false, "disk-9"),
                // Same handle, another namespace.
                elsewhere,
                // Names a labelled snapshot's name, but another UID.
                ContentSeen {
                    snapshot_uid: "uid-old".into(),
                    ..vsc("c2", "s", false, false, "disk-9")
                },
            ],
            &handles(),
            true,
        );
        assert_eq!(p, Plan::default());
    }

    #[test]
    fn with_part_of_the_disks_known_an_orphan_content_of_an_unknown_disk_is_named_as_perhaps_the_tenants()
     {
        let contents = [
            // VolumeSnapshot gone, disk not among those recorded.
            vsc("c-unknown", "gone", false, false, "disk-9"),
            // Nothing on storage: not named.
            ContentSeen {
                held: false,
                ..vsc("c-freed", "gone", true, true, "disk-8")
            },
            // Another namespace: never the tenant's.
            ContentSeen {
                namespace: "tenant-b".into(),
                ..vsc("c-elsewhere", "gone", false, false, "disk-7")
            },
        ];
        let partial = plan(NS, &[], &contents, &handles(), false);
        assert_eq!(partial.unlisted, vec!["c-unknown".to_string()]);
        assert_eq!(partial.kept(), 0, "named, not counted as kept");
        let note = kept_note(&partial, Kept::Retain).unwrap();
        assert!(
            note.starts_with("but the record does not know every disk of the tenant")
                && note.contains("VolumeSnapshotContent c-unknown in its namespace"),
            "{note}"
        );
        // Every disk known: a content of none of them is another's.
        assert_eq!(plan(NS, &[], &contents, &handles(), true), Plan::default());
    }

    #[test]
    fn a_labelled_snapshot_without_a_content_is_waited_for_or_kept() {
        let p = plan(
            NS,
            &[
                vs("going", true, true, None),
                vs("taking", true, false, None),
            ],
            &[],
            &handles(),
            true,
        );
        assert_eq!(p.unbound_going, BTreeSet::from(["going".to_string()]));
        assert_eq!(p.not_deleted, vec!["taking".to_string()]);
    }

    #[test]
    fn a_content_holds_nothing_only_once_delete_snapshot_is_done() {
        let content = |handle: bool, deleting: bool, annotations: &[&str]| {
            let mut o = DynamicObject::new(
                "c",
                &snapshot_resource("VolumeSnapshotContent", "volumesnapshotcontents"),
            );
            if handle {
                o.data = serde_json::json!({"status": {"snapshotHandle": "snap-1"}});
            }
            if deleting {
                o.metadata.deletion_timestamp = Some(
                    k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()),
                );
            }
            o.metadata.annotations = Some(
                annotations
                    .iter()
                    .map(|a| {
                        (
                            format!("snapshot.storage.kubernetes.io/{a}"),
                            "yes".to_string(),
                        )
                    })
                    .collect(),
            );
            o
        };
        assert!(holds_snapshot(&content(
            true,
            true,
            &["volumesnapshot-being-deleted"]
        )));
        // Not taken yet: the csi-snapshotter goes on creating it.
        assert!(holds_snapshot(&content(false, false, &[])));
        assert!(holds_snapshot(&content(false, true, &[])));
        assert!(holds_snapshot(&content(
            false,
            true,
            &[
                "volumesnapshot-being-deleted",
                "volumesnapshot-being-created"
            ]
        )));
        // DeleteSnapshot succeeded (or there was nothing to delete).
        assert!(!holds_snapshot(&content(
            false,
            true,
            &["volumesnapshot-being-deleted"]
        )));
    }

    #[test]
    fn kept_snapshots_are_named_with_why() {
        let one = Plan {
            not_deleted: vec!["snapshot-a".into()],
            ..Default::default()
        };
        assert_eq!(
            kept_note(&one, Kept::Retain).unwrap(),
            "but 1 snapshot kept: VolumeSnapshot snapshot-a in the management cluster, not deleted by the \
             tenant's driver (a tenant content with deletionPolicy Retain, or a snapshot it never finished taking)"
        );
        let many = Plan {
            not_deleted: (0..7).map(|i| format!("snapshot-{i}")).collect(),
            left: vec!["snapcontent-x".into()],
            ..Default::default()
        };
        let note = kept_note(&many, Kept::TenantDead).unwrap();
        assert!(
            note.starts_with(
                "but 8 snapshots kept: VolumeSnapshots snapshot-0, snapshot-1, snapshot-2, snapshot-3, \
                 snapshot-4 and 2 more in the management cluster"
            ) && note.contains("cannot tell")
                && note.contains("; VolumeSnapshotContent snapcontent-x left on the management storage"),
            "{note}"
        );
        assert_eq!(kept_note(&Plan::default(), Kept::Retain), None);
    }
}
