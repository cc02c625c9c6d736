//! The release record: annotations on the parent release, and the one place
//! that knows their keys (`docs/design.md` §3).
//!
//! The worker writes `phase`, `released-at`, `message`, `volumes` and
//! `cluster` (who the tenant cluster is, bound when custody began); a
//! person writes `override`; the mutating webhook stamps `override-by` and
//! `override-at` from the request's userInfo.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::text::{bounded, count, one_line};

/// The inventory annotation is bounded so the parent stays well under the
/// API server's 256 KiB limit on all annotations together.
pub const MAX_INVENTORY_BYTES: usize = 96 * 1024;

/// The longest string kept in one inventory field (a volumeHandle, a PV or
/// claim name). Real handles are a few hundred bytes at most; a tenant, who
/// is cluster-admin of its own cluster, could make them megabytes and drive
/// the worker's cost on every record write (fuzz finding F6).
pub const MAX_FIELD_BYTES: usize = 1024;

/// The longest `taken_at` kept (an RFC 3339 time is 20–35 bytes). It keeps
/// the envelope alone from exceeding the bound (fuzz finding F3).
pub const MAX_TAKEN_AT_BYTES: usize = 64;

/// Kubernetes' limit on all of an object's annotations together (keys and
/// values, `TotalAnnotationSizeLimitB`).
pub const ANNOTATIONS_LIMIT: usize = 256 * 1024;

/// How a parent's annotation space is used, for a record that could not be
/// written: what the record's own keys take, what everything else takes,
/// and the largest of the rest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Space {
    pub total: usize,
    pub others: usize,
    pub largest: Vec<(String, usize)>,
}

impl Space {
    pub fn of(keys: &Keys, annotations: &BTreeMap<String, String>) -> Space {
        let own = keys.worker_owned();
        let mut others: Vec<(String, usize)> = annotations
            .iter()
            .filter(|(k, _)| !own.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), k.len() + v.len()))
            .collect();
        others.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        Space {
            total: annotations.iter().map(|(k, v)| k.len() + v.len()).sum(),
            others: others.iter().map(|(_, n)| n).sum(),
            largest: others.into_iter().take(3).collect(),
        }
    }

    /// One line for an operator: what fills the space, and the command
    /// that frees it.
    pub fn describe(&self, parent: &str) -> String {
        let largest = self
            .largest
            .iter()
            .map(|(k, n)| format!("{} ({n} bytes)", bounded(k, 120)))
            .collect::<Vec<_>>()
            .join(", ");
        let remove = self
            .largest
            .iter()
            .map(|(k, _)| format!("{}-", bounded(k, 120)))
            .collect::<Vec<_>>()
            .join(" ");
        format!(
            "its annotations hold {} of the {ANNOTATIONS_LIMIT} bytes Kubernetes allows, {} of them not the record's \
             (largest: {largest}); free them with `kubectl annotate {parent} {remove}`, or, if the annotations are \
             small, shrink the release's values: the whole object is at etcd's size limit",
            self.total, self.others,
        )
    }
}

/// The current time as the record writes it (RFC 3339, seconds, UTC).
pub fn now_rfc3339() -> String {
    rfc3339(jiff::Timestamp::now())
}

/// `t` as the record writes times (RFC 3339, seconds, UTC).
pub fn rfc3339(t: jiff::Timestamp) -> String {
    t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// Annotation keys under the profile's prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keys {
    pub phase: String,
    pub released_at: String,
    pub message: String,
    pub volumes: String,
    pub override_reason: String,
    pub override_by: String,
    pub override_at: String,
    pub cluster: String,
    /// On a management PV the worker keeps (a disk whose tenant volume is
    /// not `Delete`): the label that finds every kept disk (`"true"`), the
    /// label naming the tenant's namespace, and annotations naming the
    /// tenant, its volume, the reclaim policy the PV had and when.
    pub kept: String,
    pub kept_namespace: String,
    pub kept_for: String,
    pub kept_volume: String,
    pub kept_reclaim_was: String,
    pub kept_at: String,
    /// On a kept PV: an operator's acknowledgement that it stays on storage
    /// on purpose (free text), and the mutating webhook's stamps of who
    /// wrote it and when. Acknowledged kept disks no longer alert.
    pub kept_acknowledged: String,
    pub kept_acknowledged_by: String,
    pub kept_acknowledged_at: String,
}

