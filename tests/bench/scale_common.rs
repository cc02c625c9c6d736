//! Shared pieces of the scale benchmarks (benchmarks 3–6):
//! the fixture's gate with worker flags and request tracing of our choosing, per-request accounting from the worker's
//! own log, process memory from /proc, workloads of many claims, and small
//! statistics. Used by `release_scale.rs`, `footprint.rs`, `concurrency.rs`
//! and `flux_resume.rs` through `#[path]`, beside the fixture (`tests/testkit`).
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, ObjectMeta, PostParams};
use kube::runtime::watcher;

use crate::common::cluster::ControlPlane;
use crate::common::gate::{Gate, GateConfig, helmrelease_resource};
use crate::common::tenant::{STORAGE_CLASS, Tenant};
use crate::common::wait::eventually;

/// What the worker logs per HTTP request with this filter: kube-client's
/// trace layer emits a `requesting` event inside a span carrying the URL.
pub const WORKER_TRACE_LOG: &str = "info,kube_client::client::builder=debug";

// ---------------------------------------------------------------- machine

fn first_line(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_string()
        })
        .unwrap_or_default()
}

/// nproc, CPU model, memory, kernel and rustc: the header of every run.
pub fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_string())
        .unwrap_or_else(|| "?".into());
    let mem_kib = meminfo("MemTotal").unwrap_or(0);
    format!(
        "machine: nproc {} | CPU {} | memory {:.1} GiB | kernel {} | {}",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        model,
        mem_kib as f64 / (1024.0 * 1024.0),
        first_line("uname", &["-r"]),
        first_line("rustc", &["--version"]),
    )
}

/// A field of /proc/meminfo, in KiB.
pub fn meminfo(field: &str) -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()?
        .lines()
        .find(|l| l.starts_with(&format!("{field}:")))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The 1-minute load average: other sessions share this machine.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .next()
        .unwrap_or("?")
        .to_string()
}

/// VmRSS, VmHWM, RssAnon of a process, in KiB.
#[derive(Clone, Copy, Debug, Default)]
pub struct Mem {
    pub rss: u64,
    pub hwm: u64,
    pub anon: u64,
}

pub fn proc_mem(pid: u32) -> Option<Mem> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> u64 {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Some(Mem {
        rss: field("VmRSS:"),
        hwm: field("VmHWM:"),
        anon: field("RssAnon:"),
    })
}

pub fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

// ---------------------------------------------------------------- statistics

/// Median, min and max of a sample.
#[derive(Clone, Debug)]
pub struct Stats {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

pub fn stats(xs: &[f64]) -> Stats {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if v.is_empty() {
        return Stats {
            median: f64::NAN,
            min: f64::NAN,
            max: f64::NAN,
            n: 0,
        };
    }
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    Stats {
        median,
        min: v[0],
        max: v[n - 1],
        n,
    }
}

impl std::fmt::Display for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.n <= 1 {
            write!(f, "{:.3} (n={})", self.median, self.n)
        } else {
            write!(
                f,
                "{:.3} [{:.3}..{:.3}] (n={})",
                self.median, self.min, self.max, self.n
            )
        }
    }
}

// ---------------------------------------------------------------- the gate

/// volume-gate installed by the fixture's installer (`common::gate`), its
/// files named by `tag`, with `worker_args` and the worker's log filter
/// chosen here (see `GateConfig::bench`); returns once the worker leads
/// and the API server calls both webhooks.
pub async fn install_gate(
    cp: &ControlPlane,
    tag: &str,
    worker_args: &[String],
    worker_log_filter: &str,
) -> Gate {
    let gate =
        Gate::install_configured(cp, GateConfig::bench(tag, worker_args, worker_log_filter)).await;
    gate.wait_leading().await;
    gate
}

