//! Waiting, by a watch opened before the wait, until named objects are
//! gone: the tenant's PVs (step 6), its snapshot contents, and the disks
//! behind them on the management side.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use futures::StreamExt;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::time::Instant;
use tracing::warn;

use crate::record::{Inventory, Phase, Update};
use crate::worker::{Context, TenantRef};

/// A pass's turn at its release slot. The worker has few slots (at most
/// `--max-concurrent-releases` passes at once) and a pass holds one while it
/// waits on the tenant's driver, which may free one volume at a time for
/// hours. Past `--release-turn`, while another tenant waits for a slot, a
/// wait ends early: the pass gives its slot up and queues again behind the
/// waiting ones (the slots are handed out first come, first served). Only
/// waits end early: they change nothing, and the next pass takes up where
/// this one stopped.
#[derive(Clone, Debug)]
pub struct Turn {
    ends: Instant,
    waiting: Arc<AtomicUsize>,
    yielded: Arc<AtomicBool>,
}

tokio::task_local! {
    static TURN: Turn;
}

impl Turn {
    /// A turn of `length` from now; `waiting` counts the passes waiting for
    /// a slot.
    pub fn new(length: Duration, waiting: Arc<AtomicUsize>) -> Self {
        Turn {
            ends: Instant::now() + length,
            waiting,
            yielded: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Runs `pass` in this turn: its waits end early once the turn is over
    /// and another tenant waits.
    pub async fn run<F: std::future::Future>(&self, pass: F) -> F::Output {
        TURN.scope(self.clone(), pass).await
    }

    /// Whether a wait of the pass ended early to give the slot up.
    pub fn yielded(&self) -> bool {
        self.yielded.load(Ordering::SeqCst)
    }

    /// When a wait should next look at the turn: its end, then every
    /// second while nobody waits.
    fn check_at(&self) -> Instant {
        self.ends.max(Instant::now() + Duration::from_secs(1))
    }

    /// Over, with a tenant waiting: says so, once and for good.
    fn over(&self) -> bool {
        if self.yielded() {
            return true;
        }
        let over = Instant::now() >= self.ends && self.waiting.load(Ordering::SeqCst) > 0;
        if over {
            self.yielded.store(true, Ordering::SeqCst);
        }
        over
    }
}

/// The running pass's turn is over ([`Turn`]); never outside a turn.
fn turn_over() -> bool {
    TURN.try_with(Turn::over).unwrap_or(false)
}

/// When the running pass's wait should look at its turn next.
fn turn_check_at() -> Option<Instant> {
    TURN.try_with(Turn::check_at).ok()
}

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

/// How long a watch may fail to start (its list or its watch request
/// refused or unanswered) before the wait gives up with its last error: an
/// API server that went away mid-pass (its Pod deleted, its node gone)
/// cannot be waited on, and the next pass, which asks it `/readyz` first,
/// takes the road of an unreachable tenant. A stream that breaks after it
/// started does not count (a loaded server drops them). The watch retries
/// with Kubernetes' client backoff meanwhile, never in a tight loop.
pub(super) const WATCH_GIVE_UP: Duration = Duration::from_secs(30);

/// A watcher's error as the API error it carries, for the step's report.
fn api_error(e: watcher::Error) -> kube::Error {
    match e {
        watcher::Error::InitialListFailed(k)
        | watcher::Error::WatchStartFailed(k)
        | watcher::Error::WatchFailed(k) => k,
        other => kube::Error::Service(Box::new(std::io::Error::other(other.to_string()))),
    }
}

/// Watches until every name in `targets` is gone, or until none has gone
/// for `quiet` (the worker's `--wait-bound`); returns those still present.
/// A watch that cannot start for [`WATCH_GIVE_UP`] ends the wait with its
/// error.
/// The bound counts from the last object gone, not from the start: a slow
/// driver that keeps freeing (thousands of volumes at its client's rate
/// limit) is waited for, a stuck one is reported after the bound.
/// Progress is reported at most every few seconds, so thousands of volumes
/// do not mean thousands of writes.
pub(super) async fn wait_gone<K, P>(
    api: Api<K>,
    targets: HashSet<String>,
    quiet: Duration,
    progress: &P,
) -> Result<BTreeSet<String>, kube::Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    P: Progress,
{
    wait_gone_within(api, targets, quiet, WATCH_GIVE_UP, progress).await
}

/// [`wait_gone`], giving up on a failing watch after `give_up`.
async fn wait_gone_within<K, P>(
    api: Api<K>,
    mut targets: HashSet<String>,
    quiet: Duration,
    give_up: Duration,
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
    let stream = watcher(api, watcher::Config::default()).default_backoff();
    futures::pin_mut!(stream);
    let mut seen: HashSet<String> = HashSet::new();
    let mut listing = false;
    let mut last_report = Instant::now();
    let mut unreported = false;
    let mut deadline = Instant::now() + quiet;
    let mut failing_since: Option<Instant> = None;
    // A turn ends a wait only once it has listed what is there: every pass
    // sees at least where its driver got to.
    let mut listed_once = false;
    loop {
        if listed_once && turn_over() {
            break;
        }
        let wake = turn_check_at().map_or(deadline, |at| at.min(deadline));
        let next = match tokio::time::timeout_at(wake, stream.next()).await {
            Err(_) if Instant::now() < deadline => continue,
            Err(_) => break,
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                // Only a watch that cannot even start counts: one whose
                // stream broke had reached the server (a loaded one drops
                // streams, and is waited on).
                let starting = matches!(
                    e,
                    watcher::Error::InitialListFailed(_) | watcher::Error::WatchStartFailed(_)
                );
                if starting {
                    let since = *failing_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= give_up {
                        return Err(api_error(e));
                    }
                } else {
                    failing_since = None;
                }
                warn!(error = %e, "watch failed; retrying");
                continue;
            }
            Ok(Some(Ok(ev))) => {
                // `Init` starts every attempt, a failing one too: only
                // what the API server sent shows the watch works.
                if !matches!(ev, watcher::Event::Init) {
                    failing_since = None;
                }
                ev
            }
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
                listed_once = true;
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use k8s_openapi::api::core::v1::PersistentVolume;

    use super::*;
    use crate::testing::FakeApi;

    #[tokio::test]
    async fn a_watch_that_keeps_failing_ends_the_wait_with_its_error_after_a_backoff_not_a_spin() {
        let give_up = Duration::from_secs(2);
        let api = FakeApi::new();
        api.fail("GET", "/api/v1/persistentvolumes", 500);
        let client = Arc::clone(&api).client();
        let started = Instant::now();
        let targets: HashSet<String> = ["pv-1".to_string()].into();
        let waited = wait_gone_within(
            Api::<PersistentVolume>::all(client),
            targets,
            Duration::from_secs(600),
            give_up,
            &NoProgress,
        )
        .await;
        let e = waited.expect_err("a dead API server is not waited on for the whole bound");
        assert!(
            e.to_string().contains("500") || e.to_string().contains("scripted"),
            "{e}"
        );
        let took = started.elapsed();
        assert!(
            (give_up..Duration::from_secs(60)).contains(&took),
            "gave up after {took:?}"
        );
        // With a backoff between attempts, not thousands of them.
        let tries = api.calls_to("GET", "/api/v1/persistentvolumes").len();
        assert!((2..20).contains(&tries), "{tries} lists in {took:?}");
    }
}
