//! The volume-release phase (`docs/design.md` §5, steps 1–7) for one tenant.
//!
//! [`run`] reads as the steps. Each step returns `Result<_, Stop>`: the
//! first that cannot go on ends the pass, with the tenant's state as its
//! [`Outcome`] or with a management-API error to retry. Every step is
//! idempotent and reads its state from the APIs, so a worker killed
//! anywhere resumes: the inventory is in the record, the claims are being
//! deleted or gone, and the PVs tell how far the driver got.
//!
//! - [`claims`] (pure): the inventory from the tenant's PVs; the Pods that
//!   hold claims.
//! - [`disks`] (pure): what the management cluster holds of the tenant's
//!   disks, which to keep, which the phase may free.
//! - `tenant_side`: the deletes in the tenant cluster (steps 4–5).
//! - `management`: the management side (step 7 there, keeping disks, and
//!   the road of a tenant API that cannot be reached).
//! - `wait`: a watch until named objects are gone (step 6).
//! - `outcome` (pure): every `Released` and `Blocked` a pass ends in, and
//!   its message.

pub mod claims;
pub mod disks;
pub mod holders;
mod infra_snapshots;
mod management;
mod outcome;
mod tenant_side;
mod wait;

use std::collections::{BTreeSet, HashSet};

use k8s_openapi::api::core::v1::PersistentVolume;
use kube::api::Api;
use tokio::time::Instant;
use tracing::{info, instrument, warn};

pub use management::{keep, read_disks};
pub use outcome::Outcome;
use outcome::blocked;
pub use tenant_side::FREEZE_QUOTA;
pub use wait::Turn;

use super::events::Reason;
use super::{Context, ErrorKind, TenantRef, binding, tenant};
use crate::record::{ClusterIdentity, Inventory, Phase, Record, Update, now_rfc3339};
use crate::text::count;
use wait::{NoProgress, WaitProgress, wait_gone};

/// Why a step ended the pass before step 7.
enum Stop {
    /// The tenant's state: recorded as the pass's outcome.
    Outcome(Outcome),
    /// The management API failed: the pass is tried again soon.
    Management(kube::Error),
}

impl From<kube::Error> for Stop {
    fn from(e: kube::Error) -> Self {
        Stop::Management(e)
    }
}

impl From<Outcome> for Stop {
    fn from(o: Outcome) -> Self {
        Stop::Outcome(o)
    }
}

type Step<T> = Result<T, Stop>;

/// Runs steps 1–7 once. `Err` is a management-API failure (requeue);
/// everything about the tenant is an [`Outcome`].
#[instrument(name = "pass", skip_all)]
pub async fn run(ctx: &Context, t: &TenantRef, record: &Record) -> Result<Outcome, kube::Error> {
    match pass(ctx, t, record).await {
        Ok(outcome) | Err(Stop::Outcome(outcome)) => Ok(outcome),
        Err(Stop::Management(e)) => Err(e),
    }
}

async fn pass(ctx: &Context, t: &TenantRef, record: &Record) -> Step<Outcome> {
    let tenant = reach(ctx, t, record).await?;
    let bound = same_cluster(ctx, t, &tenant, record.cluster.as_ref(), &record.inventory).await?;
    // New volumes appearing while releasing start another round, within
    // one bound of the pass's start (so a tenant that keeps making them
    // still ends in an outcome).
    let rounds_until = Instant::now() + ctx.settings.wait_bound;
    let mut inventory = record.inventory.clone();
    loop {
        let taken = take_inventory(ctx, t, &tenant, &inventory).await?;
        inventory = Some(taken.clone());
        delete_claims(&tenant, &inventory).await?;
        let contents_left = wait_for_volumes(ctx, t, &tenant, &taken, &inventory).await?;

        // Step 7: the outcome, from a fresh list, of the same cluster.
        same_cluster(ctx, t, &tenant, Some(&bound), &inventory).await?;
        let pvs = tenant_side::list_pvs(&tenant.client)
            .await
            .map_err(tenant.failed("listing PersistentVolumes", &inventory))?;
        let now = claims::reconcile_inventory(
            Some(&taken),
            &pvs,
            &now_rfc3339(),
            ctx.profile.infra.as_ref(),
        );
        let newly_freed = now.freed.saturating_sub(taken.freed);
        ctx.metrics.volumes_freed.inc_by(newly_freed as u64);
        inventory = Some(now.clone());
        if now.total > taken.total && Instant::now() < rounds_until {
            warn!("new volumes appeared while releasing; another pass");
            continue;
        }
        // What holds the volumes left, as the tenant API says it, for Blocked.
        let left: Vec<&crate::record::Volume> =
            now.remaining().filter(|v| !v.is_retain()).collect();
        let facts = holders::gather(&tenant.client, &left).await;
        return Ok(outcome(ctx, t, now, contents_left, &facts).await?);
    }
}

