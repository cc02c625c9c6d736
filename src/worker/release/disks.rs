//! What the management cluster holds of a tenant's disks, and what the
//! phase does with each: pure functions over listed objects
//! (`docs/design.md` §5b, §5c). The effects are in `management`.
//!
//! In Cozystack a tenant volume is two layers: the tenant's PV, and behind
//! it a CDI DataVolume in the tenant's namespace of the management cluster,
//! its PVC (same name) and that PVC's PV, which is the disk on the
//! hypervisor. The tenant's word (its PVs are gone) is not the disk's truth:
//! the DataVolume's deletion returns before the disk is freed, and when the
//! tenant API is dead the management cluster is the only truth left.
//!
//! What belongs to a tenant there is decided here ([`select`]): objects
//! named by the inventory (taken from the tenant's own, bound, API) and
//! objects carrying the tenant's infra labels. Only objects that are both
//! are ever deleted by the phase ([`deletable`]): a label alone, which
//! whoever edits the namespace can write, never makes the worker delete.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::ObjectMeta;

use crate::profile::InfraSpec;
use crate::record::{InfraRef, Inventory, MAX_FIELD_BYTES};
use crate::text::{bounded, count};

/// One management object of the tenant's disks, as last listed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Held {
    pub name: String,
    pub uid: Option<String>,
    /// Carries the tenant's infra labels.
    pub labelled: bool,
    pub deleting: bool,
    pub finalizers: Vec<String>,
    /// A claim's bound PV (its `spec.volumeName`).
    pub bound_pv: Option<String>,
    /// A PV's phase.
    pub pv_phase: Option<String>,
    /// A PV's claim (name; its namespace is the tenant's).
    pub claim: Option<String>,
    /// A PV's reclaim policy.
    pub reclaim: Option<String>,
    /// A PV the worker keeps (labelled `kept`): the reclaim policy it had.
    pub kept_from: Option<String>,
    /// A PV the worker keeps for another tenant (its `kept-for`, or
    /// `<unnamed>`): never pinned, let go or recorded by this one.
    pub foreign: Option<String>,
    /// A PV's CSI volumeHandle.
    pub handle: Option<String>,
    /// A claim owned by one of the tenant's infra objects (it goes when
    /// that object is deleted; one CDI has collected, or whose owner
    /// reference was removed, does not).
    pub owned: bool,
}

impl Held {
    fn describe(&self) -> String {
        let mut s = self.name.clone();
        if let Some(d) = self.bound_pv.as_ref().or(self.pv_phase.as_ref()) {
            s.push_str(&format!(" ({d})"));
        }
        if let Some(other) = &self.foreign {
            s.push_str(&format!(", kept for {other}"));
        }
        if self.deleting {
            s.push_str(", being deleted");
            if !self.finalizers.is_empty() {
                s.push_str(&format!(
                    ", held by finalizers {}",
                    self.finalizers.join(", ")
                ));
            }
        }
        s
    }
}

/// What the management cluster holds of one tenant's disks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    /// Whether the infra API (DataVolumes) is served at all.
    pub served: bool,
    /// The infra objects (DataVolumes), their PVCs and those PVCs' PVs.
    pub objects: Vec<Held>,
    pub claims: Vec<Held>,
    pub volumes: Vec<Held>,
}

impl Observed {
    pub fn is_empty(&self) -> bool {
        self.objects.is_empty() && self.claims.is_empty() && self.volumes.is_empty()
    }

    /// `2 DataVolumes (a, b), 1 PVC (a, being deleted)`, at most `n` names
    /// of each kind.
    pub fn describe(&self, kind: &str, n: usize) -> String {
        let part = |items: &[Held], what: &str| -> Option<String> {
            if items.is_empty() {
                return None;
            }
            let shown: Vec<String> = items.iter().take(n).map(Held::describe).collect();
            let more = items.len() - shown.len();
            let tail = if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            };
            let plural = if items.len() == 1 { "" } else { "s" };
            Some(format!(
                "{} {what}{plural} ({}{tail})",
                items.len(),
                shown.join("; ")
            ))
        };
        [
            part(&self.objects, kind),
            part(&self.claims, "PVC"),
            part(&self.volumes, "PV"),
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(", ")
    }
}

/// Names every inventoried volume's infra object from its volumeHandle,
/// where the profile's pattern fits; a name once recorded is kept.
pub fn attach_refs(inv: &mut Inventory, infra: &InfraSpec) {
    for v in inv.volumes.iter_mut().filter(|v| v.infra.is_none()) {
        if let Some(name) = v.handle.as_deref().and_then(|h| infra.object_of(h)) {
            v.infra = Some(InfraRef {
                name,
                ..Default::default()
            });
        }
    }
}

