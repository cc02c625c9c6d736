//! Benchmark 1: the admission overhead against the limit of the stack.
//!
//!     cargo run --release --example bench-admission -- --rounds 5 --seconds 10
//!
//! Two HTTPS servers run in this process on the same stack — `tls::serve`
//! with `tls::server_config` over one `CertReloader` holding a certificate
//! minted by `certs::generate`:
//!
//! - **gate**: the production router (`Gate` + `router`); its kube client
//!   points at a closed port, so any decision that needed an API read would be
//!   refused (and counted in `api_reads`, which must stay 0);
//! - **null**: an axum router whose `/validate` reads the body (same size
//!   limit), takes `request.uid` out of it and answers a fixed
//!   `allowed: true` AdmissionReview, deciding nothing.
//!
//! A keep-alive load generator (tokio-rustls + hyper client, HTTP/2 or
//! HTTP/1.1, trusting only the generated CA) drives them in turn: for each
//! scenario, `--rounds` rounds of (null, gate), each `--warmup` + `--seconds`
//! long, closed loop at `--concurrency` requests in flight. With two or more
//! CPUs the server runtime is pinned to CPU 0 and the client to CPU 1, so the
//! two sides do not fight over a core; each side's CPU time is read from
//! /proc/self/task/<tid>/schedstat.
//!
//! Scenarios are AdmissionReviews as the API server sends them for a tenant's
//! parent HelmRelease (managedFields, a values blob, status): UPDATE at about
//! 2, 20 and 200 KiB per object (the review carries object and oldObject), and
//! DELETE of a parent in custody (about 20 KiB). None needs an API read.
//!
//! Per round it prints rps, p50/p99/p99.9 and server CPU per request; per
//! scenario the medians over rounds, their spread and the ratios gate/null.
//! The last line is the ratio line. No assertion is made on any figure.

#[path = "null_webhook.rs"]
mod null_webhook;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{StatusCode, header};
use bytes::Bytes;
use clap::{Parser, ValueEnum};
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;
use volume_gate::admission::{Gate, router};
use volume_gate::args::{DEFAULT_MAX_BODY_BYTES, DEFAULT_WORKER_IDENTITY};
use volume_gate::certs::{self, ServingSpec};
use volume_gate::metrics::{DecisionLabels, Metrics};
use volume_gate::profile::Profile;
use volume_gate::tls::{self, CertReloader};

/// Nothing listens here (binding it needs root): every API read fails at once.
const UNREACHABLE_API: &str = "http://127.0.0.1:1";
const NAMESPACE: &str = "tenant-acme";
const TENANT: &str = "kubernetes-acme";
/// Distinct uids per scenario; requests cycle through them.
const VARIANTS: usize = 32;

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum Proto {
    /// HTTP/2 (what the API server speaks to webhooks when offered h2).
    H2,
    /// HTTP/1.1, one connection per in-flight request.
    Http1,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum Logs {
    /// As in production (`telemetry::init_json_logs`: JSON, RUST_LOG or
    /// info, written by its writer thread, which runs on the server's CPU and
    /// counts as the server's), to /dev/null instead of stderr.
    Json,
    /// No subscriber: log macros cost next to nothing.
    Off,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum Which {
    Null,
    Gate,
}

#[derive(Parser, Debug)]
#[command(
    name = "bench-admission",
    about = "Admission overhead of the gate against a null webhook on the same stack"
)]
struct Args {
    /// Rounds per scenario; each round runs null then gate.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Measured seconds per server per round.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Unmeasured seconds before each measurement (fresh connections each round).
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Requests in flight (closed loop).
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    #[arg(long, value_enum, default_value_t = Proto::H2)]
    protocol: Proto,
    /// TLS connections: default 1 for h2 (streams multiplexed), one per
    /// in-flight request for http1.
    #[arg(long)]
    connections: Option<usize>,
    /// Comma-separated: update-2k, update-20k, update-200k, delete-20k.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "update-2k,update-20k,update-200k,delete-20k"
    )]
    scenarios: Vec<String>,
    #[arg(long, value_enum, default_value_t = Logs::Json)]
    logs: Logs,
    /// Do not pin the server to CPU 0 and the client to CPU 1.
    #[arg(long)]
    no_pin: bool,
    #[arg(long, default_value_t = 1)]
    server_threads: usize,
    #[arg(long, default_value_t = 1)]
    client_threads: usize,
    /// Drive only one server (for profiling); no ratios then.
    #[arg(long, value_enum)]
    only: Option<Which>,
    /// Seconds per measurement of the in-process cost table (decode
    /// strategies, log line, metrics); 0 skips it.
    #[arg(long, default_value_t = 0.5)]
    cost_seconds: f64,
}

// ---------------------------------------------------------------------------
// Threads: pinning and CPU time
// ---------------------------------------------------------------------------

/// The TID of this process's thread named `name` (`/proc/self/task/*/comm`).
fn thread_named(name: &str) -> Option<i32> {
    std::fs::read_dir("/proc/self/task").ok()?.find_map(|e| {
        let e = e.ok()?;
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        (comm.trim() == name).then(|| e.file_name().to_str()?.parse().ok())?
    })
}

fn pin_to(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity(0, …) affects the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            eprintln!(
                "warning: cannot pin a thread to CPU {cpu}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

fn gettid() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::syscall(libc::SYS_gettid) as i32 }
}

/// The threads of one runtime, to read their CPU time.
#[derive(Clone, Default)]
struct Threads(Arc<Mutex<Vec<i32>>>);

impl Threads {
    /// Per thread: nanoseconds on CPU and nanoseconds runnable but waiting
    /// for a CPU (first two fields of schedstat).
    fn snapshot(&self) -> HashMap<i32, (u64, u64)> {
        let tids = self.0.lock().unwrap().clone();
        tids.into_iter()
            .filter_map(|tid| {
                let text =
                    std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
                let mut f = text.split_whitespace().map(|v| v.parse::<u64>().ok());
                Some((tid, (f.next()??, f.next()??)))
            })
            .collect()
    }