/// The tenant's API for one pass, and the Secret that leads to it.
struct TenantSide {
    api: tenant::TenantApi,
    client: kube::Client,
    /// `namespace/name` of the admin kubeconfig Secret.
    secret: String,
}

impl TenantSide {
    /// A failed tenant-API call while `doing`: the pass ends `Blocked`,
    /// keeping the inventory it has.
    fn failed<'a>(
        &'a self,
        doing: &'a str,
        inventory: &'a Option<Inventory>,
    ) -> impl FnOnce(kube::Error) -> Stop + 'a {
        move |e| {
            Stop::Outcome(blocked(
                ErrorKind::TenantApiError,
                format!("tenant API {} failed while {doing}: {e}", self.api.server),
                inventory.clone(),
            ))
        }
    }
}

/// Steps 1–2: the admin kubeconfig, and an API server that answers behind
/// it. A tenant that cannot be reached takes the management side's road.
#[instrument(name = "reach", skip_all)]
async fn reach(ctx: &Context, t: &TenantRef, record: &Record) -> Step<TenantSide> {
    let s = &ctx.settings;
    let api = tenant::connect(
        &ctx.client,
        &ctx.profile,
        &t.namespace,
        &t.name,
        s.request_timeout,
    )
    .await;
    let answered = match api {
        Ok(api) => tenant::probe_ready(&api, s.probe_timeout)
            .await
            .map(|()| api),
        Err(e) => Err(e),
    };
    let api = match answered {
        Ok(api) => api,
        Err(e) => {
            return Err(
                management::unreachable(ctx, t, record, e.kind(), e.to_string())
                    .await?
                    .into(),
            );
        }
    };
    ctx.note_reachable(t);
    Ok(TenantSide {
        client: api.client.clone(),
        api,
        secret: format!(
            "{}/{}",
            t.namespace,
            ctx.profile.kubeconfig_secret_name(&t.name)
        ),
    })
}

/// Step 3: the inventory, before any deletion, written to the record. A
/// disk whose tenant volume is not Delete is kept before anything can
/// delete it, and before the inventory that says so is written: the gate
/// lets a tenant's disks be deleted in teardown only once it is
/// (`docs/design.md` §5c).
#[instrument(name = "inventory", skip_all)]
async fn take_inventory(
    ctx: &Context,
    t: &TenantRef,
    tenant: &TenantSide,
    previous: &Option<Inventory>,
) -> Step<Inventory> {
    let pvs = tenant_side::list_pvs(&tenant.client)
        .await
        .map_err(tenant.failed("listing PersistentVolumes", previous))?;
    let mut inv = claims::reconcile_inventory(
        previous.as_ref(),
        &pvs,
        &now_rfc3339(),
        ctx.profile.infra.as_ref(),
    );
    if let Some(spec) = ctx.profile.infra.as_ref() {
        let observed = management::read_disks(ctx, t, spec, Some(&mut inv)).await?;
        management::keep(ctx, t, &observed, Some(&mut inv), true).await?;
    }
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
    match previous {
        None => {
            let note = format!(
                "{} inventoried before any deletion",
                count(inv.total, "volume")
            );
            ctx.event(t, Reason::InventoryTaken, note).await;
        }
        Some(old) if old.total != inv.total => {
            let note = format!(
                "now {}: new ones appeared while releasing",
                count(inv.total, "volume")
            );
            ctx.event(t, Reason::InventoryGrew, note).await;
        }
        Some(_) => {}
    }
    Ok(inv)
}

