//! `volume-gate orphans`: the storage that tenants already gone left on the
//! management cluster, as a report. It only reads (list calls), never
//! writes: it prints the commands that free each object, for a person to run.
//!
//! Cozystack clusters that ran without volume-gate carry the disks of
//! tenants deleted before it was installed: the tenant's teardown removed
//! its CSI driver before anyone freed its volumes, and the DataVolumes,
//! their PVCs and the PVs behind them stayed (cozystack/cozystack#1608,
//! #304; reproduced in `tests/teardown.rs`). volume-gate prevents new
//! leaks; this finds the old ones.
//!
//! What is a tenant's is decided as the worker decides it
//! (`docs/design.md` §5b), by the profile's infra labels, never by a name:
//! [`report`] is a pure function over what [`read`] lists. A tenant is gone
//! when no object of the parent's kind with its name exists in its
//! namespace (whatever that object's labels: one that exists, even being
//! deleted, is the worker's).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, ObjectMeta};
use kube::core::GroupVersionKind;
use serde::Serialize;
use serde_json::Value;

use crate::profile::{InfraSpec, Profile, TENANT_PLACEHOLDER, tenant_from_name};
use crate::record::Keys;
use crate::text::{age, columns, count};

#[derive(clap::Args, Debug, Clone)]
pub struct OrphansArgs {
    /// Only what was of tenants in this namespace (a PV by its claim's
    /// namespace or its kept-namespace label, a snapshot content by its
    /// VolumeSnapshot's).
    #[arg(long, short = 'n')]
    pub namespace: Option<String>,
    /// Output format: table or json.
    #[arg(long, short = 'o', default_value = "table", value_parser = ["table", "json"])]
    pub output: String,
    #[command(flatten)]
    pub profile: crate::args::ProfileArg,
}

/// A tenant: its parent release's namespace and name.
type TenantKey = (String, String);

/// Why an object is listed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Why {
    /// Labelled for a tenant whose parent no longer exists.
    TenantGone,
    /// A management PV the worker kept (label `kept: "true"`) for a tenant
    /// that no longer exists, or for none it names.
    Kept,
    /// A PV in phase Released (its claim is gone: nothing can use it again)
    /// whose claim was in a tenant namespace.
    Released,
}

impl Why {
    fn shown(self) -> &'static str {
        match self {
            Why::TenantGone => "tenant gone",
            Why::Kept => "kept",
            Why::Released => "Released",
        }
    }
}

/// One stranded object. The JSON field names are stable.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Orphan {
    /// DataVolume (the profile's infra kind), PersistentVolumeClaim,
    /// PersistentVolume or VolumeSnapshotContent.
    pub kind: String,
    /// None for a cluster-scoped object.
    pub namespace: Option<String>,
    pub name: String,
    /// The tenant it was of, `namespace/name`; None when nothing left says.
    pub tenant: Option<String>,
    pub why: Why,
    /// Capacity (a PV, a bound PVC), requested storage (a DataVolume, an
    /// unbound PVC), restore size (a snapshot content).
    pub size: Option<String>,
    /// A PV's reclaim policy, a snapshot content's deletion policy.
    pub reclaim_policy: Option<String>,
    /// A PV's claim, `namespace/name`.
    pub claim: Option<String>,
    /// creationTimestamp (RFC 3339).
    pub created: Option<String>,
    pub age_seconds: Option<i64>,
    /// The commands that free it, in order (empty: nothing to run).
    pub free: Vec<String>,
    /// What running them frees.
    pub frees: String,
}

/// What [`read`] listed: the input of [`report`].
#[derive(Clone, Debug)]
pub struct Inputs {
    /// Every object of the parent's kind (namespace, name), whatever its
    /// labels.
    pub parents: BTreeSet<TenantKey>,
    /// The namespaces holding a parent by the profile's labels.
    pub parent_namespaces: BTreeSet<String>,
    /// Infra objects carrying the infra labels; None: the kind is not
    /// served (or the profile has no infra layer).
    pub infra_objects: Option<Vec<DynamicObject>>,
    /// PVCs carrying the infra labels.
    pub claims: Vec<PersistentVolumeClaim>,
    /// Every PV.
    pub volumes: Vec<PersistentVolume>,
    /// VolumeSnapshots carrying the infra labels; None: not served.
    pub snapshots: Option<Vec<DynamicObject>>,
    /// Every VolumeSnapshotContent; None: not served.
    pub contents: Option<Vec<DynamicObject>>,
    /// Only what was of this namespace.
    pub namespace: Option<String>,
    pub now: jiff::Timestamp,
}

/// A kind the cluster does not serve: reported, not an error.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Skipped {
    pub kind: String,
    pub api_version: String,
    pub reason: String,
}

/// The command's whole answer, as `--output json` prints it.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub orphans: Vec<Orphan>,
    pub skipped: Vec<Skipped>,
}

