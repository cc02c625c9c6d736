//! One reconcile of a parent release: [`next`] decides, this carries it out;
//! and the phase task, which runs a pass and records its outcome.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use tracing::{Instrument, error, info, info_span, instrument, warn};

use super::context::ParentMeta;
use super::events::Reason;
use super::next::{self, Next, Seen};
use super::{Context, ErrorKind, TenantRef, binding, release};
use crate::record::{Phase, Record, Update, now_rfc3339};
use crate::text::count;

/// Errors of one reconcile.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("management API: {0}")]
    Management(#[from] kube::Error),
}

impl ReconcileError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            ReconcileError::Management(_) => ErrorKind::ManagementApi,
        }
    }
}

/// How soon a failed management-API call is tried again.
const API_RETRY: Duration = Duration::from_secs(5);

/// One reconcile of a parent release.
#[instrument(skip_all, fields(namespace = parent.namespace().unwrap_or_default(), tenant = %parent.name_any()))]
pub async fn reconcile(
    parent: Arc<ParentMeta>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    let t = TenantRef {
        namespace: parent.namespace().unwrap_or_default(),
        name: parent.name_any(),
    };
    let record = Record::from_annotations(&ctx.keys, parent.annotations());
    let seen = Seen {
        is_parent: ctx.profile.is_parent(parent.labels()),
        record: &record,
        in_custody: parent.finalizers().contains(&ctx.profile.custody_finalizer),
        deleting: parent.meta().deletion_timestamp.is_some(),
        namespace_deleting: ctx.namespace_deleting(&t.namespace),
        task: ctx.task_state(&t),
        request: ctx.requests(&t, parent.annotations()),
    };
    match next::next(seen) {
        Next::Ignore | Next::Wait | Next::AwaitPass => Ok(Action::await_change()),
        Next::TakeCustody { bind } => {
            ctx.take_custody(&t, &parent).await?;
            let note = format!(
                "finalizer {} added: deleting this tenant will first free its volumes",
                ctx.profile.custody_finalizer
            );
            ctx.event(&t, Reason::CustodyTaken, note).await;
            if bind {
                Ok(binding::bind(&ctx, &t).await?)
            } else {
                Ok(Action::await_change())
            }
        }
        Next::BindCluster => Ok(binding::bind(&ctx, &t).await?),
        Next::DeletedWithoutCustody => {
            warn!(
                "tenant is being deleted without custody; its volumes were not released by volume-gate"
            );
            Ok(Action::await_change())
        }
        Next::EndCustody => {
            ctx.end_custody(&t, parent.finalizers()).await?;
            Ok(Action::await_change())
        }
        Next::Override { record: true } => {
            ctx.abort_pass(&t);
            record_override(&ctx, &t, &record).await?;
            Ok(Action::await_change())
        }
        Next::Override { record: false } => {
            ctx.abort_pass(&t);
            // Recorded before; custody ends here (the write that records an
            // outcome ends it too).
            ctx.end_custody(&t, parent.finalizers()).await?;
            Ok(Action::await_change())
        }
        Next::RetryIn(delay) => Ok(Action::requeue(delay)),
        Next::RequestRetry => {
            let made = ctx.request_retry(&t).await?;
            Ok(Action::requeue(ctx.settings.backoff(made + 1)))
        }
        Next::StartPass => {
            // The pass outlives this reconcile: its span is its own, with
            // the tenant's names.
            let span = info_span!("phase", namespace = %t.namespace, tenant = %t.name);
            let task = tokio::spawn(run_phase(ctx.clone(), t.clone()).instrument(span));
            ctx.pass_started(&t, task);
            Ok(Action::await_change())
        }
    }
}