/// Records the management PV behind each inventoried volume, as bound now,
/// so the disk can still be waited for once its PVC is gone, and that PV's
/// volumeHandle, so its snapshots can be found once their VolumeSnapshots
/// are gone. A claim's own `volumeName` decides; without the claim, a PV
/// whose claimRef names it, unless several do (a stale one beside the live
/// one: none is recorded, rather than perhaps the wrong disk).
pub fn note_pvs(inv: &mut Inventory, observed: &Observed) {
    let mut by_ref: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for v in observed.volumes.iter().filter(|v| v.foreign.is_none()) {
        if let Some(claim) = v.claim.as_deref() {
            by_ref.entry(claim).or_default().push(v.name.as_str());
        }
    }
    let bound: BTreeMap<&str, &str> = by_ref
        .into_iter()
        .filter_map(|(claim, pvs)| match pvs.as_slice() {
            [only] => Some((claim, *only)),
            _ => None,
        })
        .chain(observed.claims.iter().filter_map(|c| {
            // A claim's volumeName counts only where that PV names the
            // claim back (`select`): a PVC anyone creates can name any PV.
            let pv = c.bound_pv.as_deref()?;
            observed
                .volumes
                .iter()
                .any(|v| {
                    v.name == pv
                        && v.claim.as_deref() == Some(c.name.as_str())
                        && v.foreign.is_none()
                })
                .then_some((c.name.as_str(), pv))
        }))
        .collect();
    let handles: BTreeMap<&str, &str> = observed
        .volumes
        .iter()
        .filter_map(|v| Some((v.name.as_str(), v.handle.as_deref()?)))
        .collect();
    for r in inv.volumes.iter_mut().filter_map(|v| v.infra.as_mut()) {
        if r.pv.is_none()
            && let Some(pv) = bound.get(r.name.as_str())
        {
            r.pv = Some(pv.to_string());
        }
        if r.handle.is_none()
            && let Some(h) = r.pv.as_deref().and_then(|pv| handles.get(pv))
        {
            r.handle = Some(bounded(h, MAX_FIELD_BYTES));
        }
    }
}

/// Marks gone every inventoried volume with nothing left on either layer
/// that the management cluster shows; returns how many were newly marked.
pub fn mark_gone(inv: &mut Inventory, observed: &Observed) -> usize {
    let held: HashSet<&str> = observed
        .objects
        .iter()
        .chain(&observed.claims)
        .chain(&observed.volumes)
        .map(|h| h.name.as_str())
        .collect();
    let mut marked = 0;
    for v in inv.volumes.iter_mut().filter(|v| !v.gone) {
        let Some(r) = &v.infra else { continue };
        if r.freed_here
            && !held.contains(r.name.as_str())
            && !r.pv.as_deref().is_some_and(|pv| held.contains(pv))
        {
            v.gone = true;
            marked += 1;
        }
    }
    inv.freed = (inv.freed + marked).min(inv.total);
    marked
}

/// What of the management cluster's objects is the tenant's: infra objects
/// labelled for it or named by the inventory; the claims of those (by name,
/// by owner, or by label); the PVs bound to those claims (the PV's claimRef
/// names the claim back, with its UID while the claim exists) or to a gone
/// claim the inventory names, and the PVs recorded. A PV bound in another
/// namespace is never selected: a PVC's `spec.volumeName` names any PV its
/// writer likes.
pub fn select(
    infra: &InfraSpec,
    tenant: &str,
    namespace: &str,
    inventory: Option<&Inventory>,
    objects: &[ObjectMeta],
    claims: &[PersistentVolumeClaim],
    volumes: &[PersistentVolume],
) -> Observed {
    let refs: Vec<&InfraRef> = inventory
        .map(|i| i.volumes.iter().filter_map(|v| v.infra.as_ref()).collect())
        .unwrap_or_default();
    let named: HashSet<&str> = refs.iter().map(|r| r.name.as_str()).collect();
    let recorded_pvs: HashSet<&str> = refs.iter().filter_map(|r| r.pv.as_deref()).collect();
    let labels =
        |m: &ObjectMeta| infra.is_tenants(m.labels.as_ref().unwrap_or(&BTreeMap::new()), tenant);
    let held = |m: &ObjectMeta| Held {
        name: m.name.clone().unwrap_or_default(),
        uid: m.uid.clone(),
        labelled: labels(m),
        deleting: m.deletion_timestamp.is_some(),
        finalizers: m.finalizers.clone().unwrap_or_default(),
        ..Default::default()
    };

    let mut out = Observed {
        served: true,
        ..Default::default()
    };
    for m in objects {
        let name = m.name.as_deref().unwrap_or_default();
        if labels(m) || named.contains(name) {
            out.objects.push(held(m));
        }
    }
    let object_uids: HashSet<&str> = out
        .objects
        .iter()
        .filter_map(|h| h.uid.as_deref())
        .collect();
    let object_names: HashSet<&str> = out.objects.iter().map(|h| h.name.as_str()).collect();
    for c in claims {
        let m = &c.metadata;
        let name = m.name.as_deref().unwrap_or_default();
        let owned = m
            .owner_references
            .iter()
            .flatten()
            .any(|o| object_uids.contains(o.uid.as_str()));
        if labels(m) || named.contains(name) || object_names.contains(name) || owned {
            out.claims.push(Held {
                owned,
                bound_pv: c.spec.as_ref().and_then(|s| s.volume_name.clone()),
                ..held(m)
            });
        }
    }
    // Every claim of the namespace by name (selected or not): a PV whose
    // claimRef names a claim that exists is that claim's only if the UIDs
    // agree; a claim made later under a gone claim's name is another claim.
    let live: BTreeMap<&str, Option<&str>> = claims
        .iter()
        .filter_map(|c| Some((c.metadata.name.as_deref()?, c.metadata.uid.as_deref())))
        .collect();
    let selected: HashSet<&str> = out.claims.iter().map(|h| h.name.as_str()).collect();
    for pv in volumes {
        let name = pv.metadata.name.as_deref().unwrap_or_default();
        let claim_ref = pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref());
        // A PV bound in another namespace is never the tenant's, whatever
        // names it: a PVC's `spec.volumeName`, which anyone who may create a
        // PVC writes, or a record.
        if claim_ref.is_some_and(|r| r.namespace.as_deref() != Some(namespace)) {
            continue;
        }
        let claim = claim_ref.and_then(|r| r.name.clone());
        let same_claim = |n: &str| {
            let uid = claim_ref.and_then(|r| r.uid.as_deref());
            match live.get(n) {
                Some(Some(live_uid)) => uid.is_none_or(|u| u == *live_uid),
                _ => true,
            }
        };
        // Named back by a claim of the tenant's (the claim's own, same UID),
        // or by the inventory's object whose claim is gone or is that one.
        let claimed = claim
            .as_deref()
            .is_some_and(|n| (selected.contains(n) || named.contains(n)) && same_claim(n));
        if claimed || (recorded_pvs.contains(name) && claim.as_deref().is_none_or(same_claim)) {
            out.volumes.push(Held {
                claim,
                pv_phase: pv.status.as_ref().and_then(|s| s.phase.clone()),
                reclaim: pv
                    .spec
                    .as_ref()
                    .and_then(|s| s.persistent_volume_reclaim_policy.clone()),
                handle: pv
                    .spec
                    .as_ref()
                    .and_then(|s| s.csi.as_ref())
                    .map(|c| c.volume_handle.clone()),
                ..held(&pv.metadata)
            });
        }
    }
    // A claim only labelled for the tenant is one of its disks only if a
    // selected PV is bound to it: an editor's PVC holding no disk (Pending,
    // or naming a PV that does not name it back) is nothing to wait for.
    let bound_back: HashSet<String> = out.volumes.iter().filter_map(|v| v.claim.clone()).collect();
    out.claims.retain(|c| {
        c.owned
            || named.contains(c.name.as_str())
            || object_names.contains(c.name.as_str())
            || bound_back.contains(&c.name)
    });
    for list in [&mut out.objects, &mut out.claims, &mut out.volumes] {
        list.sort_by(|a, b| a.name.cmp(&b.name));
    }
    out
}

