//! Where a release pass ends: every [`Outcome`] the phase records is built
//! here, by pure functions of what the steps found. The steps (in
//! `mod.rs`, `management.rs` and `infra_snapshots.rs`) read, delete and
//! wait; none of them decides `Released` or words a `Blocked` message
//! itself, so what each outcome means, and what it tells the operator to
//! do, is in this one file.

use std::collections::BTreeSet;
use std::time::Duration;

use super::holders;
use crate::record::{Inventory, Volume, now_rfc3339};
use crate::text::{count, listed};
use crate::worker::ErrorKind;

/// Where the phase ended up on this pass.
#[derive(Debug)]
pub enum Outcome {
    /// Every inventoried PV is gone, and with the profile's infra layer
    /// every disk behind them; `note` says how, when it is not the usual way.
    Released {
        inventory: Inventory,
        note: Option<String>,
    },
    /// Something stands in the way; retried with backoff.
    Blocked {
        reason: ErrorKind,
        message: String,
        inventory: Option<Inventory>,
    },
}

/// A step could not go on: `Blocked` for `reason`, saying `message`,
/// keeping the inventory the pass had.
pub(super) fn blocked(reason: ErrorKind, message: String, inventory: Option<Inventory>) -> Outcome {
    Outcome::Blocked {
        reason,
        message,
        inventory,
    }
}

