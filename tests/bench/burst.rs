//! Benchmark 2: decisions that need a fresh read, in a burst like a
//! namespace deletion.
//!
//!     cargo run --release --example bench-burst -- --rounds 5
//!
//! Starts the harness's real management control plane (kube-apiserver, etcd,
//! kube-controller-manager; `tests/testkit`), applies the CRDs, and creates
//! `--tenants` tenants, each a namespace with its parent HelmRelease (in
//! custody: the finalizer `volumes.cozystack.io/release`) and children
//! labelled `cozystack.io/target-cluster-name`, `--children` in all, among
//! them every tenant's `R-csi`. The gate is the production `Gate` + `router`
//! with the harness admin client; the DELETE AdmissionReviews (oldObject as
//! read back from the API server) go straight at the router in-process, all
//! at once with `--concurrency` in flight — no API server in the admission
//! path, but every read the gate makes is a real GET against it.
//!
//! Two states, `--rounds` bursts each, alternating with the baseline:
//! - **live**: nothing is being deleted (an addon toggled off, or the hook's
//!   step 2 before the parent is marked; helm-controller deletes): a child's
//!   decision reads the parent and the namespace at once (2 reads) and
//!   allows; `R-csi` reads the parent and is refused (1 read);
//! - **namespace-deleting**: the tenant namespaces are really deleted; the
//!   namespace controller marks the parents (held by the custody finalizer)
//!   and removes the children (its deletes); every decision reads the parent
//!   (1 read) and refuses.
//!
//! Baseline: the same client GETs each child's parent (the metadata GET the
//! gate makes, `get_metadata_opt`), same count, same concurrency — the floor
//! for one read. Reported: p50/p99/max per burst, medians over rounds and
//! their spread, API reads per decision (from the gate's metrics), and the
//! ratio gate p99 / bare-GET p99 on the last line, against the target of
//! at most 1.2 × that in-run floor. No assertion on timings.

use volume_gate_testkit as common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use clap::Parser;
use futures::StreamExt;
use http::{Request, header};
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use serde_json::{Value, json};
use tower::ServiceExt;
use volume_gate::admission::{Gate, router};
use volume_gate::args::{DEFAULT_MAX_BODY_BYTES, DEFAULT_WORKER_IDENTITY};
use volume_gate::metrics::Metrics;
use volume_gate::profile::Profile;

const FLUX_FINALIZER: &str = "finalizers.fluxcd.io";
/// Cozystack's child releases of a tenant cluster; `csi` first.
const CHILDREN: &[&str] = &[
    "csi",
    "cilium",
    "coredns",
    "vsnap-crd",
    "ingress-nginx",
    "cert-manager",
    "monitoring-agents",
    "fluxcd",
    "gpu-operator",
    "velero",
    "vertical-pod-autoscaler",
    "gateway-api-crds",
];

#[derive(Parser, Debug)]
#[command(
    name = "bench-burst",
    about = "Gate decisions with fresh reads, in a burst, against the harness API server"
)]
struct Args {
    /// Child HelmReleases in all (DELETE reviews per burst).
    #[arg(long, default_value_t = 300)]
    children: usize,
    /// Tenants (namespaces, parents) the children are spread over.
    #[arg(long, default_value_t = 30)]
    tenants: usize,
    /// Requests in flight.
    #[arg(long, default_value_t = 50)]
    concurrency: usize,
    /// Bursts per state (each: a bare-GET burst, then a gate burst).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// After the bursts of each state, this many GETs and decisions one at
    /// a time (latency without queueing); 0 to skip.
    #[arg(long, default_value_t = 100)]
    serial: usize,
}

