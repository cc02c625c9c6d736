//! What the worker does next for one tenant (`docs/design.md` §2, §5), as a
//! pure function of what it sees: the parent's metadata, its namespace, and
//! the state of the tenant's phase task. No I/O here; `reconcile` carries the
//! answer out, and the tests below cover every branch.

use std::time::Duration;

use crate::record::{Inventory, Override, Phase, Record};
use crate::text::count;

/// The state of the tenant's release-phase task in this worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Task {
    /// No task, or one that has ended.
    Idle,
    /// A task is running; it triggers a reconcile when it ends.
    Running,
    /// The last pass failed; the next may start in this long.
    RetryIn(Duration),
}

/// What a reconcile sees of a tenant.
#[derive(Clone, Copy, Debug)]
pub struct Seen<'a> {
    /// The object carries the profile's parent labels.
    pub is_parent: bool,
    pub record: &'a Record,
    /// The custody finalizer is on the parent.
    pub in_custody: bool,
    /// The parent has a deletionTimestamp.
    pub deleting: bool,
    /// Its namespace has a deletionTimestamp.
    pub namespace_deleting: bool,
    pub task: Task,
    /// Flux retry requests after the outcome: `None` when the profile asks
    /// for none (a platform without Flux).
    pub request: Option<Requests>,
}

/// The retry requests (`reconcile.fluxcd.io/requestedAt`) made for a parent
/// whose outcome is recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Requests {
    /// Time since the last request on the parent; `None` when it carries
    /// none (or one that does not parse).
    pub since_last: Option<Duration>,
    /// Requests this worker has made since the outcome (0 after a restart).
    pub made: u32,
    /// The delay before request `made + 1`: the worker's retry backoff.
    pub wait: Duration,
}

/// The worker's next step for a tenant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// Nothing to do until the parent changes.
    Wait,
    /// Not a tenant parent: ignore it.
    Ignore,
    /// A live tenant: add the custody finalizer (then bind, if `bind`).
    TakeCustody { bind: bool },
    /// A live tenant in custody whose cluster is not bound yet.
    BindCluster,
    /// Being deleted before custody began: nothing can hold it; say so.
    DeletedWithoutCustody,
    /// Released (the worker may have crashed before ending custody): end it.
    EndCustody,
    /// An override is recorded: stop any pass, keep what must stay of the
    /// disks, write `Overridden` (unless already written: `record`), end
    /// custody.
    Override { record: bool },
    /// A pass is running; its end triggers the next reconcile.
    AwaitPass,
    /// The last pass failed; look again in this long.
    RetryIn(Duration),
    /// Start a release pass.
    StartPass,
    /// Done and out of custody, the parent still going: ask its controller
    /// to retry the uninstall again (the request the outcome made found it
    /// failing, e.g. a hook that cannot start in a terminating namespace,
    /// and Flux's own backoff may be 15 minutes by now).
    RequestRetry,
}

/// The next step for a tenant.
pub fn next(seen: Seen<'_>) -> Next {
    if !seen.is_parent {
        return Next::Ignore;
    }
    let record = seen.record;
    let teardown = seen.deleting || seen.namespace_deleting;
    if !teardown {
        return match (seen.in_custody, record.cluster.is_some()) {
            (false, bound) => Next::TakeCustody { bind: !bound },
            (true, false) => Next::BindCluster,
            (true, true) => Next::Wait,
        };
    }
    if !seen.in_custody && record.is_done() && seen.deleting {
        return match seen.request {
            None => Next::Wait,
            Some(r) => match r.since_last {
                Some(since) if since < r.wait => Next::RetryIn(r.wait - since),
                _ => Next::RequestRetry,
            },
        };
    }
    if !seen.in_custody {
        // Loud only when it matters: the parent itself is going and nothing
        // was ever recorded.
        let unreleased = record.phase.is_none() && !record.is_done() && seen.deleting;
        return if unreleased {
            Next::DeletedWithoutCustody
        } else {
            Next::Wait
        };
    }
    if record.phase == Some(Phase::Released) {
        return Next::EndCustody;
    }
    if record.stamped_override().is_some() {
        return Next::Override {
            record: record.phase != Some(Phase::Overridden),
        };
    }
    match seen.task {
        Task::Running => Next::AwaitPass,
        Task::RetryIn(delay) if !delay.is_zero() => Next::RetryIn(delay),
        Task::RetryIn(_) | Task::Idle => Next::StartPass,
    }
}

