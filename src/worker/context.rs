//! The worker's shared state: what it remembers of each tenant between
//! reconciles (its phase task, retry pacing, counters) and the transitions
//! of that state, with the stores it watches. Its writes to the management
//! API are in `writes.rs`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::{Namespace, PersistentVolume};
use kube::ResourceExt;
use kube::api::{ApiResource, DynamicObject};
use kube::core::PartialObjectMeta;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::next::Task;
use super::{ErrorKind, Settings, TenantRef, next};
use crate::metrics::{Metrics, OutcomeLabels, PhaseLabels, TeardownLabels};
use crate::profile::Profile;
use crate::record::{Keys, Phase, Record};

/// A parent release as the worker watches it: metadata only.
pub type ParentMeta = PartialObjectMeta<DynamicObject>;

/// When a tenant's next pass may start, and how many have failed in a row.
#[derive(Clone, Copy)]
struct Retry {
    at: Instant,
    attempts: u32,
}

/// What the worker remembers of one tenant between reconciles. Nothing
/// here is needed to resume after a restart (the record and the APIs are
/// the truth); it paces the work. One rule evicts it: an entry lives while
/// its parent is in the store or its phase task runs
/// ([`Context::housekeeping`]).
#[derive(Default)]
struct TenantState {
    /// The running phase task.
    task: Option<JoinHandle<()>>,
    retry: Option<Retry>,
    /// Attempts to bind the tenant's cluster in a row (`binding::bind`).
    binds: u32,
    /// Retry requests made after the outcome (`request_retry`).
    requests: u32,
    /// When the phase started, for its duration.
    phase_started: Option<Instant>,
    /// Since when the tenant's API has been unreachable, as this worker saw
    /// it (lost on restart: the wait before freeing from the management
    /// side starts again, never shorter).
    unreachable_since: Option<Instant>,
}

pub struct Context {
    pub client: kube::Client,
    pub profile: Profile,
    pub keys: Keys,
    pub metrics: Arc<Metrics>,
    pub settings: Settings,
    pub(super) recorder: Recorder,
    pub(crate) parent_resource: ApiResource,
    pub(crate) parents: Store<ParentMeta>,
    namespaces: Store<PartialObjectMeta<Namespace>>,
    /// The management side's kept PVs (label `kept: "true"`), for residue.
    kept: Store<PartialObjectMeta<PersistentVolume>>,
    /// The tenants in teardown the last gauge refresh exported.
    teardown_series: Mutex<Vec<TeardownLabels>>,
    pub(crate) slots: Arc<Semaphore>,
    /// Passes waiting for a slot now (`release::Turn`).
    pub(crate) waiting_for_slot: Arc<std::sync::atomic::AtomicUsize>,
    tenants: Mutex<HashMap<TenantRef, TenantState>>,
    /// Reconciles a tenant when its phase task ends.
    trigger: tokio::sync::mpsc::UnboundedSender<ObjectRef<ParentMeta>>,
}

/// What a [`Context`] is made of besides its own bookkeeping.
pub struct Parts {
    pub client: kube::Client,
    pub profile: Profile,
    pub metrics: Arc<Metrics>,
    pub settings: Settings,
    pub max_concurrent: usize,
    /// This replica's name in the Events it publishes.
    pub identity: String,
    pub parents: Store<ParentMeta>,
    pub namespaces: Store<PartialObjectMeta<Namespace>>,
    pub kept: Store<PartialObjectMeta<PersistentVolume>>,
    pub trigger: tokio::sync::mpsc::UnboundedSender<ObjectRef<ParentMeta>>,
}

impl Context {
    pub fn new(p: Parts) -> Self {
        let reporter = Reporter {
            controller: "volume-gate-worker".into(),
            instance: Some(p.identity),
        };
        Context {
            recorder: Recorder::new(p.client.clone(), reporter),
            client: p.client,
            keys: Keys::new(&p.profile.annotation_prefix),
            parent_resource: p.profile.parent_resource(),
            profile: p.profile,
            metrics: p.metrics,
            settings: p.settings,
            parents: p.parents,
            namespaces: p.namespaces,
            kept: p.kept,
            teardown_series: Mutex::default(),
            slots: Arc::new(Semaphore::new(p.max_concurrent.max(1))),
            waiting_for_slot: Arc::default(),
            tenants: Mutex::new(HashMap::new()),
            trigger: p.trigger,
        }
    }

