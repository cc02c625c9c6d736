//! Benchmark 5: many tenants deleted at once.
//!
//!     cargo run --release --example bench-concurrency -- --tenants 50
//!
//! Each tenant is a real, light tenant cluster of the harness (kube-apiserver
//! with the API groups the phase uses, kube-controller-manager with the
//! volume and quota controllers, no scheduler: Pods name the simulated node;
//! one etcd for all) with a few
//! claims of the simulated driver held by running Pods (one Pod mounts two
//! claims, another one). The gate is installed as the fixture installs it;
//! the worker runs with its defaults except `--max-concurrent-releases`.
//!
//! 1. The cost of one tenant cluster is measured first: a tenant is built
//!    and the RssAnon of its three processes read from /proc (the binary's
//!    file pages are shared by all of them and not counted). N is the
//!    largest number up to `--tenants` whose clusters fit in MemAvailable
//!    minus `--reserve-gib` (other sessions use this machine too), with
//!    `--headroom` for growth during the run.
//! 2. For each `--max-concurrent` value: the worker is restarted with it;
//!    N+1 tenants are built; one is deleted alone and timed (DELETE of the
//!    parent to phase `Released`), then the other N are deleted at once and
//!    the time to the last `Released` is taken (every parent's record polled
//!    every 250 ms; a parent already gone was Released: custody ends only
//!    after it). Then every teardown is let finish (clusters stopped) before
//!    the next value.
//!
//! `--gogc` sets GOGC for every Go process the harness starts (API servers,
//! controller managers, schedulers, etcd, the simulator): it trades a little
//! CPU for memory, so more tenant clusters fit. 0 leaves Go's default.
//! No assertion is made on any figure; the last line is the ratio line.

use volume_gate_testkit as common;
#[path = "scale_common.rs"]
mod scale;

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use clap::Parser;
use common::cluster::ControlPlane;
use common::gate::helmrelease_resource;
use common::tenant::{Tenant, TenantOptions};
use futures::StreamExt;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams};
use scale::{Workload, loadavg, meminfo, mib, proc_mem, stats};
use serde_json::Value;
use volume_gate::record::{Phase, Record};

#[derive(Parser, Debug)]
#[command(about = "Benchmark 5: N tenants deleted at once vs one alone")]
struct Args {
    /// Target number of tenants deleted at once.
    #[arg(long, default_value_t = 50)]
    tenants: usize,
    /// Values of the worker's --max-concurrent-releases to run.
    #[arg(long, value_delimiter = ',', default_value = "4,16")]
    max_concurrent: Vec<usize>,
    /// Memory (GiB) left to the rest of the machine.
    #[arg(long, default_value_t = 6.0)]
    reserve_gib: f64,
    /// Growth allowed per cluster beyond the measured size (fraction).
    #[arg(long, default_value_t = 0.3)]
    headroom: f64,
    /// GOGC for the harness's Go processes (0: Go's default).
    #[arg(long, default_value_t = 50)]
    gogc: u32,
    /// Tenant clusters booted at once while building.
    #[arg(long, default_value_t = 3)]
    boot_concurrency: usize,
    /// Single-tenant deletions timed per configuration.
    #[arg(long, default_value_t = 3)]
    singles: usize,
}