/// What an override leaves, as the worker has made it: the disks it keeps
/// on the management side (`kept`: their PVs, `None` on a platform without
/// an infra layer), found by `finder`.
pub struct Leaves<'a> {
    pub inventory: Option<&'a Inventory>,
    pub kept: Option<&'a std::collections::BTreeSet<String>>,
    /// Infra objects (by name) whose management PVC no infra object of the
    /// tenant owns: deleting DataVolumes does not take those PVCs.
    pub unowned: Option<&'a std::collections::BTreeSet<String>>,
    pub finder: &'a str,
}

/// The record's message for an override: who, why, and, truly, what stays
/// on storage and what goes (`docs/design.md` §5c).
pub fn override_message(ov: &Override, leaves: &Leaves<'_>) -> String {
    let by = ov.by.as_deref().unwrap_or("?");
    let head = format!("override by {by} ({})", ov.reason.trim());
    let names = |vs: &[&crate::record::Volume]| {
        let shown: Vec<String> = vs.iter().take(20).map(|v| v.describe()).collect();
        let more = vs.len().saturating_sub(shown.len());
        if more > 0 {
            format!("{} and {more} more", shown.join(", "))
        } else {
            shown.join(", ")
        }
    };
    let Some(kept) = leaves.kept else {
        // One layer: the tenant's driver alone could free a disk.
        return match leaves.inventory {
            Some(i) => {
                let left: Vec<_> = i.remaining().collect();
                let listed = if left.is_empty() {
                    String::new()
                } else {
                    format!(": {}", names(&left))
                };
                format!(
                    "{head}: {} left on storage, kept (Retain) or not freed by the driver{listed}",
                    count(i.left(), "volume")
                )
            }
            None => {
                format!("{head}: no inventory was taken: the volumes left on storage are unknown")
            }
        };
    };
    let mut parts = Vec::new();
    if !kept.is_empty() {
        let shown: Vec<&str> = kept.iter().take(20).map(String::as_str).collect();
        parts.push(format!(
            "{} on storage, kept: their management PVs ({}) now have reclaim policy Retain, so whatever \
             deletes their DataVolumes (the teardown's hook, the namespace) leaves the disk; find them with \
             `{}`",
            verb(kept.len(), "disk", "stays", "stay"),
            shown.join(", "),
            leaves.finder
        ));
    }
    if let Some(i) = leaves.inventory {
        let unowned = |v: &&crate::record::Volume| {
            v.infra
                .as_ref()
                .is_some_and(|r| leaves.unowned.is_some_and(|u| u.contains(&r.name)))
        };
        let not_kept: Vec<_> = i
            .remaining()
            .filter(|v| v.infra.as_ref().is_some_and(|r| !r.kept))
            .collect();
        let (stays, goes): (Vec<_>, Vec<_>) = not_kept.into_iter().partition(unowned);
        if !stays.is_empty() {
            parts.push(format!(
                "{} not freed by the driver {} on storage until {} PVC is deleted: no DataVolume owns it any \
                 more (CDI collected it after completion, or its owner reference was removed), so deleting \
                 DataVolumes does not take it: {}",
                count(stays.len(), "volume"),
                if stays.len() == 1 { "stays" } else { "stay" },
                if stays.len() == 1 { "its" } else { "their" },
                names(&stays)
            ));
        }
        if !goes.is_empty() {
            parts.push(format!(
                "{} not freed by the driver {} with their DataVolumes when the teardown deletes them: {}",
                count(goes.len(), "volume"),
                if goes.len() == 1 { "goes" } else { "go" },
                names(&goes)
            ));
        }
        let unmapped: Vec<_> = i.remaining().filter(|v| v.infra.is_none()).collect();
        if !unmapped.is_empty() {
            parts.push(format!(
                "{} with nothing behind in the management cluster {} wherever their driver keeps them: {}",
                count(unmapped.len(), "volume"),
                if unmapped.len() == 1 { "stays" } else { "stay" },
                names(&unmapped)
            ));
        }
    } else {
        parts.push(
            "no inventory was taken: every disk of the tenant found on the management side is kept"
                .into(),
        );
    }
    if parts.is_empty() {
        parts.push("nothing is left on storage".into());
    }
    format!("{head}: {}", parts.join("; "))
}

