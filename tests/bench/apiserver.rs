//! Benchmark 7: what a client of the API server feels.
//!
//!     cargo run --release --example bench-apiserver -- --rounds 5
//!
//! The harness's real management control plane (kube-apiserver, etcd,
//! kube-controller-manager) with the CRDs, and `--tenants` tenants: a
//! namespace, a parent HelmRelease in custody and its children `R-csi` and
//! `R-coredns`. Two webhook servers run in this process on the same
//! TLS/HTTP stack (`volume_gate::tls::serve`): the gate (the production
//! `Gate` + `router`, reading with this process's admin client) and the null
//! webhook (`null_webhook.rs`: finds the uid, allows). Three configurations,
//! each round in a rotated order:
//!
//! - **gate**: the shipped webhook configurations (`manifests/base`, every
//!   rule, objectSelector and matchCondition as shipped) pointing at the gate;
//! - **null**: the same configurations pointing at the null webhook;
//! - **none**: no webhook configuration at all.
//!
//! Operations, one at a time (the latency a client sees, not a queue), each
//! `--requests` times per configuration per round after `--warmup`:
//!
//! - `delete-refused`: a dry-run DELETE of `R-csi` (the gate refuses it: the
//!   CSI release of a live tenant; null and none let it through);
//! - `delete-allowed`: a dry-run DELETE of `R-coredns` (the gate reads the
//!   parent and the namespace at once and allows);
//! - `parent-update-record`: a merge patch of the parent's
//!   `volumes.cozystack.io/message` annotation by the worker's identity (sent
//!   to the gate, allowed from the request alone: the worker's record write);
//! - `parent-update-spec`: a merge patch of the parent's `spec.values`
//!   (Flux's and the platform's everyday write: the matchConditions keep it
//!   from the webhooks);
//! - `bare-get`: a metadata GET of the parent, the read the gate makes for
//!   the two deletes (no admission at all): what a fresh read costs here.
//!
//! The bench client's own identity is given to the in-process gate as the
//! worker's (`--worker-identity`), so its record writes are the worker's.
//! Every answer is checked against what the configuration should do. The
//! last line gives gate/null at p50 and p99 per operation (medians over
//! rounds) against the target of at most 1.05. No assertion on timings.

use volume_gate_testkit as common;
#[path = "null_webhook.rs"]
mod null_webhook;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use volume_gate::admission::{Gate, router};
use volume_gate::args::DEFAULT_MAX_BODY_BYTES;
use volume_gate::certs::{self, ServingSpec};
use volume_gate::metrics::Metrics;
use volume_gate::profile::Profile;
use volume_gate::record::Keys;
use volume_gate::tls::{self, CertReloader};

const FLUX_FINALIZER: &str = "finalizers.fluxcd.io";

#[derive(Parser, Debug)]
#[command(
    name = "bench-apiserver",
    about = "Client-side latency through the real API server: the gate, a null webhook, no webhook"
)]
struct Args {
    /// Rounds; each runs every configuration, in a rotated order.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Measured requests per operation per configuration per round.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Unmeasured requests per operation before each measurement.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Tenants the requests cycle through.
    #[arg(long, default_value_t = 10)]
    tenants: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Config {
    Gate,
    Null,
    None,
}

impl Config {
    const ALL: [Config; 3] = [Config::Gate, Config::Null, Config::None];
    fn name(self) -> &'static str {
        match self {
            Config::Gate => "gate",
            Config::Null => "null",
            Config::None => "none",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Op {
    DeleteRefused,
    DeleteAllowed,
    ParentUpdateRecord,
    ParentUpdateSpec,
    BareGet,
}

impl Op {
    const ALL: [Op; 5] = [
        Op::DeleteRefused,
        Op::DeleteAllowed,
        Op::ParentUpdateRecord,
        Op::ParentUpdateSpec,
        Op::BareGet,
    ];
    fn name(self) -> &'static str {
        match self {
            Op::DeleteRefused => "delete-refused",
            Op::DeleteAllowed => "delete-allowed",
            Op::ParentUpdateRecord => "parent-update-record",
            Op::ParentUpdateSpec => "parent-update-spec",
            Op::BareGet => "bare-get",
        }
    }
}

struct Bench {
    client: kube::Client,
    tenants: Vec<(String, String)>,
    seq: AtomicU64,
    /// The gate's profile, for its names (R-csi, the record's keys).
    profile: Profile,
    keys: Keys,
}

/// What one request got: allowed, or refused with the API server's message.
type Outcome = Result<(), String>;

impl Bench {
    fn api(&self, ns: &str) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.client.clone(),
            ns,
            &common::gate::helmrelease_resource(),
        )
    }