struct Child {
    namespace: String,
    parent: String,
    /// The DELETE AdmissionReview for it, by each [`Requester`].
    reviews: [Bytes; 2],
    csi: bool,
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn parent_object(ns: &str, name: &str) -> DynamicObject {
    let mut o = DynamicObject::new(name, &common::gate::helmrelease_resource()).within(ns);
    o.metadata.labels = Some(
        [
            ("apps.cozystack.io/application.kind", "Kubernetes"),
            ("apps.cozystack.io/application.group", "apps.cozystack.io"),
            (
                "apps.cozystack.io/application.name",
                name.trim_start_matches("kubernetes-"),
            ),
            ("sharding.fluxcd.io/key", "shard1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
    );
    o.metadata.finalizers = Some(vec![
        FLUX_FINALIZER.into(),
        common::profile().custody_finalizer,
    ]);
    o.data = json!({"spec": {"chart": {"spec": {"chart": "kubernetes", "sourceRef": {"kind": "HelmRepository", "name": "cozystack-apps", "namespace": "cozy-public"}}}, "interval": "5m", "values": {"storageClass": "replicated", "version": "v1.32"}}});
    o
}

fn child_object(ns: &str, parent: &str, suffix: &str) -> DynamicObject {
    let name = format!("{parent}-{suffix}");
    let mut o = DynamicObject::new(&name, &common::gate::helmrelease_resource()).within(ns);
    o.metadata.labels = Some(
        [(
            "cozystack.io/target-cluster-name".to_string(),
            parent.to_string(),
        )]
        .into(),
    );
    o.data = json!({"spec": {
        "chart": {"spec": {"chart": format!("cozy-{suffix}"), "sourceRef": {"kind": "HelmRepository", "name": "cozystack-system", "namespace": "cozy-system"}}},
        "interval": "5m",
        "kubeConfig": {"secretRef": {"name": common::profile().kubeconfig_secret_name(parent), "key": common::profile().kubeconfig.keys[0]}},
        "releaseName": suffix,
        "targetNamespace": format!("cozy-{suffix}"),
    }});
    o
}

/// Who sends the DELETE: helm-controller uninstalling a release (the live
/// state: an addon switched off, the hook's step 2), or the namespace
/// controller emptying a namespace being deleted.
#[derive(Clone, Copy, Debug)]
enum Requester {
    HelmController = 0,
    NamespaceController = 1,
}

impl Requester {
    fn user_info(self) -> Value {
        match self {
            Requester::HelmController => json!({
                "username": "system:serviceaccount:cozy-fluxcd:flux",
                "groups": ["system:serviceaccounts", "system:serviceaccounts:cozy-fluxcd", "system:authenticated"]}),
            Requester::NamespaceController => json!({
                "username": "system:serviceaccount:kube-system:namespace-controller",
                "groups": ["system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"]}),
        }
    }
}

/// A DELETE review as the API server sends it when `by` deletes `obj`.
fn delete_review(uid: &str, obj: &DynamicObject, by: Requester) -> Bytes {
    let gvk = json!({"group": "helm.toolkit.fluxcd.io", "version": "v2", "kind": "HelmRelease"});
    let gvr =
        json!({"group": "helm.toolkit.fluxcd.io", "version": "v2", "resource": "helmreleases"});
    let review = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": gvk, "resource": gvr, "requestKind": gvk, "requestResource": gvr,
            "name": obj.metadata.name, "namespace": obj.metadata.namespace, "operation": "DELETE",
            "userInfo": by.user_info(),
            "oldObject": obj,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "DeleteOptions", "propagationPolicy": "Background"},
        }
    });
    Bytes::from(serde_json::to_vec(&review).unwrap())
}

/// One timed operation's result.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Outcome {
    Allowed,
    Denied { code: i64 },
    Found,
    Error(String),
}

/// Runs `op(i)` for i in 0..n with `concurrency` in flight, all released at once.
async fn burst<F, Fut>(n: usize, concurrency: usize, op: F) -> Vec<(Duration, Outcome)>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Outcome> + Send,
{
    let op = Arc::new(op);
    let next = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Barrier::new(concurrency));
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (op, next, gate) = (op.clone(), next.clone(), gate.clone());
            tokio::spawn(async move {
                gate.wait().await;
                let mut out = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let started = Instant::now();
                    let outcome = op(i).await;
                    out.push((started.elapsed(), outcome));
                }
                out
            })
        })
        .collect();
    let mut all = Vec::with_capacity(n);
    for t in tasks {
        all.extend(t.await.expect("burst task"));
    }
    all
}