impl Keys {
    pub fn new(prefix: &str) -> Self {
        let k = |s: &str| format!("{prefix}{s}");
        Self {
            phase: k("phase"),
            released_at: k("released-at"),
            message: k("message"),
            volumes: k("volumes"),
            override_reason: k("override"),
            override_by: k("override-by"),
            override_at: k("override-at"),
            cluster: k("cluster"),
            kept: k("kept"),
            kept_namespace: k("kept-namespace"),
            kept_for: k("kept-for"),
            kept_volume: k("kept-volume"),
            kept_reclaim_was: k("kept-reclaim-was"),
            kept_at: k("kept-at"),
            kept_acknowledged: k("kept-acknowledged"),
            kept_acknowledged_by: k("kept-acknowledged-by"),
            kept_acknowledged_at: k("kept-acknowledged-at"),
        }
    }

    /// Keys only the worker's identity may change.
    pub fn worker_owned(&self) -> [&str; 5] {
        [
            &self.phase,
            &self.released_at,
            &self.message,
            &self.volumes,
            &self.cluster,
        ]
    }

    /// Keys only the mutating webhook may set.
    pub fn stamped(&self) -> [&str; 2] {
        [&self.override_by, &self.override_at]
    }

    /// The record's keys mirrored where the platform shows a parent's
    /// annotations to the tenant's owner (profile
    /// `parent.visibleAnnotationPrefix`), each with its mirror's key: the
    /// phase, the message and the release time. None without a prefix.
    pub fn mirrored(&self, visible_prefix: &str) -> Vec<(&str, String)> {
        if visible_prefix.is_empty() {
            return Vec::new();
        }
        [&self.phase, &self.message, &self.released_at]
            .into_iter()
            .map(|k| (k.as_str(), format!("{visible_prefix}{k}")))
            .collect()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Phase {
    Releasing,
    Released,
    Blocked,
    Overridden,
}

impl Phase {
    pub const ALL: [Phase; 4] = [
        Phase::Releasing,
        Phase::Released,
        Phase::Blocked,
        Phase::Overridden,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Releasing => "Releasing",
            Phase::Released => "Released",
            Phase::Blocked => "Blocked",
            Phase::Overridden => "Overridden",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Phase {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Phase::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| {
                format!("unknown phase {s:?} (expected Releasing, Released, Blocked or Overridden)")
            })
    }
}

mod inventory;
pub use inventory::{InfraRef, Inventory, Volume};

/// Who the tenant cluster is: bound by the worker when custody began (or,
/// for a tenant never reachable before, at the first release pass), and
/// checked on every pass. The admin kubeconfig Secret is writable by
/// whoever may edit the tenant namespace; this is not: a Secret rewritten to
/// reach another cluster is caught before anything is deleted through it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterIdentity {
    /// The server the kubeconfig named.
    pub server: String,
    /// The UID of the cluster's `kube-system` namespace: made once, with the
    /// cluster, and the same through every address and credential.
    pub kube_system_uid: String,
    /// RFC 3339 time it was bound.
    pub bound_at: String,
    /// SHA-256 (hex) of the certificate authorities the kubeconfig trusted
    /// when the cluster was bound: a server must prove it holds a key they
    /// certified, which the `kube-system` UID alone (public, in this very
    /// record) does not. Empty in a binding made before it was kept.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub ca_sha256: String,
}

impl ClusterIdentity {
    pub fn encode(&self) -> String {
        let bounded = ClusterIdentity {
            server: bounded(&self.server, MAX_FIELD_BYTES),
            kube_system_uid: bounded(&self.kube_system_uid, MAX_FIELD_BYTES),
            bound_at: bounded(&self.bound_at, MAX_TAKEN_AT_BYTES),
            ca_sha256: bounded(&self.ca_sha256, MAX_TAKEN_AT_BYTES + 64),
        };
        serde_json::to_string(&bounded).expect("identity serializes")
    }