/// A parent HelmRelease with Cozystack's labels and `body` (`{"spec": ...}`).
pub fn parent_object(namespace: &str, name: &str, body: serde_json::Value) -> DynamicObject {
    let mut o = DynamicObject::new(name, &helmrelease_resource()).within(namespace);
    o.metadata = ObjectMeta {
        name: Some(name.into()),
        namespace: Some(namespace.into()),
        labels: Some(
            [
                (
                    "apps.cozystack.io/application.kind".to_string(),
                    "Kubernetes".to_string(),
                ),
                (
                    "apps.cozystack.io/application.group".to_string(),
                    "apps.cozystack.io".to_string(),
                ),
                (
                    "apps.cozystack.io/application.name".to_string(),
                    name.trim_start_matches("kubernetes-").to_string(),
                ),
            ]
            .into(),
        ),
        ..Default::default()
    };
    o.data = body;
    o
}

// ---------------------------------------------------------------- request accounting

/// The worker's HTTP requests, from its own log (kube-client's trace layer,
/// one `requesting` event per request, retries included), split by server.
#[derive(Clone, Debug, Default)]
pub struct Requests {
    /// Requests to the tenant API server.
    pub tenant: usize,
    /// Requests to the management API server.
    pub management: usize,
    /// Of those, Lease renewals (leader election, independent of the work).
    pub management_lease: usize,
    /// Tenant requests by `METHOD resource` (paths shortened).
    pub tenant_by_kind: BTreeMap<String, usize>,
    pub management_by_kind: BTreeMap<String, usize>,
    /// Requests to neither server.
    pub other: usize,
}

/// Reads the worker log from byte `from` and counts requests per server.
/// `tenant_servers` are `https://host:port` of tenant API servers.
pub fn count_requests(
    log: &Path,
    from: u64,
    management_server: &str,
    tenant_servers: &HashSet<String>,
) -> Requests {
    let bytes = std::fs::read(log).unwrap_or_default();
    let text = String::from_utf8_lossy(&bytes[(from as usize).min(bytes.len())..]).to_string();
    let mut r = Requests::default();
    for line in text.lines() {
        if !line.contains("\"requesting\"") {
            continue;
        }
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v.get("message").and_then(|m| m.as_str()) != Some("requesting") {
            continue;
        }
        let Some(url) = v.get("spans").and_then(|s| s.as_array()).and_then(|spans| {
            spans
                .iter()
                .rev()
                .find_map(|s| s.get("http.url").and_then(|u| u.as_str()))
        }) else {
            continue;
        };
        let method = v
            .get("spans")
            .and_then(|s| s.as_array())
            .and_then(|spans| {
                spans
                    .iter()
                    .rev()
                    .find_map(|s| s.get("http.method").and_then(|u| u.as_str()))
            })
            .unwrap_or("?");
        let (server, path) = split_url(url);
        let kind = format!("{method} {}", shorten_path(&path));
        if server == management_server {
            r.management += 1;
            if path.contains("/leases") {
                r.management_lease += 1;
            }
            *r.management_by_kind.entry(kind).or_default() += 1;
        } else if tenant_servers.contains(&server) {
            r.tenant += 1;
            *r.tenant_by_kind.entry(kind).or_default() += 1;
        } else {
            r.other += 1;
        }
    }
    r
}

fn split_url(url: &str) -> (String, String) {
    let after_scheme = url.find("://").map(|i| i + 3).unwrap_or(0);
    match url[after_scheme..].find('/') {
        Some(i) => (
            url[..after_scheme + i].to_string(),
            url[after_scheme + i..].to_string(),
        ),
        None => (url.to_string(), "/".into()),
    }
}

/// `/api/v1/namespaces/x/persistentvolumeclaims?...` → `persistentvolumeclaims`
/// (plus `watch` or `list` hints), so a breakdown reads at a glance.
fn shorten_path(path: &str) -> String {
    let (p, q) = path.split_once('?').unwrap_or((path, ""));
    let segs: Vec<&str> = p.split('/').filter(|s| !s.is_empty()).collect();
    let mut resource;
    let mut i = 0;
    // Skip api/v1 or apis/group/version.
    if segs.first() == Some(&"api") {
        i = 2;
    } else if segs.first() == Some(&"apis") {
        i = 3;
    }
    if segs.get(i) == Some(&"namespaces") && segs.len() > i + 2 {
        i += 2;
    }
    if let Some(r) = segs.get(i) {
        resource = r.to_string();
        if segs.len() > i + 2 {
            resource.push('/');
            resource.push_str(segs[i + 2]);
        }
    } else {
        resource = p.to_string();
    }
    if q.contains("watch=true") {
        resource.push_str(" (watch)");
    }
    resource
}