/// A management PV the worker makes keep its disk, or lets go again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Keep {
    /// Reclaim policy `Retain`, labelled kept, naming what it holds.
    Pin {
        pv: String,
        reclaim_was: String,
        volume: String,
    },
    /// Its tenant volume is `Delete` now: the policy it had, labels off.
    Unpin { pv: String, reclaim_was: String },
}

/// Which management PVs of the tenant must keep their disk, and which the
/// worker kept before but no longer must. A disk is kept when its tenant
/// volume is not `Delete` (`Volume::is_kept`); when no inventory was ever
/// taken, or the record could not hold it whole (`truncated`), and the
/// tenant API cannot say (`reachable` false: an unreachable API, or an
/// override), every disk of the tenant no record names is kept (its policy
/// is unknown; a disk kept by mistake is found and freed by hand, a disk
/// freed by mistake is gone). A PV being deleted is past keeping; a PV kept
/// for another tenant (`Held::foreign`) is that tenant's to let go.
pub fn keep_plan(inv: Option<&Inventory>, observed: &Observed, reachable: bool) -> Vec<Keep> {
    let mut plan = Vec::new();
    // Another tenant's kept disk is neither pinned nor let go by this one,
    // whatever names it here.
    for pv in observed
        .volumes
        .iter()
        .filter(|v| !v.deleting && v.foreign.is_none())
    {
        let volume = inv.and_then(|i| {
            i.volumes.iter().find(|v| {
                v.infra.as_ref().is_some_and(|r| {
                    r.pv.as_deref() == Some(pv.name.as_str())
                        || pv.claim.as_deref() == Some(r.name.as_str())
                })
            })
        });
        // Not in an inventory that exists: not a tenant volume (a label
        // alone, which the namespace's editors write) or one still being
        // provisioned; kept only when there is no inventory at all. A
        // volume gone from the tenant whose DataVolume is gone too was freed
        // by its driver (it deletes a DataVolume only for a Delete volume):
        // its owner turned it to Delete, and its disk is let go.
        let freed_by_driver = |v: &crate::record::Volume| {
            v.gone
                && v.infra
                    .as_ref()
                    .is_some_and(|r| !observed.objects.iter().any(|o| o.name == r.name))
        };
        // Not named by a record that was cut (it could not hold every
        // volume): its policy is unknown, as with no inventory.
        let keep = match volume {
            Some(v) => v.is_kept() && !freed_by_driver(v),
            None => inv.is_none_or(|i| i.truncated) && !reachable,
        };
        let retained = pv.reclaim.as_deref() == Some("Retain");
        match (&pv.kept_from, keep) {
            (None, true) => plan.push(Keep::Pin {
                pv: pv.name.clone(),
                reclaim_was: pv.reclaim.clone().unwrap_or_else(|| "Delete".into()),
                volume: volume.map_or_else(
                    || {
                        format!(
                            "a disk of the tenant no inventory names (its PVC {})",
                            pv.claim.as_deref().unwrap_or("?")
                        )
                    },
                    |v| {
                        format!(
                            "tenant volume {} (reclaim policy {})",
                            v.describe(),
                            v.reclaim
                        )
                    },
                ),
            }),
            (Some(was), true) if !retained => plan.push(Keep::Pin {
                pv: pv.name.clone(),
                reclaim_was: was.clone(),
                volume: volume.map_or_else(String::new, |v| v.describe()),
            }),
            (Some(was), false) => plan.push(Keep::Unpin {
                pv: pv.name.clone(),
                reclaim_was: was.clone(),
            }),
            _ => {}
        }
    }
    plan
}