/// The label selector of every infra object of any tenant: each label that
/// names the tenant only present, the others with their value.
pub fn any_tenant_selector(infra: &InfraSpec) -> String {
    infra
        .labels
        .iter()
        .map(|(k, v)| {
            if v.contains(TENANT_PLACEHOLDER) {
                k.clone()
            } else {
                format!("{k}={v}")
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The tenant `labels` name by the profile's infra labels (all of them, in
/// agreement), if any.
pub fn labelled_tenant(infra: &InfraSpec, labels: &BTreeMap<String, String>) -> Option<String> {
    let (key, pattern) = infra
        .labels
        .iter()
        .find(|(_, v)| v.contains(TENANT_PLACEHOLDER))?;
    let tenant = tenant_from_name(pattern, labels.get(key)?)?;
    infra.is_tenants(labels, &tenant).then_some(tenant)
}

fn shown((ns, name): &TenantKey) -> String {
    format!("{ns}/{name}")
}

fn text(v: &Value, pointer: &str) -> Option<String> {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .map(str::to_string)
}

/// Bytes as a quantity (`10Gi`), exact.
fn bytes(n: i64) -> String {
    for (unit, size) in [
        ("Ti", 1i64 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ] {
        if n >= size && n % size == 0 {
            return format!("{}{unit}", n / size);
        }
    }
    n.to_string()
}

const TO_DELETE: &str = r#"'{"spec":{"persistentVolumeReclaimPolicy":"Delete"}}'"#;

fn patch_pv(pv: &str) -> String {
    format!("kubectl patch pv {pv} -p {TO_DELETE}")
}

/// A management disk as the layers hold it: the infra object, its claim,
/// the claim's PV (any of them may be missing).
struct Disk<'a> {
    namespace: String,
    object: Option<&'a DynamicObject>,
    claim: Option<&'a PersistentVolumeClaim>,
    volume: Option<&'a PersistentVolume>,
}

fn reclaim(pv: &PersistentVolume) -> Option<String> {
    pv.spec
        .as_ref()
        .and_then(|s| s.persistent_volume_reclaim_policy.clone())
}

fn pv_size(pv: &PersistentVolume) -> Option<String> {
    pv.spec
        .as_ref()?
        .capacity
        .as_ref()?
        .get("storage")
        .map(|q| q.0.clone())
}

fn pv_phase(pv: &PersistentVolume) -> Option<&str> {
    pv.status.as_ref()?.phase.as_deref()
}

fn claim_of(pv: &PersistentVolume) -> Option<(String, String, Option<String>)> {
    let r = pv.spec.as_ref()?.claim_ref.as_ref()?;
    Some((r.namespace.clone()?, r.name.clone()?, r.uid.clone()))
}

impl Disk<'_> {
    /// The commands that free the disk: a PV whose policy is not Delete is
    /// given Delete first, then the top object is deleted (the infra
    /// object takes its claim with it; CDI would remake a claim deleted
    /// alone while its DataVolume exists).
    fn free(&self, infra_plural: &str) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(pv) = self.volume
            && reclaim(pv).as_deref() != Some("Delete")
        {
            out.push(patch_pv(&pv.name_any()));
        }
        if let Some(o) = self.object {
            out.push(format!(
                "kubectl delete {infra_plural} -n {} {}",
                self.namespace,
                o.name_any()
            ));
        } else if let Some(c) = self.claim {
            out.push(format!(
                "kubectl delete pvc -n {} {}",
                self.namespace,
                c.name_any()
            ));
        }
        out
    }

    fn frees(&self, infra_kind: &str) -> String {
        let mut parts = Vec::new();
        if let Some(o) = self.object {
            parts.push(format!("{infra_kind} {}", o.name_any()));
        }
        if let Some(c) = self.claim {
            parts.push(format!("PVC {}", c.name_any()));
        }
        let mut s = match self.volume {
            Some(pv) => {
                parts.push(format!("PV {}", pv.name_any()));
                format!(
                    "the disk ({}) behind them: {} go, and the storage deletes the disk (PV reclaim policy Delete)",
                    pv_size(pv).unwrap_or_else(|| "size unknown".into()),
                    parts.join(", ")
                )
            }
            None => format!("{} (no PV bound: nothing on storage)", parts.join(" and ")),
        };
        let deleting: Vec<String> = [
            self.object.map(|o| &o.metadata),
            self.claim.map(|c| &c.metadata),
            self.volume.map(|v| &v.metadata),
        ]
        .into_iter()
        .flatten()
        .filter(|m| m.deletion_timestamp.is_some())
        .map(|m| {
            format!(
                "{} is being deleted already (finalizers: {})",
                m.name.clone().unwrap_or_default(),
                m.finalizers.clone().unwrap_or_default().join(", ")
            )
        })
        .collect();
        if !deleting.is_empty() {
            s.push_str("; ");
            s.push_str(&deleting.join("; "));
        }
        s
    }
}

/// The stranded storage in `inputs`, by `profile`'s names (see the module's
/// documentation), sorted by tenant.
pub fn report(profile: &Profile, inputs: &Inputs) -> Vec<Orphan> {
    let keys = Keys::new(&profile.annotation_prefix);
    let infra = profile.infra.as_ref();
    let (infra_kind, infra_plural) = infra.map_or(("DataVolume", "datavolumes"), |i| {
        (i.kind.as_str(), i.plural.as_str())
    });
    let tenant_of = |m: &ObjectMeta| -> Option<TenantKey> {
        let labels = m.labels.as_ref()?;
        let name = labelled_tenant(infra?, labels)?;
        Some((m.namespace.clone()?, name))
    };
    let gone = |t: &TenantKey| !inputs.parents.contains(t);
    let created = |m: &ObjectMeta| m.creation_timestamp.as_ref().map(|t| t.0.to_string());
    let age_seconds = |m: &ObjectMeta| {
        m.creation_timestamp
            .as_ref()
            .map(|t| (inputs.now.as_second() - t.0.as_second()).max(0))
    };
    let objects: Vec<&DynamicObject> = inputs.infra_objects.iter().flatten().collect();
    let mut out: Vec<Orphan> = Vec::new();
    let mut seen_pvs: BTreeSet<String> = BTreeSet::new();

    // The PV bound to a claim: its claimRef names the claim back, with the
    // claim's UID (a PV bound in another namespace, or to an earlier claim
    // of the same name, is not this claim's: `docs/design.md` §5c).
    let bound_to = |c: &PersistentVolumeClaim| -> Option<&PersistentVolume> {
        inputs.volumes.iter().find(|pv| {
            claim_of(pv).is_some_and(|(ns, name, uid)| {
                Some(ns) == c.metadata.namespace
                    && Some(name) == c.metadata.name
                    && uid.is_none_or(|u| Some(u) == c.metadata.uid)
            })
        })
    };

    // 1. The infra layer of tenants gone: each disk as its layers hold it.
    let mut disks: Vec<(TenantKey, Disk)> = Vec::new();
    let mut claimed: BTreeSet<(String, String)> = BTreeSet::new();
    for o in &objects {
        let Some(t) = tenant_of(&o.metadata).filter(|t| gone(t)) else {
            continue;
        };
        let uid = o.metadata.uid.as_deref();
        // Its claim: owned by it, or (CDI's naming) of its name, and
        // labelled for the same tenant.
        let claim = inputs.claims.iter().find(|c| {
            c.metadata.namespace == o.metadata.namespace
                && tenant_of(&c.metadata).as_ref() == Some(&t)
                && (c
                    .metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|r| Some(r.uid.as_str()) == uid)
                    || c.metadata.name == o.metadata.name)
        });
        if let Some(c) = claim {
            claimed.insert((t.0.clone(), c.name_any()));
        }
        disks.push((
            t.clone(),
            Disk {
                namespace: t.0.clone(),
                object: Some(o),
                claim,
                volume: claim.and_then(bound_to),
            },
        ));
    }
    for c in &inputs.claims {
        let Some(t) = tenant_of(&c.metadata).filter(|t| gone(t)) else {
            continue;
        };
        if claimed.contains(&(t.0.clone(), c.name_any())) {
            continue;
        }
        disks.push((
            t.clone(),
            Disk {
                namespace: t.0.clone(),
                object: None,
                claim: Some(c),
                volume: bound_to(c),
            },
        ));
    }
    let kept_for = |pv: &PersistentVolume| -> Option<Option<String>> {
        let m = &pv.metadata;
        (m.labels.as_ref()?.get(&keys.kept).map(String::as_str) == Some("true")).then(|| {
            m.annotations
                .as_ref()
                .and_then(|a| a.get(&keys.kept_for))
                .cloned()
        })
    };
    let parse_tenant = |s: &str| -> Option<TenantKey> {
        let (ns, name) = s.split_once('/')?;
        Some((ns.to_string(), name.to_string()))
    };
    // Disks' handles, for the snapshot contents of their disks.
    let mut handles: HashMap<String, TenantKey> = HashMap::new();
    for (t, d) in &disks {
        let free = d.free(infra_plural);
        let frees = d.frees(infra_kind);
        if let Some(o) = d.object {
            out.push(Orphan {
                kind: infra_kind.to_string(),
                namespace: Some(d.namespace.clone()),
                name: o.name_any(),
                tenant: Some(shown(t)),
                why: Why::TenantGone,
                size: text(&o.data, "/spec/storage/resources/requests/storage")
                    .or_else(|| text(&o.data, "/spec/pvc/resources/requests/storage")),
                reclaim_policy: None,
                claim: None,
                created: created(&o.metadata),
                age_seconds: age_seconds(&o.metadata),
                free: free.clone(),
                frees: frees.clone(),
            });
        }
        if let Some(c) = d.claim {
            let size = c
                .status
                .as_ref()
                .and_then(|s| s.capacity.as_ref()?.get("storage"))
                .or_else(|| {
                    c.spec
                        .as_ref()?
                        .resources
                        .as_ref()?
                        .requests
                        .as_ref()?
                        .get("storage")
                })
                .map(|q| q.0.clone());
            out.push(Orphan {
                kind: "PersistentVolumeClaim".into(),
                namespace: Some(d.namespace.clone()),
                name: c.name_any(),
                tenant: Some(shown(t)),
                why: Why::TenantGone,
                size,
                reclaim_policy: None,
                claim: None,
                created: created(&c.metadata),
                age_seconds: age_seconds(&c.metadata),
                free: free.clone(),
                frees: frees.clone(),
            });
        }
        if let Some(pv) = d.volume {
            seen_pvs.insert(pv.name_any());
            // A PV kept for a tenant that exists is that tenant's.
            let kept = kept_for(pv);
            let owner = match &kept {
                Some(Some(k)) => parse_tenant(k),
                _ => Some(t.clone()),
            };
            if owner.as_ref().is_some_and(|o| !gone(o)) {
                continue;
            }
            if let Some(csi) = pv.spec.as_ref().and_then(|s| s.csi.as_ref()) {
                handles.insert(csi.volume_handle.clone(), t.clone());
            }
            out.push(Orphan {
                kind: "PersistentVolume".into(),
                namespace: None,
                name: pv.name_any(),
                tenant: owner.as_ref().map(shown),
                why: if kept.is_some() {
                    Why::Kept
                } else {
                    Why::TenantGone
                },
                size: pv_size(pv),
                reclaim_policy: reclaim(pv),
                claim: Some(format!(
                    "{}/{}",
                    d.namespace,
                    d.claim.map(|c| c.name_any()).unwrap_or_default()
                )),
                created: created(&pv.metadata),
                age_seconds: age_seconds(&pv.metadata),
                free,
                frees,
            });
        }
    }

    // 2. Kept PVs, and Released PVs whose claim was in a tenant namespace.
    let mut tenant_namespaces: BTreeSet<String> = inputs.parent_namespaces.clone();
    tenant_namespaces.extend(objects.iter().filter_map(|o| o.metadata.namespace.clone()));
    tenant_namespaces.extend(
        inputs
            .claims
            .iter()
            .filter_map(|c| c.metadata.namespace.clone()),
    );
    tenant_namespaces.extend(inputs.volumes.iter().filter_map(|pv| {
        pv.metadata
            .labels
            .as_ref()?
            .get(&keys.kept_namespace)
            .cloned()
    }));
    // The infra object or labelled claim of a claim's name, in its namespace.
    let named_object = |ns: &str, name: &str| {
        objects.iter().copied().find(|o| {
            o.metadata.namespace.as_deref() == Some(ns) && o.metadata.name.as_deref() == Some(name)
        })
    };
    let named_claim = |ns: &str, name: &str| {
        inputs.claims.iter().find(|c| {
            c.metadata.namespace.as_deref() == Some(ns) && c.metadata.name.as_deref() == Some(name)
        })
    };
    for pv in &inputs.volumes {
        if seen_pvs.contains(&pv.name_any()) {
            continue;
        }
        let claim = claim_of(pv);
        let kept = kept_for(pv);
        let released = pv_phase(pv) == Some("Released");
        let (why, tenant) = match (&kept, &claim) {
            (Some(k), _) => (Why::Kept, k.as_deref().and_then(parse_tenant)),
            (None, Some((ns, name, _))) if released && tenant_namespaces.contains(ns) => {
                // Of the tenant whose infra object or claim has its claim's
                // name, if one is left.
                let t = named_object(ns, name)
                    .map(|o| &o.metadata)
                    .or_else(|| named_claim(ns, name).map(|c| &c.metadata))
                    .and_then(tenant_of);
                (Why::Released, t)
            }
            _ => continue,
        };
        if tenant.as_ref().is_some_and(|t| !gone(t)) {
            continue;
        }
        let mut free = Vec::new();
        if reclaim(pv).as_deref() != Some("Delete") {
            free.push(patch_pv(&pv.name_any()));
        }
        let size = pv_size(pv).unwrap_or_else(|| "size unknown".into());
        let frees = match (pv_phase(pv), &claim) {
            (Some("Bound"), Some((ns, name, _))) => {
                match named_object(ns, name) {
                    Some(o) => free.push(format!(
                        "kubectl delete {infra_plural} -n {ns} {}",
                        o.name_any()
                    )),
                    None => free.push(format!("kubectl delete pvc -n {ns} {name}")),
                }
                format!(
                    "the disk ({size}): its claim {ns}/{name} goes, and the storage deletes the disk"
                )
            }
            (Some("Released"), _) if free.is_empty() => format!(
                "the disk ({size}): reclaim policy Delete, so the storage should be deleting it; if it stays, \
                 `kubectl describe pv {}` shows why",
                pv.name_any()
            ),
            (Some("Released"), _) => format!(
                "the disk ({size}): its claim is gone, and with reclaim policy Delete the storage deletes it"
            ),
            _ => {
                free.push(format!("kubectl delete pv {}", pv.name_any()));
                format!(
                    "the disk ({size}), by its storage once the PV object is deleted with reclaim policy Delete"
                )
            }
        };
        if let (Some(csi), Some(t)) = (pv.spec.as_ref().and_then(|s| s.csi.as_ref()), &tenant) {
            handles.insert(csi.volume_handle.clone(), t.clone());
        }
        out.push(Orphan {
            kind: "PersistentVolume".into(),
            namespace: None,
            name: pv.name_any(),
            tenant: tenant.as_ref().map(shown),
            why,
            size: pv_size(pv),
            reclaim_policy: reclaim(pv),
            claim: claim.as_ref().map(|(ns, name, _)| format!("{ns}/{name}")),
            created: created(&pv.metadata),
            age_seconds: age_seconds(&pv.metadata),
            free,
            frees,
        });
    }

    // 3. Snapshot contents of tenants gone: labelled themselves, bound to a
    // labelled VolumeSnapshot (by namespace, name and UID), or of a disk
    // listed above.
    let snapshots: Vec<&DynamicObject> = inputs.snapshots.iter().flatten().collect();
    for c in inputs.contents.iter().flatten() {
        let ref_ns = text(&c.data, "/spec/volumeSnapshotRef/namespace");
        let ref_name = text(&c.data, "/spec/volumeSnapshotRef/name");
        let ref_uid = text(&c.data, "/spec/volumeSnapshotRef/uid");
        let snapshot = snapshots.iter().copied().find(|s| {
            s.metadata.namespace == ref_ns
                && s.metadata.name == ref_name
                && ref_uid
                    .as_ref()
                    .is_none_or(|u| s.metadata.uid.as_ref() == Some(u))
        });
        let own = c
            .metadata
            .labels
            .as_ref()
            .zip(ref_ns.clone())
            .and_then(|(l, ns)| Some((ns, labelled_tenant(infra?, l)?)));
        let tenant = own
            .or_else(|| snapshot.and_then(|s| tenant_of(&s.metadata)))
            .or_else(|| {
                text(&c.data, "/spec/source/volumeHandle").and_then(|h| handles.get(&h).cloned())
            });
        let Some(t) = tenant.filter(|t| gone(t)) else {
            continue;
        };
        let policy = text(&c.data, "/spec/deletionPolicy");
        let mut free = Vec::new();
        if policy.as_deref() != Some("Delete") {
            free.push(format!(
                r#"kubectl patch volumesnapshotcontent {} --type merge -p '{{"spec":{{"deletionPolicy":"Delete"}}}}'"#,
                c.name_any()
            ));
        }
        let size = c
            .data
            .pointer("/status/restoreSize")
            .and_then(Value::as_i64)
            .map(bytes);
        let held = format!(
            "the snapshot on the management storage ({})",
            size.as_deref().unwrap_or("size unknown")
        );
        let frees = match snapshot.filter(|s| s.metadata.deletion_timestamp.is_none()) {
            Some(s) => {
                free.push(format!(
                    "kubectl delete volumesnapshot -n {} {}",
                    s.namespace().unwrap_or_default(),
                    s.name_any()
                ));
                format!(
                    "{held}: deleting its VolumeSnapshot makes the snapshot controller delete the content, \
                     and the storage the snapshot (deletionPolicy Delete)"
                )
            }
            None => {
                free.push(format!(
                    "kubectl delete volumesnapshotcontent {}",
                    c.name_any()
                ));
                format!(
                    "{held}: its VolumeSnapshot is gone; with deletionPolicy Delete the snapshot is deleted \
                     with the content (a content deleted with Retain leaves the snapshot with nothing naming it)"
                )
            }
        };
        out.push(Orphan {
            kind: "VolumeSnapshotContent".into(),
            namespace: None,
            name: c.name_any(),
            tenant: Some(shown(&t)),
            why: Why::TenantGone,
            size,
            reclaim_policy: policy,
            claim: None,
            created: created(&c.metadata),
            age_seconds: age_seconds(&c.metadata),
            free,
            frees,
        });
    }

    if let Some(ns) = &inputs.namespace {
        let of = |s: &Option<String>| {
            s.as_deref()
                .and_then(|s| s.split_once('/'))
                .is_some_and(|(n, _)| n == ns)
        };
        out.retain(|o| o.namespace.as_ref() == Some(ns) || of(&o.tenant) || of(&o.claim));
    }
    let rank = |k: &str| match k {
        "PersistentVolumeClaim" => 1,
        "PersistentVolume" => 2,
        "VolumeSnapshotContent" => 3,
        _ => 0,
    };
    out.sort_by(|a, b| {
        (&a.tenant, rank(&a.kind), &a.namespace, &a.name).cmp(&(
            &b.tenant,
            rank(&b.kind),
            &b.namespace,
            &b.name,
        ))
    });
    out
}

/// The table: one row per object, columns like `volume-gate status`.
pub fn render_table(rows: &[Orphan], now: jiff::Timestamp) -> String {
    let mut table: Vec<Vec<String>> = vec![
        [
            "KIND",
            "NAMESPACE",
            "NAME",
            "TENANT",
            "WHY",
            "SIZE",
            "RECLAIM",
            "AGE",
            "FREE WITH",
        ]
        .map(String::from)
        .to_vec(),
    ];
    let dash = |s: &Option<String>| s.clone().unwrap_or_else(|| "-".into());
    for r in rows {
        table.push(vec![
            r.kind.clone(),
            dash(&r.namespace),
            r.name.clone(),
            dash(&r.tenant),
            r.why.shown().into(),
            dash(&r.size),
            dash(&r.reclaim_policy),
            age(r.created.as_deref(), now),
            if r.free.is_empty() {
                "-".into()
            } else {
                r.free.join(" && ")
            },
        ]);
    }
    columns(&table)
}

fn snapshot_resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("snapshot.storage.k8s.io", "v1", kind),
        plural,
    )
}