pub fn fmt_kinds(m: &BTreeMap<String, usize>) -> String {
    m.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

// ---------------------------------------------------------------- workloads

/// How a tenant's claims are laid out: `claims` claims over `namespaces`
/// namespaces; one Pod mounts `multi` claims, and Pods of two claims each
/// hold the next ones, so that `held` claims in all are mounted.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    pub claims: usize,
    pub namespaces: usize,
    pub held: usize,
    pub multi: usize,
}

impl Workload {
    /// One claim in ten mounted (at least 7); one Pod mounts five claims,
    /// the others two each.
    pub fn for_size(claims: usize) -> Workload {
        let namespaces = if claims >= 1000 { 5 } else { 2 };
        Workload {
            claims,
            namespaces,
            held: (claims / 10).max(7).min(claims),
            multi: 5.min(claims),
        }
    }

    fn namespace_of(&self, i: usize) -> String {
        format!("vol-{}", i % self.namespaces)
    }

    /// `(namespace, pod, claims)` for every holding Pod.
    pub fn pods(&self) -> Vec<(String, String, Vec<String>)> {
        // Claims are held per namespace so a Pod mounts claims of its own namespace.
        let mut by_ns: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for i in 0..self.held {
            by_ns
                .entry(self.namespace_of(i))
                .or_default()
                .push(format!("data-{i:05}"));
        }
        let mut out = Vec::new();
        let mut first = true;
        for (ns, claims) in by_ns {
            let mut rest = claims.as_slice();
            if first && rest.len() >= self.multi {
                out.push((
                    ns.clone(),
                    "multi-0".to_string(),
                    rest[..self.multi].to_vec(),
                ));
                rest = &rest[self.multi..];
                first = false;
            }
            for (j, chunk) in rest.chunks(2).enumerate() {
                out.push((ns.clone(), format!("holder-{j:04}"), chunk.to_vec()));
            }
        }
        out
    }

    pub fn describe(&self) -> String {
        let pods = self.pods();
        let most = pods.iter().map(|p| p.2.len()).max().unwrap_or(0);
        format!(
            "{} claims in {} namespaces, {} mounted by {} Pods (one Pod mounts {most})",
            self.claims,
            self.namespaces,
            self.held,
            pods.len()
        )
    }

    /// Creates the namespaces, claims (at most `concurrency` requests in
    /// flight) and Pods, then waits until every claim is Bound and every Pod
    /// runs. Returns how long that took.
    pub async fn create(&self, t: &Tenant, concurrency: usize, timeout: Duration) -> Duration {
        let started = Instant::now();
        for n in 0..self.namespaces {
            t.tenant_namespace(&format!("vol-{n}")).await;
        }
        futures::stream::iter(0..self.claims)
            .map(|i| {
                let ns = self.namespace_of(i);
                async move { create_claim(&t.api, &ns, &format!("data-{i:05}")).await }
            })
            .buffer_unordered(concurrency)
            .try_collect::<Vec<()>>()
            .await
            .expect("create claims");
        let pods = self.pods();
        futures::stream::iter(pods.iter())
            .map(|(ns, name, claims)| async move {
                let refs: Vec<&str> = claims.iter().map(String::as_str).collect();
                t.pod(ns, name, &refs).await;
            })
            .buffer_unordered(concurrency)
            .collect::<Vec<()>>()
            .await;
        wait_settled(&t.api, self.claims, pods.len(), timeout).await;
        started.elapsed()
    }
}

async fn create_claim(api: &kube::Client, ns: &str, name: &str) -> Result<(), kube::Error> {
    let pvc: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": ns},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": STORAGE_CLASS,
                 "resources": {"requests": {"storage": "1Gi"}}},
    }))
    .unwrap();
    match Api::<PersistentVolumeClaim>::namespaced(api.clone(), ns)
        .create(&PostParams::default(), &pvc)
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

