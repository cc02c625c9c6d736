//! The worker's shared state, and its writes to the management API: the
//! record, Events, the custody finalizer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::Namespace;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{info, warn};

use super::events::Reason;
use super::next::Task;
use super::{ErrorKind, Settings, TenantRef, custody, next};
use crate::metrics::{Metrics, OutcomeLabels, PhaseLabels};
use crate::profile::Profile;
use crate::record::{Keys, Phase, Record, Update, now_rfc3339};
use crate::text::{one_line, shorten};

/// Whether the API server refused a write because the object would be
/// too large: its annotations over their 256 KiB (422 "Too long"), or the
/// whole object over etcd's request limit (413, or "request is too large").
pub(crate) fn is_too_large(e: &kube::Error) -> bool {
    let kube::Error::Api(s) = e else {
        return false;
    };
    let m = s.message.to_ascii_lowercase();
    s.code == 413
        || (s.code == 422 && m.contains("annotations") && m.contains("too long"))
        || m.contains("request is too large")
        || m.contains("request entity too large")
}

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
    recorder: Recorder,
    pub(crate) parent_resource: ApiResource,
    pub(crate) parents: Store<ParentMeta>,
    namespaces: Store<PartialObjectMeta<Namespace>>,
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

    fn parent_api(&self, namespace: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), namespace, &self.parent_resource)
    }

    /// Writes worker-owned record keys with a patch that names only them:
    /// other annotations, and anything a person set, stay untouched. An
    /// outcome that ends the phase (`Released`, `Overridden`) also asks the
    /// parent's controller to reconcile now and ends custody, in the same
    /// write (`custody::outcome_patch`).
    pub async fn write_record(&self, t: &TenantRef, update: &Update) -> Result<(), kube::Error> {
        let mut annotations = update.annotations(&self.keys);
        // The tenant's owner sees the phase where the platform shows a
        // parent's annotations (Cozystack's Application API); nothing reads
        // the mirror back.
        for (key, mirror) in self
            .keys
            .mirrored(&self.profile.parent.visible_annotation_prefix)
        {
            if let Some(v) = annotations.get(key).cloned() {
                annotations.insert(mirror, v);
            }
        }
        if matches!(update.phase, Some(Phase::Released | Phase::Overridden)) {
            let request = &self.profile.parent.reconcile_request_annotation;
            if !request.is_empty() {
                annotations.insert(request.clone(), serde_json::Value::String(now_rfc3339()));
            }
            if let Some(done) = self.write_outcome(t, &annotations).await? {
                return Ok(done);
            }
        }
        let patch = serde_json::json!({"metadata": {"annotations": annotations}});
        self.parent_api(&t.namespace)
            .patch_metadata(&t.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    }

    /// Writes an outcome and ends custody in one JSON Patch, built on a
    /// fresh read and retried when the parent changed under it (the patch's
    /// `test` fails). `None` when the parent was not found: the caller's
    /// plain write reports that.
    async fn write_outcome(
        &self,
        t: &TenantRef,
        annotations: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Option<()>, kube::Error> {
        let api = self.parent_api(&t.namespace);
        let mut attempt = 0;
        loop {
            let Some(parent) = api.get_metadata_opt(&t.name).await? else {
                return Ok(None);
            };
            let patch = custody::outcome_patch(
                parent.finalizers(),
                &self.profile.custody_finalizer,
                !parent.annotations().is_empty(),
                annotations,
            );
            match api
                .patch_metadata(&t.name, &PatchParams::default(), &Patch::<()>::Json(patch))
                .await
            {
                Ok(_) => {
                    info!("outcome recorded; custody ended in the same write");
                    return Ok(Some(()));
                }
                Err(kube::Error::Api(s)) if (s.code == 422 || s.code == 409) && attempt < 3 => {
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
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

    /// Asks the parent's controller to retry its uninstall once more
    /// (`reconcile.fluxcd.io/requestedAt`, as `flux reconcile` writes it) and
    /// returns how many such requests this worker has made for it.
    pub(crate) async fn request_retry(&self, t: &TenantRef) -> Result<u32, kube::Error> {
        let key = &self.profile.parent.reconcile_request_annotation;
        let patch = serde_json::json!({"metadata": {"annotations": {key.as_str(): now_rfc3339()}}});
        self.parent_api(&t.namespace)
            .patch_metadata(&t.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        let made = self.tenant(t, |s| {
            s.requests += 1;
            s.requests
        });
        info!(
            request = made,
            "the parent is still there after its outcome: asked its controller to retry the uninstall"
        );
        Ok(made)
    }

    /// The parent's record, read now, if a release pass should run on it:
    /// `None` when the parent is gone, `Released`, overridden or out of
    /// custody.
    pub(crate) async fn fresh_record(&self, t: &TenantRef) -> Result<Option<Record>, kube::Error> {
        let Some(parent) = self
            .parent_api(&t.namespace)
            .get_metadata_opt(&t.name)
            .await?
        else {
            return Ok(None);
        };
        let record = Record::from_annotations(&self.keys, parent.annotations());
        let in_custody = parent
            .finalizers()
            .contains(&self.profile.custody_finalizer);
        let done = record.phase == Some(Phase::Released) || record.stamped_override().is_some();
        Ok((in_custody && !done).then_some(record))
    }

    /// Makes a record write that failed for the parent's size loud: a
    /// Warning Event `RecordNotWritten` naming what fills the parent and the
    /// command that frees it, and the `record-too-large` error count.
    /// Nothing is deleted before the inventory is written, so nothing is
    /// lost while it waits; the caller retries on its backoff. Other errors
    /// are left to the caller. Returns whether `e` was such a failure.
    pub(crate) async fn record_not_written(&self, t: &TenantRef, e: &kube::Error) -> bool {
        if !is_too_large(e) {
            return false;
        }
        self.count_error(ErrorKind::RecordTooLarge);
        let parent = format!(
            "{}.{} -n {} {}",
            self.profile.parent.plural, self.profile.parent.group, t.namespace, t.name
        );
        let space = match self
            .parent_api(&t.namespace)
            .get_metadata_opt(&t.name)
            .await
        {
            Ok(Some(p)) => crate::record::Space::of(&self.keys, p.annotations()).describe(&parent),
            Ok(None) => "the parent is gone".into(),
            Err(read) => format!("its annotations could not be read ({read})"),
        };
        self.event(
            t,
            Reason::RecordNotWritten,
            format!(
                "cannot write the volume-release record on {}/{}: the API server refused it as too large ({}); \
                 {space}. Nothing of the tenant is deleted until its inventory is written, and the teardown \
                 waits; the worker retries on its backoff",
                t.namespace,
                t.name,
                crate::text::bounded(&e.to_string(), 300)
            ),
        )
        .await;
        true
    }

    /// An Event on the parent; a failure to publish is logged, never fatal.
    pub async fn event(&self, t: &TenantRef, reason: Reason, note: String) {
        let reference = self.parent_reference(t);
        let type_ = reason.event_type();
        let warning = type_ == EventType::Warning;
        let reason = reason.as_str();
        let ev = Event {
            type_,
            reason: reason.to_string(),
            note: Some(shorten(&one_line(&note), 1000, "...")),
            action: "ReleaseVolumes".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &reference).await {
            warn!(reason, error = %e, "cannot publish event");
        }
        if warning {
            warn!(reason, note = %note, "event");
        } else {
            info!(reason, note = %note, "event");
        }
    }

    fn parent_reference(&self, t: &TenantRef) -> k8s_openapi::api::core::v1::ObjectReference {
        let uid = self.parents.get(&self.object_ref(t)).and_then(|p| p.uid());
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
    pub(crate) async fn end_custody(
        &self,
        t: &TenantRef,
        finalizers: &[String],
    ) -> Result<(), kube::Error> {
        let Some(patch) =
            custody::remove_finalizer_patch(finalizers, &self.profile.custody_finalizer)
        else {
            return Ok(());
        };
        let api = self.parent_api(&t.namespace);
        match api
            .patch_metadata(&t.name, &PatchParams::default(), &Patch::<()>::Json(patch))
            .await
        {
            Ok(_) => {
                info!("custody ended: finalizer removed");
                Ok(())
            }
            // The `test` failed: the finalizers changed since the store saw
            // them, typically because this worker already removed its own
            // (the store lags the write). Done if it is gone now; otherwise
            // the reconcile runs again on the fresh list.
            Err(kube::Error::Api(s)) if s.code == 422 || s.code == 404 => {
                let now = api.get_metadata_opt(&t.name).await?;
                match now {
                    Some(p) if p.finalizers().contains(&self.profile.custody_finalizer) => {
                        Err(kube::Error::Api(s))
                    }
                    _ => Ok(()),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Takes custody of a parent that is not being deleted.
    pub(crate) async fn take_custody(
        &self,
        t: &TenantRef,
        meta: &ParentMeta,
    ) -> Result<(), kube::Error> {
        let rv = meta.resource_version().unwrap_or_default();
        let patch =
            custody::add_finalizer_patch(meta.finalizers(), &rv, &self.profile.custody_finalizer);
        self.parent_api(&t.namespace)
            .patch_metadata(&t.name, &PatchParams::default(), &Patch::<()>::Json(patch))
            .await?;
        Ok(())
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

    /// Recounts tenants by phase. Only the phase annotation is parsed, and
    /// an inventory only for the few Blocked or Overridden tenants: this runs
    /// over every parent, so it must stay cheap with thousands of them.
    fn refresh_phase_gauge(&self) {
        let mut counts: HashMap<&'static str, i64> = HashMap::new();
        let mut residue = 0i64;
        for p in self.parents.state() {
            let annotations = p.annotations();
            let phase = annotations
                .get(&self.keys.phase)
                .and_then(|v| v.parse::<Phase>().ok());
            *counts
                .entry(phase.map_or("NotStarted", Phase::as_str))
                .or_default() += 1;
            if matches!(phase, Some(Phase::Blocked | Phase::Overridden)) {
                residue += Record::from_annotations(&self.keys, annotations)
                    .inventory
                    .map_or(0, |i| i.left() as i64);
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
        self.metrics.residue_volumes.set(residue);
    }
}

#[cfg(test)]
mod tests {
    use super::is_too_large;

    fn api(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure(message, "Invalid")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn a_write_refused_for_size_is_told_from_other_failures() {
        for (code, message) in [
            (
                422,
                "HelmRelease.helm.toolkit.fluxcd.io \"r\" is invalid: metadata.annotations: Too long: must have at most 262144 bytes",
            ),
            (500, "etcdserver: request is too large"),
            (413, "Request entity too large: limit is 3145728"),
        ] {
            assert!(is_too_large(&api(code, message)), "{code} {message}");
        }
        for (code, message) in [
            (422, "the object has been modified"),
            (409, "conflict"),
            (500, "etcdserver: leader changed"),
            (403, "forbidden"),
        ] {
            assert!(!is_too_large(&api(code, message)), "{code} {message}");
        }
    }
}