    /// One request of `op` against tenant `i` (mod the tenants), timed.
    async fn once(&self, op: Op, i: usize) -> (Duration, Outcome) {
        let (ns, parent) = &self.tenants[i % self.tenants.len()];
        let api = self.api(ns);
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        let dry = DeleteParams {
            dry_run: true,
            ..Default::default()
        };
        let started = Instant::now();
        let result = match op {
            Op::DeleteRefused => api
                .delete(
                    &self
                        .profile
                        .csi_release_name(parent)
                        .expect("Cozystack has a CSI release"),
                    &dry,
                )
                .await
                .map(drop),
            Op::DeleteAllowed => api
                .delete(&format!("{parent}-coredns"), &dry)
                .await
                .map(drop),
            Op::ParentUpdateRecord => api
                .patch(
                    parent,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"annotations": {
                        &self.keys.message: format!("bench-apiserver {n}")}}})),
                )
                .await
                .map(drop),
            Op::ParentUpdateSpec => api
                .patch(
                    parent,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"values": {"benchRevision": n}}})),
                )
                .await
                .map(drop),
            // The gate's own fresh read, as a client makes it.
            Op::BareGet => api.get_metadata(parent).await.map(drop),
        };
        let elapsed = started.elapsed();
        (
            elapsed,
            result.map_err(|e| match e {
                kube::Error::Api(s) => format!("{} {}", s.code, s.message),
                other => other.to_string(),
            }),
        )
    }
}

/// Whether `outcome` is what `config` should give for `op`.
fn expected(config: Config, op: Op, outcome: &Outcome) -> bool {
    match (config, op, outcome) {
        (Config::Gate, Op::DeleteRefused, Err(m)) => {
            m.starts_with("403") && m.contains("volume-gate") && !m.contains("failed calling")
        }
        (Config::Gate, Op::DeleteRefused, Ok(())) => false,
        (_, _, outcome) => outcome.is_ok(),
    }
}

fn percentile(sorted_ms: &[f64], q: f64) -> f64 {
    if sorted_ms.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted_ms.len() as f64).ceil() as usize).clamp(1, sorted_ms.len());
    sorted_ms[rank - 1]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// The shipped webhook configurations pointing at `base` (or none).
