//! The volume-release phase (`docs/design.md` §5, steps 1–7) for one tenant.
//!
//! Every step is idempotent and reads its state from the APIs, so a worker
//! killed anywhere resumes: the inventory is in the record, the claims are
//! being deleted or gone, and the PVs tell how far the driver got.

use std::collections::{BTreeSet, HashSet};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{
    PersistentVolume, PersistentVolumeClaim, Pod, ResourceQuota, ResourceQuotaSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, ObjectMeta, PostParams,
};
use kube::core::GroupVersionKind;
use kube::runtime::watcher;
use tokio::time::Instant;
use tracing::{info, warn};

use super::claims::{self, ClaimKey};
use super::context::Vetted;
use super::identity;
use super::infra;
use super::tenant;
use super::{Context, TenantRef};
use crate::metrics::ErrorKind;
use crate::record::{ClusterIdentity, Inventory, Phase, Record, Update, count, now_rfc3339};

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

/// Name of the quota that stops new claims in a tenant being released.
pub const FREEZE_QUOTA: &str = "volume-gate-freeze";

fn blocked(reason: ErrorKind, message: String, inventory: Option<Inventory>) -> Outcome {
    Outcome::Blocked {
        reason,
        message,
        inventory,
    }
}

/// Runs steps 1–7 once. `Err` is a management-API failure (requeue);
/// everything about the tenant is an [`Outcome`].
pub async fn run(ctx: &Context, t: &TenantRef, record: &Record) -> Result<Outcome, kube::Error> {
    let settings = &ctx.settings;
    let previous = record.inventory.clone();
    // Step 1: the admin kubeconfig.
    let api = match tenant::connect(
        &ctx.client,
        &ctx.profile,
        &t.namespace,
        &t.name,
        settings.request_timeout,
    )
    .await
    {
        Ok(api) => api,
        Err(e) => return unreachable(ctx, t, record, e.kind(), e.to_string()).await,
    };
    // Step 2: a kubeconfig that exists is not an API server that answers.
    if let Err(e) = tenant::probe_ready(&api, settings.probe_timeout).await {
        return unreachable(ctx, t, record, e.kind(), e.to_string()).await;
    }
    ctx.reachable(t);
    // And it must be this tenant's cluster: the Secret is writable by
    // whoever may edit the tenant namespace.
    let secret = format!(
        "{}/{}",
        t.namespace,
        ctx.profile.kubeconfig_secret_name(&t.name)
    );
    let bound = match same_cluster(ctx, t, &api, record.cluster.as_ref(), &secret).await? {
        Ok(bound) => bound,
        Err(outcome) => return Ok(outcome.with_inventory(previous)),
    };
    let tc = api.client.clone();
    let fail =
        |step: &str, e: kube::Error| format!("tenant API {} failed while {step}: {e}", api.server);
    let deadline = Instant::now() + settings.wait_bound;
    let mut inventory = previous;
    loop {
        // Step 3: inventory before any deletion, written to the record.
        let pvs = match Api::<PersistentVolume>::all(tc.clone())
            .list(&ListParams::default())
            .await
        {
            Ok(l) => l.items,
            Err(e) => {
                return Ok(blocked(
                    ErrorKind::TenantApiError,
                    fail("listing PersistentVolumes", e),
                    inventory,
                ));
            }
        };
        let first_time = inventory.is_none();
        let mut inv = claims::reconcile_inventory(
            inventory.as_ref(),
            &pvs,
            &now_rfc3339(),
            ctx.profile.infra.as_ref(),
        );
        // A disk whose tenant volume is not Delete is kept before anything
        // can delete it, and before the inventory that says so is written:
        // the gate lets a tenant's disks be deleted in teardown only once it
        // is (docs/design.md §5c).
        if let Some(spec) = ctx.profile.infra.as_ref() {
            let observed = infra::observe(ctx, t, spec, Some(&inv)).await?;
            infra::note_pvs(&mut inv, &observed);
            infra::keep(ctx, t, &observed, Some(&mut inv), true).await?;
        }
        let grew = inventory.as_ref().is_some_and(|old| old.total != inv.total);
        let message = format!(
            "inventory taken: {} ({} left); deleting claims",
            count(inv.total, "volume"),
            inv.left()
        );
        ctx.write_record(
            t,
            &Update {
                phase: Some(Phase::Releasing),
                message: Some(message),
                inventory: Some(inv.clone()),
                ..Default::default()
            },
        )
        .await?;
        if first_time {
            ctx.event(
                t,
                false,
                "InventoryTaken",
                format!(
                    "{} inventoried before any deletion",
                    count(inv.total, "volume")
                ),
            )
            .await;
        } else if grew {
            ctx.event(
                t,
                false,
                "InventoryGrew",
                format!(
                    "now {}: new ones appeared while releasing",
                    count(inv.total, "volume")
                ),
            )
            .await;
        }
        inventory = Some(inv.clone());

        // Step 4: stop new claims, delete every claim, then the Pods holding them.
        if let Err(e) = freeze_claims(&tc).await {
            return Ok(blocked(
                ErrorKind::TenantApiError,
                fail("creating the claim freeze quota", e),
                inventory,
            ));
        }
        let claims = match delete_claims(&tc).await {
            Ok(c) => c,
            Err(e) => {
                return Ok(blocked(
                    ErrorKind::TenantApiError,
                    fail("deleting PersistentVolumeClaims", e),
                    inventory,
                ));
            }
        };
        let pods = match delete_holding_pods(&tc, &claims).await {
            Ok(p) => p,
            Err(e) => {
                return Ok(blocked(
                    ErrorKind::TenantApiError,
                    fail("deleting the Pods that mount claims", e),
                    inventory,
                ));
            }
        };
        info!(namespace = %t.namespace, tenant = %t.name, claims = claims.len(), pods = pods, "claims and holding pods deleted");

        // Step 5: snapshots, when that API is installed.
        let snapshot_contents = match release_snapshots(&tc).await {
            Ok(c) => c,
            Err(e) => {
                return Ok(blocked(
                    ErrorKind::TenantApiError,
                    fail("deleting VolumeSnapshots", e),
                    inventory,
                ));
            }
        };

        // Step 6: wait for the PVs themselves.
        let waited: HashSet<String> = inv
            .remaining()
            .filter(|v| !v.is_retain())
            .map(|v| v.pv.clone())
            .collect();
        let progress = WaitProgress {
            ctx,
            tenant: t,
            inventory: inv.clone(),
        };
        if let Err(e) = wait_gone(
            Api::<PersistentVolume>::all(tc.clone()),
            waited,
            deadline,
            &progress,
        )
        .await
        {
            return Ok(blocked(
                ErrorKind::TenantApiError,
                fail("watching PersistentVolumes", e),
                inventory,
            ));
        }
        let contents_left = match snapshot_contents {
            Some((api, names)) => match wait_gone(api, names, deadline, &NoProgress).await {
                Ok(s) => s,
                Err(e) => {
                    return Ok(blocked(
                        ErrorKind::TenantApiError,
                        fail("watching VolumeSnapshotContents", e),
                        inventory,
                    ));
                }
            },
            None => BTreeSet::new(),
        };

        // Step 7: the outcome, from a fresh list, of the same cluster.
        if let Err(outcome) = same_cluster(ctx, t, &api, Some(&bound), &secret).await? {
            return Ok(outcome.with_inventory(inventory));
        }
        let pvs = match Api::<PersistentVolume>::all(tc.clone())
            .list(&ListParams::default())
            .await
        {
            Ok(l) => l.items,
            Err(e) => {
                return Ok(blocked(
                    ErrorKind::TenantApiError,
                    fail("listing PersistentVolumes", e),
                    inventory,
                ));
            }
        };
        let inv = claims::reconcile_inventory(
            Some(&inv),
            &pvs,
            &now_rfc3339(),
            ctx.profile.infra.as_ref(),
        );
        let newly_freed = inv
            .freed
            .saturating_sub(inventory.as_ref().map_or(0, |i| i.freed));
        ctx.metrics.volumes_freed.inc_by(newly_freed as u64);
        inventory = Some(inv.clone());
        let appeared = inv.total > progress.inventory.total;
        if appeared && Instant::now() < deadline {
            warn!(namespace = %t.namespace, tenant = %t.name, "new volumes appeared while releasing; another pass");
            continue;
        }
        let remaining: Vec<_> = inv.remaining().filter(|v| !v.is_retain()).collect();
        let retained: Vec<_> = inv.remaining().filter(|v| v.is_retain()).collect();
        if remaining.is_empty() && retained.is_empty() && contents_left.is_empty() {
            let Some(infra) = &ctx.profile.infra else {
                return Ok(Outcome::Released {
                    inventory: inv,
                    note: None,
                });
            };
            return management_layer(ctx, t, infra, inv, deadline).await;
        }
        let mut parts = Vec::new();
        if !remaining.is_empty() {
            parts.push(format!(
                "{} of {} not freed within {}s (is the CSI driver running?): {}",
                remaining.len(),
                count(inv.total, "volume"),
                settings.wait_bound.as_secs(),
                remaining
                    .iter()
                    .map(|v| v.describe())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        if !retained.is_empty() {
            parts.push(format!(
                "{} with reclaim policy Retain, kept on storage by design (on the management side too: their \
                 PVs there now have reclaim policy Retain); set persistentVolumeReclaimPolicy to Delete in the \
                 tenant to free them, or record an override to end the teardown with them kept: {}",
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
        return Ok(blocked(reason, parts.join("; "), inventory));
    }
}

/// Step 7 on the management side: the tenant's PVs are gone, and the disks
/// behind them must be too (DataVolume, its PVC, that PVC's PV). The
/// DataVolume's deletion returns before its disk is freed, so this waits
/// for the management PVs as step 6 waits for the tenant's.
async fn management_layer(
    ctx: &Context,
    t: &TenantRef,
    spec: &crate::profile::InfraSpec,
    mut inv: Inventory,
    deadline: Instant,
) -> Result<Outcome, kube::Error> {
    let observed = infra::observe(ctx, t, spec, Some(&inv)).await?;
    infra::note_pvs(&mut inv, &observed);
    if !observed.served {
        warn!(namespace = %t.namespace, tenant = %t.name, "the management cluster does not serve {}.{}: no infra layer to check", spec.plural, spec.group);
    }
    if observed.is_empty() {
        return Ok(Outcome::Released {
            inventory: inv,
            note: None,
        });
    }
    ctx.write_record(
        t,
        &Update {
            phase: Some(Phase::Releasing),
            message: Some(format!(
                "the tenant's {} gone; waiting for the management cluster to free the disks behind them: {}",
                count(inv.total, "PV"),
                observed.describe(&spec.kind, 5)
            )),
            inventory: Some(inv.clone()),
            ..Default::default()
        },
    )
    .await?;
    let disks: HashSet<String> = observed.volumes.iter().map(|h| h.name.clone()).collect();
    let observed = wait_disks_then_observe(ctx, t, spec, disks, deadline, &mut inv).await?;
    if observed.is_empty() {
        return Ok(Outcome::Released {
            inventory: inv,
            note: None,
        });
    }
    Ok(blocked(
        ErrorKind::VolumesRemain,
        format!(
            "the tenant's PVs are gone, but the management cluster still holds the disks behind them after {}s: {} \
             (a finalizer on a {kind}, or a Pod mounting its PVC, keeps a disk; the disk is freed when the management PV goes)",
            ctx.settings.wait_bound.as_secs(),
            observed.describe(&spec.kind, 5),
            kind = spec.kind,
        ),
        Some(inv),
    ))
}

/// Steps 1–2 failed: the tenant API cannot be reached. Without an infra
/// layer this is Blocked, as the override's case. With one, the management
/// cluster is the truth left (`docs/design.md` §5b): a tenant that holds no
/// disk there is Released; once the API has been unreachable for
/// `--infra-after`, the inventoried volumes with reclaim policy Delete are
/// freed from there; what has no recorded policy, or Retain, is kept.
async fn unreachable(
    ctx: &Context,
    t: &TenantRef,
    record: &Record,
    kind: ErrorKind,
    why: String,
) -> Result<Outcome, kube::Error> {
    let previous = record.inventory.clone();
    let Some(spec) = ctx.profile.infra.as_ref() else {
        return Ok(blocked(kind, why, previous));
    };
    if kind == ErrorKind::KubeconfigForbidden {
        // The worker's own RBAC is wrong: nothing says the tenant is dead.
        return Ok(blocked(kind, why, previous));
    }
    let unreachable_for = ctx.unreachable_for(t);
    let mut inv = previous.clone();
    if let Some(i) = inv.as_mut() {
        infra::attach_refs(i, spec);
    }
    let observed = infra::observe(ctx, t, spec, inv.as_ref()).await?;
    if !observed.served {
        return Ok(blocked(
            kind,
            format!(
                "{why}; the management cluster does not serve {}.{}, so the disks cannot be read there either",
                spec.plural, spec.group
            ),
            previous,
        ));
    }
    if let Some(i) = inv.as_mut() {
        infra::note_pvs(i, &observed);
    }
    // The tenant cannot say which of its disks are meant to stay: what no
    // inventory names as Delete is kept (docs/design.md §5c).
    infra::keep(ctx, t, &observed, inv.as_mut(), false).await?;
    let labels = spec
        .labels_of(&t.name)
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    if observed.is_empty() && infra::unmapped(inv.as_ref()).is_empty() {
        return Ok(released_from_management(ctx, inv, &why, &labels, spec));
    }

    let mut freed = Vec::new();
    if let Some(i) = inv.as_mut() {
        let deletable = infra::deletable(i, &observed).len();
        if deletable > 0 && unreachable_for < ctx.settings.infra_after {
            let left = ctx.settings.infra_after.saturating_sub(unreachable_for);
            return Ok(blocked(
                kind,
                format!(
                    "{why}; the management cluster holds {}; if the tenant API stays unreachable {}s more, \
                     the phase frees from there the {} inventoried with reclaim policy Delete",
                    observed.describe(&spec.kind, 5),
                    left.as_secs().max(1),
                    count(deletable, "volume"),
                ),
                inv,
            ));
        }
        freed = infra::free_deletable(ctx, t, spec, i, &observed).await?;
    }
    let mut observed = observed;
    if !freed.is_empty() {
        let i = inv.as_mut().expect("freed from an inventory");
        let message = format!(
            "the tenant API cannot be reached ({why}): freeing {} from the management side ({} deleted, and the Pods mounting their PVCs)",
            count(freed.len(), "volume"),
            spec.kind
        );
        ctx.write_record(
            t,
            &Update {
                phase: Some(Phase::Releasing),
                message: Some(message.clone()),
                inventory: Some(i.clone()),
                ..Default::default()
            },
        )
        .await?;
        ctx.event(t, true, "FreedFromManagement", message).await;
        // The disks of what was freed: the PVs of their PVCs, or recorded.
        let disks: HashSet<String> = observed
            .claims
            .iter()
            .filter(|c| freed.contains(&c.name))
            .filter_map(|c| c.detail.clone())
            .chain(
                i.volumes
                    .iter()
                    .filter_map(|v| v.infra.as_ref())
                    .filter(|r| freed.contains(&r.name))
                    .filter_map(|r| r.pv.clone()),
            )
            .collect();
        let deadline = Instant::now() + ctx.settings.wait_bound;
        observed = wait_disks_then_observe(ctx, t, spec, disks, deadline, i).await?;
        let marked = infra::mark_gone(i, &observed);
        ctx.metrics.volumes_freed.inc_by(marked as u64);
        if observed.is_empty() && infra::unmapped(inv.as_ref()).is_empty() {
            return Ok(released_from_management(ctx, inv, &why, &labels, spec));
        }
    }

    // What is kept, and why.
    let mut parts = vec![
        why,
        format!(
            "the management cluster holds {}",
            observed.describe(&spec.kind, 5)
        ),
    ];
    parts.extend(infra::kept_reasons(inv.as_ref(), &observed, spec, &labels));
    Ok(blocked(kind, parts.join("; "), inv))
}

/// Waits (until `deadline`) for the management PVs `disks` to go, then
/// lists the management side again and records the PVs it sees in `inv`.
async fn wait_disks_then_observe(
    ctx: &Context,
    t: &TenantRef,
    spec: &crate::profile::InfraSpec,
    disks: HashSet<String>,
    deadline: Instant,
    inv: &mut Inventory,
) -> Result<infra::Observed, kube::Error> {
    wait_gone(
        Api::<PersistentVolume>::all(ctx.client.clone()),
        disks,
        deadline,
        &NoProgress,
    )
    .await?;
    let observed = infra::observe(ctx, t, spec, Some(inv)).await?;
    infra::note_pvs(inv, &observed);
    Ok(observed)
}

/// `Released` decided from the management side: nothing of the tenant is
/// left there. Every inventoried volume is gone; the note says how.
fn released_from_management(
    ctx: &Context,
    inv: Option<Inventory>,
    why: &str,
    labels: &str,
    spec: &crate::profile::InfraSpec,
) -> Outcome {
    let mut inventory = inv.unwrap_or_else(|| Inventory::new(now_rfc3339(), Vec::new()));
    let mut newly = 0;
    for v in inventory.volumes.iter_mut().filter(|v| !v.gone) {
        v.gone = true;
        newly += 1;
    }
    inventory.freed = inventory.total;
    ctx.metrics.volumes_freed.inc_by(newly as u64);
    let freed_here = inventory
        .volumes
        .iter()
        .filter(|v| v.infra.as_ref().is_some_and(|r| r.freed_here))
        .count();
    let note = if freed_here > 0 {
        format!(
            "the tenant API cannot be reached ({why}); {} freed from the management side, and nothing of the tenant is left there",
            count(freed_here, "volume")
        )
    } else {
        format!(
            "the tenant API cannot be reached ({why}), and the management cluster holds no disk of it \
             (no {kind}, PVC or PV labelled {labels} or named by the inventory)",
            kind = spec.kind
        )
    };
    Outcome::Released {
        inventory,
        note: Some(note),
    }
}

/// Checks that `api` reaches the cluster bound to the tenant, binding it
/// first if none is; `Ok(Err(..))` is the Blocked outcome of a mismatch or
/// of a cluster that does not say who it is.
async fn same_cluster(
    ctx: &Context,
    t: &TenantRef,
    api: &tenant::TenantApi,
    bound: Option<&ClusterIdentity>,
    secret: &str,
) -> Result<Result<ClusterIdentity, Outcome>, kube::Error> {
    let seen = match identity::observe(api, ctx.settings.probe_timeout, &now_rfc3339()).await {
        Ok(seen) => seen,
        Err(e) => return Ok(Err(blocked(e.kind(), e.to_string(), None))),
    };
    let (id, write) = match identity::check(bound, &seen, secret) {
        identity::Check::Same => (bound.cloned().unwrap_or(seen), false),
        identity::Check::Bind(id) | identity::Check::Pin(id) => (id, true),
        identity::Check::Different { message } => {
            return Ok(Err(blocked(ErrorKind::ClusterMismatch, message, None)));
        }
    };
    let binding = bound.is_none();
    let conflict = match ctx.vet_cluster(t, &id, binding).await? {
        Vetted::Ours => None,
        Vetted::Misplaced(why) => {
            let message = format!(
                "the admin kubeconfig Secret {secret} does not lead to this tenant's own cluster: {why}. Nothing is \
                 deleted or counted as freed through it. Restore the Secret, or record an override to abandon the \
                 volumes"
            );
            return Ok(Err(blocked(ErrorKind::ClusterConflict, message, None)));
        }
        Vetted::Conflict(why) => Some(why),
    };
    if write {
        // Recorded even in conflict: the other parent's passes see it too.
        ctx.write_record(
            t,
            &Update {
                cluster: Some(id.clone()),
                ..Default::default()
            },
        )
        .await?;
        info!(namespace = %t.namespace, tenant = %t.name, server = %id.server, binding, "tenant cluster bound at a release pass");
    }
    match conflict {
        None => Ok(Ok(id)),
        Some(why) => Ok(Err(blocked(ErrorKind::ClusterConflict, why, None))),
    }
}

impl Outcome {
    fn with_inventory(self, kept: Option<Inventory>) -> Outcome {
        match self {
            Outcome::Blocked {
                reason,
                message,
                inventory,
            } => Outcome::Blocked {
                reason,
                message,
                inventory: inventory.or(kept),
            },
            released => released,
        }
    }
}

/// A quota of zero claims in every namespace: a StatefulSet or an ephemeral
/// volume cannot bring a claim back (and with it a new disk) while the
/// tenant's volumes are released. The tenant is being deleted anyway.
async fn freeze_claims(tc: &kube::Client) -> Result<(), kube::Error> {
    let namespaces = Api::<k8s_openapi::api::core::v1::Namespace>::all(tc.clone())
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
async fn delete_claims(tc: &kube::Client) -> Result<HashSet<ClaimKey>, kube::Error> {
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
async fn delete_holding_pods(
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
    futures::stream::iter(holding)
        .map(|(ns, name)| {
            let api = Api::<Pod>::namespaced(tc.clone(), &ns);
            async move {
                match api.delete(&name, &DeleteParams::default()).await {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                    Err(e) => Err(e),
                }
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(count)
}

/// Deletes every VolumeSnapshot when the API exists; returns the contents to
/// wait for (those with deletionPolicy Delete). An absent API is skipped.
async fn release_snapshots(
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

/// Told of each object that goes while waiting.
pub trait Progress: Sync {
    fn gone(&self, left: &HashSet<String>) -> impl std::future::Future<Output = ()> + Send;
}

struct NoProgress;

impl Progress for NoProgress {
    async fn gone(&self, _left: &HashSet<String>) {}
}

struct WaitProgress<'a> {
    ctx: &'a Context,
    tenant: &'a TenantRef,
    inventory: Inventory,
}

impl Progress for WaitProgress<'_> {
    async fn gone(&self, left: &HashSet<String>) {
        let mut inv = self.inventory.clone();
        for v in inv.volumes.iter_mut() {
            if !v.is_retain() && !left.contains(&v.pv) {
                v.gone = true;
            }
        }
        // In memory every present PV is listed, so what is not gone is left.
        inv.freed = inv
            .total
            .saturating_sub(inv.volumes.iter().filter(|v| !v.gone).count());
        let message = format!(
            "{}/{} volumes freed; waiting for the CSI driver",
            inv.freed, inv.total
        );
        let update = Update {
            phase: Some(Phase::Releasing),
            message: Some(message),
            inventory: Some(inv),
            ..Default::default()
        };
        if let Err(e) = self.ctx.write_record(self.tenant, &update).await {
            warn!(namespace = %self.tenant.namespace, tenant = %self.tenant.name, error = %e, "cannot record progress");
        }
    }
}

/// Watches until every name in `targets` is gone or `deadline` passes;
/// returns those still present. Progress is reported at most every few
/// seconds, so thousands of volumes do not mean thousands of writes.
async fn wait_gone<K, P>(
    api: Api<K>,
    mut targets: HashSet<String>,
    deadline: Instant,
    progress: &P,
) -> Result<BTreeSet<String>, kube::Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    P: Progress,
{
    const REPORT_EVERY: Duration = Duration::from_secs(3);
    if targets.is_empty() {
        return Ok(BTreeSet::new());
    }
    let stream = watcher(api, watcher::Config::default());
    futures::pin_mut!(stream);
    let mut seen: HashSet<String> = HashSet::new();
    let mut listing = false;
    let mut last_report = Instant::now();
    let mut unreported = false;
    loop {
        let next = match tokio::time::timeout_at(deadline, stream.next()).await {
            Err(_) => break,
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                // The watcher recovers by itself; a persistent failure ends at the deadline.
                warn!(error = %e, "watch failed; retrying");
                continue;
            }
            Ok(Some(Ok(ev))) => ev,
        };
        let before = targets.len();
        match next {
            watcher::Event::Init => {
                listing = true;
                seen.clear();
            }
            watcher::Event::InitApply(o) => {
                if let Some(n) = o.meta().name.clone() {
                    seen.insert(n);
                }
            }
            watcher::Event::InitDone => {
                listing = false;
                targets.retain(|n| seen.contains(n));
            }
            watcher::Event::Apply(_) => {}
            watcher::Event::Delete(o) => {
                if let Some(n) = o.meta().name.as_deref() {
                    targets.remove(n);
                }
            }
        }
        if !listing && targets.len() != before {
            unreported = true;
        }
        if targets.is_empty() {
            progress.gone(&targets).await;
            return Ok(BTreeSet::new());
        }
        if unreported && last_report.elapsed() >= REPORT_EVERY {
            progress.gone(&targets).await;
            last_report = Instant::now();
            unreported = false;
        }
    }
    Ok(targets.into_iter().collect())
}