#[derive(Debug, Clone)]
struct ConfigResult {
    max_concurrent: usize,
    n: usize,
    singles: Vec<f64>,
    total: f64,
    per_tenant: Vec<f64>,
    build_seconds: f64,
    min_available_gib: f64,
    load_before: String,
    load_after: String,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    if args.gogc > 0 {
        // Inherited by `harness up`, its supervisor and every component, and the simulator.
        // SAFETY: set before any thread of ours reads the environment concurrently.
        unsafe { std::env::set_var("GOGC", args.gogc.to_string()) };
    }
    println!("bench-concurrency (benchmark 5)");
    println!("{}", scale::machine());
    println!(
        "GOGC for harness processes: {}",
        if args.gogc > 0 {
            args.gogc.to_string()
        } else {
            "default".into()
        }
    );
    let started = Instant::now();
    let cp = common::cluster::control_plane();
    println!(
        "control plane: {} (logs in {})",
        cp.management.server,
        cp.state.join("logs").display()
    );
    let first = args.max_concurrent.first().copied().unwrap_or(4);
    let mut gate = scale::install_gate(cp, "conc", &worker_args(first), "info").await;
    let sim = common::sim::Simulator::start(cp, &volume_gate::profile::Profile::cozystack());
    let workload = Workload {
        claims: 3,
        namespaces: 1,
        held: 3,
        multi: 2,
    };
    println!("each tenant: {}", workload.describe());

    // 1. What one tenant cluster costs.
    let reserve_kib = (args.reserve_gib * 1048576.0) as u64;
    let probe = build_tenants(cp, &workload, "probe", 1, 1, 0)
        .await
        .pop()
        .unwrap();
    let cluster_kib = cluster_anon_kib(cp, &probe.cluster.name).expect("cluster pids");
    let sim_before = sim.process.pid().and_then(proc_mem).map_or(0, |m| m.anon);
    let available_kib = meminfo("MemAvailable").unwrap_or(0);
    let budget_kib = available_kib.saturating_sub(reserve_kib);
    let per_cluster = (cluster_kib as f64 * (1.0 + args.headroom)) as u64;
    let fit = (budget_kib / per_cluster.max(1)) as usize;
    // N tenants deleted at once plus the one timed alone (and the probe, still up).
    let n = args.tenants.min(fit.saturating_sub(2)).max(1);
    println!(
        "one light tenant cluster: RssAnon {:.0} MiB (apiserver+controller-manager), {:.0} MiB with {:.0}% headroom; \
         MemAvailable {:.1} GiB, reserve {:.1} GiB -> {} fit; N = {}{}",
        mib(cluster_kib),
        mib(per_cluster),
        args.headroom * 100.0,
        available_kib as f64 / 1048576.0,
        args.reserve_gib,
        fit,
        n,
        if n < args.tenants {
            format!(" (target {} does not fit)", args.tenants)
        } else {
            String::new()
        }
    );
    let probe_time = release_one(&probe).await;
    println!("probe tenant released alone in {probe_time:.2}s");
    scale::teardown(&probe, Duration::from_secs(300)).await;

    let mut results = Vec::new();
    for (i, &m) in args.max_concurrent.iter().enumerate() {
        if i > 0 || m != first {
            gate.restart_worker_with(worker_args(m)).await;
        }
        println!(
            "\n== --max-concurrent-releases {m}: building {} tenants",
            n + args.singles
        );
        let t = Instant::now();
        let tenants = build_tenants(
            cp,
            &workload,
            &format!("m{m}"),
            n + args.singles,
            args.boot_concurrency,
            reserve_kib,
        )
        .await;
        assert!(
            tenants.len() > args.singles,
            "memory ran out before any tenant of the batch was built"
        );
        let build_seconds = t.elapsed().as_secs_f64();
        let (singles, batch) = tenants.split_at(args.singles);
        let sim_now = sim.process.pid().and_then(proc_mem).map_or(0, |m| m.anon);
        println!(
            "  built in {build_seconds:.0}s; MemAvailable {:.1} GiB; simulator RssAnon {:.0} MiB (was {:.0}); load {}",
            meminfo("MemAvailable").unwrap_or(0) as f64 / 1048576.0,
            mib(sim_now),
            mib(sim_before),
            loadavg()
        );
        let mut single_times = Vec::new();
        for s in singles {
            let secs = release_one(s).await;
            println!("  one tenant alone: {secs:.2}s (load {})", loadavg());
            single_times.push(secs);
        }
        for s in singles {
            scale::teardown(s, Duration::from_secs(300)).await;
        }
        let load_before = loadavg();
        let (total, per_tenant, min_avail) = release_all(cp, batch).await;
        let load_after = loadavg();
        let single = stats(&single_times);
        let pt = stats(&per_tenant);
        println!(
            "  {} tenants at once: all Released in {total:.2}s (per tenant: {pt}); one alone {single}; ratio {:.2}; \
             ideal with {m} slots if one release held its slot for the single time: {:.1}s",
            batch.len(),
            total / single.median,
            (batch.len() as f64 / m as f64).ceil() * single.median
        );
        for t in batch {
            let _ = t.hr_api().delete(&t.name, &DeleteParams::default()).await;
        }
        wait_all_gone(batch, Duration::from_secs(900)).await;
        results.push(ConfigResult {
            max_concurrent: m,
            n: batch.len(),
            singles: single_times,
            total,
            per_tenant,
            build_seconds,
            min_available_gib: min_avail,
            load_before,
            load_after,
        });
    }