/// Waits until `claims` claims are Bound and `pods` Pods run, printing
/// progress every 30 s.
pub async fn wait_settled(api: &kube::Client, claims: usize, pods: usize, timeout: Duration) {
    let started = Instant::now();
    let mut last_print = Instant::now();
    loop {
        let lp = ListParams::default();
        let pvcs = Api::<PersistentVolumeClaim>::all(api.clone())
            .list(&lp)
            .await;
        let podl = Api::<Pod>::all(api.clone()).list(&lp).await;
        if let (Ok(pvcs), Ok(podl)) = (pvcs, podl) {
            let bound = pvcs
                .items
                .iter()
                .filter(|c| c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound"))
                .count();
            let running = podl
                .items
                .iter()
                .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
                .count();
            if bound >= claims && running >= pods {
                return;
            }
            if last_print.elapsed() > Duration::from_secs(30) {
                eprintln!(
                    "    ... {bound}/{claims} claims bound, {running}/{pods} pods running ({:.0}s)",
                    started.elapsed().as_secs_f64()
                );
                last_print = Instant::now();
            }
            assert!(
                started.elapsed() < timeout,
                "not settled after {timeout:?}: {bound}/{claims} bound, {running}/{pods} running"
            );
        }
        tokio::time::sleep(Duration::from_secs(if claims > 1000 { 3 } else { 1 })).await;
    }
}

// ---------------------------------------------------------------- tenant-side observer

/// Watches a tenant's claims and PVs from outside (the same in the gated and
/// the baseline run) and notes when things happened, relative to `t0`:
/// first claim marked for deletion, last claim gone, every PV Released or
/// gone, last PV gone. It tells what a release spent its time on.
pub struct Observer {
    state: Arc<Mutex<ObserverState>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

#[derive(Default)]
struct ObserverState {
    t0: Option<Instant>,
    pvcs: HashSet<String>,
    pvc_synced: bool,
    pvs: HashMap<String, bool>, // name -> Released (or being deleted)
    pv_synced: bool,
    first_claim_deleting: Option<Instant>,
    last_claim_gone: Option<Instant>,
    all_pvs_released: Option<Instant>,
    last_pv_gone: Option<Instant>,
    pvs_total: usize,
}

/// When each milestone was reached, in seconds after `t0`.
#[derive(Clone, Debug, Default)]
pub struct Milestones {
    pub first_claim_deleting: Option<f64>,
    pub last_claim_gone: Option<f64>,
    pub all_pvs_released: Option<f64>,
    pub last_pv_gone: Option<f64>,
}

impl std::fmt::Display for Milestones {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.1}s"));
        write!(
            f,
            "first claim deleting {}, claims gone {}, PVs all Released {}, PVs gone {}",
            s(self.first_claim_deleting),
            s(self.last_claim_gone),
            s(self.all_pvs_released),
            s(self.last_pv_gone)
        )
    }
}