    /// Reads or changes what the worker remembers of `t`.
    fn tenant<R>(&self, t: &TenantRef, f: impl FnOnce(&mut TenantState) -> R) -> R {
        let mut all = self.tenants.lock().expect("lock");
        f(all.entry(t.clone()).or_default())
    }

    /// Forgets the tenants whose parent is gone from the store and whose
    /// phase task is not running: the one eviction rule, run on the
    /// worker's periodic tick.
    pub(crate) fn housekeeping(&self) {
        self.tenants.lock().expect("lock").retain(|t, s| {
            s.task.as_ref().is_some_and(|h| !h.is_finished())
                || self.parents.get(&self.object_ref(t)).is_some()
        });
        self.refresh_phase_gauge();
    }

    /// The state of `t`'s phase task, for [`next::next`].
    pub(crate) fn task_state(&self, t: &TenantRef) -> Task {
        self.tenant(t, |s| {
            if s.task.as_ref().is_some_and(|h| !h.is_finished()) {
                return Task::Running;
            }
            s.task = None;
            match s.retry {
                Some(r) => Task::RetryIn(r.at.saturating_duration_since(Instant::now())),
                None => Task::Idle,
            }
        })
    }

    /// Records `t`'s phase task, started now; the phase's duration counts
    /// from its first pass.
    pub(crate) fn pass_started(&self, t: &TenantRef, task: JoinHandle<()>) {
        self.tenant(t, |s| {
            s.phase_started.get_or_insert_with(Instant::now);
            s.task = Some(task);
        });
    }

    /// Stops `t`'s running pass, if any (an override ends the phase).
    pub(crate) fn abort_pass(&self, t: &TenantRef) {
        if let Some(task) = self.tenant(t, |s| s.task.take()) {
            task.abort();
        }
    }

    /// Stops every running pass (shutdown: the next leader resumes them).
    pub(crate) fn abort_all(&self) {
        for s in self.tenants.lock().expect("lock").values_mut() {
            if let Some(task) = s.task.take() {
                task.abort();
            }
        }
    }

    /// Ends a pass: says so, then asks for the next reconcile. That
    /// reconcile can run before the pass's task has returned, and would
    /// otherwise see it running ("its end triggers the next reconcile") and
    /// wait for an end already past: a Blocked tenant then sat unretried
    /// until its parent next changed (seen: 100 s, until another test
    /// restarted the worker).
    pub(crate) fn pass_ended(&self, t: &TenantRef) {
        self.tenant(t, |s| s.task = None);
        self.retrigger(t);
    }

    /// Schedules `t`'s next pass after a failed one, `delay(attempts)` from
    /// now; returns the attempts so far, this one included, and the delay.
    pub(crate) fn schedule_retry(
        &self,
        t: &TenantRef,
        delay: impl FnOnce(u32) -> std::time::Duration,
    ) -> (u32, std::time::Duration) {
        self.tenant(t, |s| {
            let attempts = s.retry.map_or(0, |r| r.attempts) + 1;
            let delay = delay(attempts);
            s.retry = Some(Retry {
                at: Instant::now() + delay,
                attempts,
            });
            (attempts, delay)
        })
    }

    /// `t`'s pass gave its slot up at the end of its turn: the next pass
    /// starts now (and queues for a slot), not on the backoff.
    pub(crate) fn turn_yielded(&self, t: &TenantRef) {
        self.metrics.turns_yielded.inc();
        self.tenant(t, |s| s.retry = None);
    }

    /// `t`'s phase has an outcome: no retry is due, the phase's duration is
    /// observed, and its API counts as reachable again.
    pub(crate) fn outcome_recorded(&self, t: &TenantRef, outcome: &str) {
        let started = self.tenant(t, |s| {
            s.retry = None;
            s.unreachable_since = None;
            s.phase_started.take()
        });
        if let Some(started) = started {
            self.metrics
                .phase_seconds
                .get_or_create(&OutcomeLabels {
                    outcome: outcome.into(),
                })
                .observe(started.elapsed().as_secs_f64());
        }
    }