/// Step 7 on the tenant side, from a fresh list: what is left of the
/// inventory, the VolumeSnapshotContents not gone, and what holds the
/// volumes left. `None` when nothing is left there: the pass goes on to
/// the management side (with an infra layer), or is [`released`].
pub(super) fn tenant_side(
    inv: &Inventory,
    contents_left: &BTreeSet<String>,
    facts: &holders::Facts,
    wait_bound: Duration,
    infra: bool,
) -> Option<Outcome> {
    let remaining: Vec<&Volume> = inv.remaining().filter(|v| !v.is_retain()).collect();
    let retained: Vec<&Volume> = inv.remaining().filter(|v| v.is_retain()).collect();
    if remaining.is_empty() && retained.is_empty() && contents_left.is_empty() {
        return None;
    }
    let mut parts = Vec::new();
    if !remaining.is_empty() {
        // The remedy for a dead node first: a long list is cut at the end.
        let hint = holders::remedy(&remaining, facts)
            .unwrap_or_else(|| "is the CSI driver running?".to_string());
        parts.push(format!(
            "{} of {} not freed, none for {}s ({hint}): {}",
            remaining.len(),
            count(inv.total, "volume"),
            wait_bound.as_secs(),
            remaining
                .iter()
                .map(|v| match holders::explain(v, facts) {
                    Some(why) => format!("{} [{why}]", v.describe()),
                    None => v.describe(),
                })
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    if !retained.is_empty() {
        // Only a profile with an infra layer has a management side that
        // keeps them too (the worker sets its PVs to Retain).
        let too = if infra {
            " (on the management side too: their PVs there now have reclaim policy Retain)"
        } else {
            ""
        };
        parts.push(format!(
            "{} with reclaim policy Retain, kept on storage by design{too}; set persistentVolumeReclaimPolicy \
             to Delete in the tenant to free them, or record an override to end the teardown with them kept: {}",
            count(retained.len(), "volume"),
            retained.iter().map(|v| v.describe()).collect::<Vec<_>>().join(", ")
        ));
    }
    if !contents_left.is_empty() {
        parts.push(format!(
            "{} VolumeSnapshotContents not deleted: {}",
            contents_left.len(),
            contents_left.iter().cloned().collect::<Vec<_>>().join(", ")
        ));
    }
    let reason = if remaining.is_empty() && contents_left.is_empty() {
        ErrorKind::RetainResidue
    } else {
        ErrorKind::VolumesRemain
    };
    Some(blocked(reason, parts.join("; "), Some(inv.clone())))
}

/// Nothing of the tenant's is left on storage. `note` says how, when it is
/// not the usual way; `kept` names the snapshots kept on purpose.
pub(super) fn released(
    inventory: Inventory,
    note: Option<String>,
    kept: Option<String>,
) -> Outcome {
    let note = match (note, kept) {
        (Some(n), Some(k)) => Some(format!("{n}; {k}")),
        (n, k) => n.or(k),
    };
    Outcome::Released { inventory, note }
}

/// The tenant's PVs are gone, and disks behind them still are on the
/// management side after the wait (`held`, described).
pub(super) fn disks_remain(
    inv: Inventory,
    held: &str,
    kind: &str,
    wait_bound: Duration,
) -> Outcome {
    blocked(
        ErrorKind::VolumesRemain,
        format!(
            "the tenant's PVs are gone, but the management cluster still holds disks behind them, none freed for {}s: {held} \
             (a finalizer on a {kind}, or a Pod mounting its PVC, keeps a disk; the disk is freed when the management PV goes)",
            wait_bound.as_secs(),
        ),
        Some(inv),
    )
}

/// The disks are freed, but the management storage still holds snapshots
/// being deleted after the wait (`left`).
pub(super) fn snapshots_remain(inv: Inventory, left: &[String], wait_bound: Duration) -> Outcome {
    blocked(
        ErrorKind::VolumesRemain,
        format!(
            "the disks are freed, but the management storage still holds {} being deleted, none gone for {}s: {} \
             (the storage frees a snapshot when the csi-snapshotter there has deleted it and its \
             VolumeSnapshotContent goes; what keeps one is in the events of its VolumeSnapshot or \
             VolumeSnapshotContent there: a claim restoring from it, a failing DeleteSnapshot, a finalizer, \
             or no snapshot controller running)",
            count(left.len(), "snapshot"),
            wait_bound.as_secs(),
            listed(left, 5)
        ),
        Some(inv),
    )
}

/// The tenant API cannot be reached (`why`) and the management side does
/// not serve the infra kind: nothing can be read there either.
pub(super) fn unreachable_unserved(
    kind: ErrorKind,
    why: &str,
    plural: &str,
    group: &str,
    inv: Option<Inventory>,
) -> Outcome {
    blocked(
        kind,
        format!(
            "{why}; the management cluster does not serve {plural}.{group}, so the disks cannot be read there either"
        ),
        inv,
    )
}

/// The tenant API cannot be reached, not yet for `--infra-after`: the
/// `deletable` volumes are freed from the management side in `left`.
pub(super) fn unreachable_waiting(
    kind: ErrorKind,
    why: &str,
    held: &str,
    left: Duration,
    deletable: usize,
    inv: Option<Inventory>,
) -> Outcome {
    blocked(
        kind,
        format!(
            "{why}; the management cluster holds {held}; if the tenant API stays unreachable {}s more, \
             the phase frees from there the {} inventoried with reclaim policy Delete",
            left.as_secs().max(1),
            count(deletable, "volume"),
        ),
        inv,
    )
}

/// The tenant API cannot be reached, and the management side keeps disks
/// (`held`) for the `reasons` given.
pub(super) fn unreachable_kept(
    kind: ErrorKind,
    why: String,
    held: &str,
    reasons: Vec<String>,
    inv: Option<Inventory>,
) -> Outcome {
    let mut parts = vec![why, format!("the management cluster holds {held}")];
    parts.extend(reasons);
    blocked(kind, parts.join("; "), inv)
}

/// The tenant API cannot be reached (`why`) and the management cluster
/// holds no disk of it: every inventoried volume is gone. Returns the
/// inventory so marked, how many were newly marked, and the note saying
/// how (the volumes freed from there, or none found under `labels`).
pub(super) fn gone_from_management(
    inv: Option<Inventory>,
    why: &str,
    labels: &str,
    kind: &str,
) -> (Inventory, usize, String) {
    let mut inventory = inv.unwrap_or_else(|| Inventory::new(now_rfc3339(), Vec::new()));
    let mut newly = 0;
    for v in inventory.volumes.iter_mut().filter(|v| !v.gone) {
        v.gone = true;
        newly += 1;
    }
    inventory.freed = inventory.total;
    let freed_here = inventory
        .volumes
        .iter()
        .filter(|v| v.infra.as_ref().is_some_and(|r| r.freed_here))
        .count();
    let note = if freed_here > 0 {
        format!(
            "the tenant API cannot be reached ({why}); {} freed from the management side, and no disk of the tenant is left there",
            count(freed_here, "volume")
        )
    } else {
        format!(
            "the tenant API cannot be reached ({why}), and the management cluster holds no disk of it \
             (no {kind}, PVC or PV labelled {labels} or named by the inventory)"
        )
    };
    (inventory, newly, note)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Volume;

    fn volume(pv: &str, retain: bool, gone: bool) -> Volume {
        Volume {
            pv: pv.into(),
            driver: None,
            handle: None,
            capacity: None,
            reclaim: if retain { "Retain" } else { "Delete" }.into(),
            claim: Some(format!("ns/{pv}")),
            gone,
            infra: None,
        }
    }

    fn inventory(vs: Vec<Volume>) -> Inventory {
        Inventory::new("2026-12-07T08:00:00Z".into(), vs)
    }

    #[test]
    fn nothing_left_on_the_tenant_side_goes_on() {
        let inv = inventory(vec![volume("pv-a", false, true)]);
        let none = tenant_side(
            &inv,
            &BTreeSet::new(),
            &holders::Facts::default(),
            Duration::from_secs(60),
            true,
        );
        assert!(none.is_none());
    }

    #[test]
    fn a_kept_volume_names_the_management_side_only_where_there_is_one() {
        let inv = inventory(vec![volume("pv-a", true, false)]);
        for (infra, says) in [(true, true), (false, false)] {
            let Some(Outcome::Blocked {
                reason, message, ..
            }) = tenant_side(
                &inv,
                &BTreeSet::new(),
                &holders::Facts::default(),
                Duration::from_secs(60),
                infra,
            )
            else {
                panic!("a kept volume blocks");
            };
            assert_eq!(reason, ErrorKind::RetainResidue);
            assert_eq!(
                message.contains("management side"),
                says,
                "infra {infra}: {message}"
            );
        }
    }

    #[test]
    fn a_volume_not_freed_is_named_with_the_wait() {
        let inv = inventory(vec![
            volume("pv-a", false, false),
            volume("pv-b", false, true),
        ]);
        let Some(Outcome::Blocked {
            reason, message, ..
        }) = tenant_side(
            &inv,
            &BTreeSet::new(),
            &holders::Facts::default(),
            Duration::from_secs(60),
            true,
        )
        else {
            panic!("a volume left blocks");
        };
        assert_eq!(reason, ErrorKind::VolumesRemain);
        assert!(
            message.starts_with("1 of 2 volumes not freed, none for 60s"),
            "{message}"
        );
        assert!(message.contains("pv-a"), "{message}");
    }

    #[test]
    fn released_joins_how_and_what_was_kept() {
        let inv = inventory(Vec::new());
        let Outcome::Released { note, .. } =
            released(inv, Some("how".into()), Some("but 1 snapshot kept".into()))
        else {
            panic!("released");
        };
        assert_eq!(note.as_deref(), Some("how; but 1 snapshot kept"));
    }

    #[test]
    fn gone_from_management_marks_every_volume_and_counts_the_new_ones() {
        let inv = inventory(vec![
            volume("pv-a", false, false),
            volume("pv-b", false, true),
        ]);
        let (inv, newly, note) = gone_from_management(Some(inv), "no answer", "l=t", "DataVolume");
        assert_eq!(newly, 1);
        assert_eq!(inv.freed, inv.total);
        assert!(inv.volumes.iter().all(|v| v.gone));
        assert!(
            note.contains("holds no disk of it (no DataVolume, PVC or PV labelled l=t"),
            "{note}"
        );
    }
}
