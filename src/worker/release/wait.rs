//! Waiting, by a watch opened before the wait, until named objects are
//! gone: the tenant's PVs (step 6), its snapshot contents, and the disks
//! behind them on the management side.

use std::collections::{BTreeSet, HashSet};
use std::time::Duration;

use futures::StreamExt;
use kube::api::Api;
use kube::runtime::watcher;
use tokio::time::Instant;
use tracing::warn;

use crate::record::{Inventory, Phase, Update};
use crate::worker::{Context, TenantRef};

/// Told of each object that goes while waiting.
pub trait Progress: Sync {
    fn gone(&self, left: &HashSet<String>) -> impl std::future::Future<Output = ()> + Send;
}

pub(super) struct NoProgress;

impl Progress for NoProgress {
    async fn gone(&self, _left: &HashSet<String>) {}
}

pub(super) struct WaitProgress<'a> {
    pub ctx: &'a Context,
    pub tenant: &'a TenantRef,
    pub inventory: Inventory,
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
            warn!(error = %e, "cannot record progress");
        }
    }
}

/// Watches until every name in `targets` is gone, or until none has gone
/// for `quiet` (the worker's `--wait-bound`); returns those still present.
/// The bound counts from the last object gone, not from the start: a slow
/// driver that keeps freeing (thousands of volumes at its client's rate
/// limit) is waited for, a stuck one is reported after the bound.
/// Progress is reported at most every few seconds, so thousands of volumes
/// do not mean thousands of writes.
pub(super) async fn wait_gone<K, P>(
    api: Api<K>,
    mut targets: HashSet<String>,
    quiet: Duration,
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
    let mut deadline = Instant::now() + quiet;
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
            deadline = Instant::now() + quiet;
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