    println!("\n== summary");
    let mut parts = Vec::new();
    for r in &results {
        let single = stats(&r.singles);
        let pt = stats(&r.per_tenant);
        println!(
            "--max-concurrent-releases {:>2}: N={} all Released in {:.1}s; one alone {} s; total/one = {:.2}; per-tenant completion {} s; \
             min MemAvailable during the batch {:.1} GiB; load {} -> {}; build {:.0}s",
            r.max_concurrent,
            r.n,
            r.total,
            single,
            r.total / single.median,
            pt,
            r.min_available_gib,
            r.load_before,
            r.load_after,
            r.build_seconds
        );
        parts.push(format!(
            "max{}={:.2} ({:.1}s/{:.1}s)",
            r.max_concurrent,
            r.total / single.median,
            r.total,
            single.median
        ));
    }
    println!("total wall time {:.0}s", started.elapsed().as_secs_f64());
    println!(
        "RATIO N={} at once / one alone: {}",
        results.first().map_or(0, |r| r.n),
        parts.join(" ")
    );
    drop(sim);
}

fn worker_args(max_concurrent: usize) -> Vec<String> {
    vec![format!("--max-concurrent-releases={max_concurrent}")]
}

/// Anonymous memory of a harness cluster's processes (KiB).
fn cluster_anon_kib(cp: &ControlPlane, cluster: &str) -> Option<u64> {
    let info: Value = serde_json::from_str(
        &std::fs::read_to_string(cp.state.join(cluster).join("info.json")).ok()?,
    )
    .ok()?;
    let mut total = 0;
    for key in ["apiserver_pid", "kcm_pid", "scheduler_pid"] {
        if let Some(pid) = info[key].as_u64() {
            total += proc_mem(pid as u32)?.anon;
        }
    }
    Some(total)
}

/// Builds `count` tenants (cluster, management objects, workload), at most
/// `concurrency` at a time; stops early (and says so) if memory runs low.
async fn build_tenants(
    cp: &'static ControlPlane,
    w: &Workload,
    prefix: &str,
    count: usize,
    concurrency: usize,
    min_available_kib: u64,
) -> Vec<Tenant> {
    let handle = tokio::runtime::Handle::current();
    let w = *w;
    let tenants: Vec<Tenant> = futures::stream::iter(0..count)
        .map(|i| {
            let handle = handle.clone();
            let app = format!("{prefix}-{i:03}");
            async move {
                let available = meminfo("MemAvailable").unwrap_or(0);
                if available < min_available_kib {
                    eprintln!(
                        "    MemAvailable {:.1} GiB below the reserve: tenant {app} not built",
                        available as f64 / 1048576.0
                    );
                    return None;
                }
                let t = tokio::task::spawn_blocking(move || {
                    handle.block_on(async move {
                        let t = Tenant::create(cp, TenantOptions::new(&app).light()).await;
                        t.wait_custody().await;
                        w.create(&t, 4, Duration::from_secs(600)).await;
                        t
                    })
                })
                .await
                .expect("build tenant");
                Some(t)
            }
        })
        .buffer_unordered(concurrency)
        .filter_map(futures::future::ready)
        .enumerate()
        .map(|(i, t)| {
            if (i + 1) % 10 == 0 {
                eprintln!(
                    "    ... {} tenants built (MemAvailable {:.1} GiB, load {})",
                    i + 1,
                    meminfo("MemAvailable").unwrap_or(0) as f64 / 1048576.0,
                    loadavg()
                );
            }
            t
        })
        .collect()
        .await;
    tenants
}