/// Step 4: stop new claims, delete every claim, then the Pods holding them.
#[instrument(name = "delete_claims", skip_all)]
async fn delete_claims(tenant: &TenantSide, inventory: &Option<Inventory>) -> Step<()> {
    let tc = &tenant.client;
    tenant_side::freeze_claims(tc)
        .await
        .map_err(tenant.failed("creating the claim freeze quota", inventory))?;
    let claims = tenant_side::delete_claims(tc)
        .await
        .map_err(tenant.failed("deleting PersistentVolumeClaims", inventory))?;
    let pods = tenant_side::delete_holding_pods(tc, &claims)
        .await
        .map_err(tenant.failed("deleting the Pods that mount claims", inventory))?;
    info!(
        claims = claims.len(),
        pods, "claims and holding pods deleted"
    );
    Ok(())
}

/// Steps 5–6: the snapshots, when that API is installed, then a wait (until
/// none has gone for `--wait-bound`) for the tenant's PVs and the snapshot
/// contents to go.
/// Returns the contents still there.
#[instrument(name = "wait", skip_all)]
async fn wait_for_volumes(
    ctx: &Context,
    t: &TenantRef,
    tenant: &TenantSide,
    taken: &Inventory,
    inventory: &Option<Inventory>,
) -> Step<BTreeSet<String>> {
    let quiet = ctx.settings.wait_bound;
    let contents = tenant_side::release_snapshots(&tenant.client)
        .await
        .map_err(tenant.failed("deleting VolumeSnapshots", inventory))?;
    let waited: HashSet<String> = taken
        .remaining()
        .filter(|v| !v.is_retain())
        .map(|v| v.pv.clone())
        .collect();
    let progress = WaitProgress {
        ctx,
        tenant: t,
        inventory: taken.clone(),
    };
    wait_gone(
        Api::<PersistentVolume>::all(tenant.client.clone()),
        waited,
        quiet,
        &progress,
    )
    .await
    .map_err(tenant.failed("watching PersistentVolumes", inventory))?;
    match contents {
        Some((api, names)) => Ok(wait_gone(api, names, quiet, &NoProgress)
            .await
            .map_err(tenant.failed("watching VolumeSnapshotContents", inventory))?),
        None => Ok(BTreeSet::new()),
    }
}

/// Step 7's verdict on the inventory as it is now
/// ([`outcome::tenant_side`]); nothing left there goes on to the
/// management side, with an infra layer.
async fn outcome(
    ctx: &Context,
    t: &TenantRef,
    inv: Inventory,
    contents_left: BTreeSet<String>,
    facts: &holders::Facts,
) -> Result<Outcome, kube::Error> {
    let infra = ctx.profile.infra.as_ref();
    if let Some(o) = outcome::tenant_side(
        &inv,
        &contents_left,
        facts,
        ctx.settings.wait_bound,
        infra.is_some(),
    ) {
        return Ok(o);
    }
    match infra {
        None => Ok(outcome::released(inv, None, None)),
        Some(spec) => management::management_layer(ctx, t, spec, inv).await,
    }
}

/// Checks that the tenant's API reaches the cluster bound to the tenant,
/// binding it first if none is. A mismatch, a cluster that does not say who
/// it is, or one another parent holds ends the pass `Blocked`, keeping
/// `inventory`.
#[instrument(name = "same_cluster", skip_all)]
async fn same_cluster(
    ctx: &Context,
    t: &TenantRef,
    tenant: &TenantSide,
    bound: Option<&ClusterIdentity>,
    inventory: &Option<Inventory>,
) -> Step<ClusterIdentity> {
    let stop = |reason: ErrorKind, message: String| -> Stop {
        blocked(reason, message, inventory.clone()).into()
    };
    match binding::confirm(ctx, t, &tenant.api, &tenant.secret, bound).await? {
        binding::Confirmed::Cluster(id) => Ok(id),
        binding::Confirmed::Refused(reason, message) => Err(stop(reason, message)),
    }
}
