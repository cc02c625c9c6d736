//! Pure pieces of the release phase: the inventory of a tenant's PVs and the
//! matching of Pods to the claims they mount.

use std::collections::{BTreeSet, HashMap, HashSet};

use k8s_openapi::api::core::v1::{PersistentVolume, Pod};

use crate::profile::InfraSpec;
use crate::record::{Inventory, MAX_FIELD_BYTES, Volume};
use crate::text::bounded;

/// A claim, `namespace/name`.
pub type ClaimKey = (String, String);

/// One inventory entry per PV, as it is now.
pub fn volume_of(pv: &PersistentVolume) -> Volume {
    let spec = pv.spec.as_ref();
    let csi = spec.and_then(|s| s.csi.as_ref());
    // Every field is bounded: the tenant writes these objects (fuzz F6).
    let b = |s: &str| bounded(s, MAX_FIELD_BYTES);
    Volume {
        pv: b(pv.metadata.name.as_deref().unwrap_or_default()),
        driver: csi.map(|c| b(&c.driver)),
        handle: csi.map(|c| b(&c.volume_handle)),
        capacity: spec
            .and_then(|s| s.capacity.as_ref())
            .and_then(|c| c.get("storage"))
            .map(|q| b(&q.0)),
        reclaim: b(spec
            .and_then(|s| s.persistent_volume_reclaim_policy.as_deref())
            .unwrap_or("Delete")),
        claim: spec.and_then(|s| s.claim_ref.as_ref()).map(|c| {
            b(&format!(
                "{}/{}",
                c.namespace.as_deref().unwrap_or(""),
                c.name.as_deref().unwrap_or("")
            ))
        }),
        gone: false,
        infra: None,
    }
}

/// Brings an inventory up to date with the PVs that exist now: PVs missing
/// from `current` are gone, PVs not yet inventoried are added (a claim
/// provisioned after the first pass is still the tenant's disk). Works from
/// a truncated record too: counts carry over, and every PV present now is
/// listed in the result (truncation happens only when it is written).
/// With an infra layer, each volume names the management object behind it.
pub fn reconcile_inventory(
    previous: Option<&Inventory>,
    current: &[PersistentVolume],
    now: &str,
    infra: Option<&InfraSpec>,
) -> Inventory {
    let present: HashSet<&str> = current
        .iter()
        .filter_map(|pv| pv.metadata.name.as_deref())
        .collect();
    let (mut total, taken_at, unlisted_remaining) = match previous {
        Some(p) => {
            let listed_gone = p.volumes.iter().filter(|v| v.gone).count();
            let unlisted = p.total.saturating_sub(p.volumes.len());
            let unlisted_freed = p.freed.saturating_sub(listed_gone);
            (
                p.total,
                p.taken_at.clone(),
                unlisted.saturating_sub(unlisted_freed),
            )
        }
        None => (0, now.to_string(), 0),
    };
    let mut volumes: Vec<Volume> = Vec::new();
    let mut known: HashSet<String> = HashSet::new();
    // A present PV's reclaim policy is read again: the tenant's admin may
    // turn a Retain volume to Delete to have it freed (the Blocked message
    // says so), and the kept disk behind it must then be let go.
    let reclaim_now: HashMap<&str, String> = current
        .iter()
        .filter_map(|pv| Some((pv.metadata.name.as_deref()?, volume_of(pv).reclaim)))
        .collect();
    for v in previous.map(|p| p.volumes.as_slice()).unwrap_or_default() {
        let mut v = v.clone();
        v.gone = v.gone || !present.contains(v.pv.as_str());
        if let Some(policy) = reclaim_now.get(v.pv.as_str()).filter(|_| !v.gone) {
            v.reclaim = policy.clone();
        }
        known.insert(v.pv.clone());
        volumes.push(v);
    }
    let mut added: usize = 0;
    for pv in current {
        let name = pv.metadata.name.as_deref().unwrap_or_default();
        if !known.contains(name) {
            volumes.push(volume_of(pv));
            added += 1;
        }
    }
    // PVs the truncated record did not list are found again, not new.
    total += added.saturating_sub(unlisted_remaining);
    let present_count = volumes.iter().filter(|v| !v.gone).count();
    let mut inv = Inventory::new(taken_at, volumes);
    inv.total = total.max(present_count);
    inv.freed = inv.total - present_count;
    if let Some(infra) = infra {
        super::disks::attach_refs(&mut inv, infra);
    }
    inv
}