#[derive(Clone, Copy, Default)]
struct Stats {
    p50: f64,
    p99: f64,
    max: f64,
    /// Wall time of the whole burst.
    wall: f64,
}

fn stats(results: &[(Duration, Outcome)], wall: Duration) -> Stats {
    let mut ms: Vec<f64> = results.iter().map(|(d, _)| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let q = |q: f64| ms[((q * ms.len() as f64).ceil() as usize).clamp(1, ms.len()) - 1];
    Stats {
        p50: q(0.5),
        p99: q(0.99),
        max: *ms.last().unwrap(),
        wall: wall.as_secs_f64() * 1e3,
    }
}

fn outcomes(results: &[(Duration, Outcome)]) -> String {
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    for (_, o) in results {
        let key = match o {
            Outcome::Allowed => "allowed".to_string(),
            Outcome::Denied { code } => format!("denied {code}"),
            Outcome::Found => "found".to_string(),
            Outcome::Error(e) => format!("ERROR {}", &e[..e.len().min(120)]),
        };
        *counts.entry(key).or_default() += 1;
    }
    counts
        .iter()
        .map(|(k, v)| format!("{v} {k}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn spread(v: &[f64]) -> String {
    let lo = v.iter().cloned().fold(f64::INFINITY, f64::min);
    let hi = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    format!("{lo:.2}–{hi:.2}")
}

struct Bench {
    args: Args,
    client: kube::Client,
    metrics: Arc<Metrics>,
    router: axum::Router,
    children: Arc<Vec<Child>>,
}

impl Bench {
    async fn gate_burst(&self, by: Requester) -> (Vec<(Duration, Outcome)>, Duration, u64) {
        self.gate_run(self.children.len(), self.args.concurrency, by)
            .await
    }

    async fn gate_run(
        &self,
        n: usize,
        concurrency: usize,
        by: Requester,
    ) -> (Vec<(Duration, Outcome)>, Duration, u64) {
        let reads_before = self.metrics.api_reads.get();
        let (router, children) = (self.router.clone(), self.children.clone());
        let started = Instant::now();
        let results = burst(n, concurrency, move |i| {
            let (router, children) = (router.clone(), children.clone());
            async move {
                let request = Request::post("/validate?timeout=10s")
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(Body::from(children[i].reviews[by as usize].clone()))
                    .unwrap();
                let response = router.oneshot(request).await.expect("infallible");
                let body = match response.into_body().collect().await {
                    Ok(b) => b.to_bytes(),
                    Err(e) => return Outcome::Error(e.to_string()),
                };
                let v: Value = match serde_json::from_slice(&body) {
                    Ok(v) => v,
                    Err(e) => return Outcome::Error(format!("answer is not JSON: {e}")),
                };
                match v["response"]["allowed"].as_bool() {
                    Some(true) => Outcome::Allowed,
                    Some(false) => {
                        let code = v["response"]["status"]["code"].as_i64().unwrap_or(0);
                        if code == 403 {
                            Outcome::Denied { code }
                        } else {
                            // 400: the gate could not judge (a read failed).
                            Outcome::Error(
                                v["response"]["status"]["message"]
                                    .as_str()
                                    .unwrap_or("")
                                    .to_string(),
                            )
                        }
                    }
                    None => Outcome::Error(format!("no response.allowed in {v}")),
                }
            }
        })
        .await;
        (
            results,
            started.elapsed(),
            self.metrics.api_reads.get() - reads_before,
        )
    }

    async fn get_burst(&self) -> (Vec<(Duration, Outcome)>, Duration) {
        self.get_run(self.children.len(), self.args.concurrency)
            .await
    }

    async fn get_run(&self, n: usize, concurrency: usize) -> (Vec<(Duration, Outcome)>, Duration) {
        let (client, children) = (self.client.clone(), self.children.clone());
        let hr = common::gate::helmrelease_resource();
        let started = Instant::now();
        let results = burst(n, concurrency, move |i| {
            let (client, children, hr) = (client.clone(), children.clone(), hr.clone());
            async move {
                let c = &children[i];
                let api: Api<DynamicObject> = Api::namespaced_with(client, &c.namespace, &hr);
                match api.get_metadata_opt(&c.parent).await {
                    Ok(Some(_)) => Outcome::Found,
                    Ok(None) => Outcome::Error("parent not found".into()),
                    Err(e) => Outcome::Error(e.to_string()),
                }
            }
        })
        .await;
        (results, started.elapsed())
    }

    /// Alternating bursts; returns (median gate p99, median GET p99, reads per decision).
    async fn state(&self, name: &str, by: Requester, expect: &str) -> (f64, f64, f64, f64) {
        println!("\nstate {name}: {expect}");
        println!(
            "  {:>5} {:<8} {:>8} {:>8} {:>8} {:>9} {:>10}  outcomes",
            "burst", "what", "p50 ms", "p99 ms", "max ms", "wall ms", "reads/dec"
        );
        let mut gate_rows = Vec::new();
        let mut get_rows = Vec::new();
        let mut reads_per_decision = Vec::new();
        for r in 0..self.args.rounds {
            let (results, wall) = self.get_burst().await;
            let s = stats(&results, wall);
            println!(
                "  {:>5} {:<8} {:>8.2} {:>8.2} {:>8.2} {:>9.1} {:>10}  {}",
                r + 1,
                "bare-GET",
                s.p50,
                s.p99,
                s.max,
                s.wall,
                "1",
                outcomes(&results)
            );
            get_rows.push(s);
            let (results, wall, reads) = self.gate_burst(by).await;
            let s = stats(&results, wall);
            let rpd = reads as f64 / results.len() as f64;
            println!(
                "  {:>5} {:<8} {:>8.2} {:>8.2} {:>8.2} {:>9.1} {:>10.2}  {}",
                r + 1,
                "gate",
                s.p50,
                s.p99,
                s.max,
                s.wall,
                rpd,
                outcomes(&results)
            );
            gate_rows.push(s);
            reads_per_decision.push(rpd);
        }
        let col = |rows: &[Stats], f: fn(&Stats) -> f64| rows.iter().map(f).collect::<Vec<_>>();
        for (what, rows) in [("bare-GET", &get_rows), ("gate", &gate_rows)] {
            println!(
                "  median {what:<8} p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms, burst wall {:.1} ms   (spread: p50 {}, p99 {}, max {})",
                median(col(rows, |s| s.p50)),
                median(col(rows, |s| s.p99)),
                median(col(rows, |s| s.max)),
                median(col(rows, |s| s.wall)),
                spread(&col(rows, |s| s.p50)),
                spread(&col(rows, |s| s.p99)),
                spread(&col(rows, |s| s.max)),
            );
        }
        // The same requests one at a time: the latency of a read without queueing.
        let n = self.args.serial.min(self.children.len());
        if n > 0 {
            let (get, _) = self.get_run(n, 1).await;
            let (gate, _, reads) = self.gate_run(n, 1, by).await;
            let (g, b) = (stats(&gate, Duration::ZERO), stats(&get, Duration::ZERO));
            println!(
                "  one at a time ({n} each): bare-GET p50 {:.2} ms, p99 {:.2} ms | gate p50 {:.2} ms, p99 {:.2} ms, reads/decision {:.2}",
                b.p50,
                b.p99,
                g.p50,
                g.p99,
                reads as f64 / n as f64
            );
        }
        let gate_p99 = median(col(&gate_rows, |s| s.p99));
        let get_p99 = median(col(&get_rows, |s| s.p99));
        let rpd = median(reads_per_decision);
        let paired: Vec<f64> = gate_rows
            .iter()
            .zip(&get_rows)
            .map(|(g, b)| g.p99 / b.p99)
            .collect();
        println!(
            "  {name}: gate p99 / bare-GET p99 = {:.2} (per-burst {}), API reads per decision {rpd:.2}",
            gate_p99 / get_p99,
            spread(&paired)
        );
        (gate_p99, get_p99, rpd, gate_p99 / get_p99)
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    println!("bench-burst: gate decisions with fresh reads against the harness API server");
    println!(
        "  {} DELETE reviews of child HelmReleases over {} tenants, {} in flight, {} burst(s) per state; {} CPUs; load average {}",
        args.children,
        args.tenants,
        args.concurrency,
        args.rounds,
        cpus,
        loadavg()
    );

    let started = Instant::now();
    let cp = tokio::task::spawn_blocking(common::cluster::control_plane)
        .await
        .expect("control plane");
    common::gate::apply_crds(cp).await;
    let client = cp.management_client().await;
    println!(
        "  control plane up and CRDs established in {:.1}s (state {})",
        started.elapsed().as_secs_f64(),
        cp.state.display()
    );

    // Tenants: namespace, parent in custody, children.
    let hr = common::gate::helmrelease_resource();
    let tenants: Vec<(String, String)> = (0..args.tenants)
        .map(|t| (format!("tenant-burst{t}"), format!("kubernetes-burst{t}")))
        .collect();
    let mut plan: Vec<(usize, String)> = Vec::new();
    for i in 0..args.children {
        let (t, k) = (i % args.tenants, i / args.tenants);
        let suffix = if k < CHILDREN.len() {
            CHILDREN[k].to_string()
        } else {
            format!("addon-{k}")
        };
        plan.push((t, suffix));
    }
    let setup = Instant::now();
    futures::stream::iter(tenants.iter())
        .for_each_concurrent(8, |(ns, parent)| {
            let (client, hr) = (client.clone(), hr.clone());
            async move {
                cp.namespace(ns).await;
                let api: Api<DynamicObject> = Api::namespaced_with(client, ns, &hr);
                api.create(&PostParams::default(), &parent_object(ns, parent))
                    .await
                    .expect("create parent");
            }
        })
        .await;
    let created: Vec<DynamicObject> = futures::stream::iter(plan.iter())
        .map(|(t, suffix)| {
            let (client, hr) = (client.clone(), hr.clone());
            let (ns, parent) = tenants[*t].clone();
            async move {
                let api: Api<DynamicObject> = Api::namespaced_with(client, &ns, &hr);
                api.create(&PostParams::default(), &child_object(&ns, &parent, suffix))
                    .await
                    .expect("create child")
            }
        })
        .buffered(8)
        .collect()
        .await;
    let children: Vec<Child> = created
        .iter()
        .enumerate()
        .map(|(i, obj)| {
            let ns = obj.metadata.namespace.clone().unwrap();
            let parent =
                obj.metadata.labels.as_ref().unwrap()["cozystack.io/target-cluster-name"].clone();
            let csi = obj.metadata.name.as_deref()
                == Some(
                    &common::profile()
                        .csi_release_name(&parent)
                        .expect("Cozystack has a CSI release"),
                );
            Child {
                reviews: [Requester::HelmController, Requester::NamespaceController]
                    .map(|by| delete_review(&format!("burst-{i:06}"), obj, by)),
                namespace: ns,
                parent,
                csi,
            }
        })
        .collect();
    let csi = children.iter().filter(|c| c.csi).count();
    let review_sizes: Vec<usize> = children.iter().map(|c| c.reviews[0].len()).collect();
    println!(
        "  created {} namespaces + parents (custody finalizer) and {} children ({} of them R-csi) in {:.1}s; reviews {}–{} bytes",
        tenants.len(),
        children.len(),
        csi,
        setup.elapsed().as_secs_f64(),
        review_sizes.iter().min().unwrap(),
        review_sizes.iter().max().unwrap()
    );

    let metrics = Metrics::new();
    let gate = Arc::new(Gate::new(
        Profile::cozystack(),
        DEFAULT_WORKER_IDENTITY.to_string(),
        client.clone(),
        metrics.clone(),
    ));
    let bench = Bench {
        router: router(gate, DEFAULT_MAX_BODY_BYTES),
        args,
        client: client.clone(),
        metrics: metrics.clone(),
        children: Arc::new(children),
    };

    // Cold: the client's connection pool is empty (TLS handshakes to the API server).
    let (cold_get, wall) = bench.get_burst().await;
    let s = stats(&cold_get, wall);
    println!(
        "  cold bare-GET burst (new connections): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; {}",
        s.p50,
        s.p99,
        s.max,
        outcomes(&cold_get)
    );
    let (cold_gate, wall, reads) = bench.gate_burst(Requester::HelmController).await;
    let s = stats(&cold_gate, wall);
    println!(
        "  first gate burst (warm pool):            p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; reads/decision {:.2}; {}",
        s.p50,
        s.p99,
        s.max,
        reads as f64 / cold_gate.len() as f64,
        outcomes(&cold_gate)
    );

    let live = bench
        .state(
            "live",
            Requester::HelmController,
            &format!(
                "parents and namespaces not deleting, helm-controller deletes; expect {} allowed (children: parent and namespace read at once) and {} denied 403 (R-csi: parent read)",
                bench.children.len() - csi,
                csi
            ),
        )
        .await;

    // A real namespace deletion: the namespace controller marks the parents
    // (held by the custody finalizer) and deletes the children.
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for (ns, _) in &tenants {
        namespaces
            .delete(ns, &DeleteParams::default())
            .await
            .expect("delete namespace");
    }
    let deleting = Instant::now();
    common::wait::eventually(
        "namespace controller: parents marked, children gone",
        Duration::from_secs(180),
        || {
            let (client, hr, tenants) = (client.clone(), hr.clone(), tenants.clone());
            async move {
                for (ns, parent) in &tenants {
                    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &hr);
                    let left = api
                        .list_metadata(&ListParams::default())
                        .await
                        .map_err(|e| e.to_string())?;
                    let names: Vec<_> = left
                        .items
                        .iter()
                        .filter_map(|o| o.metadata.name.clone())
                        .collect();
                    if names != [parent.clone()] {
                        return Err(format!("{ns}: {} releases left", names.len()));
                    }
                    if left.items[0].metadata.deletion_timestamp.is_none() {
                        return Err(format!("{ns}/{parent} not marked yet"));
                    }
                }
                Ok(())
            }
        },
    )
    .await;
    println!(
        "\n  deleted {} namespaces: parents marked for deletion (held by the custody finalizer), children gone, after {:.1}s",
        tenants.len(),
        deleting.elapsed().as_secs_f64()
    );
    let nsdel = bench
        .state(
            "namespace-deleting",
            Requester::NamespaceController,
            &format!(
                "the namespace controller deletes; every decision reads the parent (deleting) and refuses: expect {} denied 403",
                bench.children.len()
            ),
        )
        .await;

    println!("\ngate decisions (volume_gate_admission_decisions_total, all bursts):");
    for line in metrics
        .encode()
        .lines()
        .filter(|l| l.starts_with("volume_gate_admission_decisions_total"))
    {
        println!("  {line}");
    }
    println!("  load average at the end: {}", loadavg());
    let verdict = |(gate_p99, get_p99, rpd, ratio): (f64, f64, f64, f64)| {
        format!(
            "{ratio:.2} (gate p99 {gate_p99:.2} ms vs bare GET {get_p99:.2} ms, the floor measured in this run; ratio <= 1.20: {}; reads/decision {rpd:.2} <= 2: {})",
            if ratio <= 1.2 { "met" } else { "MISSED" },
            if rpd <= 2.0 { "met" } else { "MISSED" }
        )
    };
    println!(
        "\nratio gate p99 / bare-GET p99 (medians of {} bursts of {} at concurrency {}): live {} | namespace-deleting {}",
        bench.args.rounds,
        bench.children.len(),
        bench.args.concurrency,
        verdict(live),
        verdict(nsdel)
    );
}