/// Records a stamped override: keeps what must stay of the disks before
/// custody ends (after it, the hook's and the namespace's deletes reach
/// them), then writes `Overridden` and says what stays and what goes.
async fn record_override(ctx: &Context, t: &TenantRef, record: &Record) -> Result<(), kube::Error> {
    let ov = record
        .stamped_override()
        .expect("next saw a stamped override");
    let mut inventory = record.inventory.clone();
    let (kept, unowned) = match ctx.profile.infra.as_ref() {
        Some(spec) => {
            let observed = release::read_disks(ctx, t, spec, inventory.as_mut()).await?;
            let unowned: std::collections::BTreeSet<String> = observed
                .claims
                .iter()
                .filter(|c| !c.owned)
                .map(|c| c.name.clone())
                .collect();
            (
                Some(release::keep(ctx, t, &observed, inventory.as_mut(), false).await?),
                Some(unowned),
            )
        }
        None => (None, None),
    };
    let finder = format!(
        "kubectl get pv -l {}={}",
        ctx.keys.kept_namespace, t.namespace
    );
    let message = next::override_message(
        ov,
        &next::Leaves {
            inventory: inventory.as_ref(),
            kept: kept.as_ref(),
            unowned: unowned.as_ref(),
            finder: &finder,
        },
    );
    let update = Update {
        phase: Some(Phase::Overridden),
        message: Some(message.clone()),
        inventory,
        ..Default::default()
    };
    if let Err(e) = ctx.write_record(t, &update).await {
        ctx.record_not_written(t, &e).await;
        return Err(e);
    }
    ctx.event(t, Reason::Overridden, message).await;
    ctx.outcome_recorded(t, "overridden");
    Ok(())
}

/// The phase task: waits for a slot, runs steps 1–7, records the outcome.
pub(crate) async fn run_phase(ctx: Arc<Context>, t: TenantRef) {
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
            warn!(error = %e, "cannot read the parent before a release pass; retrying");
            ctx.schedule_retry(&t, |_| API_RETRY);
            ctx.pass_ended(&t);
            return;
        }
    };
    if record.phase.is_none() {
        record_start(&ctx, &t).await;
    }
    let asked = Instant::now();
    ctx.waiting_for_slot.fetch_add(1, Ordering::SeqCst);
    let permit = ctx.slots.clone().acquire_owned().await;
    ctx.waiting_for_slot.fetch_sub(1, Ordering::SeqCst);
    let Ok(_permit) = permit else {
        return;
    };
    ctx.metrics
        .slot_wait_seconds
        .observe(asked.elapsed().as_secs_f64());
    let turn = release::Turn::new(ctx.settings.release_turn, ctx.waiting_for_slot.clone());
    let recorded = match turn.run(release::run(&ctx, &t, &record)).await {
        Ok(release::Outcome::Blocked { inventory, .. }) if turn.yielded() => {
            record_yield(&ctx, &t, inventory).await
        }
        Ok(outcome) => record_outcome(&ctx, &t, outcome).await,
        Err(e) => Err(e),
    };
    if let Err(e) = recorded {
        // A parent too large for its record stays so until someone acts:
        // said once per attempt on the backoff, not every API_RETRY.
        let too_large = ctx.record_not_written(&t, &e).await;
        if !too_large {
            ctx.count_error(ErrorKind::ManagementApi);
        }
        error!(error = %e, too_large, "release pass failed on the management API; retrying");
        ctx.schedule_retry(&t, |n| {
            if too_large {
                ctx.settings.backoff(n)
            } else {
                API_RETRY
            }
        });
    }
    ctx.pass_ended(&t);
}

/// A pass that gave its slot up at the end of its turn (`release::Turn`):
/// still `Releasing`, saying how far it got; the next pass queues for a
/// slot at once, behind the tenants that were waiting.
async fn record_yield(
    ctx: &Context,
    t: &TenantRef,
    inventory: Option<crate::record::Inventory>,
) -> Result<(), kube::Error> {
    let so_far = inventory
        .as_ref()
        .map(|i| format!("{}/{} volumes freed; ", i.freed, i.total))
        .unwrap_or_default();
    let message = format!(
        "{so_far}gave its release slot to a waiting tenant after its {}s turn (--release-turn) and queued again",
        ctx.settings.release_turn.as_secs()
    );
    info!(%message, "release turn over");
    ctx.turn_yielded(t);
    let update = Update {
        phase: Some(Phase::Releasing),
        message: Some(message.clone()),
        inventory,
        ..Default::default()
    };
    ctx.write_record(t, &update).await?;
    ctx.event(t, Reason::SlotYielded, message).await;
    Ok(())
}