/// `2 disks stay` / `1 disk stays`.
fn verb(n: usize, noun: &str, one: &str, many: &str) -> String {
    format!("{} {}", count(n, noun), if n == 1 { one } else { many })
}

/// The delay before retry `attempts` (1-based): `base` doubling up to `max`.
pub fn backoff(base: Duration, max: Duration, attempts: u32) -> Duration {
    let factor = 2u32.saturating_pow(attempts.saturating_sub(1).min(16));
    base.saturating_mul(factor).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{ClusterIdentity, Keys};

    fn record(pairs: &[(&str, &str)]) -> Record {
        let keys = Keys::new("volumes.cozystack.io/");
        let ann = pairs
            .iter()
            .map(|(k, v)| (format!("volumes.cozystack.io/{k}"), v.to_string()))
            .collect();
        Record::from_annotations(&keys, &ann)
    }

    fn bound() -> Record {
        let mut r = record(&[]);
        r.cluster = Some(ClusterIdentity {
            server: "https://t".into(),
            kube_system_uid: "u".into(),
            bound_at: "2026-01-01T00:00:00Z".into(),
            ca_sha256: "c".into(),
        });
        r
    }

    fn seen(record: &Record) -> Seen<'_> {
        Seen {
            is_parent: true,
            record,
            in_custody: true,
            deleting: false,
            namespace_deleting: false,
            task: Task::Idle,
            request: None,
        }
    }

    #[test]
    fn a_parent_still_going_after_its_outcome_gets_a_new_retry_request_after_a_backoff() {
        let released = record(&[("phase", "Released")]);
        let going = |request| Seen {
            in_custody: false,
            deleting: true,
            request,
            ..seen(&released)
        };
        let wait = Duration::from_secs(20);
        let asked = |secs, made| {
            Some(Requests {
                since_last: Some(Duration::from_secs(secs)),
                made,
                wait,
            })
        };
        assert_eq!(
            next(going(asked(5, 1))),
            Next::RetryIn(Duration::from_secs(15))
        );
        assert_eq!(next(going(asked(20, 1))), Next::RequestRetry);
        assert_eq!(
            next(going(Some(Requests {
                since_last: None,
                made: 0,
                wait
            }))),
            Next::RequestRetry,
            "no request on the parent (or a worker that restarted): ask now"
        );
        assert_eq!(
            next(going(None)),
            Next::Wait,
            "a platform without Flux is asked nothing"
        );
        // Overridden and out of custody: the same.
        let overridden = record(&[
            ("phase", "Overridden"),
            ("override", "abandoned"),
            ("override-by", "alice"),
            ("override-at", "2026-01-01T00:00:00Z"),
        ]);
        assert_eq!(
            next(Seen {
                in_custody: false,
                deleting: true,
                request: asked(30, 2),
                ..seen(&overridden)
            }),
            Next::RequestRetry
        );
        // Not deleting (custody handed back on uninstall): nothing.
        assert_eq!(
            next(Seen {
                in_custody: false,
                request: asked(30, 2),
                ..seen(&released)
            }),
            Next::TakeCustody { bind: true }
        );
    }

    const OVERRIDE: [(&str, &str); 3] = [
        ("override", " abandoned "),
        ("override-by", "alice"),
        ("override-at", "2026-01-01T00:00:00Z"),
    ];

    #[test]
    fn an_object_without_the_parent_labels_is_ignored_whatever_else_it_carries() {
        let r = record(&[("phase", "Blocked")]);
        assert_eq!(
            next(Seen {
                is_parent: false,
                deleting: true,
                ..seen(&r)
            }),
            Next::Ignore
        );
    }

    #[test]
    fn a_live_tenant_is_taken_into_custody_then_bound_once() {
        let unbound = record(&[]);
        let b = bound();
        assert_eq!(
            next(Seen {
                in_custody: false,
                ..seen(&unbound)
            }),
            Next::TakeCustody { bind: true }
        );
        assert_eq!(
            next(Seen {
                in_custody: false,
                ..seen(&b)
            }),
            Next::TakeCustody { bind: false }
        );
        assert_eq!(next(seen(&unbound)), Next::BindCluster);
        assert_eq!(next(seen(&b)), Next::Wait);
    }

    #[test]
    fn a_tenant_deleted_before_custody_is_reported_once_its_parent_goes_and_never_held() {
        let r = record(&[]);
        assert_eq!(
            next(Seen {
                in_custody: false,
                deleting: true,
                ..seen(&r)
            }),
            Next::DeletedWithoutCustody
        );
        // Only its namespace going: the parent's own deletion reports it.
        assert_eq!(
            next(Seen {
                in_custody: false,
                namespace_deleting: true,
                ..seen(&r)
            }),
            Next::Wait
        );
        // Custody already ended after a recorded outcome: nothing to say.
        let released = record(&[("phase", "Released")]);
        assert_eq!(
            next(Seen {
                in_custody: false,
                deleting: true,
                ..seen(&released)
            }),
            Next::Wait
        );
    }

    #[test]
    fn a_released_tenant_still_in_custody_ends_custody_whatever_the_task_does() {
        let r = record(&[("phase", "Released")]);
        for task in [
            Task::Idle,
            Task::Running,
            Task::RetryIn(Duration::from_secs(9)),
        ] {
            assert_eq!(
                next(Seen {
                    deleting: true,
                    task,
                    ..seen(&r)
                }),
                Next::EndCustody
            );
        }
    }

    #[test]
    fn a_stamped_override_is_recorded_once_then_only_ends_custody() {
        let mut pairs = OVERRIDE.to_vec();
        pairs.push(("phase", "Blocked"));
        let blocked = record(&pairs);
        assert_eq!(
            next(Seen {
                deleting: true,
                task: Task::Running,
                ..seen(&blocked)
            }),
            Next::Override { record: true }
        );
        pairs.pop();
        pairs.push(("phase", "Overridden"));
        let recorded = record(&pairs);
        assert_eq!(
            next(Seen {
                namespace_deleting: true,
                ..seen(&recorded)
            }),
            Next::Override { record: false }
        );
    }

    #[test]
    fn an_unstamped_override_is_not_an_override() {
        let r = record(&[("override", "abandoned")]);
        assert_eq!(
            next(Seen {
                deleting: true,
                ..seen(&r)
            }),
            Next::StartPass
        );
    }

    #[test]
    fn in_teardown_a_pass_starts_unless_one_runs_or_a_retry_is_due_later() {
        for phase in [None, Some("Releasing"), Some("Blocked")] {
            let r = record(phase.map(|p| [("phase", p)]).unwrap_or_default().as_ref());
            let s = Seen {
                deleting: true,
                ..seen(&r)
            };
            assert_eq!(next(s), Next::StartPass, "{phase:?}");
            assert_eq!(
                next(Seen {
                    task: Task::Running,
                    ..s
                }),
                Next::AwaitPass
            );
            assert_eq!(
                next(Seen {
                    task: Task::RetryIn(Duration::from_secs(3)),
                    ..s
                }),
                Next::RetryIn(Duration::from_secs(3))
            );
            assert_eq!(
                next(Seen {
                    task: Task::RetryIn(Duration::ZERO),
                    ..s
                }),
                Next::StartPass
            );
        }
    }

    #[test]
    fn a_namespace_deletion_is_a_teardown_too() {
        let r = record(&[]);
        assert_eq!(
            next(Seen {
                namespace_deleting: true,
                ..seen(&r)
            }),
            Next::StartPass
        );
    }

    #[test]
    fn backoff_doubles_from_the_base_up_to_the_max_and_never_overflows() {
        let (base, max) = (Duration::from_secs(30), Duration::from_secs(600));
        let delays: Vec<u64> = (1..=7).map(|n| backoff(base, max, n).as_secs()).collect();
        assert_eq!(delays, [30, 60, 120, 240, 480, 600, 600]);
        assert_eq!(backoff(base, max, 0), base);
        assert_eq!(backoff(base, Duration::MAX, u32::MAX), base * 65536);
    }

    #[test]
    fn an_override_says_what_stays_and_what_goes() {
        use crate::record::{InfraRef, Volume};
        let ov = Override {
            reason: "archived".into(),
            by: Some("alice".into()),
            at: None,
        };
        let vol = |pv: &str, reclaim: &str, infra: Option<(&str, bool)>| Volume {
            pv: pv.into(),
            driver: Some("csi.kubevirt.io".into()),
            handle: Some(pv.into()),
            capacity: None,
            reclaim: reclaim.into(),
            claim: None,
            gone: false,
            infra: infra.map(|(pv, kept)| InfraRef {
                name: pv.into(),
                pv: Some(format!("m-{pv}")),
                kept,
                ..Default::default()
            }),
        };
        let inv = Inventory::new(
            "t".into(),
            vec![
                vol("a", "Retain", Some(("a", true))),
                vol("b", "Delete", Some(("b", false))),
                vol("c", "Delete", None),
            ],
        );
        let kept = std::collections::BTreeSet::from(["m-a".to_string()]);
        let finder = "kubectl get pv -l volumes.cozystack.io/kept-namespace=tenant-x";
        let m = override_message(
            &ov,
            &Leaves {
                inventory: Some(&inv),
                kept: Some(&kept),
                unowned: None,
                finder,
            },
        );
        // b's PVC has no DataVolume owning it: it stays, and says why.
        let unowned = std::collections::BTreeSet::from(["b".to_string()]);
        let orphan = override_message(
            &ov,
            &Leaves {
                inventory: Some(&inv),
                kept: Some(&kept),
                unowned: Some(&unowned),
                finder,
            },
        );
        assert!(
            orphan.contains(
                "1 volume not freed by the driver stays on storage until its PVC is deleted"
            ) && !orphan.contains("goes with their DataVolumes"),
            "{orphan}"
        );
        for needle in [
            "override by alice (archived)",
            "1 disk stays on storage, kept",
            "m-a",
            finder,
            "1 volume not freed by the driver goes with their DataVolumes",
            "b (driver",
            "1 volume with nothing behind in the management cluster stays",
            "c (driver",
        ] {
            assert!(m.contains(needle), "{needle:?} in {m}");
        }
        // One layer: what is left stays, whatever the reason.
        let m = override_message(
            &ov,
            &Leaves {
                inventory: Some(&inv),
                kept: None,
                unowned: None,
                finder,
            },
        );
        assert!(m.contains("3 volumes left on storage"), "{m}");
        // No inventory on the management side: everything found is kept.
        let m = override_message(
            &ov,
            &Leaves {
                inventory: None,
                kept: Some(&kept),
                unowned: None,
                finder,
            },
        );
        assert!(
            m.contains("every disk of the tenant found on the management side is kept"),
            "{m}"
        );
    }
}