    pub fn decode(text: &str) -> Result<Self, String> {
        serde_json::from_str(text)
            .map_err(|e| format!("cluster annotation is not a valid cluster identity: {e}"))
    }

    /// `server S (kube-system UID U, CA sha256 C)`, for messages.
    pub fn describe(&self) -> String {
        let ca = if self.ca_sha256.is_empty() {
            String::new()
        } else {
            let short: String = self.ca_sha256.chars().take(16).collect();
            format!(", CA sha256 {short}…")
        };
        format!(
            "server {} (kube-system UID {}{ca})",
            self.server, self.kube_system_uid
        )
    }
}

/// A recorded override. It counts only once the webhook has stamped it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Override {
    pub reason: String,
    pub by: Option<String>,
    pub at: Option<String>,
}

impl Override {
    pub fn is_stamped(&self) -> bool {
        !self.reason.trim().is_empty()
            && self.by.as_deref().is_some_and(|b| !b.is_empty())
            && self.at.is_some()
    }
}

/// The record as read from a parent's annotations.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Record {
    pub phase: Option<Phase>,
    pub released_at: Option<String>,
    pub message: Option<String>,
    pub inventory: Option<Inventory>,
    pub override_: Option<Override>,
    /// The tenant cluster bound to this tenant.
    pub cluster: Option<ClusterIdentity>,
    /// What could not be parsed, for messages; never makes a tenant done.
    pub problems: Vec<String>,
}

impl Record {
    pub fn from_annotations(keys: &Keys, annotations: &BTreeMap<String, String>) -> Self {
        let mut problems = Vec::new();
        let phase = annotations
            .get(&keys.phase)
            .and_then(|p| p.parse::<Phase>().map_err(|e| problems.push(e)).ok());
        let inventory = annotations
            .get(&keys.volumes)
            .and_then(|v| Inventory::decode(v).map_err(|e| problems.push(e)).ok());
        let cluster = annotations.get(&keys.cluster).and_then(|v| {
            ClusterIdentity::decode(v)
                .map_err(|e| problems.push(e))
                .ok()
        });
        let override_ = annotations
            .get(&keys.override_reason)
            .map(|reason| Override {
                reason: reason.clone(),
                by: annotations.get(&keys.override_by).cloned(),
                at: annotations.get(&keys.override_at).cloned(),
            });
        Self {
            phase,
            released_at: annotations.get(&keys.released_at).cloned(),
            message: annotations.get(&keys.message).cloned(),
            inventory,
            override_,
            cluster,
            problems,
        }
    }

    /// Done: the phase recorded the PVs gone, or an override is stamped.
    pub fn is_done(&self) -> bool {
        self.phase == Some(Phase::Released) || self.stamped_override().is_some()
    }

    pub fn stamped_override(&self) -> Option<&Override> {
        self.override_.as_ref().filter(|o| o.is_stamped())
    }

    /// A one-line summary of where the phase stands, for deny messages.
    pub fn summary(&self) -> String {
        let phase = self.phase.map_or("not started", Phase::as_str);
        let mut s = format!("phase {phase}");
        if let Some(m) = self.message.as_deref().filter(|m| !m.is_empty()) {
            s.push_str(&format!(" ({m})"));
        }
        match &self.inventory {
            Some(inv) => {
                s.push_str(&format!(
                    "; {} of {} left",
                    inv.left(),
                    count(inv.total, "volume")
                ));
                let first = inv.first_remaining(3);
                if !first.is_empty() {
                    s.push_str(&format!(": {first}"));
                }
            }
            None => s.push_str("; volumes not inventoried yet"),
        }
        s
    }
}

/// A change to the worker-owned part of the record, as a JSON merge patch
/// fragment for `metadata.annotations` (`None` removes the key).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Update {
    pub phase: Option<Phase>,
    pub message: Option<String>,
    pub released_at: Option<String>,
    pub inventory: Option<Inventory>,
    pub cluster: Option<ClusterIdentity>,
}