    /// Notes that `t`'s API did not answer (the clock starts now if it was
    /// reachable until now) and returns how long it has been unreachable.
    pub(crate) fn note_unreachable(&self, t: &TenantRef) -> std::time::Duration {
        self.tenant(t, |s| {
            s.unreachable_since
                .get_or_insert_with(Instant::now)
                .elapsed()
        })
    }

    /// Notes that `t`'s API answered: the unreachable clock stops.
    pub(crate) fn note_reachable(&self, t: &TenantRef) {
        self.tenant(t, |s| s.unreachable_since = None);
    }

    /// Counts one worker error in `volume_gate_reconcile_errors_total`.
    pub(crate) fn count_error(&self, kind: ErrorKind) {
        self.metrics.count_error(kind.as_str());
    }

    /// The reference of tenant `t`'s parent in the controller's queue.
    pub(crate) fn object_ref(&self, t: &TenantRef) -> ObjectRef<ParentMeta> {
        ObjectRef::new_with(&t.name, self.parent_resource.clone()).within(&t.namespace)
    }

    /// Asks the controller to reconcile `t` again.
    pub(crate) fn retrigger(&self, t: &TenantRef) {
        let _ = self.trigger.send(self.object_ref(t));
    }

    /// What the retry requests on a parent look like, for `next`: `None`
    /// when the profile makes none.
    pub(crate) fn requests(
        &self,
        t: &TenantRef,
        annotations: &std::collections::BTreeMap<String, String>,
    ) -> Option<next::Requests> {
        let key = &self.profile.parent.reconcile_request_annotation;
        if key.is_empty() {
            return None;
        }
        let since_last = annotations
            .get(key)
            .and_then(|v| v.parse::<jiff::Timestamp>().ok())
            .map(|at| {
                let secs = (jiff::Timestamp::now().as_millisecond() - at.as_millisecond()).max(0);
                std::time::Duration::from_millis(secs as u64)
            });
        let made = self.tenant(t, |s| s.requests);
        Some(next::Requests {
            since_last,
            made,
            wait: self.settings.backoff(made + 1),
        })
    }

    /// A retry request was made for `t` after its outcome: how many so far.
    pub(crate) fn request_made(&self, t: &TenantRef) -> u32 {
        self.tenant(t, |s| {
            s.requests += 1;
            s.requests
        })
    }

    /// A binding attempt failed: how many have in a row.
    pub(crate) fn bind_failed(&self, t: &TenantRef) -> u32 {
        self.tenant(t, |s| {
            s.binds += 1;
            s.binds
        })
    }

    /// The tenant is bound: the next failure counts from one.
    pub(crate) fn bind_succeeded(&self, t: &TenantRef) {
        self.tenant(t, |s| s.binds = 0);
    }

