//! `volume-gate worker`: leader election (a Lease), then the controller
//! wired to its watches until shutdown or lost leadership.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume};
use kube::ResourceExt;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::controller::{self, Controller};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt, watcher};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::context::{ParentMeta, Parts};
use super::{Context, Settings, WorkerError, reconcile};
use crate::args::WorkerArgs;
use crate::metrics::Metrics;
use crate::profile::Profile;
use crate::record::Keys;
use crate::runtime::Runtime;

/// What the controller is built from.
struct Base {
    client: kube::Client,
    profile: Profile,
    metrics: Arc<Metrics>,
    settings: Settings,
    max_concurrent: usize,
    identity: String,
}

/// Reconciles run at once. Each makes at most a few short API calls (the
/// release phase runs in its own tasks). Unbounded, a worker taking custody
/// of 1,000 tenants at start made 1,000 requests at once and kept a 93 MiB
/// RSS; with this bound, 52 MiB (`docs/benchmarks-scale.md`, benchmark 4).
const RECONCILE_CONCURRENCY: u16 = 8;

/// How long a stopping worker lets running reconciles finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

/// `volume-gate worker`: leader election, then the controller until
/// shutdown or lost leadership.
pub async fn run(args: WorkerArgs) -> Result<(), WorkerError> {
    let rt = Runtime::start(&args.common).await?;
    let (client, shutdown) = (rt.client.clone(), rt.shutdown.clone());

    let identity = args.identity.clone().unwrap_or_else(|| {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "worker".into());
        format!("{host}-{}", std::process::id())
    });
    let lease_err = |message: String| WorkerError::Lease {
        namespace: args.lease_namespace.clone(),
        name: args.lease_name.clone(),
        message,
    };
    let manager = kube_lease_manager::LeaseManagerBuilder::new(client.clone(), &args.lease_name)
        .with_namespace(&args.lease_namespace)
        .with_identity(&identity)
        .with_duration(args.lease_duration.as_secs().max(2))
        .with_grace((args.lease_duration.as_secs() / 3).max(1))
        .build()
        .await
        .map_err(|e| lease_err(e.to_string()))?;
    let (mut leader, lease_task) = manager.watch().await;
    // Registered at 0 by every replica, so "no leader" is a series of
    // zeros that can be alerted on, not an absence.
    rt.metrics.worker_leader.set(0);
    info!(identity = %identity, lease = %format!("{}/{}", args.lease_namespace, args.lease_name), "waiting to lead");
    let leading = tokio::select! {
        _ = shutdown.cancelled() => false,
        r = leader.wait_for(|is_leader| *is_leader) => { r.map_err(|e| lease_err(e.to_string()))?; true }
    };
    if !leading {
        drop(leader);
        let _ = lease_task.await;
        rt.finish().await;
        return Ok(());
    }
    info!(identity = %identity, "leading: starting the controller");
    rt.metrics.worker_leader.set(1);

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
        release_turn: args.release_turn,
        request_timeout: Duration::from_secs(30),
        retry_base: args.retry_base,
        retry_max: args.retry_max,
        infra_after: args.infra_after,
    };
    let base = Base {
        client,
        profile: rt.profile.clone(),
        metrics: rt.metrics.clone(),
        settings,
        max_concurrent: args.max_concurrent_releases,
        identity: identity.clone(),
    };
    run_controller(base, args.namespace.clone(), stop).await;
    rt.metrics.worker_leader.set(0);

    // Every receiver gone: the lease manager releases the Lease, so the next
    // worker leads at once instead of after the lease duration.
    watch_lost.abort();
    let _ = watch_lost.await;
    drop(leader);
    if tokio::time::timeout(SHUTDOWN_GRACE, lease_task)
        .await
        .is_err()
    {
        warn!(grace = ?SHUTDOWN_GRACE, "the Lease was not released in time; the next worker leads once it expires");
    }
    let signalled = shutdown.is_cancelled();
    rt.finish().await;
    if lost.is_cancelled() && !signalled {
        return Err(WorkerError::LostLeadership);
    }
    Ok(())
}

/// The controller: watches parents (and namespaces, whose deletion puts
/// every parent in them in teardown) until `stop`.
async fn run_controller(base: Base, namespace: Option<String>, stop: CancellationToken) {
    let Base {
        client,
        profile,
        metrics,
        settings,
        max_concurrent,
        identity,
    } = base;
    let parent_resource = profile.parent_resource();
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
        watcher(
            parents_api,
            watcher::Config::default().labels(&profile.parent_selector()),
        )
        .default_backoff(),
    )
    .touched_objects();
    let ns_writer = reflector::store::Writer::<PartialObjectMeta<Namespace>>::new(());
    let namespaces = ns_writer.as_reader();
    let ns_stream = reflector::reflector(
        ns_writer,
        watcher(ns_api, watcher::Config::default()).default_backoff(),
    )
    .touched_objects();
    // The kept PVs, for the residue gauge: label-selected, metadata only.
    let kept_api: Api<PartialObjectMeta<PersistentVolume>> = Api::all(client.clone());
    let kept_writer = reflector::store::Writer::<PartialObjectMeta<PersistentVolume>>::new(());
    let kept = kept_writer.as_reader();
    let kept_stream = reflector::reflector(
        kept_writer,
        watcher(
            kept_api,
            watcher::Config::default().labels(&format!(
                "{}=true",
                Keys::new(&profile.annotation_prefix).kept
            )),
        )
        .default_backoff(),
    );
    {
        let stop = stop.clone();
        tokio::spawn(async move {
            let drained = kept_stream.for_each(|_| futures::future::ready(()));
            tokio::select! { _ = stop.cancelled() => {}, () = drained => {} }
        });
    }
    let (trigger, triggered) = tokio::sync::mpsc::unbounded_channel();

    let ctx = Arc::new(Context::new(Parts {
        client,
        profile,
        metrics,
        settings,
        max_concurrent,
        identity,
        parents: parents.clone(),
        namespaces,
        kept,
        trigger,
    }));

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
                _ = tick.tick() => gauge_ctx.housekeeping(),
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
        .run(reconcile::reconcile, reconcile::error_policy, ctx)
        .for_each(|res| async move {
            match res {
                // A tenant whose custody just ended is gone before its last trigger.
                Err(kube::runtime::controller::Error::ObjectNotFound(obj)) => {
                    tracing::debug!(object = %obj, "already gone")
                }
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
    ctx_for_tasks.abort_all();
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<T>,
) -> impl futures::Stream<Item = T> + Send {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}
