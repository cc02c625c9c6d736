//! Load: one namespace holding 50 tenant clusters is deleted at
//! once, while admission traffic hits the webhook through the real API
//! server. Every decision must be right, none may fail or time out, and
//! every tenant's volumes must be freed.
//!
//! Tenants run on light tenant clusters (see the harness's lightAPIs) so 50
//! fit on one machine; `VOLUME_GATE_LOAD_TENANTS` changes the count.

use volume_gate_testkit as common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::gate::helmrelease_resource;
use common::tenant::{Tenant, TenantOptions};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use volume_gate::record::{Phase, Record};

const NAMESPACE: &str = "tenant-load";
const BOOT_CONCURRENCY: usize = 3;
const TRAFFIC_TASKS: usize = 4;
/// Pacing of each traffic task, so the traffic does not starve the 50
/// clusters of a small machine.
const TRAFFIC_PERIOD: Duration = Duration::from_millis(20);

fn tenant_count() -> usize {
    std::env::var("VOLUME_GATE_LOAD_TENANTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Op {
    /// Dry-run DELETE of `R-csi`: allowed only once done.
    DeleteCsi,
    /// Dry-run DELETE of `R-cilium`: refused in teardown until done.
    DeleteChild,
    /// Dry-run merge patch of an ordinary annotation on the parent: allowed.
    UpdateParent,
}

#[derive(Debug)]
enum Outcome {
    Allowed,
    Denied(String),
    Gone,
    Failed(String),
}

struct Sample {
    tenant: usize,
    op: Op,
    sent: Instant,
    outcome: Outcome,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_of_50_tenants_deleted_under_webhook_traffic_frees_every_volume_with_every_decision_right()
 {
    // Flux as Cozystack runs it (its own retry delays, 750 ms doubling): in
    // a namespace deletion Cluster API's cascade, retried on its own
    // backoff, may take a tenant's control plane before the namespace
    // controller's next pass deletes the tenant's child releases, whose
    // uninstalls then fail once on the unreachable cluster and are retried
    // (helm-controller skips the uninstall once the kubeconfig Secret has
    // gone with the control plane, `reconcileReleaseDeletion`, v1.6.0); the
    // tests' default first retry, 10 min, would be most of the run.
    let env = common::env(common::EnvConfig {
        flux: common::flux::FluxConfig::cozystack(),
        ..common::EnvConfig::gated()
    });
    let cp = env.cp;
    let n = tenant_count();
    let started = Instant::now();

    // 50 tenants in one namespace, each with two claims held by one Pod.
    let handle = tokio::runtime::Handle::current();
    let mut tenants: Vec<Tenant> = futures::stream::iter(0..n)
        .map(|i| {
            let handle = handle.clone();
            async move {
                tokio::task::spawn_blocking(move || {
                    handle.block_on(async move {
                        let t = Tenant::create(
                            cp,
                            TenantOptions::new(&format!("load-{i:02}"))
                                .in_namespace(NAMESPACE)
                                .light(),
                        )
                        .await;
                        t.wait_custody().await;
                        t.with_held_claims(&["data", "wal"]).await;
                        (i, t)
                    })
                })
                .await
                .expect("build tenant")
            }
        })
        .buffer_unordered(BOOT_CONCURRENCY)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<BTreeMap<_, _>>()
        .into_values()
        .collect();
    let built = started.elapsed();
    let volumes_before: usize = tenants
        .iter()
        .map(|t| env.sim.volumes_of(&t.namespace, &t.name).len())
        .sum();
    assert_eq!(
        volumes_before,
        2 * n,
        "every tenant has its two volumes on storage"
    );
    let names: Arc<Vec<String>> = Arc::new(tenants.iter().map(|t| t.name.clone()).collect());

    let client = cp.management_client().await;
    let hrs: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), NAMESPACE, &helmrelease_resource());
    let stop = Arc::new(AtomicBool::new(false));
    let teardown_begun = Arc::new(AtomicBool::new(false));
    let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
    let violations: Arc<Mutex<Vec<String>>> = Arc::default();

    // Observer: when each tenant was first seen done (Released or Overridden)
    // or gone; the parent's record is the only place "done" is written.
    let done_at: Arc<Mutex<BTreeMap<usize, Instant>>> = Arc::default();
    let observer = {
        let (hrs, names, stop, done_at, violations) = (
            hrs.clone(),
            names.clone(),
            stop.clone(),
            done_at.clone(),
            violations.clone(),
        );
        tokio::spawn(async move {
            let keys = common::keys();
            let lp = ListParams::default().labels("apps.cozystack.io/application.kind=Kubernetes");
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            while !stop.load(Ordering::SeqCst) {
                tick.tick().await;
                let Ok(list) = hrs.list_metadata(&lp).await else {
                    continue;
                };
                let seen = Instant::now();
                let mut done = done_at.lock().unwrap();
                for (i, name) in names.iter().enumerate() {
                    let parent = list
                        .items
                        .iter()
                        .find(|p| p.metadata.name.as_deref() == Some(name));
                    let is_done = match parent {
                        None => true,
                        Some(p) => {
                            let r = Record::from_annotations(
                                &keys,
                                &p.metadata.annotations.clone().unwrap_or_default(),
                            );
                            let is_done =
                                matches!(r.phase, Some(Phase::Released | Phase::Overridden));
                            // Done is final: a record that goes back from it
                            // makes the gate refuse what it had allowed.
                            if !is_done && done.contains_key(&i) {
                                violations.lock().unwrap().push(format!(
                                    "the record of {name} went back from done to {:?} ({:?})",
                                    r.phase, r.message
                                ));
                            }
                            is_done
                        }
                    };
                    if is_done {
                        done.entry(i).or_insert(seen);
                    }
                }
            }
        })
    };

    // Traffic: dry-run requests through the API server as cluster-admin.
    let traffic: Vec<_> = (0..TRAFFIC_TASKS)
        .map(|task| {
            let (hrs, names, stop, teardown_begun) = (hrs.clone(), names.clone(), stop.clone(), teardown_begun.clone());
            let (samples, violations) = (samples.clone(), violations.clone());
            tokio::spawn(async move {
                let dry_delete = DeleteParams { dry_run: true, ..Default::default() };
                let dry_patch = PatchParams { dry_run: true, ..Default::default() };
                let mut tick = tokio::time::interval(TRAFFIC_PERIOD);
                let mut k = task;
                while !stop.load(Ordering::SeqCst) {
                    tick.tick().await;
                    k += TRAFFIC_TASKS;
                    let tenant = (k * 7) % names.len();
                    let op = [Op::DeleteCsi, Op::DeleteChild, Op::UpdateParent][k % 3];
                    let r = &names[tenant];
                    let in_teardown = teardown_begun.load(Ordering::SeqCst);
                    let sent = Instant::now();
                    let result = match op {
                        Op::DeleteCsi => hrs.delete(&common::profile().csi_release_name(r).expect("Cozystack has a CSI release"), &dry_delete).await.map(|_| ()),
                        Op::DeleteChild => hrs.delete(&format!("{r}-cilium"), &dry_delete).await.map(|_| ()),
                        Op::UpdateParent => {
                            let patch = serde_json::json!({"metadata": {"annotations": {"load.volume-gate.test/touched": k.to_string()}}});
                            hrs.patch(r, &dry_patch, &Patch::Merge(&patch)).await.map(|_| ())
                        }
                    };
                    let outcome = match result {
                        Ok(()) => Outcome::Allowed,
                        Err(kube::Error::Api(s)) if s.code == 404 => Outcome::Gone,
                        Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains("denied the request") => Outcome::Denied(s.message),
                        Err(e) => Outcome::Failed(e.to_string()),
                    };
                    // An allow while the tenant's volumes are still on storage
                    // (volumes are only ever freed, so they were there at the
                    // decision) is the loss the gate exists to prevent.
                    let left = || env.sim.volumes_of(NAMESPACE, r).len();
                    let wrong_allow = matches!(outcome, Outcome::Allowed)
                        && match op {
                            Op::DeleteCsi => left() > 0,
                            Op::DeleteChild => in_teardown && left() > 0,
                            Op::UpdateParent => false,
                        };
                    if wrong_allow {
                        violations.lock().unwrap().push(format!("{op:?} of {r} allowed with {} volumes on storage", left()));
                    }
                    samples.lock().unwrap().push(Sample { tenant, op, sent, outcome });
                }
            })
        })
        .collect();

    // Some traffic before the teardown: nothing is refused then but the
    // CSI releases.
    common::wait::eventually(
        "traffic flowing before the teardown",
        Duration::from_secs(60),
        || {
            let samples = samples.clone();
            async move {
                let seen = samples.lock().unwrap().len();
                if seen >= 10 * TRAFFIC_TASKS {
                    Ok(())
                } else {
                    Err(format!("{seen} requests answered"))
                }
            }
        },
    )
    .await;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let t0 = Instant::now();
    namespaces
        .delete(NAMESPACE, &DeleteParams::default())
        .await
        .expect("delete the namespace of all tenants");
    teardown_begun.store(true, Ordering::SeqCst);
    // A bound, not a target: after every tenant is Released the namespace
    // still waits on Flux, whose uninstalls fail while it terminates (the
    // tenant chart's hook cannot start there) and are retried on its
    // growing backoff. A fresh-clone suite run saw all 50 Released 13
    // minutes after the delete and the namespace still held at 20 minutes by
    // `finalizers.fluxcd.io` on 2 parents alone (docs/benchmarks-scale.md).
    common::tenant::wait_namespace_gone(&client, NAMESPACE, Duration::from_secs(1800)).await;
    let teardown = t0.elapsed();
    stop.store(true, Ordering::SeqCst);
    for t in traffic {
        t.await.expect("traffic task");
    }
    observer.await.expect("observer");

    // Every volume freed.
    let left: Vec<String> = tenants
        .iter()
        .flat_map(|t| env.sim.volumes_of(&t.namespace, &t.name))
        .collect();
    assert!(
        left.is_empty(),
        "volumes left on storage after the namespace was deleted: {left:?}"
    );

    // Every decision right, none failed.
    let samples = std::mem::take(&mut *samples.lock().unwrap());
    let done_at = done_at.lock().unwrap().clone();
    let mut violations = std::mem::take(&mut *violations.lock().unwrap());
    let mut counts: BTreeMap<(Op, &str), usize> = BTreeMap::new();
    for s in &samples {
        let name = &names[s.tenant];
        let kind = match &s.outcome {
            Outcome::Allowed => "allowed",
            Outcome::Denied(_) => "denied",
            Outcome::Gone => "gone",
            Outcome::Failed(_) => "failed",
        };
        *counts.entry((s.op, kind)).or_default() += 1;
        match (&s.outcome, s.op) {
            (Outcome::Failed(e), op) => violations.push(format!("{op:?} of {name} failed: {e}")),
            (Outcome::Denied(m), Op::UpdateParent) => {
                violations.push(format!("an ordinary annotation on {name} was refused: {m}"))
            }
            // Sent after the tenant was seen done: the fresh read must see it.
            (Outcome::Denied(m), Op::DeleteCsi | Op::DeleteChild)
                if done_at.get(&s.tenant).is_some_and(|d| s.sent > *d) =>
            {
                violations.push(format!(
                    "{:?} of {name} refused after the tenant was done: {m}",
                    s.op
                ))
            }
            (Outcome::Denied(m), _) if !m.contains(name.as_str()) => violations.push(format!(
                "a refusal that does not name the tenant {name}: {m}"
            )),
            _ => {}
        }
    }
    let decided = samples
        .iter()
        .filter(|s| matches!(s.outcome, Outcome::Allowed | Outcome::Denied(_)))
        .count();
    println!(
        "{n} tenants built in {:.0}s; namespace deleted and gone in {:.0}s; {} requests ({decided} decided by the webhook): {counts:?}",
        built.as_secs_f64(),
        teardown.as_secs_f64(),
        samples.len()
    );
    assert!(
        violations.is_empty(),
        "{} wrong or failed decisions, first 20:\n{}",
        violations.len(),
        violations
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    let csi_refused = counts.get(&(Op::DeleteCsi, "denied")).copied().unwrap_or(0);
    let child_refused = counts
        .get(&(Op::DeleteChild, "denied"))
        .copied()
        .unwrap_or(0);
    assert!(
        csi_refused > 0 && child_refused > 0,
        "the traffic saw the gate refuse nothing: {counts:?}"
    );
    assert_eq!(done_at.len(), n, "every tenant was seen done or gone");
    tenants.clear();
}
