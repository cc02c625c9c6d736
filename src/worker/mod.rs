//! The worker: custody of every tenant and the volume-release phase
//! (DESIGN.md §2, §3, §5).
//!
//! One reconcile per parent release, over a metadata-only watch (thousands of
//! HelmReleases stay cheap). Custody and the record are decided there; the
//! long-running phase runs in its own task, at most N at once, so custody of
//! new tenants never waits behind a slow driver.

pub mod claims;
pub mod custody;
pub mod identity;
pub mod release;
pub mod status;
pub mod tenant;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};

use kube::{Resource, ResourceExt};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::admission::server::parse_duration;
use crate::metrics::{ErrorLabels, Metrics, OutcomeLabels, PhaseLabels};
use crate::profile::Profile;
use crate::record::{Keys, Phase, Record, Update, count, one_line};

#[derive(clap::Args, Debug, Clone)]
pub struct WorkerArgs {
    /// Plain-HTTP address for /healthz, /readyz and /metrics.
    #[arg(long, default_value = "0.0.0.0:8080", env = "VOLUME_GATE_ADMIN_LISTEN")]
    pub admin_listen: SocketAddr,
    /// Platform profile (YAML); Cozystack when absent.
    #[arg(long, env = "VOLUME_GATE_PROFILE")]
    pub profile: Option<PathBuf>,
    /// At most this many tenants are released at once.
    #[arg(long, default_value_t = 4)]
    pub max_concurrent_releases: usize,
    /// Bound on the tenant /readyz probe.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub probe_timeout: Duration,
    /// How long one pass waits for the PVs to be gone before Blocked.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pub wait_bound: Duration,
    /// First retry delay after Blocked; doubles up to --retry-max.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub retry_base: Duration,
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pub retry_max: Duration,
    /// Lease for leader election, in the worker's namespace.
    #[arg(long, default_value = "volume-gate-worker")]
    pub lease_name: String,
    #[arg(long, env = "POD_NAMESPACE", default_value = "volume-gate")]
    pub lease_namespace: String,
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    pub lease_duration: Duration,
    /// This replica's identity in the Lease (the Pod name in a cluster).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Only watch parents in this namespace (tests); all namespaces when absent.
    #[arg(long)]
    pub namespace: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Profile(#[from] crate::profile::ProfileError),
    #[error("cannot build a Kubernetes client (in-cluster config or KUBECONFIG): {0}")]
    Client(#[source] kube::Error),
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
    #[error("leader election on Lease {namespace}/{name} failed: {message}")]
    Lease { namespace: String, name: String, message: String },
    #[error("lost the leader Lease; exiting so a standby takes over cleanly")]
    LostLeadership,
}

/// Errors of one reconcile; the variant names are metric labels.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("management API: {0}")]
    Management(#[from] kube::Error),
}

impl ReconcileError {
    fn label(&self) -> &'static str {
        match self {
            ReconcileError::Management(_) => "management-api",
        }
    }
}

/// A tenant: its parent release's namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TenantRef {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for TenantRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[derive(Clone, Debug)]
pub struct Settings {
    pub probe_timeout: Duration,
    pub wait_bound: Duration,
    pub request_timeout: Duration,
    pub retry_base: Duration,
    pub retry_max: Duration,
}

type ParentMeta = PartialObjectMeta<DynamicObject>;

/// A running phase task and when the phase started (for its duration).
struct Running {
    task: tokio::task::JoinHandle<()>,
}

#[derive(Clone, Copy)]
struct Retry {
    at: Instant,
    attempts: u32,
}

pub struct Context {
    pub client: kube::Client,
    pub profile: Profile,
    pub keys: Keys,
    pub metrics: Arc<Metrics>,
    pub settings: Settings,
    recorder: Recorder,
    parent_resource: ApiResource,
    parents: Store<ParentMeta>,
    namespaces: Store<PartialObjectMeta<Namespace>>,
    slots: Arc<Semaphore>,
    running: Mutex<HashMap<TenantRef, Running>>,
    retries: Mutex<HashMap<TenantRef, Retry>>,
    /// Attempts to bind a tenant's cluster (see `bind_cluster`).
    binds: Mutex<HashMap<TenantRef, u32>>,
    phase_started: Mutex<HashMap<TenantRef, Instant>>,
    /// Reconciles a tenant when its phase task ends.
    trigger: tokio::sync::mpsc::UnboundedSender<ObjectRef<ParentMeta>>,
}

impl Context {
    fn parent_api(&self, namespace: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), namespace, &self.parent_resource)
    }

    /// Writes worker-owned record keys with a merge patch that names only
    /// them: other annotations, and anything a person set, stay untouched.
    pub async fn write_record(&self, t: &TenantRef, update: &Update) -> Result<(), kube::Error> {
        let patch = serde_json::json!({"metadata": {"annotations": update.annotations(&self.keys)}});
        self.parent_api(&t.namespace).patch_metadata(&t.name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        Ok(())
    }

    /// The parent's record, read now, if a release pass should run on it:
    /// `None` when the parent is gone, `Released`, overridden or out of
    /// custody.
    async fn fresh_record(&self, t: &TenantRef) -> Result<Option<Record>, kube::Error> {
        let Some(parent) = self.parent_api(&t.namespace).get_metadata_opt(&t.name).await? else { return Ok(None) };
        let record = Record::from_annotations(&self.keys, parent.annotations());
        let in_custody = parent.finalizers().contains(&self.profile.custody_finalizer);
        let done = record.phase == Some(Phase::Released) || record.stamped_override().is_some();
        Ok((in_custody && !done).then_some(record))
    }

    /// An Event on the parent; a failure to publish is logged, never fatal.
    pub async fn event(&self, t: &TenantRef, warning: bool, reason: &str, note: String) {
        let reference = self.parent_reference(t);
        let ev = Event {
            type_: if warning { EventType::Warning } else { EventType::Normal },
            reason: reason.to_string(),
            note: Some(truncate(&one_line(&note), 1000)),
            action: "ReleaseVolumes".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &reference).await {
            warn!(tenant = %t, reason, error = %e, "cannot publish event");
        }
        if warning {
            warn!(tenant = %t, reason, note = %note, "event");
        } else {
            info!(tenant = %t, reason, note = %note, "event");
        }
    }

    fn parent_reference(&self, t: &TenantRef) -> k8s_openapi::api::core::v1::ObjectReference {
        let uid = self.parents.get(&ObjectRef::new_with(&t.name, self.parent_resource.clone()).within(&t.namespace)).and_then(|p| p.uid());
        k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some(self.parent_resource.api_version.clone()),
            kind: Some(self.parent_resource.kind.clone()),
            namespace: Some(t.namespace.clone()),
            name: Some(t.name.clone()),
            uid,
            ..Default::default()
        }
    }

    /// Ends custody: removes the finalizer, guarded by a `test` of its index.
    async fn end_custody(&self, t: &TenantRef, finalizers: &[String]) -> Result<(), kube::Error> {
        let Some(patch) = custody::remove_finalizer_patch(finalizers, &self.profile.custody_finalizer) else { return Ok(()) };
        let api = self.parent_api(&t.namespace);
        match api.patch_metadata(&t.name, &PatchParams::default(), &Patch::<()>::Json(patch)).await {
            Ok(_) => {
                info!(tenant = %t, "custody ended: finalizer removed");
                Ok(())
            }
            // The `test` failed: the finalizers changed since the store saw
            // them, typically because this worker already removed its own
            // (the store lags the write). Done if it is gone now; otherwise
            // the reconcile runs again on the fresh list.
            Err(kube::Error::Api(s)) if s.code == 422 || s.code == 404 => {
                let now = api.get_metadata_opt(&t.name).await?;
                match now {
                    Some(p) if p.finalizers().contains(&self.profile.custody_finalizer) => Err(kube::Error::Api(s)),
                    _ => Ok(()),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Takes custody of a parent that is not being deleted.
    async fn take_custody(&self, t: &TenantRef, meta: &ParentMeta) -> Result<(), kube::Error> {
        let rv = meta.resource_version().unwrap_or_default();
        let patch = custody::add_finalizer_patch(meta.finalizers(), &rv, &self.profile.custody_finalizer);
        self.parent_api(&t.namespace).patch_metadata(&t.name, &PatchParams::default(), &Patch::<()>::Json(patch)).await?;
        Ok(())
    }

    /// Binds the tenant to the cluster its admin kubeconfig reaches now,
    /// while nothing is at stake, so a release pass can tell when the Secret
    /// was later made to point elsewhere. A tenant whose kubeconfig or API
    /// is not there yet (Kamaji is still building it) is tried again with
    /// backoff.
    async fn bind_cluster(&self, t: &TenantRef) -> Result<Action, kube::Error> {
        let s = &self.settings;
        let observed = match tenant::connect(&self.client, &self.profile, &t.namespace, &t.name, s.request_timeout).await {
            Ok(api) => identity::observe(&api, s.probe_timeout, &jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string()).await,
            Err(e) => Err(e),
        };
        match observed {
            Ok(id) => {
                self.write_record(t, &Update { cluster: Some(id.clone()), ..Default::default() }).await?;
                self.binds.lock().expect("lock").remove(t);
                self.event(t, false, "ClusterBound", format!("tenant cluster bound: {}; every release pass checks that the admin kubeconfig still reaches it", id.describe())).await;
                Ok(Action::await_change())
            }
            Err(e) => {
                let attempts = {
                    let mut binds = self.binds.lock().expect("lock");
                    let n = binds.entry(t.clone()).or_insert(0);
                    *n += 1;
                    *n
                };
                let delay = backoff(s, attempts);
                debug!(tenant = %t, error = %e, attempts, retry_in = ?delay, "tenant cluster not bound yet");
                Ok(Action::requeue(delay))
            }
        }
    }

    fn namespace_deleting(&self, namespace: &str) -> bool {
        self.namespaces.get(&ObjectRef::new(namespace)).is_some_and(|n| n.metadata.deletion_timestamp.is_some())
    }

    /// Recounts tenants by phase. Only the phase annotation is parsed, and
    /// an inventory only for the few Blocked or Overridden tenants: this runs
    /// over every parent, so it must stay cheap with thousands of them.
    fn refresh_phase_gauge(&self) {
        let mut counts: HashMap<&'static str, i64> = HashMap::new();
        let mut residue = 0i64;
        for p in self.parents.state() {
            let annotations = p.annotations();
            let phase = annotations.get(&self.keys.phase).and_then(|v| v.parse::<Phase>().ok());
            *counts.entry(phase.map_or("NotStarted", Phase::as_str)).or_default() += 1;
            if matches!(phase, Some(Phase::Blocked | Phase::Overridden)) {
                residue += Record::from_annotations(&self.keys, annotations).inventory.map_or(0, |i| i.left() as i64);
            }
        }
        for phase in ["NotStarted", "Releasing", "Released", "Blocked", "Overridden"] {
            self.metrics.tenants_by_phase.get_or_create(&PhaseLabels { phase: phase.into() }).set(*counts.get(phase).unwrap_or(&0));
        }
        self.metrics.residue_volumes.set(residue);
    }

    fn observe_outcome(&self, t: &TenantRef, outcome: &str) {
        if let Some(started) = self.phase_started.lock().expect("lock").remove(t) {
            self.metrics
                .phase_seconds
                .get_or_create(&OutcomeLabels { outcome: outcome.into() })
                .observe(started.elapsed().as_secs_f64());
        }
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut cut = max - 3;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}...", &s[..cut])
}

/// One reconcile of a parent release.
async fn reconcile(parent: Arc<ParentMeta>, ctx: Arc<Context>) -> Result<Action, ReconcileError> {
    let t = TenantRef { namespace: parent.namespace().unwrap_or_default(), name: parent.name_any() };
    if !ctx.profile.is_parent(parent.labels()) {
        return Ok(Action::await_change());
    }
    let record = Record::from_annotations(&ctx.keys, parent.annotations());
    let in_custody = parent.finalizers().contains(&ctx.profile.custody_finalizer);
    let teardown = parent.meta().deletion_timestamp.is_some() || ctx.namespace_deleting(&t.namespace);

    if !teardown {
        if !in_custody {
            ctx.take_custody(&t, &parent).await?;
            ctx.event(&t, false, "CustodyTaken", format!(
                "finalizer {} added: deleting this tenant will first free its volumes", ctx.profile.custody_finalizer
            )).await;
        }
        if record.cluster.is_none() {
            return Ok(ctx.bind_cluster(&t).await?);
        }
        return Ok(Action::await_change());
    }
    if !in_custody {
        if record.phase.is_none() && !record.is_done() && parent.meta().deletion_timestamp.is_some() {
            // Deleted before custody began (the gate was not installed yet):
            // nothing can hold it now; say so loudly, once per reconcile.
            warn!(tenant = %t, "tenant is being deleted without custody; its volumes were not released by volume-gate");
        }
        return Ok(Action::await_change());
    }

    // Resume after a crash between the record write and the finalizer removal.
    if record.phase == Some(Phase::Released) {
        ctx.end_custody(&t, parent.finalizers()).await?;
        return Ok(Action::await_change());
    }
    if let Some(ov) = record.stamped_override() {
        if let Some(running) = ctx.running.lock().expect("lock").remove(&t) {
            running.task.abort();
        }
        if record.phase != Some(Phase::Overridden) {
            let left = record
                .inventory
                .as_ref()
                .map(|i| {
                    let named = i.first_remaining(50);
                    format!("{} left on storage{}", count(i.left(), "volume"), if named.is_empty() { String::new() } else { format!(": {named}") })
                })
                .unwrap_or_else(|| "no inventory was taken: the volumes left on storage are unknown".into());
            let by = ov.by.as_deref().unwrap_or("?");
            let message = format!("override by {by} ({}): {left}", ov.reason.trim());
            ctx.write_record(&t, &Update { phase: Some(Phase::Overridden), message: Some(message.clone()), ..Default::default() })
                .await?;
            ctx.event(&t, true, "Overridden", message).await;
            ctx.observe_outcome(&t, "overridden");
            ctx.retries.lock().expect("lock").remove(&t);
        }
        ctx.end_custody(&t, parent.finalizers()).await?;
        return Ok(Action::await_change());
    }

    // The phase: one task per tenant, at most N holding a slot.
    {
        let mut running = ctx.running.lock().expect("lock");
        if let Some(r) = running.get(&t) {
            if !r.task.is_finished() {
                // The task triggers a reconcile when it ends.
                return Ok(Action::await_change());
            }
            running.remove(&t);
        }
        if let Some(retry) = ctx.retries.lock().expect("lock").get(&t).copied() {
            let now = Instant::now();
            if retry.at > now {
                return Ok(Action::requeue(retry.at - now));
            }
        }
        ctx.phase_started.lock().expect("lock").entry(t.clone()).or_insert_with(Instant::now);
        let task = tokio::spawn(run_phase(ctx.clone(), t.clone()));
        running.insert(t, Running { task });
    }
    Ok(Action::await_change())
}

/// The phase task: waits for a slot, runs steps 1–7, records the outcome.
async fn run_phase(ctx: Arc<Context>, t: TenantRef) {
    // The controller's store can be behind the worker's own writes: the
    // reconcile that the end of a pass triggers may still see the parent as
    // it was when the pass began (in custody, `Releasing`). A pass started
    // from that view wrote `Releasing` over `Released`, and the gate then
    // refused what it had allowed. So a pass starts from a fresh read, and
    // not at all for a tenant that is gone, done or out of custody (the
    // watch brings the reconcile that settles those).
    let record = match ctx.fresh_record(&t).await {
        Ok(Some(record)) => record,
        Ok(None) => return,
        Err(e) => {
            warn!(tenant = %t, error = %e, "cannot read the parent before a release pass; retrying");
            ctx.retries.lock().expect("lock").insert(t.clone(), Retry { at: Instant::now() + Duration::from_secs(5), attempts: 0 });
            let _ = ctx.trigger.send(ObjectRef::new_with(&t.name, ctx.parent_resource.clone()).within(&t.namespace));
            return;
        }
    };
    if record.phase.is_none() {
        let waiting = ctx.slots.available_permits() == 0;
        let message = if waiting { "waiting for a release slot" } else { "release started" };
        if let Err(e) = ctx.write_record(&t, &Update { phase: Some(Phase::Releasing), message: Some(message.into()), ..Default::default() }).await {
            warn!(tenant = %t, error = %e, "cannot record the start of the release");
        }
        ctx.event(&t, false, "ReleaseStarted", "tenant is being deleted: releasing its volumes before the CSI driver goes".into()).await;
    }
    let Ok(_permit) = ctx.slots.clone().acquire_owned().await else { return };
    let outcome = release::run(&ctx, &t, &record).await;
    let result = match outcome {
        Ok(release::Outcome::Released { inventory }) => {
            let message = format!("{} freed, none left on storage", count(inventory.total, "volume"));
            let update = Update {
                phase: Some(Phase::Released),
                message: Some(message.clone()),
                released_at: Some(jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string()),
                inventory: Some(inventory),
                cluster: None,
            };
            match ctx.write_record(&t, &update).await {
                Ok(()) => {
                    ctx.event(&t, false, "Released", message).await;
                    ctx.observe_outcome(&t, "released");
                    ctx.retries.lock().expect("lock").remove(&t);
                    // Custody ends in the reconcile this write triggers.
                    Ok(())
                }
                Err(e) => Err(e),
            }
        }
        Ok(release::Outcome::Blocked { reason, message, inventory }) => {
            ctx.metrics.reconcile_errors.get_or_create(&ErrorLabels { error: reason.into() }).inc();
            let attempts = {
                let mut retries = ctx.retries.lock().expect("lock");
                let attempts = retries.get(&t).map_or(0, |r| r.attempts) + 1;
                let delay = backoff(&ctx.settings, attempts);
                retries.insert(t.clone(), Retry { at: Instant::now() + delay, attempts });
                attempts
            };
            let delay = backoff(&ctx.settings, attempts);
            let full = format!("{message} (attempt {attempts}; retrying in {}s)", delay.as_secs());
            let update = Update { phase: Some(Phase::Blocked), message: Some(full.clone()), inventory, ..Default::default() };
            let written = ctx.write_record(&t, &update).await;
            ctx.event(&t, true, "Blocked", full).await;
            written
        }
        Err(e) => Err(e),
    };
    if let Err(e) = result {
        ctx.metrics.reconcile_errors.get_or_create(&ErrorLabels { error: "management-api".into() }).inc();
        error!(tenant = %t, error = %e, "release pass failed on the management API; retrying");
        let mut retries = ctx.retries.lock().expect("lock");
        let attempts = retries.get(&t).map_or(0, |r| r.attempts) + 1;
        retries.insert(t.clone(), Retry { at: Instant::now() + Duration::from_secs(5), attempts });
    }
    let reference = ObjectRef::new_with(&t.name, ctx.parent_resource.clone()).within(&t.namespace);
    let _ = ctx.trigger.send(reference);
}

fn tokio_stream_from<T: Send + 'static>(mut rx: tokio::sync::mpsc::UnboundedReceiver<T>) -> impl futures::Stream<Item = T> + Send {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

fn backoff(settings: &Settings, attempts: u32) -> Duration {
    let factor = 2u32.saturating_pow(attempts.saturating_sub(1).min(16));
    settings.retry_base.saturating_mul(factor).min(settings.retry_max)
}

fn error_policy(parent: Arc<ParentMeta>, error: &ReconcileError, ctx: Arc<Context>) -> Action {
    ctx.metrics.reconcile_errors.get_or_create(&ErrorLabels { error: error.label().into() }).inc();
    warn!(namespace = parent.namespace().unwrap_or_default(), name = %parent.name_any(), error = %error, "reconcile failed");
    Action::requeue(Duration::from_secs(5))
}

/// Reconciles run at once. Each makes at most a few short API calls (the
/// release phase runs in its own tasks). Unbounded, a worker taking custody
/// of 1,000 tenants at start made 1,000 requests at once and kept a 93 MiB
/// RSS; with this bound, 52 MiB (BENCHMARKS-scale.md, benchmark 4).
const RECONCILE_CONCURRENCY: u16 = 8;

/// How long a stopping worker lets running reconciles finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

/// `volume-gate worker`: leader election, then the controller until
/// shutdown or lost leadership.
pub async fn run(args: WorkerArgs) -> Result<(), WorkerError> {
    let profile = match &args.profile {
        Some(path) => Profile::load(path)?,
        None => Profile::cozystack(),
    };
    let client = kube::Client::try_default().await.map_err(WorkerError::Client)?;
    let metrics = Metrics::new();
    let shutdown = CancellationToken::new();
    tokio::spawn(crate::shutdown_on_signal(shutdown.clone()));

    let admin_listener = tokio::net::TcpListener::bind(args.admin_listen)
        .await
        .map_err(|source| WorkerError::Listen { addr: args.admin_listen, source })?;
    let readiness = Arc::new(crate::admin::ApiServerReadiness::new(client.clone()));
    let admin = tokio::spawn(crate::admin::serve_admin(admin_listener, metrics.clone(), readiness, shutdown.clone()));

    let identity = args.identity.clone().unwrap_or_else(|| {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "worker".into());
        format!("{host}-{}", std::process::id())
    });
    let lease_err = |message: String| WorkerError::Lease { namespace: args.lease_namespace.clone(), name: args.lease_name.clone(), message };
    let manager = kube_lease_manager::LeaseManagerBuilder::new(client.clone(), &args.lease_name)
        .with_namespace(&args.lease_namespace)
        .with_identity(&identity)
        .with_duration(args.lease_duration.as_secs().max(2))
        .with_grace((args.lease_duration.as_secs() / 3).max(1))
        .build()
        .await
        .map_err(|e| lease_err(e.to_string()))?;
    let (mut leader, lease_task) = manager.watch().await;
    info!(identity = %identity, lease = %format!("{}/{}", args.lease_namespace, args.lease_name), "waiting to lead");
    let leading = tokio::select! {
        _ = shutdown.cancelled() => false,
        r = leader.wait_for(|is_leader| *is_leader) => { r.map_err(|e| lease_err(e.to_string()))?; true }
    };
    if !leading {
        drop(leader);
        let _ = lease_task.await;
        let _ = admin.await;
        return Ok(());
    }
    info!(identity = %identity, "leading: starting the controller");

    let lost = CancellationToken::new();
    // This task holds a clone of the leadership receiver; it is aborted
    // before the Lease is released, or the lease task would wait for it.
    let watch_lost = {
        let lost = lost.clone();
        let mut leader = leader.clone();
        tokio::spawn(async move {
            let _ = leader.wait_for(|is_leader| !*is_leader).await;
            lost.cancel();
        })
    };
    let stop = CancellationToken::new();
    {
        let (stop, shutdown, lost) = (stop.clone(), shutdown.clone(), lost.clone());
        tokio::spawn(async move {
            tokio::select! { _ = shutdown.cancelled() => {}, _ = lost.cancelled() => {} }
            stop.cancel();
        });
    }

    let settings = Settings {
        probe_timeout: args.probe_timeout,
        wait_bound: args.wait_bound,
        request_timeout: Duration::from_secs(30),
        retry_base: args.retry_base,
        retry_max: args.retry_max,
    };
    run_controller(client, profile, metrics, settings, args.max_concurrent_releases, args.namespace.clone(), &identity, stop).await;

    // Every receiver gone: the lease manager releases the Lease, so the next
    // worker leads at once instead of after the lease duration.
    watch_lost.abort();
    let _ = watch_lost.await;
    drop(leader);
    if tokio::time::timeout(SHUTDOWN_GRACE, lease_task).await.is_err() {
        warn!(grace = ?SHUTDOWN_GRACE, "the Lease was not released in time; the next worker leads once it expires");
    }
    shutdown.cancel();
    let _ = admin.await;
    if lost.is_cancelled() && !shutdown.is_cancelled() {
        return Err(WorkerError::LostLeadership);
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn run_controller(
    client: kube::Client,
    profile: Profile,
    metrics: Arc<Metrics>,
    settings: Settings,
    max_concurrent: usize,
    namespace: Option<String>,
    identity: &str,
    stop: CancellationToken,
) {
    let parent_resource = custody::parent_resource(&profile);
    // Metadata only: thousands of HelmReleases with large specs stay cheap.
    let parents_api: Api<ParentMeta> = match &namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &parent_resource),
        None => Api::all_with(client.clone(), &parent_resource),
    };
    let ns_api: Api<PartialObjectMeta<Namespace>> = Api::all(client.clone());

    let parents_writer = reflector::store::Writer::<ParentMeta>::new(parent_resource.clone());
    let parents = parents_writer.as_reader();
    let parent_stream = reflector::reflector(
        parents_writer,
        watcher(parents_api, watcher::Config::default().labels(&profile.parent_selector())).default_backoff(),
    )
    .touched_objects();
    let ns_writer = reflector::store::Writer::<PartialObjectMeta<Namespace>>::new(());
    let namespaces = ns_writer.as_reader();
    let ns_stream =
        reflector::reflector(ns_writer, watcher(ns_api, watcher::Config::default()).default_backoff()).touched_objects();
    let (trigger, triggered) = tokio::sync::mpsc::unbounded_channel();

    let reporter = Reporter { controller: "volume-gate-worker".into(), instance: Some(identity.to_string()) };
    let ctx = Arc::new(Context {
        recorder: Recorder::new(client.clone(), reporter),
        client,
        keys: Keys::new(&profile.annotation_prefix),
        profile,
        metrics,
        settings,
        parent_resource: parent_resource.clone(),
        parents: parents.clone(),
        namespaces,
        slots: Arc::new(Semaphore::new(max_concurrent.max(1))),
        running: Mutex::new(HashMap::new()),
        retries: Mutex::new(HashMap::new()),
        binds: Mutex::new(HashMap::new()),
        phase_started: Mutex::new(HashMap::new()),
        trigger,
    });

    // A namespace being deleted puts every parent in it in teardown.
    let parents_for_ns = parents.clone();
    let ns_resource = parent_resource.clone();
    let ns_mapper = move |ns: PartialObjectMeta<Namespace>| {
        let name = ns.name_any();
        if ns.metadata.deletion_timestamp.is_none() {
            return Vec::new();
        }
        parents_for_ns
            .state()
            .iter()
            .filter(|p| p.namespace().as_deref() == Some(name.as_str()))
            .map(|p| ObjectRef::from_obj_with(p.as_ref(), ns_resource.clone()))
            .collect::<Vec<_>>()
    };
    let gauge_ctx = ctx.clone();
    let gauge_stop = stop.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            tokio::select! {
                _ = gauge_stop.cancelled() => break,
                _ = tick.tick() => gauge_ctx.refresh_phase_gauge(),
            }
        }
    });
    let stop_signal = stop.clone();
    let ctx_for_tasks = ctx.clone();
    let controller = Controller::for_stream_with(parent_stream, parents, parent_resource)
        .with_config(controller::Config::default().concurrency(RECONCILE_CONCURRENCY))
        .watches_stream_with(ns_stream, ns_mapper, ())
        .reconcile_on(tokio_stream_from(triggered))
        .graceful_shutdown_on(async move { stop_signal.cancelled().await })
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            match res {
                // A tenant whose custody just ended is gone before its last trigger.
                Err(kube::runtime::controller::Error::ObjectNotFound(obj)) => tracing::debug!(object = %obj, "already gone"),
                Err(e) => warn!(error = %e, "controller event"),
                Ok(_) => {}
            }
        });
    // A graceful shutdown lets running reconciles finish; one stuck on an
    // unresponsive API server could hold a terminating worker (and its
    // Lease) until the kubelet kills it. Everything the worker does is safe
    // to abandon at any point (the next leader finishes it), so the wait is
    // bounded.
    tokio::select! {
        () = controller => {}
        () = async {
            stop.cancelled().await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => info!(grace = ?SHUTDOWN_GRACE, "stopping with reconciles still running; the next leader resumes them"),
    }
    for (_, running) in ctx_for_tasks.running.lock().expect("lock").drain() {
        running.task.abort();
    }
}