/// The first pass of a phase: `Releasing` (or waiting for a slot) and its Event.
async fn record_start(ctx: &Context, t: &TenantRef) {
    let message = if ctx.slots.available_permits() == 0 {
        "waiting for a release slot"
    } else {
        "release started"
    };
    let update = Update {
        phase: Some(Phase::Releasing),
        message: Some(message.into()),
        ..Default::default()
    };
    if let Err(e) = ctx.write_record(t, &update).await {
        warn!(error = %e, "cannot record the start of the release");
    }
    let note = "tenant is being deleted: releasing its volumes before the CSI driver goes";
    ctx.event(t, Reason::ReleaseStarted, note.into()).await;
}

/// Writes a pass's outcome and its Event: `Released` (custody ends in the
/// same write), or `Blocked` with the next retry on the backoff.
async fn record_outcome(
    ctx: &Context,
    t: &TenantRef,
    outcome: release::Outcome,
) -> Result<(), kube::Error> {
    match outcome {
        release::Outcome::Released { inventory, note } => {
            let mut message = format!(
                "{} freed, none left on storage",
                count(inventory.total, "volume")
            );
            if let Some(note) = note {
                message.push_str(": ");
                message.push_str(&note);
            }
            let update = Update {
                phase: Some(Phase::Released),
                message: Some(message.clone()),
                released_at: Some(now_rfc3339()),
                inventory: Some(inventory),
                cluster: None,
            };
            ctx.write_record(t, &update).await?;
            ctx.event(t, Reason::Released, message).await;
            ctx.outcome_recorded(t, "released");
            Ok(())
        }
        release::Outcome::Blocked {
            reason,
            message,
            inventory,
        } => {
            ctx.count_error(reason);
            let (attempts, delay) = ctx.schedule_retry(t, |n| ctx.settings.backoff(n));
            let full = format!(
                "{message} (attempt {attempts}; retrying in {}s)",
                delay.as_secs()
            );
            let update = Update {
                phase: Some(Phase::Blocked),
                message: Some(full.clone()),
                inventory,
                ..Default::default()
            };
            let written = ctx.write_record(t, &update).await;
            ctx.event(t, Reason::Blocked, full).await;
            written
        }
    }
}

pub(crate) fn error_policy(
    parent: Arc<ParentMeta>,
    error: &ReconcileError,
    ctx: Arc<Context>,
) -> Action {
    ctx.count_error(error.kind());
    warn!(namespace = parent.namespace().unwrap_or_default(), name = %parent.name_any(), error = %error, "reconcile failed");
    Action::requeue(API_RETRY)
}