    /// (on-CPU ns, run-queue wait ns) between two snapshots.
    fn delta(before: &HashMap<i32, (u64, u64)>, after: &HashMap<i32, (u64, u64)>) -> (u64, u64) {
        after
            .iter()
            .filter_map(|(tid, (r, w))| {
                before
                    .get(tid)
                    .map(|(r0, w0)| (r.saturating_sub(*r0), w.saturating_sub(*w0)))
            })
            .fold((0, 0), |(a, b), (r, w)| (a + r, b + w))
    }
}

fn runtime(
    name: &'static str,
    threads: usize,
    cpu: Option<usize>,
    tids: Threads,
) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .on_thread_start(move || {
            if let Some(c) = cpu {
                pin_to(c);
            }
            tids.0.lock().unwrap().push(gettid());
        })
        .build()
        .expect("tokio runtime")
}

// ---------------------------------------------------------------------------
// The two servers
// ---------------------------------------------------------------------------

struct Server {
    name: &'static str,
    addr: SocketAddr,
    /// The gate's metrics; `None` for the null webhook.
    metrics: Option<Arc<Metrics>>,
}

async fn start_gate(reloader: Arc<CertReloader>, shutdown: CancellationToken) -> Server {
    assert!(
        TcpStream::connect("127.0.0.1:1").await.is_err(),
        "something listens on 127.0.0.1:1; the benchmark needs an unreachable API server"
    );
    let client = kube::Client::try_from(kube::Config::new(UNREACHABLE_API.parse().unwrap()))
        .expect("kube client");
    let metrics = Metrics::new();
    let gate = Arc::new(Gate::new(
        Profile::cozystack(),
        DEFAULT_WORKER_IDENTITY.to_string(),
        client,
        metrics.clone(),
    ));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(tls::serve(
        listener,
        tls::server_config(reloader),
        router(gate, DEFAULT_MAX_BODY_BYTES),
        shutdown,
    ));
    Server {
        name: "gate",
        addr,
        metrics: Some(metrics),
    }
}

async fn start_null(reloader: Arc<CertReloader>, shutdown: CancellationToken) -> Server {
    let app = null_webhook::router(Default::default());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(tls::serve(
        listener,
        tls::server_config(reloader),
        app,
        shutdown,
    ));
    Server {
        name: "null",
        addr,
        metrics: None,
    }
}

impl Server {
    /// (sum of seconds, count) of the gate's own decision histogram.
    fn handler_stats(&self) -> Option<(f64, u64)> {
        let text = self.metrics.as_ref()?.encode();
        let find = |prefix: &str| {
            text.lines()
                .find(|l| l.starts_with(prefix))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse::<f64>().ok())
        };
        let sum = find("volume_gate_admission_duration_seconds_sum{endpoint=\"validate\"}")
            .unwrap_or(0.0);
        let count = find("volume_gate_admission_duration_seconds_count{endpoint=\"validate\"}")
            .unwrap_or(0.0);
        Some((sum, count as u64))
    }
}

// ---------------------------------------------------------------------------
// AdmissionReview bodies
// ---------------------------------------------------------------------------

/// The `fieldsV1` a field manager owns for `v`: every map key, lists atomic.
fn fields_of(v: &Value) -> Value {
    match v {
        Value::Object(m) => {
            let mut out = Map::new();
            out.insert(".".into(), json!({}));
            for (k, x) in m {
                out.insert(format!("f:{k}"), fields_of(x));
            }
            Value::Object(out)
        }
        _ => json!({}),
    }
}

fn alert_rule(i: usize) -> Value {
    json!({
        "alert": format!("TenantVolumeFillingUp{i}"),
        "expr": format!(
            "kubelet_volume_stats_available_bytes{{namespace=\"apps\",persistentvolumeclaim=\"data-{i}\"}} / \
             kubelet_volume_stats_capacity_bytes{{namespace=\"apps\",persistentvolumeclaim=\"data-{i}\"}} < 0.{:02}",
            10 + i % 20
        ),
        "for": "15m",
        "labels": {"severity": if i.is_multiple_of(3) { "critical" } else { "warning" }, "team": "platform"},
        "annotations": {
            "summary": format!("Volume data-{i} is filling up"),
            "description": "Only {{ $value | humanizePercentage }} is free on the volume; see https://runbooks.example.org/volume-filling-up",
        },
    })
}

/// Cozystack's Kubernetes application values, with `rules` alert rules in a
/// monitoring override (the knob that sizes the object).
fn values(rules: usize, version: &str) -> Value {
    let mut v = json!({
        "host": "",
        "storageClass": "replicated",
        "version": version,
        "controlPlane": {"replicas": 2, "apiServer": {"resourcesPreset": "medium"}},
        "nodeGroups": {"md0": {"minReplicas": 0, "maxReplicas": 10, "instanceType": "u1.medium", "ephemeralStorage": "20Gi", "roles": ["ingress-nginx"]}},
        "addons": {"certManager": {"enabled": false}, "ingressNginx": {"enabled": true, "exposeMethod": "Proxied"}},
    });
    if rules > 0 {
        v["addons"]["monitoringAgents"] = json!({
            "enabled": true,
            "valuesOverride": {"alerts": {"groups": [{"name": "tenant-volumes", "rules": (0..rules).map(alert_rule).collect::<Vec<_>>()}]}},
        });
    }
    v
}