/// The management PVs kept once `plan` is carried out: those kept before
/// and not let go, and those pinned now.
pub fn kept_after(observed: &Observed, plan: &[Keep]) -> BTreeSet<String> {
    let mut kept: BTreeSet<String> = observed
        .volumes
        .iter()
        .filter(|v| v.kept_from.is_some() && v.foreign.is_none())
        .map(|v| v.name.clone())
        .collect();
    for step in plan {
        match step {
            Keep::Pin { pv, .. } => kept.insert(pv.clone()),
            Keep::Unpin { pv, .. } => kept.remove(pv),
        };
    }
    kept
}

/// Marks each inventoried volume whose management PV is in `kept`.
pub fn mark_kept(inv: &mut Inventory, kept: &BTreeSet<String>) {
    for r in inv.volumes.iter_mut().filter_map(|v| v.infra.as_mut()) {
        r.kept = r.pv.as_ref().is_some_and(|pv| kept.contains(pv));
    }
}

/// The inventoried volumes the phase may free from the management side:
/// reclaim policy Delete, and an infra object that is both named by the
/// inventory and labelled for the tenant.
pub fn deletable<'a>(inv: &'a Inventory, observed: &Observed) -> Vec<&'a InfraRef> {
    let labelled: HashSet<&str> = observed
        .objects
        .iter()
        .filter(|h| h.labelled)
        .map(|h| h.name.as_str())
        .collect();
    inv.volumes
        .iter()
        .filter(|v| v.reclaim == "Delete")
        .filter_map(|v| v.infra.as_ref())
        .filter(|r| labelled.contains(r.name.as_str()))
        .collect()
}

/// The management PVs behind the infra objects `freed`: those their PVCs
/// are bound to now, and those the inventory recorded (a PVC already gone).
pub fn disks_of(freed: &[String], inv: &Inventory, observed: &Observed) -> HashSet<String> {
    let freed: HashSet<&str> = freed.iter().map(String::as_str).collect();
    observed
        .volumes
        .iter()
        .filter(|v| v.foreign.is_none() && v.claim.as_deref().is_some_and(|c| freed.contains(c)))
        .filter(|v| {
            observed
                .claims
                .iter()
                .any(|c| c.bound_pv.as_deref() == Some(v.name.as_str()))
        })
        .map(|v| v.name.clone())
        .chain(
            inv.volumes
                .iter()
                .filter_map(|v| v.infra.as_ref())
                .filter(|r| freed.contains(r.name.as_str()))
                .filter_map(|r| r.pv.clone()),
        )
        .collect()
}

/// Inventoried volumes whose volumeHandle names nothing on the management
/// side: they cannot be vouched for from there.
pub fn unmapped(inv: Option<&Inventory>) -> Vec<String> {
    inv.iter()
        .flat_map(|i| i.remaining())
        .filter(|v| v.infra.is_none())
        .map(|v| v.describe())
        .collect()
}

