//! The management side of the phase: what the management cluster holds of
//! a tenant's disks ([`read_disks`]), keeping what must stay ([`keep`]), freeing
//! what may go when the tenant API is dead ([`free_deletable`]), and the two
//! roads that end there: step 7 on the management side
//! ([`management_layer`]) and a tenant API that cannot be reached
//! ([`unreachable`]). The decisions are `disks`' pure functions.

use std::collections::{BTreeSet, HashSet};

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Preconditions};
use tracing::{info, instrument, warn};

use super::claims::{self, ClaimKey};
use super::disks::{self, Keep, Observed};
use super::infra_snapshots::{Kept, snapshots_settle};
use super::outcome::{self, Outcome, blocked};
use super::wait::{NoProgress, wait_gone};
use crate::profile::InfraSpec;
use crate::record::{Inventory, Phase, Record, Update};
use crate::text::count;
use crate::worker::events::Reason;
use crate::worker::{Context, ErrorKind, TenantRef};

/// Lists the management cluster and selects what is the tenant's; names in
/// `inventory` the infra object behind each volume and the management PV
/// bound behind it now (so a disk can still be waited for once its PVC is
/// gone). A cluster that does not serve the infra API has no infra layer:
/// `served` is false and nothing else is listed.
pub async fn read_disks(
    ctx: &Context,
    t: &TenantRef,
    infra: &InfraSpec,
    mut inventory: Option<&mut Inventory>,
) -> Result<Observed, kube::Error> {
    if let Some(inv) = inventory.as_deref_mut() {
        disks::attach_refs(inv, infra);
    }
    let ar = infra.resource();
    let objects: Vec<ObjectMeta> = match Api::<kube::api::DynamicObject>::namespaced_with(
        ctx.client.clone(),
        &t.namespace,
        &ar,
    )
    .list_metadata(&ListParams::default())
    .await
    {
        Ok(l) => l.items.into_iter().map(|o| o.metadata).collect(),
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Observed::default()),
        Err(e) => return Err(e),
    };
    let claims = Api::<PersistentVolumeClaim>::namespaced(ctx.client.clone(), &t.namespace)
        .list(&ListParams::default())
        .await?
        .items;
    let volumes = Api::<PersistentVolume>::all(ctx.client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let mut observed = disks::select(
        infra,
        &t.name,
        &t.namespace,
        inventory.as_deref(),
        &objects,
        &claims,
        &volumes,
    );
    let keys = &ctx.keys;
    let me = format!("{}/{}", t.namespace, t.name);
    for held in observed.volumes.iter_mut() {
        let Some(pv) = volumes
            .iter()
            .find(|v| v.metadata.name.as_deref() == Some(held.name.as_str()))
        else {
            continue;
        };
        let m = &pv.metadata;
        if m.labels
            .as_ref()
            .and_then(|l| l.get(&keys.kept))
            .map(String::as_str)
            == Some("true")
        {
            // Kept for whom: only this tenant's own kept disks are its to
            // let go (a PV is written by the worker and administrators only,
            // but what selects it here, a PVC's name and labels, by anyone
            // who may edit the namespace).
            let kept_for = m
                .annotations
                .as_ref()
                .and_then(|a| a.get(&keys.kept_for))
                .cloned();
            if kept_for.as_deref() != Some(me.as_str()) {
                held.foreign = Some(kept_for.unwrap_or_else(|| "<unnamed>".into()));
                continue;
            }
            held.kept_from = Some(
                m.annotations
                    .as_ref()
                    .and_then(|a| a.get(&keys.kept_reclaim_was))
                    .cloned()
                    .unwrap_or_else(|| "Delete".into()),
            );
        }
    }
    if let Some(inv) = inventory {
        disks::note_pvs(inv, &observed);
    }
    Ok(observed)
}