    /// Every parent bound to a cluster, as `(namespace/name, binding)`.
    pub(crate) fn bindings(&self) -> Vec<(String, crate::record::ClusterIdentity)> {
        self.parents
            .state()
            .iter()
            .filter_map(|p| {
                let who = format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any());
                let id = Record::from_annotations(&self.keys, p.annotations()).cluster?;
                Some((who, id))
            })
            .collect()
    }

    pub(crate) fn namespace_deleting(&self, namespace: &str) -> bool {
        self.namespaces
            .get(&ObjectRef::new(namespace))
            .is_some_and(|n| n.metadata.deletion_timestamp.is_some())
    }

    /// Recounts tenants by phase, the residue, and how long each tenant in
    /// teardown has waited. Only the phase annotation is parsed, and an
    /// inventory only for the few Blocked or Overridden tenants: this runs
    /// over every parent, so it must stay cheap with thousands of them.
    fn refresh_phase_gauge(&self) {
        let now = jiff::Timestamp::now();
        let (kept, kept_left, acknowledged) = self.kept_residue();
        let mut counts: HashMap<&'static str, i64> = HashMap::new();
        let mut residue = 0i64;
        let mut teardown = Vec::new();
        for p in self.parents.state() {
            let annotations = p.annotations();
            let phase = annotations
                .get(&self.keys.phase)
                .and_then(|v| v.parse::<Phase>().ok());
            *counts
                .entry(phase.map_or("NotStarted", Phase::as_str))
                .or_default() += 1;
            let namespace = p.namespace().unwrap_or_default();
            if matches!(phase, Some(Phase::Blocked | Phase::Overridden)) {
                // Its disks kept on the management side are counted below,
                // one by one, acknowledged or not.
                let left = Record::from_annotations(&self.keys, annotations)
                    .inventory
                    .map_or(0, |i| i.left() as i64);
                let kept_here = kept
                    .get(&format!("{namespace}/{}", p.name_any()))
                    .copied()
                    .unwrap_or(0);
                residue += (left - kept_here).max(0);
            }
            if let Some(since) = self.teardown_since(&p, &namespace)
                && !matches!(phase, Some(Phase::Released | Phase::Overridden))
            {
                let labels = TeardownLabels {
                    tenant_namespace: namespace,
                    tenant: p.name_any(),
                    phase: phase.map_or("NotStarted", Phase::as_str).into(),
                };
                let waited = now.duration_since(since).as_secs().max(0);
                teardown.push((labels, waited));
            }
        }
        for phase in [
            "NotStarted",
            "Releasing",
            "Released",
            "Blocked",
            "Overridden",
        ] {
            self.metrics
                .tenants_by_phase
                .get_or_create(&PhaseLabels {
                    phase: phase.into(),
                })
                .set(*counts.get(phase).unwrap_or(&0));
        }
        self.metrics.residue_volumes.set(residue + kept_left);
        self.metrics.residue_acknowledged_volumes.set(acknowledged);
        // The new series first, then the ones no longer true removed: a
        // scrape in between sees a tenant twice at most, never not at all.
        let mut exported = self.teardown_series.lock().expect("lock");
        for (labels, waited) in &teardown {
            self.metrics
                .tenant_teardown_seconds
                .get_or_create(labels)
                .set(*waited);
        }
        let now_exported: Vec<TeardownLabels> = teardown.into_iter().map(|(l, _)| l).collect();
        for gone in exported.iter().filter(|l| !now_exported.contains(l)) {
            self.metrics.tenant_teardown_seconds.remove(gone);
        }
        *exported = now_exported;
    }

    /// Since when `p` has been in teardown: its own deletion or its
    /// namespace's, the earlier; none when neither is being deleted.
    fn teardown_since(&self, p: &ParentMeta, namespace: &str) -> Option<jiff::Timestamp> {
        let own = p.metadata.deletion_timestamp.as_ref().map(|t| t.0);
        let of_namespace = self
            .namespaces
            .get(&ObjectRef::new(namespace))
            .and_then(|n| n.metadata.deletion_timestamp.as_ref().map(|t| t.0));
        match (own, of_namespace) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The management side's kept PVs: how many each tenant has (by
    /// `kept-for`), and how many are not acknowledged and acknowledged. A
    /// kept disk is acknowledged when it carries `kept-acknowledged` and the
    /// mutating webhook's stamp of who wrote it.
    fn kept_residue(&self) -> (HashMap<String, i64>, i64, i64) {
        let (mut of_tenant, mut left, mut acknowledged) = (HashMap::new(), 0, 0);
        for pv in self.kept.state() {
            let a = pv.annotations();
            if let Some(tenant) = a.get(&self.keys.kept_for) {
                *of_tenant.entry(tenant.clone()).or_default() += 1;
            }
            let stamped = a
                .get(&self.keys.kept_acknowledged)
                .is_some_and(|v| !v.trim().is_empty())
                && a.contains_key(&self.keys.kept_acknowledged_by);
            if stamped {
                acknowledged += 1;
            } else {
                left += 1;
            }
        }
        (of_tenant, left, acknowledged)
    }
}