/// Why the phase keeps what the management side still holds of a tenant
/// whose API cannot be reached (`docs/design.md` §5b): one clause per
/// reason, for the `Blocked` message. `labels` is the tenant's infra label
/// selector as written (`k=v,...`).
pub fn kept_reasons(
    inv: Option<&Inventory>,
    observed: &Observed,
    spec: &InfraSpec,
    labels: &str,
) -> Vec<String> {
    let Some(i) = inv else {
        return vec![
            "no inventory was taken while the tenant API answered, so these disks' reclaim policy is unknown: \
             the phase keeps them (their management PVs now have reclaim policy Retain) and does not delete them. \
             If their data is not wanted, give a PV its reclaim policy Delete and delete its DataVolume; or record \
             an override to end the teardown with them kept"
                .into(),
        ];
    };
    let mut parts = Vec::new();
    let retained = i
        .volumes
        .iter()
        .filter(|v| v.is_retain() && v.infra.is_some())
        .count();
    if retained > 0 {
        parts.push(format!(
            "{} with reclaim policy Retain, kept by design",
            count(retained, "volume")
        ));
    }
    let named: HashSet<&str> = i
        .volumes
        .iter()
        .filter_map(|v| v.infra.as_ref().map(|r| r.name.as_str()))
        .collect();
    let strangers: Vec<&str> = observed
        .objects
        .iter()
        .filter(|h| !named.contains(h.name.as_str()))
        .map(|h| h.name.as_str())
        .collect();
    if !strangers.is_empty() {
        parts.push(format!(
            "{} labelled {labels} but named by no inventoried volume, so kept: {}",
            count(strangers.len(), &spec.kind),
            strangers.join(", ")
        ));
    }
    let unmapped = unmapped(inv);
    if !unmapped.is_empty() {
        parts.push(format!(
            "{} whose volumeHandle names nothing in the management cluster: {}",
            count(unmapped.len(), "volume"),
            unmapped.join(", ")
        ));
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Volume;
    use k8s_openapi::api::core::v1::{
        ObjectReference, PersistentVolumeClaimSpec, PersistentVolumeSpec,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    const NS: &str = "tenant-a";

    fn meta(name: &str, labels: &[(&str, &str)]) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NS.into()),
            uid: Some(format!("uid-{name}")),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..Default::default()
        }
    }

    fn pvc(
        name: &str,
        labels: &[(&str, &str)],
        owner: Option<&str>,
        pv: Option<&str>,
    ) -> PersistentVolumeClaim {
        let mut m = meta(name, labels);
        m.owner_references = owner.map(|o| {
            vec![OwnerReference {
                uid: format!("uid-{o}"),
                name: o.into(),
                ..Default::default()
            }]
        });
        PersistentVolumeClaim {
            metadata: m,
            spec: Some(PersistentVolumeClaimSpec {
                volume_name: pv.map(str::to_string),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn pv(name: &str, claim_ns: &str, claim: &str) -> PersistentVolume {
        PersistentVolume {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(PersistentVolumeSpec {
                claim_ref: Some(ObjectReference {
                    namespace: Some(claim_ns.into()),
                    name: Some(claim.into()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn inventory(handles: &[(&str, &str)]) -> Inventory {
        let mut inv = Inventory::new(
            "t".into(),
            handles
                .iter()
                .map(|(h, reclaim)| Volume {
                    pv: format!("tenant-{h}"),
                    driver: Some("csi.kubevirt.io".into()),
                    handle: Some(h.to_string()),
                    capacity: None,
                    reclaim: reclaim.to_string(),
                    claim: None,
                    gone: false,
                    infra: None,
                })
                .collect(),
        );
        attach_refs(&mut inv, &InfraSpec::cozystack());
        inv
    }

    #[test]
    fn the_disks_of_freed_objects_are_their_bound_pvs_and_the_recorded_ones() {
        let mut inv = inventory(&[
            ("pvc-a", "Delete"),
            ("pvc-b", "Delete"),
            ("pvc-c", "Delete"),
        ]);
        // pvc-b's PVC is gone already: its disk is known from the record.
        inv.volumes[1].infra.as_mut().unwrap().pv = Some("disk-b".into());
        let observed = Observed {
            served: true,
            claims: vec![
                Held {
                    name: "pvc-a".into(),
                    bound_pv: Some("disk-a".into()),
                    ..Default::default()
                },
                Held {
                    name: "pvc-c".into(),
                    bound_pv: Some("disk-c".into()),
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let observed = Observed {
            volumes: ["a", "c"]
                .map(|x| Held {
                    name: format!("disk-{x}"),
                    claim: Some(format!("pvc-{x}")),
                    ..Default::default()
                })
                .into(),
            ..observed
        };
        let freed = vec!["pvc-a".to_string(), "pvc-b".to_string()];
        let disks = disks_of(&freed, &inv, &observed);
        let want: HashSet<String> = ["disk-a", "disk-b"].map(String::from).into();
        assert_eq!(
            disks, want,
            "pvc-c was not freed: its disk is not waited for"
        );
    }

    const MINE: (&str, &str) = ("cluster.x-k8s.io/cluster-name", "kubernetes-a");
    const OTHER: (&str, &str) = ("cluster.x-k8s.io/cluster-name", "kubernetes-b");

    #[test]
    fn a_handle_names_its_object_only_when_the_pattern_fits_and_the_name_is_valid() {
        let mut infra = InfraSpec::cozystack();
        assert_eq!(infra.object_of("pvc-1").as_deref(), Some("pvc-1"));
        assert_eq!(infra.object_of("Bad/Name"), None);
        assert_eq!(infra.object_of(""), None);
        infra.handle = "dv-{name}.disk".into();
        assert_eq!(infra.object_of("dv-pvc-1.disk").as_deref(), Some("pvc-1"));
        assert_eq!(infra.object_of("pvc-1"), None);
    }

    #[test]
    fn the_tenants_objects_are_the_labelled_and_the_inventoried_and_what_hangs_off_them() {
        let inv = inventory(&[("pvc-1", "Delete"), ("pvc-2", "Delete")]);
        let objects = [
            meta("pvc-1", &[MINE]),
            meta("pvc-2", &[]),      // inventoried, label removed
            meta("pvc-3", &[MINE]),  // labelled, not inventoried
            meta("pvc-9", &[OTHER]), // another tenant's
            meta("vm-root", &[]),    // nobody's
        ];
        let claims = [
            pvc("pvc-1", &[MINE], Some("pvc-1"), Some("pv-m1")),
            pvc("pvc-2", &[], Some("pvc-2"), Some("pv-m2")),
            pvc("pvc-9", &[OTHER], Some("pvc-9"), Some("pv-m9")),
            pvc("data", &[], None, Some("pv-data")),
        ];
        let volumes = [
            pv("pv-m1", NS, "pvc-1"),
            pv("pv-m2", NS, "pvc-2"),
            pv("pv-m9", NS, "pvc-9"),
            pv("pv-other-ns", "elsewhere", "pvc-1"),
            pv("pv-data", NS, "data"),
        ];
        let o = select(
            &InfraSpec::cozystack(),
            "kubernetes-a",
            NS,
            Some(&inv),
            &objects,
            &claims,
            &volumes,
        );
        let names = |h: &[Held]| h.iter().map(|h| h.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&o.objects), ["pvc-1", "pvc-2", "pvc-3"]);
        assert_eq!(names(&o.claims), ["pvc-1", "pvc-2"]);
        assert_eq!(names(&o.volumes), ["pv-m1", "pv-m2"]);
        // Only labelled and inventoried Delete volumes are ever deleted.
        let d: Vec<&str> = deletable(&inv, &o)
            .iter()
            .map(|r| r.name.as_str())
            .collect();
        assert_eq!(d, ["pvc-1"]);
    }

    /// `pv` bound to claim `claim` of `claim_ns` whose UID was `uid`.
    fn bound_pv(name: &str, claim_ns: &str, claim: &str, uid: &str) -> PersistentVolume {
        let mut v = pv(name, claim_ns, claim);
        v.spec.as_mut().unwrap().claim_ref.as_mut().unwrap().uid = Some(uid.into());
        v
    }

    #[test]
    fn a_pvc_naming_a_pv_of_another_namespace_or_a_gone_claims_pv_selects_nothing() {
        let inv = inventory(&[("pvc-1", "Delete")]);
        // An editor's PVC labelled for the tenant: its volumeName names a PV
        // bound in another namespace (case 2 and 3 of issue 41).
        let claims = [
            pvc("pvc-1", &[MINE], Some("pvc-1"), Some("pv-m1")),
            pvc("decoy", &[MINE], None, Some("pv-elsewhere")),
            // Made under the name of a gone tenant's claim (case 1): the
            // released PV still names the old claim's UID.
            pvc("old-claim", &[MINE], None, None),
        ];
        let volumes = [
            bound_pv("pv-m1", NS, "pvc-1", "uid-pvc-1"),
            bound_pv("pv-elsewhere", "victims", "data", "uid-data"),
            bound_pv("pv-gone-tenants", NS, "old-claim", "uid-of-the-gone-claim"),
        ];
        let o = select(
            &InfraSpec::cozystack(),
            "kubernetes-a",
            NS,
            Some(&inv),
            &[meta("pvc-1", &[MINE])],
            &claims,
            &volumes,
        );
        let names: Vec<&str> = o.volumes.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(names, ["pv-m1"]);
        // The decoys hold no disk of the tenant's: nothing to wait for.
        let selected: Vec<&str> = o.claims.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(selected, ["pvc-1"]);
        // Not even with no inventory, where every selected disk is kept.
        let none = select(
            &InfraSpec::cozystack(),
            "kubernetes-a",
            NS,
            None,
            &[],
            &claims,
            &volumes,
        );
        let pinned: Vec<String> = keep_plan(None, &none, false)
            .into_iter()
            .map(|k| match k {
                Keep::Pin { pv, .. } | Keep::Unpin { pv, .. } => pv,
            })
            .collect();
        assert_eq!(pinned, ["pv-m1"], "{none:?}");
        // Nor is a PVC's volumeName recorded as the tenant's disk.
        let mut inv = inventory(&[("decoy", "Delete")]);
        note_pvs(&mut inv, &none);
        assert_eq!(inv.volumes[0].infra.as_ref().unwrap().pv, None);
    }

    #[test]
    fn another_tenants_kept_disk_is_never_pinned_or_let_go() {
        let mut inv = inventory(&[("old-claim", "Delete")]);
        // Named by this tenant's inventory (its API, which its admin
        // writes), kept for a gone sibling.
        let mut theirs = disk("pv-gone-tenants", "old-claim", "Retain", Some("Delete"));
        theirs.foreign = Some("tenant-a/kubernetes-gone".into());
        let observed = with_disks(vec![theirs]);
        note_pvs(&mut inv, &observed);
        assert_eq!(
            inv.volumes[0].infra.as_ref().unwrap().pv,
            None,
            "not recorded as ours"
        );
        for reachable in [true, false] {
            assert!(keep_plan(Some(&inv), &observed, reachable).is_empty());
            assert!(keep_plan(None, &observed, reachable).is_empty());
        }
        assert!(kept_after(&observed, &[]).is_empty());
        assert!(
            observed.volumes[0]
                .describe()
                .contains("kept for tenant-a/kubernetes-gone")
        );
    }

    #[test]
    fn a_disk_a_cut_record_does_not_name_is_kept_at_an_override() {
        let mut inv = inventory(&[("pvc-1", "Delete")]);
        let observed = with_disks(vec![
            disk("mgmt-1", "pvc-1", "Delete", None),
            disk("mgmt-cut", "pvc-left-out", "Delete", None),
        ]);
        note_pvs(&mut inv, &observed);
        // The record held everything: a disk it does not name is not a
        // tenant volume.
        assert!(keep_plan(Some(&inv), &observed, false).is_empty());
        // It was cut: the left-out disk's policy is unknown, so it is kept
        // (an override or the unreachable road); the API answering, the
        // pass knows every volume and the plan is its own.
        inv.truncated = true;
        assert_eq!(
            keep_plan(Some(&inv), &observed, false)
                .iter()
                .map(|k| match k {
                    Keep::Pin { pv, .. } | Keep::Unpin { pv, .. } => pv.as_str(),
                })
                .collect::<Vec<_>>(),
            ["mgmt-cut"]
        );
        assert!(keep_plan(Some(&inv), &observed, true).is_empty());
    }

    #[test]
    fn a_recorded_pv_is_still_the_tenants_once_its_claim_is_gone() {
        let mut inv = inventory(&[("pvc-1", "Delete")]);
        let before = select(
            &InfraSpec::cozystack(),
            "kubernetes-a",
            NS,
            Some(&inv),
            &[meta("pvc-1", &[MINE])],
            &[pvc("pvc-1", &[MINE], Some("pvc-1"), Some("pv-m1"))],
            &[bound_pv("pv-m1", NS, "pvc-1", "uid-pvc-1")],
        );
        note_pvs(&mut inv, &before);
        let mut released = pv("pv-m1", "", "");
        released.spec = None;
        let after = select(
            &InfraSpec::cozystack(),
            "kubernetes-a",
            NS,
            Some(&inv),
            &[],
            &[],
            &[released],
        );
        assert_eq!(after.volumes.len(), 1, "{after:?}");
        assert!(after.objects.is_empty() && after.claims.is_empty());
    }

    #[test]
    fn the_management_pv_and_its_volume_handle_are_recorded_once_seen_bound() {
        let mut inv = inventory(&[("pvc-1", "Delete")]);
        let seen = tenants_disk(
            &inv,
            Some("pv-m1"),
            &[pv_with_handle("pv-m1", "pvc-1", "disk-m1")],
        );
        note_pvs(&mut inv, &seen);
        let r = inv.volumes[0].infra.as_ref().expect("infra ref");
        assert_eq!(
            (r.pv.as_deref(), r.handle.as_deref()),
            (Some("pv-m1"), Some("disk-m1"))
        );
        // Once the PV is gone, what was recorded stays.
        note_pvs(&mut inv, &Observed::default());
        assert_eq!(
            inv.volumes[0].infra.as_ref().unwrap().handle.as_deref(),
            Some("disk-m1")
        );
    }

    #[test]
    fn with_two_pvs_naming_one_gone_claim_neither_is_recorded_and_a_live_claim_decides() {
        let pvs = [
            pv_with_handle("pv-live", "pvc-1", "disk-live"),
            pv_with_handle("pv-stale", "pvc-1", "disk-stale"),
        ];
        // The claim gone: two PVs claim its name, none is taken.
        let mut inv = inventory(&[("pvc-1", "Delete")]);
        inv.volumes[0].infra.as_mut().unwrap().pv = None;
        let seen = tenants_disk(&inv, None, &pvs);
        note_pvs(&mut inv, &seen);
        let r = inv.volumes[0].infra.as_ref().unwrap();
        assert_eq!(
            (r.pv.as_deref(), r.handle.as_deref()),
            (None, None),
            "{seen:?}"
        );
        // The claim there: its volumeName decides, whatever sorts last.
        let seen = tenants_disk(&inv, Some("pv-live"), &pvs);
        note_pvs(&mut inv, &seen);
        let r = inv.volumes[0].infra.as_ref().unwrap();
        assert_eq!(
            (r.pv.as_deref(), r.handle.as_deref()),
            (Some("pv-live"), Some("disk-live"))
        );
    }

    /// Management PV `name` of claim `claim` with CSI volumeHandle `handle`.
    fn pv_with_handle(name: &str, claim: &str, handle: &str) -> PersistentVolume {
        let mut v = pv(name, NS, claim);
        v.spec.as_mut().unwrap().csi =
            Some(k8s_openapi::api::core::v1::CSIPersistentVolumeSource {
                driver: "infra.example".into(),
                volume_handle: handle.into(),
                ..Default::default()
            });
        v
    }

    /// What the release sees of the tenant's one disk `pvc-1`: its
    /// DataVolume, its claim when `bound_to` a PV (none when gone), `pvs`.
    fn tenants_disk(inv: &Inventory, bound_to: Option<&str>, pvs: &[PersistentVolume]) -> Observed {
        let claims: Vec<PersistentVolumeClaim> = bound_to
            .map(|v| pvc("pvc-1", &[MINE], Some("pvc-1"), Some(v)))
            .into_iter()
            .collect();
        select(
            &InfraSpec::cozystack(),
            "kubernetes-a",
            NS,
            Some(inv),
            &[meta("pvc-1", &[MINE])],
            &claims,
            pvs,
        )
    }

    #[test]
    fn retain_volumes_and_unrecorded_policies_are_never_deletable() {
        let inv = inventory(&[("pvc-1", "Retain"), ("pvc-2", "Recycle")]);
        let o = select(
            &InfraSpec::cozystack(),
            "kubernetes-a",
            NS,
            Some(&inv),
            &[meta("pvc-1", &[MINE]), meta("pvc-2", &[MINE])],
            &[],
            &[],
        );
        assert!(deletable(&inv, &o).is_empty());
        let none = select(
            &InfraSpec::cozystack(),
            "kubernetes-a",
            NS,
            None,
            &[meta("pvc-1", &[MINE])],
            &[],
            &[],
        );
        assert_eq!(
            none.objects.len(),
            1,
            "a labelled object is held without an inventory"
        );
    }

    #[test]
    fn the_description_names_each_layer_and_what_holds_it() {
        let mut dv = meta("pvc-1", &[MINE]);
        dv.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            Default::default(),
        ));
        dv.finalizers = Some(vec!["example.com/keep".into()]);
        let o = select(
            &InfraSpec::cozystack(),
            "kubernetes-a",
            NS,
            None,
            &[dv],
            &[pvc("pvc-1", &[MINE], Some("pvc-1"), Some("pv-m1"))],
            &[],
        );
        assert_eq!(
            o.describe("DataVolume", 5),
            "1 DataVolume (pvc-1, being deleted, held by finalizers example.com/keep), 1 PVC (pvc-1 (pv-m1))"
        );
    }

    #[test]
    fn what_is_kept_from_the_management_side_is_explained_case_by_case() {
        let spec = InfraSpec::cozystack();
        let labels = "cluster.x-k8s.io/cluster-name=kubernetes-a";
        let held = |names: &[&str]| Observed {
            served: true,
            objects: names
                .iter()
                .map(|n| Held {
                    name: n.to_string(),
                    labelled: true,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        let mut unmapped_inv = inventory(&[("pvc-1", "Delete")]);
        unmapped_inv.volumes.push(Volume {
            pv: "tenant-nfs".into(),
            driver: Some("nfs.csi.k8s.io".into()),
            handle: Some("server/share".into()),
            capacity: None,
            reclaim: "Delete".into(),
            claim: None,
            gone: false,
            infra: None,
        });
        let cases: Vec<(&str, Option<Inventory>, Observed, Vec<&str>)> = vec![
            (
                "no inventory",
                None,
                held(&["pvc-1"]),
                vec!["no inventory was taken while the tenant API answered"],
            ),
            (
                "retained",
                Some(inventory(&[("pvc-1", "Retain"), ("pvc-2", "Delete")])),
                held(&["pvc-1"]),
                vec!["1 volume with reclaim policy Retain, kept by design"],
            ),
            (
                "labelled stranger",
                Some(inventory(&[("pvc-1", "Delete")])),
                held(&["pvc-1", "pvc-7", "pvc-8"]),
                vec![
                    "2 DataVolumes labelled cluster.x-k8s.io/cluster-name=kubernetes-a but named by no inventoried volume, so kept: pvc-7, pvc-8",
                ],
            ),
            (
                "unmapped handle",
                Some(unmapped_inv),
                held(&[]),
                vec![
                    "1 volume whose volumeHandle names nothing in the management cluster: tenant-nfs (driver nfs.csi.k8s.io, volumeHandle server/share)",
                ],
            ),
            (
                "only deletable objects left",
                Some(inventory(&[("pvc-1", "Delete")])),
                held(&["pvc-1"]),
                vec![],
            ),
        ];
        for (name, inv, observed, want) in cases {
            let got = kept_reasons(inv.as_ref(), &observed, &spec, labels);
            assert_eq!(got.len(), want.len(), "{name}: {got:?}");
            for (g, w) in got.iter().zip(&want) {
                assert!(g.starts_with(w), "{name}: {g:?} does not start with {w:?}");
            }
        }
    }

    /// A management PV of the tenant, bound to its PVC `claim`, with
    /// `reclaim`, kept before (with the policy it had) or not.
    fn disk(name: &str, claim: &str, reclaim: &str, kept_from: Option<&str>) -> Held {
        Held {
            name: name.into(),
            claim: Some(claim.into()),
            reclaim: Some(reclaim.into()),
            kept_from: kept_from.map(str::to_string),
            ..Default::default()
        }
    }

    fn with_disks(disks: Vec<Held>) -> Observed {
        Observed {
            served: true,
            volumes: disks,
            ..Default::default()
        }
    }

    #[test]
    fn a_disk_whose_tenant_volume_is_not_delete_is_kept_and_let_go_when_it_becomes_delete() {
        let mut inv = inventory(&[("pvc-1", "Retain"), ("pvc-2", "Delete")]);
        let observed = with_disks(vec![
            disk("mgmt-1", "pvc-1", "Delete", None),
            disk("mgmt-2", "pvc-2", "Delete", None),
            disk("mgmt-x", "stranger", "Delete", None),
        ]);
        note_pvs(&mut inv, &observed);
        // The API answers: only the Retain volume's disk; a disk no
        // inventory names may be a volume still being provisioned.
        let plan = keep_plan(Some(&inv), &observed, true);
        assert_eq!(
            plan,
            vec![Keep::Pin {
                pv: "mgmt-1".into(),
                reclaim_was: "Delete".into(),
                volume: format!(
                    "tenant volume {} (reclaim policy Retain)",
                    inv.volumes[0].describe()
                ),
            }]
        );
        let kept = kept_after(&observed, &plan);
        mark_kept(&mut inv, &kept);
        assert_eq!(
            inv.volumes
                .iter()
                .map(|v| v.infra.as_ref().unwrap().kept)
                .collect::<Vec<_>>(),
            [true, false]
        );
        // The API cannot say any more (or an override ends it): the same;
        // a disk no inventory names is not a tenant volume.
        assert_eq!(keep_plan(Some(&inv), &observed, false), plan);
        // No inventory at all: every disk is kept.
        assert_eq!(keep_plan(None, &observed, false).len(), 3);
        // Kept already: nothing to do; its volume turned Delete: let go,
        // back to the policy it had.
        let observed = with_disks(vec![disk("mgmt-1", "pvc-1", "Retain", Some("Delete"))]);
        assert!(keep_plan(Some(&inv), &observed, true).is_empty());
        inv.volumes[0].reclaim = "Delete".into();
        assert_eq!(
            keep_plan(Some(&inv), &observed, true),
            vec![Keep::Unpin {
                pv: "mgmt-1".into(),
                reclaim_was: "Delete".into()
            }]
        );
        // Gone from the tenant with its DataVolume: freed by the driver, so
        // turned Delete after the last pass read it; let go.
        inv.volumes[0].reclaim = "Retain".into();
        inv.volumes[0].gone = true;
        assert_eq!(
            keep_plan(Some(&inv), &observed, true),
            vec![Keep::Unpin {
                pv: "mgmt-1".into(),
                reclaim_was: "Delete".into()
            }]
        );
        // Gone from the tenant but its DataVolume still there (the PV was
        // deleted by hand, Retain): kept.
        let with_dv = Observed {
            objects: vec![Held {
                name: "pvc-1".into(),
                ..Default::default()
            }],
            ..observed.clone()
        };
        assert!(keep_plan(Some(&inv), &with_dv, true).is_empty());
        inv.volumes[0].gone = false;
        // A PV already being deleted is past keeping.
        let mut going = disk("mgmt-2", "pvc-2", "Delete", None);
        going.deleting = true;
        inv.volumes[1].reclaim = "Retain".into();
        assert!(keep_plan(Some(&inv), &with_disks(vec![going]), true).is_empty());
    }
}