async fn configure(client: &kube::Client, docs: &[Value], target: Option<(&str, &str)>) {
    for doc in docs {
        match target {
            Some((base, ca)) => {
                common::manifests::apply(client, &common::manifests::point_at_local(doc, base, ca))
                    .await
            }
            None => {
                let kind = common::manifests::kind_of(doc);
                let plural = format!("{}s", kind.to_lowercase());
                let api: Api<DynamicObject> = Api::all_with(
                    client.clone(),
                    &common::chart::webhook_configuration(kind, &plural),
                );
                let name = doc["metadata"]["name"].as_str().unwrap();
                match api.delete(name, &DeleteParams::default()).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => panic!("delete {kind} {name}: {e}"),
                }
            }
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    println!("bench-apiserver (benchmark 7): a client's latency through the real API server");
    println!(
        "  {} tenants; {} round(s) × {} configurations × {} operations × ({} warm-up + {} measured), one request at a time; load average {}",
        args.tenants,
        args.rounds,
        Config::ALL.len(),
        Op::ALL.len(),
        args.warmup,
        args.requests,
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

    // Who this client is: given to the gate as the worker's identity.
    let me = Api::<SelfSubjectReview>::all(client.clone())
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
        .expect("SelfSubjectReview");
    let username = me
        .status
        .and_then(|s| s.user_info)
        .and_then(|u| u.username)
        .expect("this client's username");

    // Tenants: namespace, parent in custody, R-csi and R-coredns.
    let tenants: Vec<(String, String)> = (0..args.tenants)
        .map(|t| (format!("tenant-api{t}"), format!("kubernetes-api{t}")))
        .collect();
    let hr = common::gate::helmrelease_resource();
    for (ns, parent) in &tenants {
        cp.namespace(ns).await;
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &hr);
        let mut p = DynamicObject::new(parent, &hr).within(ns);
        p.metadata.labels = Some(
            [
                ("apps.cozystack.io/application.kind", "Kubernetes"),
                ("apps.cozystack.io/application.group", "apps.cozystack.io"),
                (
                    "apps.cozystack.io/application.name",
                    parent.trim_start_matches("kubernetes-"),
                ),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        );
        p.metadata.finalizers = Some(vec![
            FLUX_FINALIZER.into(),
            common::profile().custody_finalizer,
        ]);
        p.data = json!({"spec": common::flux::inert_spec("kubernetes")});
        api.create(&PostParams::default(), &p)
            .await
            .expect("create parent");
        for suffix in ["csi", "coredns"] {
            let mut c = DynamicObject::new(&format!("{parent}-{suffix}"), &hr).within(ns);
            c.metadata.labels = Some(
                [(
                    "cozystack.io/target-cluster-name".to_string(),
                    parent.clone(),
                )]
                .into(),
            );
            c.data = json!({"spec": common::flux::inert_spec(suffix)});
            api.create(&PostParams::default(), &c)
                .await
                .expect("create child");
        }
    }

    // The two webhook servers, same stack, same certificate.
    let dir = tempfile::tempdir().unwrap();
    let mut spec = ServingSpec::new("volume-gate-webhook", "volume-gate");
    spec.extra_sans = vec!["127.0.0.1".into()];
    let bundle = certs::generate(&spec, None).expect("certs::generate");
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert, &bundle.tls_cert).unwrap();
    std::fs::write(&key, &bundle.tls_key).unwrap();
    let reloader = CertReloader::load(&cert, &key).expect("load the generated pair");
    let ca = bundle.ca_bundle_b64();
    let shutdown = CancellationToken::new();
    let metrics = Metrics::new();
    let gate = Arc::new(Gate::new(
        Profile::cozystack(),
        username.clone(),
        client.clone(),
        metrics.clone(),
    ));
    let serve = |app: axum::Router| {
        let (reloader, shutdown) = (reloader.clone(), shutdown.clone());
        async move {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let base = format!("https://{}", listener.local_addr().unwrap());
            tokio::spawn(tls::serve(
                listener,
                tls::server_config(reloader),
                app,
                shutdown,
            ));
            base
        }
    };
    let gate_base = serve(router(gate, DEFAULT_MAX_BODY_BYTES)).await;
    let null_calls = Arc::new(AtomicU64::new(0));
    let null_base = serve(null_webhook::router(null_calls.clone())).await;
    let docs: Vec<Value> = common::manifests::base_documents()
        .into_iter()
        .filter(common::manifests::is_webhook_configuration)
        .collect();
    let gate_calls = || {
        metrics
            .encode()
            .lines()
            .filter(|l| l.starts_with("volume_gate_admission_decisions_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    };

    let bench = Bench {
        client: client.clone(),
        tenants,
        seq: AtomicU64::new(0),
        profile: Profile::cozystack(),
        keys: common::keys(),
    };
    println!(
        "  gate at {gate_base}, null at {null_base}; worker identity {username:?}; {} webhook configurations from manifests/base",
        docs.len()
    );

    // samples[(config, op)] = per round (p50, p99) in ms.
    let mut samples: BTreeMap<(Config, Op), Vec<(f64, f64)>> = BTreeMap::new();
    let mut unexpected = 0usize;
    for round in 0..args.rounds {
        let order: Vec<Config> = (0..3).map(|k| Config::ALL[(round + k) % 3]).collect();
        for config in order {
            match config {
                Config::Gate => configure(&client, &docs, Some((&gate_base, &ca))).await,
                Config::Null => configure(&client, &docs, Some((&null_base, &ca))).await,
                Config::None => configure(&client, &docs, None).await,
            }
            // Until the API server acts on the configuration: the one
            // answer it must give, from the server it must call (for none,
            // 20 answers in a row that reach neither server).
            let (mut quiet, bound) = (0, Instant::now() + Duration::from_secs(30));
            loop {
                assert!(
                    Instant::now() < bound,
                    "the API server did not take configuration {} within 30s",
                    config.name()
                );
                let (n0, g0) = (null_calls.load(Ordering::Relaxed), gate_calls());
                let (_, outcome) = bench.once(Op::DeleteRefused, 0).await;
                let (n1, g1) = (null_calls.load(Ordering::Relaxed), gate_calls());
                let taken = match config {
                    Config::Gate => expected(config, Op::DeleteRefused, &outcome) && g1 > g0,
                    Config::Null => outcome.is_ok() && n1 > n0 && g1 == g0,
                    Config::None => {
                        quiet = if outcome.is_ok() && n1 == n0 && g1 == g0 {
                            quiet + 1
                        } else {
                            0
                        };
                        quiet >= 20
                    }
                };
                if taken {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let mut line = format!("  round {} {:<5}", round + 1, config.name());
            for op in Op::ALL {
                for i in 0..args.warmup {
                    let _ = bench.once(op, i).await;
                }
                let mut ms = Vec::with_capacity(args.requests);
                for i in 0..args.requests {
                    let (elapsed, outcome) = bench.once(op, i).await;
                    if !expected(config, op, &outcome) {
                        unexpected += 1;
                        if unexpected <= 5 {
                            println!(
                                "    UNEXPECTED {} {}: {outcome:?}",
                                config.name(),
                                op.name()
                            );
                        }
                    }
                    ms.push(elapsed.as_secs_f64() * 1e3);
                }
                ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
                let (p50, p99) = (percentile(&ms, 0.50), percentile(&ms, 0.99));
                line += &format!(" | {} p50 {p50:.2} p99 {p99:.2}", op.name());
                samples.entry((config, op)).or_default().push((p50, p99));
            }
            println!("{line}  (ms; load {})", loadavg());
        }
    }
    configure(&client, &docs, None).await;
    shutdown.cancel();

    println!(
        "\nmedians over {} rounds (ms; spread min–max of the per-round figure):",
        args.rounds
    );
    println!(
        "  {:<22} {:>22} {:>22} {:>22} {:>14} {:>14} {:>14} {:>14}",
        "operation",
        "gate p50 / p99",
        "null p50 / p99",
        "none p50 / p99",
        "gate/null p50",
        "gate/null p99",
        "null/none p50",
        "null/none p99"
    );
    let mut ratio_line = Vec::new();
    let mut worst: f64 = 0.0;
    for op in Op::ALL {
        let get = |c: Config| {
            let s = &samples[&(c, op)];
            (
                median(s.iter().map(|x| x.0).collect()),
                median(s.iter().map(|x| x.1).collect()),
            )
        };
        let (g, n, z) = (get(Config::Gate), get(Config::Null), get(Config::None));
        let (r50, r99) = (g.0 / n.0, g.1 / n.1);
        worst = worst.max(r50).max(r99);
        println!(
            "  {:<22} {:>10.2} / {:>9.2} {:>10.2} / {:>9.2} {:>10.2} / {:>9.2} {:>14.3} {:>14.3} {:>14.3} {:>14.3}",
            op.name(),
            g.0,
            g.1,
            n.0,
            n.1,
            z.0,
            z.1,
            r50,
            r99,
            n.0 / z.0,
            n.1 / z.1
        );
        ratio_line.push(format!("{} {r50:.3}/{r99:.3}", op.name()));
    }
    println!(
        "  answers not as the configuration should give: {unexpected}; gate decisions {}, null reviews {}",
        gate_calls(),
        null_calls.load(Ordering::Relaxed)
    );
    println!("  load average at the end: {}", loadavg());
    println!(
        "\nRATIO gate/null latency p50/p99 (medians of {} rounds of {} one at a time): {} | worst {worst:.3} (target <= 1.05: {})",
        args.rounds,
        args.requests,
        ratio_line.join(", "),
        if worst <= 1.05 { "met" } else { "MISSED" }
    );
    if unexpected > 0 {
        std::process::exit(1);
    }
}