impl Update {
    pub fn annotations(&self, keys: &Keys) -> Map<String, Value> {
        let mut m = Map::new();
        if let Some(p) = self.phase {
            m.insert(keys.phase.clone(), Value::String(p.to_string()));
        }
        if let Some(msg) = &self.message {
            m.insert(keys.message.clone(), Value::String(one_line(msg)));
        }
        if let Some(at) = &self.released_at {
            m.insert(keys.released_at.clone(), Value::String(at.clone()));
        }
        if let Some(inv) = &self.inventory {
            m.insert(keys.volumes.clone(), Value::String(inv.encode()));
        }
        if let Some(c) = &self.cluster {
            m.insert(keys.cluster.clone(), Value::String(c.encode()));
        }
        m
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_space_report_names_what_is_not_the_record_largest_first() {
        let keys = Keys::new("volumes.cozystack.io/");
        let annotations = BTreeMap::from([
            ("volumes.cozystack.io/volumes".to_string(), "v".repeat(1000)),
            (
                "volumes.cozystack.io/phase".to_string(),
                "Releasing".to_string(),
            ),
            ("filler/a".to_string(), "x".repeat(5000)),
            ("filler/b".to_string(), "x".repeat(7000)),
            ("small".to_string(), "y".to_string()),
            ("filler/c".to_string(), "x".repeat(6000)),
        ]);
        let space = Space::of(&keys, &annotations);
        assert_eq!(space.others, 8 + 5000 + 8 + 7000 + 6 + 8 + 6000);
        assert_eq!(space.total, space.others + 28 + 1000 + 26 + 9);
        assert_eq!(
            space.largest,
            vec![
                ("filler/b".to_string(), 7008),
                ("filler/c".to_string(), 6008),
                ("filler/a".to_string(), 5008)
            ]
        );
        let line = space.describe("helmreleases.helm.toolkit.fluxcd.io -n t r");
        assert!(
            line.contains("kubectl annotate helmreleases.helm.toolkit.fluxcd.io -n t r filler/b- filler/c- filler/a-"),
            "{line}"
        );
        assert!(line.contains("262144"), "{line}");
    }

    use super::*;

    fn keys() -> Keys {
        Keys::new("volumes.cozystack.io/")
    }

    fn vol(i: usize, gone: bool) -> Volume {
        Volume {
            pv: format!("pvc-{i:05}-0000-1111-2222-333344445555"),
            driver: Some("csi.sim.volume-gate.dev".into()),
            handle: Some(format!("vol-{i:05}-aaaaaaaaaaaaaaaaaaaa")),
            capacity: Some("10Gi".into()),
            reclaim: "Delete".into(),
            claim: Some(format!("default/data-{i}")),
            gone,
            infra: None,
        }
    }

    fn ann(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (format!("volumes.cozystack.io/{k}"), v.to_string()))
            .collect()
    }

    #[test]
    fn a_huge_taken_at_is_cut_so_the_bound_holds() {
        let inv = Inventory::new("9".repeat(200_000), vec![]);
        let text = inv.encode();
        assert!(text.len() <= MAX_INVENTORY_BYTES, "{} bytes", text.len());
        assert!(
            Inventory::decode(&text)
                .unwrap()
                .taken_at
                .ends_with("…[200000 bytes]"),
            "{text}"
        );
    }

    #[test]
    fn keys_carry_the_prefix() {
        let k = Keys::new("example.com/");
        assert_eq!(k.phase, "example.com/phase");
        assert_eq!(k.override_by, "example.com/override-by");
    }

    #[test]
    fn released_phase_is_done() {
        let r = Record::from_annotations(&keys(), &ann(&[("phase", "Released")]));
        assert!(r.is_done());
    }

    #[test]
    fn blocked_releasing_and_absent_phases_are_not_done() {
        for p in ["Blocked", "Releasing"] {
            assert!(
                !Record::from_annotations(&keys(), &ann(&[("phase", p)])).is_done(),
                "{p}"
            );
        }
        assert!(!Record::from_annotations(&keys(), &BTreeMap::new()).is_done());
    }