/// The tenant's parent HelmRelease as stored, at about the size `rules` gives.
fn parent_release(rules: usize, generation: u64, version: &str) -> Value {
    let values = values(rules, version);
    let labels = json!({
        "apps.cozystack.io/application.group": "apps.cozystack.io",
        "apps.cozystack.io/application.kind": "Kubernetes",
        "apps.cozystack.io/application.name": "acme",
        "sharding.fluxcd.io/key": "shard2",
    });
    let spec = json!({
        "chart": {"spec": {"chart": "kubernetes", "reconcileStrategy": "Revision", "sourceRef": {"kind": "HelmRepository", "name": "cozystack-apps", "namespace": "cozy-public"}, "version": ">= 0.0.0-0"}},
        "interval": "5m",
        "values": values,
    });
    json!({
        "apiVersion": "helm.toolkit.fluxcd.io/v2",
        "kind": "HelmRelease",
        "metadata": {
            "name": TENANT,
            "namespace": NAMESPACE,
            "uid": "3f0b7a52-9d8e-4c1e-a0c9-5b2f6e1d7c44",
            "resourceVersion": "48211973",
            "generation": generation,
            "creationTimestamp": "2025-06-02T09:14:27Z",
            "labels": labels,
            "finalizers": ["finalizers.fluxcd.io", Profile::cozystack().custody_finalizer],
            "managedFields": [
                {
                    "manager": "cozystack-api", "operation": "Update", "apiVersion": "helm.toolkit.fluxcd.io/v2",
                    "time": "2025-06-10T16:02:51Z", "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:metadata": {"f:labels": fields_of(&labels)}, "f:spec": fields_of(&spec)},
                },
                {
                    "manager": "helm-controller", "operation": "Update", "apiVersion": "helm.toolkit.fluxcd.io/v2",
                    "time": "2025-06-10T16:03:40Z", "fieldsType": "FieldsV1", "subresource": "status",
                    "fieldsV1": {"f:status": {"f:conditions": {}, "f:history": {}, "f:observedGeneration": {}}},
                },
            ],
        },
        "spec": spec,
        "status": {
            "conditions": [{"type": "Ready", "status": "True", "reason": "UpgradeSucceeded", "observedGeneration": generation, "lastTransitionTime": "2025-06-10T16:03:40Z", "message": "Helm upgrade succeeded for release tenant-acme/kubernetes-acme.v7 with chart kubernetes@0.24.1"}],
            "history": [{"chartName": "kubernetes", "chartVersion": "0.24.1", "digest": "sha256:2c4d0e6a8f8b3a1e", "status": "deployed", "version": 7}],
            "observedGeneration": generation,
        },
    })
}

/// The smallest `rules` whose object is at least `target` bytes.
fn rules_for(target: usize) -> usize {
    let size = |r| {
        serde_json::to_vec(&parent_release(r, 3, "v1.32"))
            .unwrap()
            .len()
    };
    if size(0) >= target {
        return 0;
    }
    let per_rule = (size(10) - size(0)) / 10;
    let mut r = (target - size(0)) / per_rule.max(1);
    while size(r) < target {
        r += 1;
    }
    r
}

fn request(
    uid: &str,
    operation: &str,
    user: &str,
    object: Option<Value>,
    old_object: Option<Value>,
    options_kind: &str,
) -> Value {
    let gvk = json!({"group": "helm.toolkit.fluxcd.io", "version": "v2", "kind": "HelmRelease"});
    let gvr =
        json!({"group": "helm.toolkit.fluxcd.io", "version": "v2", "resource": "helmreleases"});
    let mut r = json!({
        "uid": uid,
        "kind": gvk, "resource": gvr, "requestKind": gvk, "requestResource": gvr,
        "name": TENANT, "namespace": NAMESPACE, "operation": operation,
        "userInfo": {"username": user, "uid": "8a1f5a0e-5f7e-4c6a-9d6b-1f1c2b3d4e5f", "groups": ["system:serviceaccounts", "system:serviceaccounts:cozy-system", "system:authenticated"]},
        "dryRun": false,
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": options_kind},
    });
    if let Some(o) = object {
        r["object"] = o;
    }
    if let Some(o) = old_object {
        r["oldObject"] = o;
    }
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": r})
}

struct Scenario {
    name: String,
    object_bytes: usize,
    review_bytes: usize,
    /// (body, uid) pairs.
    bodies: Arc<Vec<(Bytes, String)>>,
    /// The decision the gate must count for each request.
    expect: DecisionLabels,
}

fn scenario(name: &str, index: usize) -> Scenario {
    let user = "system:serviceaccount:cozy-system:cozystack-api";
    let (review, object_bytes, expect) = match name {
        "update-2k" | "update-20k" | "update-200k" => {
            let target = match name {
                "update-2k" => 2 * 1024,
                "update-20k" => 20 * 1024,
                _ => 200 * 1024,
            };
            let rules = rules_for(target);
            let old = parent_release(rules, 3, "v1.31");
            let new = parent_release(rules, 4, "v1.32");
            let size = serde_json::to_vec(&new).unwrap().len();
            let labels = DecisionLabels {
                target: "parent".into(),
                operation: "UPDATE".into(),
                verdict: "allowed".into(),
                reason: "guards-passed".into(),
            };
            (
                request("", "UPDATE", user, Some(new), Some(old), "UpdateOptions"),
                size,
                labels,
            )
        }
        "delete-20k" => {
            let old = parent_release(rules_for(20 * 1024), 4, "v1.32");
            let size = serde_json::to_vec(&old).unwrap().len();
            let labels = DecisionLabels {
                target: "parent".into(),
                operation: "DELETE".into(),
                verdict: "allowed".into(),
                reason: "in-custody".into(),
            };
            (
                request("", "DELETE", user, None, Some(old), "DeleteOptions"),
                size,
                labels,
            )
        }
        other => {
            panic!("unknown scenario {other:?}: use update-2k, update-20k, update-200k, delete-20k")
        }
    };
    let bodies: Vec<(Bytes, String)> = (0..VARIANTS)
        .map(|i| {
            let uid = format!("b3nc4000-{index:04x}-4a00-8000-{i:012x}");
            let mut r = review.clone();
            r["request"]["uid"] = json!(uid);
            (Bytes::from(serde_json::to_vec(&r).unwrap()), uid)
        })
        .collect();
    let review_bytes = bodies[0].0.len();
    Scenario {
        name: name.to_string(),
        object_bytes,
        review_bytes,
        bodies: Arc::new(bodies),
        expect,
    }
}

// ---------------------------------------------------------------------------
// The load generator
// ---------------------------------------------------------------------------

fn connector(ca_pem: &str, proto: Proto) -> TlsConnector {
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap())
        .unwrap();
    let mut config =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    config.alpn_protocols = vec![match proto {
        Proto::H2 => b"h2".to_vec(),
        Proto::Http1 => b"http/1.1".to_vec(),
    }];
    TlsConnector::from(Arc::new(config))
}