/// A list that failed, said with what to do.
fn failed(what: &str, resource: &str, e: kube::Error) -> String {
    match e {
        kube::Error::Api(s) if s.code == 403 => format!(
            "cannot list {what}: forbidden ({}). `volume-gate orphans` needs the verb `list` on {resource}; \
             the worker's ClusterRole grants it, so it can run in the worker's Pod \
             (kubectl -n volume-gate exec deploy/volume-gate-worker -- /usr/local/bin/volume-gate orphans), \
             or grant your user `list` on {resource}",
            s.message
        ),
        kube::Error::Api(s) if s.code == 401 => format!(
            "cannot list {what}: unauthorized ({}): the kubeconfig's credentials were refused",
            s.message
        ),
        e => format!("cannot list {what}: {e}"),
    }
}

/// Lists `api`; `None` when the API server does not serve its kind.
async fn list_served<K>(
    api: Api<K>,
    lp: &ListParams,
    what: &str,
    resource: &str,
) -> Result<Option<Vec<K>>, String>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.list(lp).await {
        Ok(l) => Ok(Some(l.items)),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(None),
        Err(e) => Err(failed(what, resource, e)),
    }
}

fn dynamic(client: &kube::Client, ar: &ApiResource, ns: Option<&str>) -> Api<DynamicObject> {
    match ns {
        Some(ns) => Api::namespaced_with(client.clone(), ns, ar),
        None => Api::all_with(client.clone(), ar),
    }
}

