//! The inventory (`volumes` key): every tenant PV as it was before anything
//! was deleted, what is gone since, and its bounded JSON codec.

use super::*;

/// One tenant PV as inventoried before anything was deleted.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    /// PersistentVolume name.
    pub pv: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<String>,
    /// The CSI volumeHandle: the disk's name on storage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handle: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<String>,
    /// Reclaim policy; `Retain` volumes are residue by design.
    pub reclaim: String,
    /// `namespace/name` of the bound claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
    /// Set once the PV is gone.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gone: bool,
    /// The disk behind it in the management cluster, when the profile has
    /// an infra layer and the volumeHandle names an object there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub infra: Option<InfraRef>,
}

/// The management objects behind one tenant volume (profile `infra`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InfraRef {
    /// The infra object (DataVolume) in the tenant's namespace; its PVC
    /// has the same name.
    pub name: String,
    /// The management PV of that PVC, once seen bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pv: Option<String>,
    /// That PV's CSI volumeHandle: the disk on the management storage, which
    /// its VolumeSnapshotContents name as their source, so that a snapshot
    /// of it is found after its VolumeSnapshot is gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handle: Option<String>,
    /// Set when the phase freed it from the management side because the
    /// tenant API could not be reached.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub freed_here: bool,
    /// Set once the worker has made its management PV keep the disk
    /// (reclaim policy `Retain`, labelled `kept`): a tenant volume that is
    /// not `Delete` stays on storage whatever deletes its DataVolume.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub kept: bool,
}

impl Volume {
    pub fn is_retain(&self) -> bool {
        self.reclaim == "Retain"
    }

    /// Whether its disk is to stay on storage when the tenant goes: any
    /// reclaim policy but `Delete` (`Retain`; `Recycle`, which CSI volumes
    /// do not have, is kept too rather than guessed at).
    pub fn is_kept(&self) -> bool {
        self.reclaim != "Delete"
    }

    /// `pv (driver, handle)` for messages.
    pub fn describe(&self) -> String {
        format!(
            "{} (driver {}, volumeHandle {})",
            self.pv,
            self.driver.as_deref().unwrap_or("<none>"),
            self.handle.as_deref().unwrap_or("<none>")
        )
    }
}

/// The inventory: every tenant PV, taken before any deletion.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inventory {
    /// RFC 3339 time it was taken.
    pub taken_at: String,
    /// How many PVs the tenant had, listed or not.
    pub total: usize,
    /// How many of them are gone.
    #[serde(default)]
    pub freed: usize,
    /// True when `volumes` lists only the first of `total` PVs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
    pub volumes: Vec<Volume>,
}

impl Inventory {
    /// Builds an inventory over all volumes, sorted by PV name.
    pub fn new(taken_at: String, mut volumes: Vec<Volume>) -> Self {
        volumes.sort_by(|a, b| a.pv.cmp(&b.pv));
        let freed = volumes.iter().filter(|v| v.gone).count();
        Self {
            taken_at,
            total: volumes.len(),
            freed,
            truncated: false,
            volumes,
        }
    }

    pub fn left(&self) -> usize {
        self.total.saturating_sub(self.freed)
    }

    /// Listed volumes that are not gone yet.
    pub fn remaining(&self) -> impl Iterator<Item = &Volume> {
        self.volumes.iter().filter(|v| !v.gone)
    }

    /// JSON for the annotation, truncated to [`MAX_INVENTORY_BYTES`]: the
    /// volumes still on storage are kept first (those whose disk stays
    /// before the rest), and truncation is stated.
    pub fn encode(&self) -> String {
        let taken_at = bounded(&self.taken_at, MAX_TAKEN_AT_BYTES);
        if taken_at.len() < self.taken_at.len() {
            return Inventory {
                taken_at,
                ..self.clone()
            }
            .encode();
        }
        let full = serde_json::to_string(self).expect("inventory serializes");
        if full.len() <= MAX_INVENTORY_BYTES {
            return full;
        }
        // The volumes still on storage are listed first, those whose disk
        // is to stay (not `Delete`) before all: an override keeps what the
        // record names and every disk a cut record may have left out.
        let mut all: Vec<Volume> = self
            .volumes
            .iter()
            .filter(|v| !v.gone && v.is_kept())
            .cloned()
            .collect();
        all.extend(
            self.volumes
                .iter()
                .filter(|v| !v.gone && !v.is_kept())
                .cloned(),
        );
        all.extend(self.volumes.iter().filter(|v| v.gone).cloned());
        let encode_first = |n: usize| {
            let shown = Inventory {
                taken_at: self.taken_at.clone(),
                total: self.total,
                freed: self.freed,
                truncated: true,
                volumes: all[..n].to_vec(),
            };
            serde_json::to_string(&shown).expect("inventory serializes")
        };
        // The largest prefix that fits, by bisection: a few serializations
        // even for tens of thousands of volumes.
        let (mut fits, mut too_big) = (0usize, all.len());
        while too_big - fits > 1 {
            let mid = fits + (too_big - fits) / 2;
            if encode_first(mid).len() <= MAX_INVENTORY_BYTES {
                fits = mid;
            } else {
                too_big = mid;
            }
        }
        encode_first(fits)
    }

    pub fn decode(text: &str) -> Result<Self, String> {
        serde_json::from_str(text)
            .map_err(|e| format!("volumes annotation is not a valid inventory: {e}"))
    }

    /// The first `n` remaining volumes, described, and how many more.
    pub fn first_remaining(&self, n: usize) -> String {
        let shown: Vec<String> = self.remaining().take(n).map(Volume::describe).collect();
        let more = self.left().saturating_sub(shown.len());
        match (shown.is_empty(), more) {
            (true, 0) => String::new(),
            (true, m) => format!("{m} not listed"),
            (false, 0) => shown.join(", "),
            (false, m) => format!("{} and {m} more", shown.join(", ")),
        }
    }
}