enum Sender {
    H1(http1::SendRequest<Full<Bytes>>),
    H2(http2::SendRequest<Full<Bytes>>),
}

async fn connect(addr: SocketAddr, connector: &TlsConnector, proto: Proto) -> Sender {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    // As Go's net.Dial (the API server's client) does.
    tcp.set_nodelay(true).unwrap();
    let tls = connector
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .expect("TLS handshake against the generated CA");
    let io = TokioIo::new(tls);
    match proto {
        Proto::H2 => {
            let (sender, conn) = http2::handshake(TokioExecutor::new(), io)
                .await
                .expect("h2 handshake");
            tokio::spawn(conn);
            Sender::H2(sender)
        }
        Proto::Http1 => {
            let (sender, conn) = http1::handshake(io).await.expect("http1 handshake");
            tokio::spawn(conn);
            Sender::H1(sender)
        }
    }
}

impl Sender {
    async fn post(&mut self, body: Bytes) -> Result<(StatusCode, Bytes), String> {
        let builder = Request::builder()
            .method(Method::POST)
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ACCEPT, "application/json, */*")
            .header(header::CONTENT_LENGTH, body.len());
        // The API server calls webhooks with ?timeout=<timeoutSeconds>s.
        let builder = match self {
            Sender::H1(_) => builder
                .uri("/validate?timeout=10s")
                .header(header::HOST, "127.0.0.1"),
            Sender::H2(_) => builder.uri("https://127.0.0.1/validate?timeout=10s"),
        };
        let request = builder.body(Full::new(body)).unwrap();
        let response = match self {
            Sender::H1(s) => {
                s.ready().await.map_err(|e| e.to_string())?;
                s.send_request(request).await
            }
            Sender::H2(s) => {
                s.ready().await.map_err(|e| e.to_string())?;
                s.send_request(request).await
            }
        }
        .map_err(|e| e.to_string())?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, body))
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[derive(Default)]
struct WorkerOut {
    /// Latencies (ns) of requests started inside the measured window.
    latencies: Vec<u64>,
    /// Every answered request, warm-up included.
    answered: u64,
    errors: u64,
    first_error: Option<String>,
}

async fn worker(
    mut sender: Sender,
    bodies: Arc<Vec<(Bytes, String)>>,
    seed: usize,
    measure_from: Instant,
    until: Instant,
) -> WorkerOut {
    let mut out = WorkerOut {
        latencies: Vec::with_capacity(1 << 16),
        ..Default::default()
    };
    let mut i = seed;
    loop {
        let started = Instant::now();
        if started >= until {
            break;
        }
        let (body, uid) = &bodies[i % bodies.len()];
        i += 1;
        let result = sender.post(body.clone()).await;
        let took = started.elapsed().as_nanos() as u64;
        let problem = match result {
            Ok((StatusCode::OK, answer))
                if contains(&answer, b"\"allowed\":true") && contains(&answer, uid.as_bytes()) =>
            {
                None
            }
            Ok((status, answer)) => Some(format!(
                "HTTP {status}: {}",
                String::from_utf8_lossy(&answer[..answer.len().min(300)])
            )),
            Err(e) => Some(e),
        };
        match problem {
            None => {
                out.answered += 1;
                if started >= measure_from {
                    out.latencies.push(took);
                }
            }
            Some(p) => {
                out.errors += 1;
                out.first_error.get_or_insert(p);
                // A broken connection would only spin; stop this worker.
                break;
            }
        }
    }
    out
}

struct RoundResult {
    rps: f64,
    p50: f64,
    p99: f64,
    p999: f64,
    /// Server CPU microseconds per answered request in the window.
    server_us_per_req: f64,
    server_cpu: f64,
    /// Share of the window the server's threads were runnable but waiting
    /// for a CPU (taken by other processes).
    server_wait: f64,
    client_cpu: f64,
    errors: u64,
    first_error: Option<String>,
    answered: u64,
    /// The gate's own mean decision time (its histogram), microseconds.
    handler_us: Option<f64>,
}

/// Milliseconds at quantile `q` of sorted nanoseconds.
fn quantile_ms(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1e6
}

struct Ctx {
    args: Args,
    connector: TlsConnector,
    server_threads: Threads,
    client_threads: Threads,
}

async fn round(ctx: &Ctx, server: &Server, scenario: &Scenario) -> RoundResult {
    let args = &ctx.args;
    let connections = args.connections.unwrap_or(match args.protocol {
        Proto::H2 => 1,
        Proto::Http1 => args.concurrency,
    });
    if args.protocol == Proto::Http1 && connections < args.concurrency {
        panic!(
            "HTTP/1.1 needs one connection per in-flight request (--connections >= --concurrency)"
        );
    }
    let mut conns = Vec::new();
    for _ in 0..connections.max(1) {
        conns.push(Some(
            connect(server.addr, &ctx.connector, args.protocol).await,
        ));
    }
    let handler_before = server.handler_stats();
    let start = Instant::now();
    let measure_from = start + Duration::from_secs_f64(args.warmup);
    let until = measure_from + Duration::from_secs_f64(args.seconds);
    let mut workers = Vec::new();
    for w in 0..args.concurrency {
        let sender = match args.protocol {
            Proto::H2 => match conns[w % conns.len()].as_ref() {
                Some(Sender::H2(s)) => Sender::H2(s.clone()),
                _ => unreachable!("h2 connections are shared"),
            },
            Proto::Http1 => conns[w].take().expect("one HTTP/1.1 connection per worker"),
        };
        workers.push(tokio::spawn(worker(
            sender,
            scenario.bodies.clone(),
            w * 7,
            measure_from,
            until,
        )));
    }
    tokio::time::sleep_until(measure_from.into()).await;
    let (s0, c0) = (ctx.server_threads.snapshot(), ctx.client_threads.snapshot());
    tokio::time::sleep_until(until.into()).await;
    let (s1, c1) = (ctx.server_threads.snapshot(), ctx.client_threads.snapshot());
    let window = (Instant::now() - measure_from).as_secs_f64();
    let mut latencies = Vec::new();
    let (mut errors, mut answered, mut first_error) = (0, 0, None);
    for w in workers {
        let out = w.await.expect("worker");
        latencies.extend(out.latencies);
        errors += out.errors;
        answered += out.answered;
        if first_error.is_none() {
            first_error = out.first_error;
        }
    }
    drop(conns);
    latencies.sort_unstable();
    let (server_ns, server_wait_ns) = Threads::delta(&s0, &s1);
    let (client_ns, _) = Threads::delta(&c0, &c1);
    let n = latencies.len().max(1) as f64;
    let handler_us = match (handler_before, server.handler_stats()) {
        (Some((s0, n0)), Some((s1, n1))) if n1 > n0 => Some((s1 - s0) / (n1 - n0) as f64 * 1e6),
        _ => None,
    };
    RoundResult {
        rps: latencies.len() as f64 / args.seconds,
        p50: quantile_ms(&latencies, 0.50),
        p99: quantile_ms(&latencies, 0.99),
        p999: quantile_ms(&latencies, 0.999),
        server_us_per_req: server_ns as f64 / 1e3 / n,
        server_cpu: server_ns as f64 / 1e9 / window,
        server_wait: server_wait_ns as f64 / 1e9 / window,
        client_cpu: client_ns as f64 / 1e9 / window,
        errors,
        first_error,
        answered,
        handler_us,
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn spread(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
            (lo.min(*x), hi.max(*x))
        })
}