/// Reconcile against a scripted API server: the calls each decision makes.
#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Namespace;
    use kube::core::PartialObjectMeta;
    use kube::runtime::reflector::store::Writer;
    use serde_json::{Value, json};

    use super::*;
    use crate::metrics::Metrics;
    use crate::profile::Profile;
    use crate::testing::{FakeApi, partial_metadata};
    use crate::worker::Settings;
    use crate::worker::context::Parts;

    const NS: &str = "tenant-a";
    const PARENT: &str =
        "/apis/helm.toolkit.fluxcd.io/v2/namespaces/tenant-a/helmreleases/kubernetes-a";
    const SECRET: &str = "/api/v1/namespaces/tenant-a/secrets/kubernetes-a-admin-kubeconfig";
    const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/tenant-a/events";
    const CUSTODY: &str = "volumes.cozystack.io/release";

    struct World {
        api: Arc<FakeApi>,
        ctx: Arc<Context>,
        triggered:
            tokio::sync::mpsc::UnboundedReceiver<kube::runtime::reflector::ObjectRef<ParentMeta>>,
    }

    fn world() -> World {
        let api = FakeApi::new();
        let event = json!({"apiVersion": "events.k8s.io/v1", "kind": "Event",
                           "metadata": {"name": "e", "namespace": NS}, "eventTime": "2026-01-01T00:00:00.000000Z"});
        api.on("POST", EVENTS, 201, event);
        let profile = Profile::cozystack();
        let (trigger, triggered) = tokio::sync::mpsc::unbounded_channel();
        let settings = Settings {
            probe_timeout: Duration::from_secs(1),
            wait_bound: Duration::from_secs(1),
            release_turn: Duration::from_secs(120),
            request_timeout: Duration::from_secs(1),
            retry_base: Duration::from_secs(30),
            retry_max: Duration::from_secs(600),
            infra_after: Duration::from_secs(120),
        };
        let ctx = Arc::new(Context::new(Parts {
            client: api.client(),
            parents: Writer::<ParentMeta>::new(profile.parent_resource()).as_reader(),
            namespaces: Writer::<PartialObjectMeta<Namespace>>::new(()).as_reader(),
            kept: Writer::new(()).as_reader(),
            profile,
            metrics: Metrics::new(),
            settings,
            max_concurrent: 1,
            identity: "test".into(),
            trigger,
        }));
        World {
            api,
            ctx,
            triggered,
        }
    }

    fn parent(labels: bool, deleting: bool, finalizers: &[&str], annotations: Value) -> Value {
        let mut meta = json!({"name": "kubernetes-a", "namespace": NS, "resourceVersion": "7", "uid": "p-uid",
                              "annotations": annotations, "finalizers": finalizers});
        if labels {
            meta["labels"] = json!({"apps.cozystack.io/application.kind": "Kubernetes", "apps.cozystack.io/application.group": "apps.cozystack.io"});
        }
        if deleting {
            meta["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        }
        partial_metadata(meta)
    }

    fn meta(v: &Value) -> Arc<ParentMeta> {
        Arc::new(serde_json::from_value(v.clone()).expect("parent metadata"))
    }

    /// The bodies of the PATCHes sent to the parent, in order.
    fn patches(api: &FakeApi) -> Vec<(String, Value)> {
        api.calls_to("PATCH", PARENT)
            .into_iter()
            .map(|c| (c.content_type, c.body))
            .collect()
    }

    fn event_reasons(api: &FakeApi) -> Vec<(String, String)> {
        api.calls_to("POST", EVENTS)
            .iter()
            .map(|c| {
                (
                    c.body["type"].as_str().unwrap_or("").to_string(),
                    c.body["reason"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect()
    }

    #[tokio::test]
    async fn an_object_without_the_parent_labels_gets_no_call() {
        let w = world();
        let p = parent(
            false,
            true,
            &[],
            json!({"volumes.cozystack.io/phase": "Blocked"}),
        );
        let action = reconcile(meta(&p), w.ctx.clone()).await.unwrap();
        assert_eq!(action, Action::await_change());
        assert!(w.api.calls().is_empty(), "{:?}", w.api.calls());
    }

    #[tokio::test]
    async fn a_live_tenant_is_taken_into_custody_at_its_version_and_its_binding_retried_with_backoff()
     {
        let w = world();
        let p = parent(true, false, &["finalizers.fluxcd.io"], json!({}));
        w.api.on("PATCH", PARENT, 200, p.clone());
        let action = reconcile(meta(&p), w.ctx.clone()).await.unwrap();
        let sent = patches(&w.api);
        assert_eq!(sent.len(), 1, "{sent:?}");
        assert_eq!(sent[0].0, "application/json-patch+json");
        assert_eq!(
            sent[0].1,
            json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": "7"},
                {"op": "add", "path": "/metadata/finalizers/-", "value": CUSTODY},
            ])
        );
        assert_eq!(
            event_reasons(&w.api),
            [("Normal".to_string(), "CustodyTaken".to_string())]
        );
        // No kubeconfig yet (Kamaji is building the tenant): tried again after retry_base.
        assert_eq!(w.api.calls_to("GET", SECRET).len(), 1);
        assert_eq!(action, Action::requeue(Duration::from_secs(30)));
        let again = reconcile(
            meta(&parent(
                true,
                false,
                &["finalizers.fluxcd.io", CUSTODY],
                json!({}),
            )),
            w.ctx.clone(),
        )
        .await
        .unwrap();
        assert_eq!(
            again,
            Action::requeue(Duration::from_secs(60)),
            "the second attempt backs off"
        );
    }

    #[tokio::test]
    async fn a_released_tenant_still_in_custody_has_only_its_finalizer_removed_by_index_under_a_test()
     {
        let w = world();
        let p = parent(
            true,
            true,
            &["finalizers.fluxcd.io", CUSTODY],
            json!({"volumes.cozystack.io/phase": "Released"}),
        );
        w.api.on("PATCH", PARENT, 200, p.clone());
        reconcile(meta(&p), w.ctx.clone()).await.unwrap();
        assert_eq!(
            patches(&w.api)
                .iter()
                .map(|p| p.1.clone())
                .collect::<Vec<_>>(),
            [json!([
                {"op": "test", "path": "/metadata/finalizers/1", "value": CUSTODY},
                {"op": "remove", "path": "/metadata/finalizers/1"},
            ])]
        );
        assert!(
            w.api.calls_to("GET", SECRET).is_empty(),
            "a released tenant's cluster is not touched"
        );
    }

    #[tokio::test]
    async fn a_stamped_override_is_recorded_with_a_warning_then_custody_ends() {
        let w = world();
        let p = parent(
            true,
            true,
            &["finalizers.fluxcd.io", CUSTODY],
            json!({
                "volumes.cozystack.io/phase": "Blocked",
                "volumes.cozystack.io/override": "tenant abandoned",
                "volumes.cozystack.io/override-by": "alice",
                "volumes.cozystack.io/override-at": "2026-01-01T00:00:00Z",
            }),
        );
        w.api.get(PARENT, p.clone());
        w.api.on("PATCH", PARENT, 200, p.clone());
        reconcile(meta(&p), w.ctx.clone()).await.unwrap();
        let sent = patches(&w.api);
        assert_eq!(
            sent.len(),
            1,
            "one write records the outcome and ends custody: {sent:?}"
        );
        assert_eq!(sent[0].0, "application/json-patch+json");
        let ops = sent[0].1.as_array().expect("a JSON Patch");
        assert_eq!(
            ops[..2],
            [
                json!({"op": "test", "path": "/metadata/finalizers/1", "value": CUSTODY}),
                json!({"op": "remove", "path": "/metadata/finalizers/1"})
            ],
            "custody ends by index under a test, Flux's finalizer untouched"
        );
        let set = |key: &str| {
            let path = format!("/metadata/annotations/{}", key.replace('/', "~1"));
            ops.iter()
                .find(|o| o["op"] == "add" && o["path"] == path.as_str())
                .map(|o| o["value"].clone())
        };
        assert_eq!(set("volumes.cozystack.io/phase"), Some(json!("Overridden")));
        let message = set("volumes.cozystack.io/message").expect("a message");
        assert!(
            message
                .as_str()
                .unwrap()
                .starts_with("override by alice (tenant abandoned)"),
            "{message}"
        );
        assert_eq!(
            set("volumes.cozystack.io/override"),
            None,
            "the person's keys are not rewritten: {ops:?}"
        );
        assert!(
            set("reconcile.fluxcd.io/requestedAt").is_some_and(|v| v.is_string()),
            "Flux is asked to retry in the same write: {ops:?}"
        );
        assert_eq!(
            event_reasons(&w.api),
            [("Warning".to_string(), "Overridden".to_string())]
        );
    }

    #[tokio::test]
    async fn a_parent_still_going_after_its_outcome_is_asked_again_with_a_backoff() {
        let w = world();
        let p = parent(
            true,
            true,
            &["finalizers.fluxcd.io"],
            json!({
                "volumes.cozystack.io/phase": "Released",
                "reconcile.fluxcd.io/requestedAt": "2026-01-01T00:00:00Z",
            }),
        );
        w.api.on("PATCH", PARENT, 200, p.clone());
        let action = reconcile(meta(&p), w.ctx.clone()).await.unwrap();
        let sent = patches(&w.api);
        assert_eq!(sent.len(), 1, "{sent:?}");
        assert_eq!(sent[0].0, "application/merge-patch+json");
        let asked = sent[0].1["metadata"]["annotations"]["reconcile.fluxcd.io/requestedAt"]
            .as_str()
            .expect("a request");
        assert!(asked > "2026-01-01T00:00:00Z", "a new request: {asked}");
        assert_eq!(
            sent[0].1["metadata"]["annotations"]
                .as_object()
                .unwrap()
                .len(),
            1,
            "nothing else written"
        );
        // The next one waits the worker's backoff (retry-base 30s, doubled).
        assert_eq!(action, Action::requeue(Duration::from_secs(60)));
        // A request just made: nothing sent, a look again when it is due.
        let fresh = parent(
            true,
            true,
            &["finalizers.fluxcd.io"],
            json!({
                "volumes.cozystack.io/phase": "Released",
                "reconcile.fluxcd.io/requestedAt": crate::record::now_rfc3339(),
            }),
        );
        let action = reconcile(meta(&fresh), w.ctx.clone()).await.unwrap();
        assert_eq!(patches(&w.api).len(), 1);
        assert!(action != Action::await_change(), "{action:?}");
    }

    #[test]
    fn an_outcome_on_a_parent_without_annotations_sets_the_whole_map_and_leaves_a_missing_finalizer_alone()
     {
        let annotations = serde_json::Map::from_iter([(
            "volumes.cozystack.io/phase".to_string(),
            json!("Released"),
        )]);
        let patch = crate::worker::custody::outcome_patch(
            &["finalizers.fluxcd.io".into()],
            CUSTODY,
            false,
            &annotations,
        );
        assert_eq!(
            serde_json::to_value(&patch).unwrap(),
            json!([{"op": "add", "path": "/metadata/annotations", "value": {"volumes.cozystack.io/phase": "Released"}}])
        );
    }

    /// A pass whose kubeconfig Secret is missing: the phase task records
    /// `Releasing`, then `Blocked` naming the Secret, counts the error, and
    /// triggers the reconcile that waits out the backoff.
    #[tokio::test]
    async fn a_pass_without_a_kubeconfig_is_blocked_loudly_and_retried_after_the_backoff() {
        let mut w = world();
        let p = parent(true, true, &[CUSTODY], json!({}));
        w.api.get(PARENT, p.clone());
        w.api.on("PATCH", PARENT, 200, p.clone());
        let action = reconcile(meta(&p), w.ctx.clone()).await.unwrap();
        assert_eq!(action, Action::await_change());
        // The task's last act is the trigger; the test has no other clock.
        let again = tokio::time::timeout(Duration::from_secs(30), w.triggered.recv())
            .await
            .expect("the pass ends");
        assert_eq!(again.expect("a trigger").name, "kubernetes-a");

        let phases: Vec<Value> = patches(&w.api)
            .iter()
            .map(|p| p.1["metadata"]["annotations"].clone())
            .collect();
        assert_eq!(phases.len(), 2, "{phases:?}");
        assert_eq!(phases[0]["volumes.cozystack.io/phase"], "Releasing");
        assert!(
            phases
                .iter()
                .all(|a| a.get("reconcile.fluxcd.io/requestedAt").is_none()),
            "no retry request before an outcome: {phases:?}"
        );
        assert_eq!(phases[1]["volumes.cozystack.io/phase"], "Blocked");
        let message = phases[1]["volumes.cozystack.io/message"].as_str().unwrap();
        assert!(
            message.contains("tenant-a/kubernetes-a-admin-kubeconfig")
                && message.contains("(attempt 1; retrying in 30s)"),
            "{message}"
        );
        assert_eq!(
            event_reasons(&w.api).last().unwrap(),
            &("Warning".to_string(), "Blocked".to_string())
        );
        assert!(
            w.ctx
                .metrics
                .encode()
                .contains(r#"volume_gate_reconcile_errors_total{error="kubeconfig-not-found"} 1"#)
        );

        // Reconciled again before the backoff ends: a requeue, no new pass.
        let blocked = parent(true, true, &[CUSTODY], phases[1].clone());
        let calls = w.api.calls().len();
        let action = reconcile(meta(&blocked), w.ctx.clone()).await.unwrap();
        assert!(format!("{action:?}").contains("Some("), "{action:?}");
        assert_eq!(w.api.calls().len(), calls, "{:?}", &w.api.calls()[calls..]);
    }
}