/// Deletes one tenant alone; seconds from its DELETE to `Released`.
async fn release_one(t: &Tenant) -> f64 {
    let t0 = Instant::now();
    t.delete_parent().await;
    let seen = scale::poll_phase(
        t,
        Phase::Released,
        Duration::from_millis(100),
        Duration::from_secs(900),
    )
    .await;
    seen.duration_since(t0).as_secs_f64()
}

/// Deletes every tenant at once; returns the time to the last `Released`,
/// each tenant's time and the lowest MemAvailable seen (GiB).
async fn release_all(cp: &ControlPlane, tenants: &[Tenant]) -> (f64, Vec<f64>, f64) {
    let client = cp.management_client().await;
    let api: Api<DynamicObject> = Api::all_with(client, &helmrelease_resource());
    let keys = common::keys();
    let wanted: HashMap<(String, String), usize> = tenants
        .iter()
        .enumerate()
        .map(|(i, t)| ((t.namespace.clone(), t.name.clone()), i))
        .collect();
    let t0 = Instant::now();
    futures::stream::iter(tenants)
        .map(|t| async move { t.hr_api().delete(&t.name, &DeleteParams::default()).await })
        .buffer_unordered(tenants.len())
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .for_each(|r| {
            r.expect("delete parent");
        });
    let delete_took = t0.elapsed().as_secs_f64();
    let mut done: BTreeMap<usize, f64> = BTreeMap::new();
    let mut min_avail = f64::MAX;
    let lp = ListParams::default().labels("apps.cozystack.io/application.kind=Kubernetes");
    let deadline = Instant::now() + Duration::from_secs(1800);
    let mut last_print = Instant::now();
    while done.len() < tenants.len() {
        let now = t0.elapsed().as_secs_f64();
        if let Ok(list) = api.list_metadata(&lp).await {
            let mut present = std::collections::HashSet::new();
            for p in &list.items {
                let key = (
                    p.metadata.namespace.clone().unwrap_or_default(),
                    p.metadata.name.clone().unwrap_or_default(),
                );
                let Some(&i) = wanted.get(&key) else { continue };
                present.insert(i);
                let r = Record::from_annotations(
                    &keys,
                    &p.metadata.annotations.clone().unwrap_or_default(),
                );
                if r.phase == Some(Phase::Released) {
                    done.entry(i).or_insert(now);
                }
            }
            for i in 0..tenants.len() {
                if !present.contains(&i) {
                    done.entry(i).or_insert(now);
                }
            }
        }
        min_avail = min_avail.min(meminfo("MemAvailable").unwrap_or(0) as f64 / 1048576.0);
        if last_print.elapsed() > Duration::from_secs(15) {
            eprintln!(
                "    ... {}/{} Released after {now:.0}s (load {})",
                done.len(),
                tenants.len(),
                loadavg()
            );
            last_print = Instant::now();
        }
        assert!(
            Instant::now() < deadline,
            "only {}/{} Released after 1800s",
            done.len(),
            tenants.len()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    println!("  ({} DELETEs sent in {delete_took:.2}s)", tenants.len());
    let total = done.values().cloned().fold(0.0, f64::max);
    (total, done.into_values().collect(), min_avail)
}

async fn wait_all_gone(tenants: &[Tenant], timeout: Duration) {
    let deadline = Instant::now() + timeout;
    for t in tenants {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_secs(10));
        t.wait_parent_gone(left).await;
    }
}