struct Summary {
    rps: f64,
    p50: f64,
    p99: f64,
    p999: f64,
    us_per_req: f64,
}

fn summarize(name: &str, rounds: &[RoundResult]) -> Summary {
    let col = |f: fn(&RoundResult) -> f64| rounds.iter().map(f).collect::<Vec<_>>();
    let s = Summary {
        rps: median(col(|r| r.rps)),
        p50: median(col(|r| r.p50)),
        p99: median(col(|r| r.p99)),
        p999: median(col(|r| r.p999)),
        us_per_req: median(col(|r| r.server_us_per_req)),
    };
    let (rl, rh) = spread(&col(|r| r.rps));
    let (pl, ph) = spread(&col(|r| r.p99));
    let (ul, uh) = spread(&col(|r| r.server_us_per_req));
    println!(
        "  median {name:<4}  {:>9.0} rps  p50 {:>7.3}  p99 {:>7.3}  p99.9 {:>7.3} ms  server {:>6.1} µs/req   (spread: rps {rl:.0}–{rh:.0}, p99 {pl:.3}–{ph:.3} ms, µs/req {ul:.1}–{uh:.1})",
        s.rps, s.p50, s.p99, s.p999, s.us_per_req
    );
    s
}

// ---------------------------------------------------------------------------
// Where the gate's time goes: in-process costs, one thread
// ---------------------------------------------------------------------------

/// What a decision reads of a review: the request's fields and the metadata
/// of object and oldObject. Every other field (spec, status, managedFields)
/// is skimmed by serde without being built.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct SlimReview<O> {
    api_version: String,
    kind: String,
    request: SlimRequest<O>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct SlimRequest<O> {
    uid: String,
    kind: SlimGvk,
    name: String,
    namespace: Option<String>,
    operation: String,
    user_info: SlimUser,
    #[serde(default)]
    dry_run: bool,
    object: Option<O>,
    old_object: Option<O>,
}

#[derive(Deserialize)]
#[allow(dead_code)]
struct SlimGvk {
    group: String,
    version: String,
    kind: String,
}

#[derive(Deserialize)]
#[allow(dead_code)]
struct SlimUser {
    username: Option<String>,
    uid: Option<String>,
    #[serde(default)]
    groups: Vec<String>,
    #[serde(default)]
    extra: std::collections::BTreeMap<String, Vec<String>>,
}

#[derive(Deserialize)]
#[allow(dead_code)]
struct SlimObject {
    metadata: SlimMeta,
}