/// Carries out a [`disks::keep_plan`] on the management PVs: merge patches of the
/// worker's own labels and annotations and of the reclaim policy.
pub async fn apply_keep(ctx: &Context, t: &TenantRef, plan: &[Keep]) -> Result<(), kube::Error> {
    use kube::api::{Patch, PatchParams};
    use serde_json::{Value, json};
    let api = Api::<PersistentVolume>::all(ctx.client.clone());
    let k = &ctx.keys;
    for step in plan {
        let (pv, patch) = match step {
            Keep::Pin {
                pv,
                reclaim_was,
                volume,
            } => (
                pv,
                json!({
                        "metadata": {
                            "labels": {k.kept.as_str(): "true", k.kept_namespace.as_str(): t.namespace},
                            "annotations": {
                                k.kept_for.as_str(): format!("{}/{}", t.namespace, t.name),
                                k.kept_volume.as_str(): crate::text::bounded(volume, 1024),
                                k.kept_reclaim_was.as_str(): reclaim_was,
                                k.kept_at.as_str(): crate::record::now_rfc3339(),
                            }},
                        "spec": {"persistentVolumeReclaimPolicy": "Retain"}}),
            ),
            Keep::Unpin { pv, reclaim_was } => (
                pv,
                json!({
                    "metadata": {
                        "labels": {k.kept.as_str(): Value::Null, k.kept_namespace.as_str(): Value::Null},
                        "annotations": {k.kept_for.as_str(): Value::Null, k.kept_volume.as_str(): Value::Null,
                                        k.kept_reclaim_was.as_str(): Value::Null, k.kept_at.as_str(): Value::Null}},
                    "spec": {"persistentVolumeReclaimPolicy": reclaim_was}}),
            ),
        };
        match api
            .patch(pv, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {
                info!(pv = %pv, keep = matches!(step, Keep::Pin { .. }), "management disk kept or let go")
            }
            // Gone meanwhile: nothing left to keep.
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Keeps what must stay of the tenant's disks ([`disks::keep_plan`]), and records
/// which in `inv`: the one call the phase and the override make. Returns
/// the management PVs kept.
#[instrument(name = "keep_disks", skip_all)]
pub async fn keep(
    ctx: &Context,
    t: &TenantRef,
    observed: &Observed,
    inv: Option<&mut Inventory>,
    reachable: bool,
) -> Result<BTreeSet<String>, kube::Error> {
    let plan = disks::keep_plan(inv.as_deref(), observed, reachable);
    apply_keep(ctx, t, &plan).await?;
    let kept = disks::kept_after(observed, &plan);
    if let Some(inv) = inv {
        disks::mark_kept(inv, &kept);
    }
    Ok(kept)
}

/// Frees the [`disks::deletable`] volumes from the management side: deletes their
/// infra objects (guarded by UID), then the Pods that mount their PVCs (the
/// attachments of a VM of a cluster whose API is gone). Marks them
/// `freed_here` in `inv`; returns their names.
#[instrument(name = "free_from_management", skip_all)]
pub async fn free_deletable(
    ctx: &Context,
    t: &TenantRef,
    infra: &InfraSpec,
    inv: &mut Inventory,
    observed: &Observed,
) -> Result<Vec<String>, kube::Error> {
    let names: BTreeSet<String> = disks::deletable(inv, observed)
        .into_iter()
        .map(|r| r.name.clone())
        .collect();
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let objects = Api::<kube::api::DynamicObject>::namespaced_with(
        ctx.client.clone(),
        &t.namespace,
        &infra.resource(),
    );
    for h in observed
        .objects
        .iter()
        .filter(|h| names.contains(&h.name) && !h.deleting)
    {
        let dp = DeleteParams {
            preconditions: h.uid.clone().map(|uid| Preconditions {
                uid: Some(uid),
                resource_version: None,
            }),
            ..DeleteParams::background()
        };
        match objects.delete(&h.name, &dp).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(e) => return Err(e),
        }
        info!(object = %h.name, kind = %infra.kind, "infra object deleted: the tenant API is unreachable");
    }
    // Their PVCs (same name) are held by pvc-protection while a Pod mounts them.
    let held: HashSet<ClaimKey> = names
        .iter()
        .map(|n| (t.namespace.clone(), n.clone()))
        .collect();
    let pods: Vec<Pod> = Api::<Pod>::namespaced(ctx.client.clone(), &t.namespace)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();
    let holding = claims::pods_holding(&pods, &held);
    super::tenant_side::delete_pods(&ctx.client, holding, 8).await?;
    for r in inv.volumes.iter_mut().filter_map(|v| v.infra.as_mut()) {
        if names.contains(&r.name) {
            r.freed_here = true;
        }
    }
    Ok(names.into_iter().collect())
}

/// Step 7 on the management side: the tenant's PVs are gone, and the disks
/// behind them must be too (DataVolume, its PVC, that PVC's PV). The
/// DataVolume's deletion returns before its disk is freed, so this waits
/// for the management PVs as step 6 waits for the tenant's.
#[instrument(name = "management_layer", skip_all)]
pub(super) async fn management_layer(
    ctx: &Context,
    t: &TenantRef,
    spec: &InfraSpec,
    mut inv: Inventory,
) -> Result<Outcome, kube::Error> {
    let observed = read_disks(ctx, t, spec, Some(&mut inv)).await?;
    if !observed.served {
        warn!(
            "the management cluster does not serve {}.{}: no infra layer to check",
            spec.plural, spec.group
        );
    }
    if observed.is_empty() {
        return snapshots_settle(ctx, t, spec, inv, None, Kept::Retain).await;
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
    let observed = wait_disks_then_observe(ctx, t, spec, disks, &mut inv).await?;
    if observed.is_empty() {
        return snapshots_settle(ctx, t, spec, inv, None, Kept::Retain).await;
    }
    Ok(outcome::disks_remain(
        inv,
        &observed.describe(&spec.kind, 5),
        &spec.kind,
        ctx.settings.wait_bound,
    ))
}

/// Steps 1–2 failed: the tenant API cannot be reached. Without an infra
/// layer this is Blocked, as the override's case. With one, the management
/// cluster is the truth left (`docs/design.md` §5b): a tenant that holds no
/// disk there is Released; once the API has been unreachable for
/// `--infra-after`, the inventoried volumes with reclaim policy Delete are
/// freed from there; what has no recorded policy, or Retain, is kept.
#[instrument(name = "unreachable", skip_all)]
pub(super) async fn unreachable(
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
    let unreachable_for = ctx.note_unreachable(t);
    let mut inv = previous.clone();
    let observed = read_disks(ctx, t, spec, inv.as_mut()).await?;
    if !observed.served {
        return Ok(outcome::unreachable_unserved(
            kind,
            &why,
            &spec.plural,
            &spec.group,
            previous,
        ));
    }
    // The tenant cannot say which of its disks are meant to stay: what no
    // inventory names as Delete is kept (docs/design.md §5c).
    keep(ctx, t, &observed, inv.as_mut(), false).await?;
    let labels = spec.selector_of(&t.name);
    if observed.is_empty() && disks::unmapped(inv.as_ref()).is_empty() {
        return gone_from_management(ctx, t, spec, inv, &why, &labels).await;
    }

    let mut freed = Vec::new();
    if let Some(i) = inv.as_mut() {
        let deletable = disks::deletable(i, &observed).len();
        if deletable > 0 && unreachable_for < ctx.settings.infra_after {
            let left = ctx.settings.infra_after.saturating_sub(unreachable_for);
            return Ok(outcome::unreachable_waiting(
                kind,
                &why,
                &observed.describe(&spec.kind, 5),
                left,
                deletable,
                inv,
            ));
        }
        freed = free_deletable(ctx, t, spec, i, &observed).await?;
    }
    let mut observed = observed;
    if !freed.is_empty() {
        let i = inv.as_mut().expect("freed from an inventory");
        observed = record_and_wait_freed(ctx, t, spec, &why, &freed, i, &observed).await?;
        if observed.is_empty() && disks::unmapped(inv.as_ref()).is_empty() {
            return gone_from_management(ctx, t, spec, inv, &why, &labels).await;
        }
    }

    // What is kept, and why.
    let reasons = disks::kept_reasons(inv.as_ref(), &observed, spec, &labels);
    Ok(outcome::unreachable_kept(
        kind,
        why,
        &observed.describe(&spec.kind, 5),
        reasons,
        inv,
    ))
}

/// Says what was freed from the management side (the record, a Warning
/// Event), waits for the disks behind it to go, and marks gone what went;
/// returns what the management side holds then.
async fn record_and_wait_freed(
    ctx: &Context,
    t: &TenantRef,
    spec: &InfraSpec,
    why: &str,
    freed: &[String],
    inv: &mut Inventory,
    observed: &Observed,
) -> Result<Observed, kube::Error> {
    let message = format!(
        "the tenant API cannot be reached ({why}): freeing {} from the management side ({} deleted, and the Pods mounting their PVCs)",
        count(freed.len(), "volume"),
        spec.kind
    );
    let update = Update {
        phase: Some(Phase::Releasing),
        message: Some(message.clone()),
        inventory: Some(inv.clone()),
        ..Default::default()
    };
    ctx.write_record(t, &update).await?;
    ctx.event(t, Reason::FreedFromManagement, message).await;
    let disks = disks::disks_of(freed, inv, observed);
    let observed = wait_disks_then_observe(ctx, t, spec, disks, inv).await?;
    let marked = disks::mark_gone(inv, &observed);
    ctx.metrics.volumes_freed.inc_by(marked as u64);
    Ok(observed)
}

/// Waits (until none has gone for `--wait-bound`) for the management PVs
/// `disks` to go, then
/// lists the management side again and records the PVs it sees in `inv`.
async fn wait_disks_then_observe(
    ctx: &Context,
    t: &TenantRef,
    spec: &InfraSpec,
    disks: HashSet<String>,
    inv: &mut Inventory,
) -> Result<Observed, kube::Error> {
    wait_gone(
        Api::<PersistentVolume>::all(ctx.client.clone()),
        disks,
        ctx.settings.wait_bound,
        &NoProgress,
    )
    .await?;
    read_disks(ctx, t, spec, Some(inv)).await
}

/// No disk of the tenant is left on the management side: every
/// inventoried volume is gone ([`outcome::gone_from_management`]), once
/// the snapshots being deleted there are.
async fn gone_from_management(
    ctx: &Context,
    t: &TenantRef,
    spec: &InfraSpec,
    inv: Option<Inventory>,
    why: &str,
    labels: &str,
) -> Result<Outcome, kube::Error> {
    let (inventory, newly, note) = outcome::gone_from_management(inv, why, labels, &spec.kind);
    ctx.metrics.volumes_freed.inc_by(newly as u64);
    snapshots_settle(ctx, t, spec, inventory, Some(note), Kept::TenantDead).await
}