impl Observer {
    pub async fn start(api: &kube::Client) -> Observer {
        let state = Arc::new(Mutex::new(ObserverState::default()));
        let mut tasks = Vec::new();
        {
            let state = state.clone();
            let stream = watcher(
                Api::<PersistentVolumeClaim>::all(api.clone()),
                watcher::Config::default(),
            );
            tasks.push(tokio::spawn(async move {
                futures::pin_mut!(stream);
                while let Some(ev) = stream.next().await {
                    let Ok(ev) = ev else { continue };
                    let now = Instant::now();
                    let mut s = state.lock().unwrap();
                    let armed = s.t0.is_some();
                    match ev {
                        watcher::Event::InitApply(c) | watcher::Event::Apply(c) => {
                            let key = key_of(&c.metadata);
                            if c.metadata.deletion_timestamp.is_some()
                                && armed
                                && s.first_claim_deleting.is_none()
                            {
                                s.first_claim_deleting = Some(now);
                            }
                            s.pvcs.insert(key);
                        }
                        watcher::Event::Delete(c) => {
                            s.pvcs.remove(&key_of(&c.metadata));
                            if armed && s.pvcs.is_empty() {
                                s.last_claim_gone = Some(now);
                            }
                        }
                        watcher::Event::InitDone => s.pvc_synced = true,
                        watcher::Event::Init => s.pvcs.clear(),
                    }
                }
            }));
        }
        {
            let state = state.clone();
            let stream = watcher(
                Api::<PersistentVolume>::all(api.clone()),
                watcher::Config::default(),
            );
            tasks.push(tokio::spawn(async move {
                futures::pin_mut!(stream);
                while let Some(ev) = stream.next().await {
                    let Ok(ev) = ev else { continue };
                    let now = Instant::now();
                    let mut s = state.lock().unwrap();
                    let armed = s.t0.is_some();
                    match ev {
                        watcher::Event::InitApply(pv) | watcher::Event::Apply(pv) => {
                            let released = pv.metadata.deletion_timestamp.is_some()
                                || pv.status.as_ref().and_then(|st| st.phase.as_deref())
                                    == Some("Released");
                            let name = pv.metadata.name.clone().unwrap_or_default();
                            s.pvs.insert(name, released);
                            if armed && s.all_pvs_released.is_none() && s.pvs.values().all(|r| *r) {
                                s.all_pvs_released = Some(now);
                            }
                        }
                        watcher::Event::Delete(pv) => {
                            s.pvs
                                .remove(pv.metadata.name.as_deref().unwrap_or_default());
                            if armed && s.all_pvs_released.is_none() && s.pvs.values().all(|r| *r) {
                                s.all_pvs_released = Some(now);
                            }
                            if armed && s.pvs.is_empty() {
                                s.last_pv_gone = Some(now);
                            }
                        }
                        watcher::Event::InitDone => s.pv_synced = true,
                        watcher::Event::Init => s.pvs.clear(),
                    }
                }
            }));
        }
        let st = state.clone();
        eventually("observer synced", Duration::from_secs(120), || {
            let st = st.clone();
            async move {
                let s = st.lock().unwrap();
                if s.pv_synced && s.pvc_synced {
                    Ok(())
                } else {
                    Err("syncing".into())
                }
            }
        })
        .await;
        Observer { state, tasks }
    }

    /// Starts the clock (just before the first action).
    pub fn arm(&self, t0: Instant) {
        let mut s = self.state.lock().unwrap();
        s.t0 = Some(t0);
        s.pvs_total = s.pvs.len();
    }

    /// Waits (bounded) until the observer has seen every PV go.
    pub async fn wait_pvs_gone(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.state.lock().unwrap().last_pv_gone.is_some() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn milestones(&self) -> Milestones {
        let s = self.state.lock().unwrap();
        let t0 = s.t0.expect("armed");
        let rel = |x: Option<Instant>| x.map(|i| i.saturating_duration_since(t0).as_secs_f64());
        Milestones {
            first_claim_deleting: rel(s.first_claim_deleting),
            last_claim_gone: rel(s.last_claim_gone),
            all_pvs_released: rel(s.all_pvs_released),
            last_pv_gone: rel(s.last_pv_gone),
        }
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn key_of(m: &ObjectMeta) -> String {
    format!(
        "{}/{}",
        m.namespace.as_deref().unwrap_or(""),
        m.name.as_deref().unwrap_or("")
    )
}

// ---------------------------------------------------------------- records

/// Polls the parent's record every `every` until `phase` (or panics after
/// `timeout`); returns when it was first seen.
pub async fn poll_phase(
    t: &Tenant,
    phase: volume_gate::record::Phase,
    every: Duration,
    timeout: Duration,
) -> Instant {
    let keys = crate::common::keys();
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    loop {
        let seen = Instant::now();
        if let Ok(Some(p)) = t.hr_api().get_metadata_opt(&t.name).await {
            let r = volume_gate::record::Record::from_annotations(
                &keys,
                &p.metadata.annotations.unwrap_or_default(),
            );
            if r.phase == Some(phase) {
                return seen;
            }
            last = format!("{:?} {:?}", r.phase, r.message);
        }
        assert!(
            Instant::now() < deadline,
            "{}: phase {phase} not reached in {timeout:?}; last {last}",
            t.name
        );
        tokio::time::sleep(every).await;
    }
}

/// Deletes a parent and waits until the teardown has finished (parent gone,
/// tenant API server stopped by the simulated Kamaji).
pub async fn teardown(t: &Tenant, timeout: Duration) {
    let _ = t.hr_api().delete(&t.name, &DeleteParams::default()).await;
    t.wait_parent_gone(timeout).await;
}