/// An object as k8s-openapi's full `ObjectMeta` (managedFields included)
/// and nothing else: no `#[serde(flatten)]`, so serde needs no buffer.
#[derive(Deserialize)]
#[allow(dead_code)]
struct MetaObject {
    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct SlimMeta {
    name: Option<String>,
    namespace: Option<String>,
    #[serde(default)]
    labels: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    annotations: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    finalizers: Vec<String>,
    deletion_timestamp: Option<String>,
}

/// This thread's CPU time in seconds (not wall time: other processes
/// taking the CPU do not count).
fn thread_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec to write to.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// Mean CPU microseconds per call of `f` over the bodies, for about
/// `seconds` of CPU (the result is dropped inside the timing, as the gate
/// drops it).
fn per_call_us(seconds: f64, bodies: &[(Bytes, String)], f: impl Fn(&[u8]) -> bool) -> f64 {
    let started = thread_cpu();
    let mut calls = 0u64;
    while thread_cpu() - started < seconds {
        for (body, _) in bodies {
            assert!(f(body), "a strategy failed to decode a benchmark body");
            calls += 1;
        }
    }
    (thread_cpu() - started) * 1e6 / calls as f64
}

/// The product's log format (`volume_gate::telemetry`) writing to `w`.
fn json_subscriber<W>(w: W) -> impl tracing::Subscriber + Send + Sync
where
    W: for<'a> tracing_subscriber::fmt::MakeWriter<'a> + Send + Sync + 'static,
{
    tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_current_span(false)
        .with_target(false)
        .with_writer(w)
        .finish()
}

/// This thread's mean CPU µs per decision log line, over `n` lines.
fn log_line_us(n: u64) -> f64 {
    let started = thread_cpu();
    for i in 0..n {
        tracing::info!(
            endpoint = "validate",
            uid = %format_args!("b3nc4000-0000-4a00-8000-{i:012x}"),
            operation = "UPDATE",
            kind = %"helm.toolkit.fluxcd.io/HelmRelease",
            namespace = NAMESPACE,
            name = %TENANT,
            user = "system:serviceaccount:cozy-system:cozystack-api",
            dry_run = false,
            target = "parent",
            verdict = "allowed",
            reason = "guards-passed",
            patched = false,
            refusal = "",
            micros = 12u64,
            "admission decision"
        );
    }
    (thread_cpu() - started) * 1e6 / n as f64
}

/// The gate's handler in-process, on one thread, against the null's: the
/// whole router (axum, no TLS or HTTP framing) and its parts, mean CPU µs
/// per review. What the gate adds per request, item by item.
fn handler_table(seconds: f64, scenarios: &[Scenario]) {
    use futures::FutureExt;
    use tower::ServiceExt;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (gate, gate_router) = rt.block_on(async {
        let client = kube::Client::try_from(kube::Config::new(UNREACHABLE_API.parse().unwrap()))
            .expect("kube client");
        let gate = Arc::new(Gate::new(
            Profile::cozystack(),
            DEFAULT_WORKER_IDENTITY.to_string(),
            client,
            Metrics::new(),
        ));
        (gate.clone(), router(gate, DEFAULT_MAX_BODY_BYTES))
    });
    let null_router = null_webhook::router(Default::default());
    // The body is copied for both routers alike (the copy is in both columns).
    let through = |app: &axum::Router, body: &[u8]| -> bool {
        let request = http::Request::post("/validate")
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(axum::body::Body::from(Bytes::copy_from_slice(body)))
            .unwrap();
        rt.block_on(async {
            let response = app.clone().oneshot(request).await.expect("infallible");
            let ok = response.status() == http::StatusCode::OK;
            ok && response.into_body().collect().await.is_ok()
        })
    };
    println!(
        "\nthe handler in-process (one thread, mean CPU µs per review; axum router, no TLS or HTTP framing):"
    );
    println!(
        "  {:<12} {:>11} {:>11} {:>9} | {:>13} {:>9} {:>9}",
        "scenario", "null router", "gate router", "gate−null", "decode−skim", "decision", "respond"
    );
    for sc in scenarios {
        let null = per_call_us(seconds, &sc.bodies, |b| through(&null_router, b));
        let full = per_call_us(seconds, &sc.bodies, |b| through(&gate_router, b));
        let skim = per_call_us(seconds, &sc.bodies, |b| {
            serde_json::from_slice::<null_webhook::UidOnly>(b).is_ok()
        });
        let decode = per_call_us(seconds, &sc.bodies, |b| {
            volume_gate::admission::review::decode(b).is_ok()
        });
        let requests: Vec<_> = sc
            .bodies
            .iter()
            .map(|(b, _)| volume_gate::admission::review::decode(b).unwrap())
            .collect();
        // The decisions of these scenarios make no read: they finish at once.
        let decision = {
            let started = thread_cpu();
            let mut calls = 0u64;
            while thread_cpu() - started < seconds {
                for req in &requests {
                    let done = gate.validate(req).now_or_never().is_some();
                    assert!(done, "a decision of this scenario waited");
                    calls += 1;
                }
            }
            (thread_cpu() - started) * 1e6 / calls as f64
        };
        let verdict = volume_gate::admission::decide::Verdict::allow("guards-passed");
        let respond = per_call_us(seconds, &sc.bodies, |_| {
            !volume_gate::admission::review::respond(
                "b3nc4000-0000-4a00-8000-000000000000",
                &verdict,
                None,
            )
            .is_empty()
        });
        println!(
            "  {:<12} {null:>11.1} {full:>11.1} {:>9.1} | {:>13.1} {decision:>9.1} {respond:>9.1}",
            sc.name,
            full - null,
            decode - skim
        );
    }
    println!(
        "  gate−null: what the gate's handler adds in-process (the log line and metrics are in it, with this run's subscriber); decode−skim: its decode"
    );
    println!(
        "  beyond the null's uid skim; decision: Gate::validate on the decoded review; respond: its answer serialized."
    );
}

fn cost_table(seconds: f64, scenarios: &[Scenario], logs: Logs) {
    use kube::core::DynamicObject;
    use kube::core::admission::AdmissionReview;
    println!(
        "\nin-process cost per review on one thread (mean CPU µs per call, result dropped inside the timing):"
    );
    println!(
        "  {:<12} {:>10} {:>15} {:>17} {:>18} {:>11} {:>14}",
        "scenario",
        "null skim",
        "review::decode",
        "typed from_slice",
        "PartialObjectMeta",
        "ObjectMeta",
        "metadata only"
    );
    for sc in scenarios {
        let skim = per_call_us(seconds, &sc.bodies, |b| {
            serde_json::from_slice::<null_webhook::UidOnly>(b).is_ok()
        });
        let product = per_call_us(seconds, &sc.bodies, |b| {
            volume_gate::admission::review::decode(b).is_ok()
        });
        let typed = per_call_us(seconds, &sc.bodies, |b| {
            serde_json::from_slice::<AdmissionReview<DynamicObject>>(b).is_ok()
        });
        let partial = per_call_us(seconds, &sc.bodies, |b| {
            serde_json::from_slice::<AdmissionReview<kube::core::PartialObjectMeta<DynamicObject>>>(
                b,
            )
            .is_ok()
        });
        let meta = per_call_us(seconds, &sc.bodies, |b| {
            serde_json::from_slice::<SlimReview<MetaObject>>(b).is_ok()
        });
        let slim = per_call_us(seconds, &sc.bodies, |b| {
            serde_json::from_slice::<SlimReview<SlimObject>>(b).is_ok()
        });
        println!(
            "  {:<12} {skim:>10.1} {product:>15.1} {typed:>17.1} {partial:>18.1} {meta:>11.1} {slim:>14.1}",
            sc.name
        );
    }
    handler_table(seconds, scenarios);
    // The log line of every decision, with the fields the gate writes: as
    // this run's subscriber writes it, and as the product's writes it in a
    // container (stderr is a pipe) with a blocking and a non-blocking writer.
    let log_us = log_line_us(20_000);
    let (pipe_blocking_us, pipe_nonblocking_us) = {
        let (reader, writer) = std::io::pipe().expect("pipe");
        let drain = std::thread::spawn(move || {
            use std::io::Read;
            let mut reader = reader;
            let mut buf = vec![0u8; 1 << 16];
            while reader.read(&mut buf).is_ok_and(|n| n > 0) {}
        });
        let writer = Arc::new(writer);
        let blocking = tracing::subscriber::with_default(json_subscriber(writer.clone()), || {
            log_line_us(20_000)
        });
        let (non_blocking, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
            .lossy(false)
            .finish(writer.try_clone().expect("dup pipe"));
        let nb = tracing::subscriber::with_default(json_subscriber(non_blocking), || {
            log_line_us(20_000)
        });
        drop(guard); // flushes, then the writer thread ends
        drop(writer);
        drain.join().unwrap();
        (blocking, nb)
    };
    // The metrics of every decision: a labelled counter and a histogram.
    let metrics_us = {
        let m = Metrics::new();
        let n = 200_000u64;
        let started = thread_cpu();
        for _ in 0..n {
            m.decisions
                .get_or_create(&DecisionLabels {
                    target: "parent".into(),
                    operation: "UPDATE".into(),
                    verdict: "allowed".into(),
                    reason: "guards-passed".into(),
                })
                .inc();
            m.decision_seconds
                .get_or_create(&volume_gate::metrics::EndpointLabels {
                    endpoint: "validate".into(),
                })
                .observe(0.0001);
        }
        (thread_cpu() - started) * 1e6 / n as f64
    };
    println!(
        "  one decision's log line ({logs:?} logs): {log_us:.1} µs; its metrics (counter + histogram): {metrics_us:.2} µs"
    );
    println!(
        "  the log line into a pipe (stderr in a container), request thread's CPU: blocking writer {pipe_blocking_us:.1} µs, non-blocking writer (the product's) {pipe_nonblocking_us:.1} µs"
    );
    println!(
        "  null skim: the null webhook's uid parse. review::decode: the gate's. typed from_slice: AdmissionReview<DynamicObject>."
    );
    println!(
        "  PartialObjectMeta: AdmissionReview<PartialObjectMeta<DynamicObject>> (kube's; flattens TypeMeta). ObjectMeta: request fields +"
    );
    println!(
        "  objects as {{metadata: ObjectMeta}}, no flatten. metadata only: request fields + name, namespace, labels, annotations,"
    );
    println!(
        "  finalizers, deletionTimestamp of object and oldObject; serde skims (and validates) everything else in all of them."
    );
}

fn main() {
    let args = Args::parse();
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let pin = !args.no_pin && cpus >= 2;
    let (server_cpu, client_cpu) = if pin {
        (Some(0), Some(1))
    } else {
        (None, None)
    };
    if let Some(c) = client_cpu {
        pin_to(c);
    }
    // The product's logging (`telemetry::init_json_logs`: JSON, RUST_LOG or
    // info, a non-blocking writer thread), to /dev/null instead of stderr.
    let _logs = (args.logs == Logs::Json).then(|| {
        volume_gate::telemetry::init_json_logs_to(
            std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/null")
                .expect("/dev/null"),
        )
    });

    let server_threads = Threads::default();
    let client_threads = Threads::default();
    // The log writer thread is the server's: its CPU and its time count.
    if let Some(tid) = thread_named("volume-gate-log") {
        if let Some(c) = server_cpu {
            // SAFETY: plain data; sched_setaffinity on a thread of this process.
            unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(c, &mut set);
                libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set);
            }
        }
        server_threads.0.lock().unwrap().push(tid);
    }
    let server_rt = runtime(
        "bench-server",
        args.server_threads,
        server_cpu,
        server_threads.clone(),
    );
    let client_rt = runtime(
        "bench-client",
        args.client_threads,
        client_cpu,
        client_threads.clone(),
    );

