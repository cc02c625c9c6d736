//! The Events the worker publishes on a parent release: each reason once,
//! with its type. Operators and alerts match on these names, each with its
//! runbook section (`docs/operations.md`, "Events"): a contract, not free
//! text.

use kube::runtime::events::EventType;

/// Why the worker publishes an Event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The custody finalizer was added.
    CustodyTaken,
    /// The tenant cluster was bound to its parent.
    ClusterBound,
    /// Another parent is bound to the same cluster: neither acts through it.
    ClusterConflict,
    /// The kubeconfig leads away from where the tenant's control plane runs.
    ClusterNotBound,
    /// The phase started.
    ReleaseStarted,
    /// The first inventory, before any deletion.
    InventoryTaken,
    /// Volumes appeared while releasing.
    InventoryGrew,
    /// A pass gave its release slot to a waiting tenant and queued again.
    SlotYielded,
    /// The tenant API is dead: volumes freed from the management side.
    FreedFromManagement,
    /// A pass could not finish; retried with backoff.
    Blocked,
    /// Every volume freed: the teardown may go on.
    Released,
    /// An authorized person ended the phase.
    Overridden,
    /// The parent has no room for the record.
    RecordNotWritten,
}

impl Reason {
    pub const ALL: [Reason; 13] = [
        Reason::CustodyTaken,
        Reason::ClusterBound,
        Reason::ClusterConflict,
        Reason::ClusterNotBound,
        Reason::ReleaseStarted,
        Reason::InventoryTaken,
        Reason::InventoryGrew,
        Reason::SlotYielded,
        Reason::FreedFromManagement,
        Reason::Blocked,
        Reason::Released,
        Reason::Overridden,
        Reason::RecordNotWritten,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::CustodyTaken => "CustodyTaken",
            Reason::ClusterBound => "ClusterBound",
            Reason::ClusterConflict => "ClusterConflict",
            Reason::ClusterNotBound => "ClusterNotBound",
            Reason::ReleaseStarted => "ReleaseStarted",
            Reason::InventoryTaken => "InventoryTaken",
            Reason::InventoryGrew => "InventoryGrew",
            Reason::SlotYielded => "SlotYielded",
            Reason::FreedFromManagement => "FreedFromManagement",
            Reason::Blocked => "Blocked",
            Reason::Released => "Released",
            Reason::Overridden => "Overridden",
            Reason::RecordNotWritten => "RecordNotWritten",
        }
    }

    /// Warning for what an operator should look at; Normal for progress.
    pub fn event_type(self) -> EventType {
        match self {
            Reason::ClusterConflict
            | Reason::ClusterNotBound
            | Reason::FreedFromManagement
            | Reason::Blocked
            | Reason::Overridden
            | Reason::RecordNotWritten => EventType::Warning,
            Reason::CustodyTaken
            | Reason::ClusterBound
            | Reason::ReleaseStarted
            | Reason::SlotYielded
            | Reason::InventoryTaken
            | Reason::InventoryGrew
            | Reason::Released => EventType::Normal,
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_is_listed_once_under_its_own_name() {
        let names: std::collections::BTreeSet<_> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(names.len(), Reason::ALL.len());
        for r in Reason::ALL {
            assert_eq!(format!("{r:?}"), r.as_str());
        }
    }

    #[test]
    fn the_readme_names_every_reason_with_its_type() {
        let readme = include_str!("../../README.md");
        let start = readme
            .find("an Event for every transition")
            .expect("the README's Events paragraph");
        let paragraph = &readme[start..start + readme[start..].find("\n\n").unwrap_or(0)];
        let (normal, warning) = paragraph.split_once(';').expect("Normal; Warnings");
        for r in Reason::ALL {
            let name = format!("`{}`", r.as_str());
            let listed = if r.event_type() == EventType::Warning {
                warning
            } else {
                normal
            };
            assert!(
                listed.contains(&name),
                "{name} is not listed as {:?} in the README",
                r.event_type()
            );
        }
    }
}