/// Lists what [`report`] needs (list calls only), in `namespace` or
/// cluster-wide; the kinds the cluster does not serve are returned as
/// skipped.
pub async fn read(
    client: &kube::Client,
    profile: &Profile,
    namespace: Option<&str>,
) -> Result<(Inputs, Vec<Skipped>), String> {
    let mut skipped = Vec::new();
    let mut skip = |kind: &str, api_version: String| {
        skipped.push(Skipped {
            kind: kind.into(),
            api_version,
            reason: "not installed, skipped".into(),
        })
    };
    let p = &profile.parent;
    let parent_resource = format!("{}.{}", p.plural, p.group);
    let parents = match dynamic(client, &profile.parent_resource(), namespace)
        .list_metadata(&ListParams::default())
        .await
    {
        Ok(l) => l.items,
        Err(kube::Error::Api(s)) if s.code == 404 => {
            return Err(format!(
                "the cluster does not serve {parent_resource}/{}: without it no tenant can be told to exist, \
                 so nothing is reported (is this the management cluster?)",
                p.version
            ));
        }
        Err(e) => {
            return Err(failed(
                &format!("the tenants' parent releases ({parent_resource})"),
                &parent_resource,
                e,
            ));
        }
    };
    let parent_namespaces = parents
        .iter()
        .filter(|o| profile.is_parent(o.labels()))
        .map(|o| o.namespace().unwrap_or_default())
        .collect();
    let parents = parents
        .iter()
        .map(|o| (o.namespace().unwrap_or_default(), o.name_any()))
        .collect();

    let (infra_objects, claims, snapshots) = match &profile.infra {
        None => (None, Vec::new(), None),
        Some(infra) => {
            let selected = ListParams::default().labels(&any_tenant_selector(infra));
            let resource = format!("{}.{}", infra.plural, infra.group);
            let objects = list_served(
                dynamic(client, &infra.resource(), namespace),
                &selected,
                &format!("{} ({resource})", infra.kind),
                &resource,
            )
            .await?;
            if objects.is_none() {
                skip(&infra.kind, format!("{}/{}", infra.group, infra.version));
            }
            let claims_api: Api<PersistentVolumeClaim> = match namespace {
                Some(ns) => Api::namespaced(client.clone(), ns),
                None => Api::all(client.clone()),
            };
            let claims = list_served(
                claims_api,
                &selected,
                "PersistentVolumeClaims",
                "persistentvolumeclaims",
            )
            .await?
            .unwrap_or_default();
            let snapshots = list_served(
                dynamic(
                    client,
                    &snapshot_resource("VolumeSnapshot", "volumesnapshots"),
                    namespace,
                ),
                &selected,
                "VolumeSnapshots",
                "volumesnapshots.snapshot.storage.k8s.io",
            )
            .await?;
            (objects, claims, snapshots)
        }
    };
    let volumes = list_served(
        Api::<PersistentVolume>::all(client.clone()),
        &ListParams::default(),
        "PersistentVolumes",
        "persistentvolumes",
    )
    .await?
    .unwrap_or_default();
    let contents = list_served(
        dynamic(
            client,
            &snapshot_resource("VolumeSnapshotContent", "volumesnapshotcontents"),
            None,
        ),
        &ListParams::default(),
        "VolumeSnapshotContents",
        "volumesnapshotcontents.snapshot.storage.k8s.io",
    )
    .await?;
    if contents.is_none() {
        skip("VolumeSnapshotContent", "snapshot.storage.k8s.io/v1".into());
    }
    let inputs = Inputs {
        parents,
        parent_namespaces,
        infra_objects,
        claims,
        volumes,
        snapshots,
        contents,
        namespace: namespace.map(str::to_string),
        now: jiff::Timestamp::now(),
    };
    Ok((inputs, skipped))
}