/// The claims each Pod mounts: `persistentVolumeClaim.claimName`, and the
/// claim `<pod>-<volume>` of each generic ephemeral volume. Matching is done
/// here in code: a Pod can mount several claims (docs/design.md §0, the JSONPath lesson).
pub fn claims_of(pod: &Pod) -> Vec<ClaimKey> {
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let pod_name = pod.metadata.name.clone().unwrap_or_default();
    let Some(spec) = pod.spec.as_ref() else {
        return Vec::new();
    };
    spec.volumes
        .iter()
        .flatten()
        .filter_map(|v| {
            if let Some(pvc) = &v.persistent_volume_claim {
                Some((ns.clone(), pvc.claim_name.clone()))
            } else {
                v.ephemeral
                    .as_ref()
                    .map(|_| (ns.clone(), format!("{pod_name}-{}", v.name)))
            }
        })
        .collect()
}

/// Pods (`namespace/name`) that mount any of `claims`, sorted.
pub fn pods_holding(pods: &[Pod], claims: &HashSet<ClaimKey>) -> Vec<ClaimKey> {
    let mut out = BTreeSet::new();
    for pod in pods {
        if claims_of(pod).iter().any(|c| claims.contains(c)) {
            out.insert((
                pod.metadata.namespace.clone().unwrap_or_default(),
                pod.metadata.name.clone().unwrap_or_default(),
            ));
        }
    }
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        CSIPersistentVolumeSource, EphemeralVolumeSource, ObjectReference,
        PersistentVolumeClaimVolumeSource, PersistentVolumeSpec, PodSpec, Volume as PodVolume,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use kube::api::ObjectMeta;

    fn pod(ns: &str, name: &str, volumes: Vec<PodVolume>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                namespace: Some(ns.into()),
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                volumes: Some(volumes),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn pvc_vol(volume: &str, claim: &str) -> PodVolume {
        PodVolume {
            name: volume.into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.into(),
                read_only: None,
            }),
            ..Default::default()
        }
    }

    fn ephemeral_vol(volume: &str) -> PodVolume {
        PodVolume {
            name: volume.into(),
            ephemeral: Some(EphemeralVolumeSource::default()),
            ..Default::default()
        }
    }

    fn other_vol(volume: &str) -> PodVolume {
        PodVolume {
            name: volume.into(),
            ..Default::default()
        }
    }

    fn key(ns: &str, n: &str) -> ClaimKey {
        (ns.into(), n.into())
    }

    fn pv(name: &str, reclaim: &str) -> PersistentVolume {
        PersistentVolume {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(PersistentVolumeSpec {
                csi: Some(CSIPersistentVolumeSource {
                    driver: "d".into(),
                    volume_handle: format!("h-{name}"),
                    ..Default::default()
                }),
                capacity: Some([("storage".to_string(), Quantity("1Gi".into()))].into()),
                persistent_volume_reclaim_policy: Some(reclaim.into()),
                claim_ref: Some(ObjectReference {
                    namespace: Some("default".into()),
                    name: Some(format!("c-{name}")),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_huge_volume_handle_is_kept_bounded_and_marked() {
        let mut p = pv("pv-a", "Delete");
        p.spec.as_mut().unwrap().csi.as_mut().unwrap().volume_handle = "x".repeat(80_000);
        let v = volume_of(&p);
        let handle = v.handle.unwrap();
        assert!(
            handle.len() <= crate::record::MAX_FIELD_BYTES && handle.ends_with("…[80000 bytes]"),
            "{}",
            handle.len()
        );
        assert_eq!(v.pv, "pv-a");
    }

    #[test]
    fn a_pod_mounting_two_claims_is_found_for_either() {
        let pods = vec![pod(
            "db",
            "pg-0",
            vec![
                pvc_vol("data", "data-pg-0"),
                pvc_vol("wal", "wal-pg-0"),
                other_vol("cfg"),
            ],
        )];
        for claim in ["data-pg-0", "wal-pg-0"] {
            let claims = HashSet::from([key("db", claim)]);
            assert_eq!(
                pods_holding(&pods, &claims),
                vec![key("db", "pg-0")],
                "{claim}"
            );
        }
    }

    #[test]
    fn claims_match_only_in_their_own_namespace() {
        let pods = vec![pod("a", "p", vec![pvc_vol("v", "data")])];
        assert!(pods_holding(&pods, &HashSet::from([key("b", "data")])).is_empty());
    }

    #[test]
    fn a_generic_ephemeral_volume_is_the_claim_pod_dash_volume() {
        let p = pod("ns", "web-7f9", vec![ephemeral_vol("scratch")]);
        assert_eq!(claims_of(&p), vec![key("ns", "web-7f9-scratch")]);
        assert_eq!(
            pods_holding(&[p], &HashSet::from([key("ns", "web-7f9-scratch")])),
            vec![key("ns", "web-7f9")]
        );
    }

    #[test]
    fn pods_without_claims_are_left_alone() {
        let pods = vec![pod("ns", "a", vec![other_vol("x")]), pod("ns", "b", vec![])];
        assert!(pods_holding(&pods, &HashSet::from([key("ns", "x")])).is_empty());
    }

    #[test]
    fn each_holding_pod_is_listed_once_sorted() {
        let pods = vec![
            pod("ns", "b", vec![pvc_vol("1", "c1"), pvc_vol("2", "c2")]),
            pod("ns", "a", vec![pvc_vol("1", "c1")]),
        ];
        let claims = HashSet::from([key("ns", "c1"), key("ns", "c2")]);
        assert_eq!(
            pods_holding(&pods, &claims),
            vec![key("ns", "a"), key("ns", "b")]
        );
    }

    #[test]
    fn a_volume_records_driver_handle_capacity_reclaim_and_claim() {
        let v = volume_of(&pv("pv1", "Retain"));
        assert_eq!(v.driver.as_deref(), Some("d"));
        assert_eq!(v.handle.as_deref(), Some("h-pv1"));
        assert_eq!(v.capacity.as_deref(), Some("1Gi"));
        assert!(v.is_retain());
        assert_eq!(v.claim.as_deref(), Some("default/c-pv1"));
    }

    #[test]
    fn inventory_marks_missing_pvs_gone_and_adds_new_ones() {
        let first = reconcile_inventory(None, &[pv("a", "Delete"), pv("b", "Delete")], "t0", None);
        assert_eq!((first.total, first.freed), (2, 0));
        let second = reconcile_inventory(
            Some(&first),
            &[pv("b", "Delete"), pv("c", "Delete")],
            "t1",
            None,
        );
        assert_eq!(
            second.taken_at, "t0",
            "the inventory keeps the time it was first taken"
        );
        assert_eq!((second.total, second.freed, second.left()), (3, 1, 2));
        assert!(second.volumes.iter().find(|v| v.pv == "a").unwrap().gone);
        // A PV once gone stays gone, even if a PV of that name reappears.
        let third = reconcile_inventory(
            Some(&second),
            &[pv("a", "Delete"), pv("c", "Delete")],
            "t2",
            None,
        );
        assert!(third.volumes.iter().find(|v| v.pv == "a").unwrap().gone);
    }

    #[test]
    fn a_truncated_record_keeps_its_counts() {
        // 10 volumes, 6 freed; the record lists only 3 remaining ones.
        let mut listed = reconcile_inventory(
            None,
            &[pv("a", "Delete"), pv("b", "Delete"), pv("c", "Delete")],
            "t0",
            None,
        );
        listed.total = 10;
        listed.freed = 6;
        listed.truncated = true;
        // Now present: a, b, c and the unlisted remaining d; e is new.
        let now = [
            pv("a", "Delete"),
            pv("b", "Delete"),
            pv("c", "Delete"),
            pv("d", "Delete"),
            pv("e", "Delete"),
        ];
        let inv = reconcile_inventory(Some(&listed), &now, "t1", None);
        assert_eq!(inv.total, 11, "d was known, e is new");
        assert_eq!(inv.left(), 5);
        assert_eq!(inv.freed, 6);
        assert_eq!(inv.volumes.len(), 5, "every present PV is listed in memory");
    }
}