    let dir = tempfile::tempdir().unwrap();
    let mut spec = ServingSpec::new("volume-gate-webhook", "volume-gate");
    spec.extra_sans = vec!["127.0.0.1".into()];
    let bundle = certs::generate(&spec, None).expect("certs::generate");
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert, &bundle.tls_cert).unwrap();
    std::fs::write(&key, &bundle.tls_key).unwrap();
    let reloader = CertReloader::load(&cert, &key).expect("load the generated pair");

    let shutdown = CancellationToken::new();
    let (null, gate) = server_rt.block_on(async {
        let null = start_null(reloader.clone(), shutdown.clone()).await;
        let gate = start_gate(reloader.clone(), shutdown.clone()).await;
        (null, gate)
    });
    let servers: Vec<&Server> = match args.only {
        None => vec![&null, &gate],
        Some(Which::Null) => vec![&null],
        Some(Which::Gate) => vec![&gate],
    };

    let scenarios: Vec<Scenario> = args
        .scenarios
        .iter()
        .enumerate()
        .map(|(i, s)| scenario(s.trim(), i))
        .collect();

    println!(
        "bench-admission: volume-gate admission overhead vs a null webhook on the same TLS/HTTP stack"
    );
    println!(
        "  {} CPUs; server runtime {} thread(s){}, client runtime {} thread(s){}; logs {:?}",
        cpus,
        args.server_threads,
        server_cpu
            .map(|c| format!(" pinned to CPU {c}"))
            .unwrap_or_default(),
        args.client_threads,
        client_cpu
            .map(|c| format!(" pinned to CPU {c}"))
            .unwrap_or_default(),
        args.logs
    );
    println!(
        "  {:?}, {} in flight over {} connection(s); {} round(s) × ({:.1}s warm-up + {:.1}s measured) per server per scenario",
        args.protocol,
        args.concurrency,
        args.connections.unwrap_or(if args.protocol == Proto::H2 {
            1
        } else {
            args.concurrency
        }),
        args.rounds,
        args.warmup,
        args.seconds
    );
    println!(
        "  CPU time from /proc/self/task/*/schedstat (srv CPU = on a CPU, srv wait = runnable but waiting for one); latency = request written to answer read, in the client; handler µs = the gate's own mean (its duration histogram, body read included)"
    );
    println!(
        "  load average at the start: {} (other processes on these CPUs inflate latency, not CPU per request)",
        loadavg()
    );

    if args.cost_seconds > 0.0 {
        cost_table(args.cost_seconds, &scenarios, args.logs);
    }

    let ctx = Ctx {
        connector: connector(&bundle.ca.cert, args.protocol),
        args,
        server_threads,
        client_threads,
    };
    let mut ratios: Vec<(String, f64, f64, f64)> = Vec::new();
    let mut gate_answered = vec![0u64; scenarios.len()];
    let mut total_errors = 0;

    client_rt.block_on(async {
        for (si, sc) in scenarios.iter().enumerate().filter(|_| ctx.args.rounds > 0) {
            println!(
                "\nscenario {}: {} object {:.1} KiB, AdmissionReview {:.1} KiB on the wire; gate decides target={} {} {} ({})",
                sc.name,
                if sc.expect.operation == "UPDATE" { "HelmRelease UPDATE, parent," } else { "HelmRelease DELETE, parent in custody," },
                sc.object_bytes as f64 / 1024.0,
                sc.review_bytes as f64 / 1024.0,
                sc.expect.target,
                sc.expect.operation,
                sc.expect.verdict,
                sc.expect.reason
            );
            println!(
                "  {:>5} {:<6} {:>9} {:>8} {:>8} {:>9} {:>10} {:>8} {:>9} {:>8} {:>10} {:>6}",
                "round", "server", "rps", "p50 ms", "p99 ms", "p99.9 ms", "srv µs/req", "srv CPU", "srv wait", "cli CPU", "handler µs", "errors"
            );
            let mut results: Vec<Vec<RoundResult>> = servers.iter().map(|_| Vec::new()).collect();
            for r in 0..ctx.args.rounds {
                for (k, server) in servers.iter().enumerate() {
                    let res = round(&ctx, server, sc).await;
                    println!(
                        "  {:>5} {:<6} {:>9.0} {:>8.3} {:>8.3} {:>9.3} {:>10.1} {:>7.0}% {:>8.0}% {:>7.0}% {:>10} {:>6}",
                        r + 1,
                        server.name,
                        res.rps,
                        res.p50,
                        res.p99,
                        res.p999,
                        res.server_us_per_req,
                        res.server_cpu * 100.0,
                        res.server_wait * 100.0,
                        res.client_cpu * 100.0,
                        res.handler_us.map(|h| format!("{h:.1}")).unwrap_or_else(|| "-".into()),
                        res.errors
                    );
                    if let Some(e) = &res.first_error {
                        println!("        first error: {e}");
                    }
                    total_errors += res.errors;
                    if server.name == "gate" {
                        gate_answered[si] += res.answered;
                    }
                    results[k].push(res);
                }
            }
            let summaries: Vec<Summary> = servers.iter().zip(&results).map(|(s, r)| summarize(s.name, r)).collect();
            if servers.len() == 2 {
                let (n, g) = (&summaries[0], &summaries[1]);
                let paired: Vec<f64> = results[1].iter().zip(&results[0]).map(|(g, n)| g.rps / n.rps).collect();
                let (pl, ph) = spread(&paired);
                let t = g.rps / n.rps;
                let p = g.p99 / n.p99;
                let c = g.us_per_req / n.us_per_req;
                println!(
                    "  gate/null {}: throughput {t:.3} (per-round {pl:.3}–{ph:.3}), p99 {p:.3}, p50 {:.3}, server CPU per request {c:.3} (+{:.1} µs)",
                    sc.name,
                    g.p50 / n.p50,
                    g.us_per_req - n.us_per_req
                );
                ratios.push((sc.name.clone(), t, p, c));
            }
        }
    });

    // What the gate did: no API read, and exactly the expected decision for every request.
    if let Some(m) = &gate.metrics
        && servers.iter().any(|s| s.name == "gate")
    {
        println!("\ngate decisions (volume_gate_admission_decisions_total):");
        for line in m
            .encode()
            .lines()
            .filter(|l| l.starts_with("volume_gate_admission_decisions_total"))
        {
            println!("  {line}");
        }
        let mut all_expected = true;
        let mut expected_total: HashMap<String, (u64, DecisionLabels)> = HashMap::new();
        for (sc, answered) in scenarios.iter().zip(&gate_answered) {
            let key = format!("{:?}", sc.expect);
            expected_total
                .entry(key)
                .or_insert((0, sc.expect.clone()))
                .0 += answered;
        }
        for (want, labels) in expected_total.values() {
            let got = m.decisions.get_or_create(labels).get();
            let ok = got == *want;
            all_expected &= ok;
            println!(
                "  {} {} {} {}: {got} decisions counted, {want} answers received{}",
                labels.target,
                labels.operation,
                labels.verdict,
                labels.reason,
                if ok { "" } else { "  <-- MISMATCH" }
            );
        }
        let reads = m.api_reads.get();
        println!(
            "  api_reads: {reads} ({}); every request decided as expected: {}",
            if reads == 0 {
                "no decision touched the API server"
            } else {
                "UNEXPECTED: some decisions read the API"
            },
            if all_expected { "yes" } else { "NO" }
        );
    }
    println!("  load average at the end: {}", loadavg());
    if total_errors > 0 {
        println!(
            "\nWARNING: {total_errors} failed requests (see 'first error' lines); figures of those rounds are suspect"
        );
    }

    shutdown.cancel();
    server_rt.shutdown_timeout(Duration::from_secs(2));
    client_rt.shutdown_timeout(Duration::from_secs(2));

    if ratios.is_empty() {
        println!("\nratio: n/a (--only runs one server, or --rounds 0)");
        return;
    }
    let tmin = ratios.iter().map(|r| r.1).fold(f64::INFINITY, f64::min);
    let pmax = ratios.iter().map(|r| r.2).fold(f64::NEG_INFINITY, f64::max);
    let per: Vec<String> = ratios
        .iter()
        .map(|(n, t, p, c)| format!("{n} {t:.2}/{p:.2}/{c:.2}"))
        .collect();
    println!(
        "\nratio gate/null (medians of {} rounds; throughput/p99/cpu-per-req): {} | worst throughput {tmin:.2} (target >= 0.90: {}), worst p99 {pmax:.2} (target <= 1.20: {})",
        ctx.args.rounds,
        per.join(", "),
        if tmin >= 0.9 { "met" } else { "MISSED" },
        if pmax <= 1.2 { "met" } else { "MISSED" }
    );
}