pub async fn run(args: OrphansArgs) -> Result<(), String> {
    let profile = Profile::load_or_default(args.profile.path()).map_err(|e| e.to_string())?;
    let client = kube::Client::try_default()
        .await
        .map_err(|e| format!("cannot reach the management cluster: {e}"))?;
    let (inputs, skipped) = read(&client, &profile, args.namespace.as_deref()).await?;
    let orphans = report(&profile, &inputs);
    if args.output == "json" {
        let report = Report { orphans, skipped };
        println!(
            "{}",
            serde_json::to_string_pretty(&report).expect("the report serializes")
        );
        return Ok(());
    }
    for s in &skipped {
        eprintln!("{} ({}): {}", s.kind, s.api_version, s.reason);
    }
    if profile.infra.is_none() {
        eprintln!("the profile has no infra layer: only PVs are looked at");
    }
    if orphans.is_empty() {
        eprintln!("No stranded storage found.");
        return Ok(());
    }
    print!("{}", render_table(&orphans, inputs.now));
    let tenants: BTreeSet<&String> = orphans.iter().filter_map(|o| o.tenant.as_ref()).collect();
    eprintln!(
        "{} of {} gone; nothing was changed (this command only reads)",
        count(orphans.len(), "object"),
        count(tenants.len(), "tenant"),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const LABEL: &str = "cluster.x-k8s.io/cluster-name";

    fn now() -> jiff::Timestamp {
        "2026-12-05T00:00:00Z".parse().unwrap()
    }

    fn dv(ns: &str, name: &str, tenant: Option<&str>) -> DynamicObject {
        let labels = tenant.map_or(json!({}), |t| json!({LABEL: t}));
        serde_json::from_value(json!({
            "apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
            "metadata": {"name": name, "namespace": ns, "uid": format!("dv-{name}"), "labels": labels,
                         "creationTimestamp": "2026-12-01T00:00:00Z"},
            "spec": {"storage": {"resources": {"requests": {"storage": "10Gi"}}}},
        }))
        .unwrap()
    }

    fn pvc(ns: &str, name: &str, tenant: &str, pv: &str) -> PersistentVolumeClaim {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns, "uid": format!("pvc-{name}"), "labels": {LABEL: tenant},
                         "ownerReferences": [{"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
                                              "name": name, "uid": format!("dv-{name}")}]},
            "spec": {"volumeName": pv, "resources": {"requests": {"storage": "10Gi"}}},
            "status": {"phase": "Bound", "capacity": {"storage": "10Gi"}},
        }))
        .unwrap()
    }

    fn pv(name: &str, claim: Option<(&str, &str)>, phase: &str, policy: &str) -> PersistentVolume {
        let claim_ref =
            claim.map(|(ns, c)| json!({"namespace": ns, "name": c, "uid": format!("pvc-{c}")}));
        serde_json::from_value(json!({
            "metadata": {"name": name, "creationTimestamp": "2026-11-05T00:00:00Z"},
            "spec": {"capacity": {"storage": "10Gi"}, "persistentVolumeReclaimPolicy": policy,
                     "claimRef": claim_ref, "csi": {"driver": "rbd", "volumeHandle": format!("handle-{name}")}},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    fn kept(mut v: PersistentVolume, ns: &str, tenant: &str) -> PersistentVolume {
        let keys = Keys::new(&Profile::cozystack().annotation_prefix);
        v.metadata.labels = Some(BTreeMap::from([
            (keys.kept.clone(), "true".into()),
            (keys.kept_namespace.clone(), ns.into()),
        ]));
        v.metadata.annotations = Some(BTreeMap::from([(
            keys.kept_for.clone(),
            format!("{ns}/{tenant}"),
        )]));
        v
    }

    fn snapshot(ns: &str, name: &str, tenant: &str) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
            "metadata": {"name": name, "namespace": ns, "uid": format!("vs-{name}"), "labels": {LABEL: tenant}},
        }))
        .unwrap()
    }

    fn content(name: &str, snapshot: (&str, &str), handle: &str, policy: &str) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotContent",
            "metadata": {"name": name},
            "spec": {"deletionPolicy": policy, "source": {"volumeHandle": handle},
                     "volumeSnapshotRef": {"namespace": snapshot.0, "name": snapshot.1, "uid": format!("vs-{}", snapshot.1)}},
            "status": {"restoreSize": 5368709120i64, "snapshotHandle": "snap-1"},
        }))
        .unwrap()
    }

    /// Namespace `tenant-a` held tenants `kubernetes-gone` (its parent
    /// deleted) and `kubernetes-live` (its parent there): one disk each,
    /// all three layers.
    fn world() -> Inputs {
        Inputs {
            parents: BTreeSet::from([("tenant-a".into(), "kubernetes-live".into())]),
            parent_namespaces: BTreeSet::from(["tenant-a".into()]),
            infra_objects: Some(vec![
                dv("tenant-a", "pvc-g1", Some("kubernetes-gone")),
                dv("tenant-a", "pvc-l1", Some("kubernetes-live")),
            ]),
            claims: vec![
                pvc("tenant-a", "pvc-g1", "kubernetes-gone", "disk-g1"),
                pvc("tenant-a", "pvc-l1", "kubernetes-live", "disk-l1"),
            ],
            volumes: vec![
                pv("disk-g1", Some(("tenant-a", "pvc-g1")), "Bound", "Delete"),
                pv("disk-l1", Some(("tenant-a", "pvc-l1")), "Bound", "Delete"),
                pv("other", Some(("apps", "data")), "Bound", "Delete"),
            ],
            snapshots: Some(vec![]),
            contents: Some(vec![]),
            namespace: None,
            now: now(),
        }
    }

    fn names(r: &[Orphan]) -> Vec<(String, String)> {
        r.iter().map(|o| (o.kind.clone(), o.name.clone())).collect()
    }

    fn pair(kind: &str, name: &str) -> (String, String) {
        (kind.to_string(), name.to_string())
    }

    #[test]
    fn a_gone_tenants_disk_is_listed_in_its_three_layers_and_a_live_tenants_never() {
        let r = report(&Profile::cozystack(), &world());
        assert_eq!(
            names(&r),
            vec![
                pair("DataVolume", "pvc-g1"),
                pair("PersistentVolumeClaim", "pvc-g1"),
                pair("PersistentVolume", "disk-g1"),
            ],
            "{r:#?}"
        );
        assert!(
            r.iter()
                .all(|o| o.tenant.as_deref() == Some("tenant-a/kubernetes-gone"))
        );
        assert!(r.iter().all(|o| o.why == Why::TenantGone));
        let dv = &r[0];
        assert_eq!(
            dv.free,
            vec!["kubectl delete datavolumes -n tenant-a pvc-g1"]
        );
        assert_eq!(dv.size.as_deref(), Some("10Gi"));
        assert_eq!(dv.age_seconds, Some(4 * 86400));
        assert!(dv.frees.contains("PV disk-g1"), "{}", dv.frees);
        let pv = &r[2];
        assert_eq!(pv.reclaim_policy.as_deref(), Some("Delete"));
        assert_eq!(pv.claim.as_deref(), Some("tenant-a/pvc-g1"));
        assert_eq!(pv.free, dv.free, "the PV goes with its DataVolume");
    }

    #[test]
    fn a_tenant_whose_parent_exists_is_never_listed_even_its_kept_or_released_pvs() {
        let mut w = world();
        w.parents
            .insert(("tenant-a".into(), "kubernetes-gone".into()));
        w.volumes.push(kept(
            pv("kept-l", None, "Released", "Retain"),
            "tenant-a",
            "kubernetes-live",
        ));
        w.infra_objects.as_mut().unwrap().push(dv(
            "tenant-a",
            "pvc-going",
            Some("kubernetes-live"),
        ));
        w.volumes.push(pv(
            "going",
            Some(("tenant-a", "pvc-going")),
            "Released",
            "Retain",
        ));
        let r = report(&Profile::cozystack(), &w);
        assert!(r.is_empty(), "{r:#?}");
    }

    #[test]
    fn a_retain_disk_is_given_delete_first() {
        let mut w = world();
        w.volumes[0] = pv("disk-g1", Some(("tenant-a", "pvc-g1")), "Bound", "Retain");
        let r = report(&Profile::cozystack(), &w);
        assert_eq!(
            r[0].free,
            vec![
                r#"kubectl patch pv disk-g1 -p '{"spec":{"persistentVolumeReclaimPolicy":"Delete"}}'"#.to_string(),
                "kubectl delete datavolumes -n tenant-a pvc-g1".into(),
            ]
        );
    }

    #[test]
    fn kept_pvs_are_listed_with_the_tenant_they_were_kept_for() {
        let mut w = world();
        w.volumes.push(kept(
            pv(
                "kept-1",
                Some(("tenant-old", "pvc-x")),
                "Released",
                "Retain",
            ),
            "tenant-old",
            "kubernetes-old",
        ));
        let r = report(&Profile::cozystack(), &w);
        let k = r
            .iter()
            .find(|o| o.name == "kept-1")
            .expect("the kept PV is listed");
        assert_eq!(k.why, Why::Kept);
        assert_eq!(k.tenant.as_deref(), Some("tenant-old/kubernetes-old"));
        assert_eq!(
            k.free,
            vec![
                r#"kubectl patch pv kept-1 -p '{"spec":{"persistentVolumeReclaimPolicy":"Delete"}}'"#
            ]
        );
        assert_eq!(k.reclaim_policy.as_deref(), Some("Retain"));
    }

    #[test]
    fn a_released_pv_is_listed_only_when_its_claim_was_in_a_tenant_namespace() {
        let mut w = world();
        w.volumes.push(pv(
            "rel-tenant",
            Some(("tenant-a", "pvc-old")),
            "Released",
            "Retain",
        ));
        w.volumes.push(pv(
            "rel-elsewhere",
            Some(("monitoring", "data")),
            "Released",
            "Retain",
        ));
        let r = report(&Profile::cozystack(), &w);
        let rel: Vec<&Orphan> = r.iter().filter(|o| o.why == Why::Released).collect();
        assert_eq!(rel.len(), 1, "{r:#?}");
        assert_eq!(rel[0].name, "rel-tenant");
        assert_eq!(rel[0].tenant, None, "nothing left says whose it was");
        assert_eq!(rel[0].claim.as_deref(), Some("tenant-a/pvc-old"));
    }

    #[test]
    fn names_alone_match_nothing() {
        let mut w = world();
        // Named like the gone tenant's disks, but not labelled for it.
        w.infra_objects
            .as_mut()
            .unwrap()
            .push(dv("tenant-a", "kubernetes-gone-disk", None));
        let r = report(&Profile::cozystack(), &w);
        assert!(r.iter().all(|o| o.name != "kubernetes-gone-disk"), "{r:#?}");
    }

    #[test]
    fn a_gone_tenants_snapshot_contents_are_listed_by_their_labelled_snapshot_or_their_disk() {
        let mut w = world();
        w.snapshots = Some(vec![
            snapshot("tenant-a", "snap-g", "kubernetes-gone"),
            snapshot("tenant-a", "snap-l", "kubernetes-live"),
        ]);
        w.contents = Some(vec![
            content("c-g", ("tenant-a", "snap-g"), "handle-x", "Delete"),
            content("c-l", ("tenant-a", "snap-l"), "handle-disk-l1", "Delete"),
            // Its VolumeSnapshot gone, a snapshot of the gone tenant's disk.
            content(
                "c-disk",
                ("tenant-a", "snap-gone"),
                "handle-disk-g1",
                "Retain",
            ),
            content("c-other", ("apps", "s"), "handle-other", "Delete"),
        ]);
        let r = report(&Profile::cozystack(), &w);
        let contents: Vec<&Orphan> = r
            .iter()
            .filter(|o| o.kind == "VolumeSnapshotContent")
            .collect();
        assert_eq!(
            contents.iter().map(|o| o.name.as_str()).collect::<Vec<_>>(),
            vec!["c-disk", "c-g"],
            "{r:#?}"
        );
        assert!(
            contents
                .iter()
                .all(|o| o.tenant.as_deref() == Some("tenant-a/kubernetes-gone"))
        );
        assert_eq!(
            contents[1].free,
            vec!["kubectl delete volumesnapshot -n tenant-a snap-g"]
        );
        assert_eq!(contents[1].size.as_deref(), Some("5Gi"));
        assert_eq!(
            contents[0].free,
            vec![
                r#"kubectl patch volumesnapshotcontent c-disk --type merge -p '{"spec":{"deletionPolicy":"Delete"}}'"#,
                "kubectl delete volumesnapshotcontent c-disk",
            ]
        );
    }

    #[test]
    fn a_namespace_narrows_to_what_was_of_it() {
        let mut w = world();
        w.volumes.push(kept(
            pv("kept-1", None, "Released", "Retain"),
            "tenant-old",
            "kubernetes-old",
        ));
        w.namespace = Some("tenant-old".into());
        let r = report(&Profile::cozystack(), &w);
        assert_eq!(names(&r), vec![pair("PersistentVolume", "kept-1")]);
    }

    #[test]
    fn the_table_has_a_header_and_one_row_per_object() {
        let r = report(&Profile::cozystack(), &world());
        let t = render_table(&r, now());
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 1 + r.len(), "{t}");
        assert!(
            lines[0].starts_with("KIND") && lines[0].contains("FREE WITH"),
            "{t}"
        );
        assert!(
            lines[1].contains("kubectl delete datavolumes -n tenant-a pvc-g1")
                && lines[1].contains("4d"),
            "{t}"
        );
        let json = serde_json::to_value(&r[2]).unwrap();
        for field in [
            "kind",
            "namespace",
            "name",
            "tenant",
            "why",
            "size",
            "reclaimPolicy",
            "claim",
            "created",
            "ageSeconds",
            "free",
            "frees",
        ] {
            assert!(json.get(field).is_some(), "{field} in {json}");
        }
        assert_eq!(json["why"], "tenantGone");
    }

    #[test]
    fn the_selector_finds_every_tenants_objects_and_the_labels_name_one() {
        let infra = InfraSpec::cozystack();
        assert_eq!(any_tenant_selector(&infra), LABEL);
        let labels = BTreeMap::from([(LABEL.to_string(), "kubernetes-a".to_string())]);
        assert_eq!(
            labelled_tenant(&infra, &labels).as_deref(),
            Some("kubernetes-a")
        );
        assert_eq!(labelled_tenant(&infra, &BTreeMap::new()), None);
    }

    fn list(items: Vec<Value>) -> Value {
        json!({"apiVersion": "v1", "kind": "List", "metadata": {}, "items": items})
    }

    #[tokio::test]
    async fn the_lister_only_reads_and_reports_kinds_not_installed_as_skipped() {
        use crate::testing::FakeApi;
        let api = FakeApi::new();
        api.get("/apis/helm.toolkit.fluxcd.io/v2/helmreleases", list(vec![]));
        api.get("/api/v1/persistentvolumeclaims", list(vec![]));
        api.get(
            "/api/v1/persistentvolumes",
            list(vec![
                serde_json::to_value(kept(
                    pv("kept-1", None, "Released", "Retain"),
                    "t",
                    "kubernetes-x",
                ))
                .unwrap(),
            ]),
        );
        // DataVolumes and the snapshot kinds are not served: 404.
        let (inputs, skipped) = read(&api.client(), &Profile::cozystack(), None)
            .await
            .unwrap();
        assert!(
            api.calls().iter().all(|c| c.method == "GET"),
            "{:?}",
            api.calls().iter().map(|c| c.line()).collect::<Vec<_>>()
        );
        assert_eq!(
            skipped.iter().map(|s| s.kind.as_str()).collect::<Vec<_>>(),
            vec!["DataVolume", "VolumeSnapshotContent"]
        );
        assert!(skipped.iter().all(|s| s.reason == "not installed, skipped"));
        let selector = api.calls_to("GET", "/api/v1/persistentvolumeclaims")[0]
            .query
            .clone();
        assert!(
            selector.contains("labelSelector=cluster.x-k8s.io%2Fcluster-name"),
            "{selector}"
        );
        let r = report(&Profile::cozystack(), &inputs);
        assert_eq!(names(&r), vec![pair("PersistentVolume", "kept-1")]);
    }

    #[tokio::test]
    async fn a_forbidden_list_names_the_verb_and_resource_it_needs() {
        use crate::testing::FakeApi;
        let api = FakeApi::new();
        api.get("/apis/helm.toolkit.fluxcd.io/v2/helmreleases", list(vec![]));
        api.get("/api/v1/persistentvolumeclaims", list(vec![]));
        api.fail("GET", "/api/v1/persistentvolumes", 403);
        let err = read(&api.client(), &Profile::cozystack(), None)
            .await
            .unwrap_err();
        assert!(
            err.contains("cannot list PersistentVolumes: forbidden")
                && err.contains("`list` on persistentvolumes")
                && err.contains("exec deploy/volume-gate-worker"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn without_the_parent_kind_nothing_is_reported() {
        use crate::testing::FakeApi;
        let api = FakeApi::new();
        let err = read(&api.client(), &Profile::cozystack(), None)
            .await
            .unwrap_err();
        assert!(
            err.contains("does not serve helmreleases.helm.toolkit.fluxcd.io/v2"),
            "{err}"
        );
    }
}