    #[test]
    fn an_unknown_phase_is_not_done_and_is_reported() {
        let r = Record::from_annotations(&keys(), &ann(&[("phase", "released")]));
        assert!(!r.is_done());
        assert_eq!(r.problems.len(), 1);
        assert!(r.problems[0].contains("released"));
    }

    #[test]
    fn an_unstamped_override_is_not_done() {
        let r = Record::from_annotations(&keys(), &ann(&[("override", "abandoned")]));
        assert!(!r.is_done());
        let r = Record::from_annotations(
            &keys(),
            &ann(&[("override", "abandoned"), ("override-by", "alice")]),
        );
        assert!(!r.is_done());
    }

    #[test]
    fn a_stamped_override_is_done() {
        let r = Record::from_annotations(
            &keys(),
            &ann(&[
                ("override", "abandoned"),
                ("override-by", "alice"),
                ("override-at", "2026-01-01T00:00:00Z"),
            ]),
        );
        assert!(r.is_done());
    }

    #[test]
    fn a_blank_override_reason_is_not_done_even_if_stamped() {
        let r = Record::from_annotations(
            &keys(),
            &ann(&[
                ("override", "  "),
                ("override-by", "alice"),
                ("override-at", "2026-01-01T00:00:00Z"),
            ]),
        );
        assert!(!r.is_done());
    }

    #[test]
    fn inventory_round_trips() {
        let inv = Inventory::new(
            "2026-01-01T00:00:00Z".into(),
            vec![vol(2, false), vol(1, true)],
        );
        assert_eq!(inv.volumes[0].pv, vol(1, true).pv, "sorted by PV name");
        assert_eq!((inv.total, inv.freed, inv.left()), (2, 1, 1));
        let back = Inventory::decode(&inv.encode()).unwrap();
        assert_eq!(back, inv);
    }

    #[test]
    fn a_large_inventory_is_truncated_within_bound_and_says_so() {
        let vols: Vec<Volume> = (0..5000).map(|i| vol(i, i % 2 == 0)).collect();
        let inv = Inventory::new("t".into(), vols);
        let text = inv.encode();
        assert!(text.len() <= MAX_INVENTORY_BYTES, "{}", text.len());
        let back = Inventory::decode(&text).unwrap();
        assert!(back.truncated);
        assert_eq!(back.total, 5000);
        assert_eq!(back.left(), 2500);
        assert!(back.volumes.len() > 100, "kept {}", back.volumes.len());
        assert!(
            back.volumes.iter().all(|v| !v.gone),
            "remaining volumes are listed first"
        );
        // Nearly full: adding one more would not have fit.
        assert!(text.len() > MAX_INVENTORY_BYTES - 400, "{}", text.len());
    }

    #[test]
    fn garbage_inventory_is_a_problem_not_a_panic() {
        let r = Record::from_annotations(&keys(), &ann(&[("volumes", "{not json")]));
        assert!(r.inventory.is_none());
        assert!(r.problems[0].contains("volumes annotation"));
    }

    #[test]
    fn summary_names_the_phase_count_and_first_volumes() {
        let inv = Inventory::new("t".into(), (0..5).map(|i| vol(i, i == 0)).collect());
        let mut a = ann(&[("phase", "Blocked"), ("message", "driver gone")]);
        a.insert(keys().volumes, inv.encode());
        let s = Record::from_annotations(&keys(), &a).summary();
        assert!(s.contains("phase Blocked (driver gone)"), "{s}");
        assert!(s.contains("4 of 5 volumes left"), "{s}");
        assert!(s.contains("volumeHandle vol-00001-"), "{s}");
        assert!(s.contains("and 1 more"), "{s}");
        assert!(
            !s.contains("vol-00000-"),
            "a freed volume is not listed: {s}"
        );
    }

    #[test]
    fn update_writes_only_what_it_names() {
        let u = Update {
            phase: Some(Phase::Blocked),
            message: Some("a\nb".into()),
            ..Default::default()
        };
        let m = u.annotations(&keys());
        assert_eq!(m.len(), 2);
        assert_eq!(m["volumes.cozystack.io/message"], "a b");
    }
}
