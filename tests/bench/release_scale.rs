//! Benchmark 3: the release phase at scale, against the upstream fix's
//! procedure run as a shell hook would run it.
//!
//!     cargo run --release --example bench-release -- --sizes 100,1000,5000
//!
//! One control plane (management + one tenant cluster per tenant, real
//! kube-apiserver / kube-controller-manager / kube-scheduler / etcd), the
//! gate installed as the fixture installs it (manifests, RBAC, TokenRequest
//! identities, shipped webhook configurations; worker with its default
//! flags), the simulator (CSI driver, kubelet, the management node running
//! Job Pods), and the real helm-controller, which installs each tenant from
//! the tenant chart and runs its real pre-delete hook.
//!
//! For each size and round, two identical tenants are built: N claims of the
//! simulated driver over a few namespaces (created with bounded concurrency,
//! waited for until Bound), one claim in ten mounted by running Pods (one Pod
//! mounts five claims, the others two each). Then, in alternating order
//! (odd rounds the baseline first, even rounds the gate; `--gate-first`
//! swaps them, so rounds run one invocation at a time still alternate):
//!
//! - **gate**: the parent HelmRelease is deleted; the time is from that
//!   DELETE to the record's phase `Released` (the parent's metadata polled
//!   every `--poll-ms`). The worker's HTTP requests are counted from its own
//!   log (kube-client's trace layer logs one `requesting` event per request,
//!   retries included), split into the tenant API and the management API.
//! - **baseline**: the upstream fix's Step 1b (docs/design.md §0) as a hook runs it, each step a
//!   `kubectl` process (upstream kubectl, built beside the harness): `get --raw /readyz`,
//!   `get pv -o name` (what to wait for), `delete pvc --all -A --wait=false`,
//!   `get pods -A -o json` matched in code, one `delete pod --wait=false`
//!   per holding Pod, then one `wait --for=delete pv/NAME` per PV. The time
//!   is from the first process's start to the last one's exit. Its requests
//!   are counted from kubectl's own `-v=6` log.
//!
//! A tenant-side observer (a watch on claims and PVs, the same in both runs)
//! notes when the claims were gone, every PV was Released and every PV was
//! gone: what the time went to. The two tenants of a round are built at
//! once. A measurement (gate or baseline) is repeated up to `--rounds`
//! times only if its first run took less than `--repeat-under` seconds; the
//! ratio is of the medians.
//! No assertion is made on any figure; the last line is the ratio line.

use volume_gate_testkit as common;
#[path = "scale_common.rs"]
mod scale;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use clap::Parser;
use common::cluster::ControlPlane;
use common::tenant::Tenant;
use k8s_openapi::api::core::v1::Pod;
use scale::{Milestones, Observer, Requests, Workload, fmt_kinds, loadavg, stats};
use volume_gate::record::Phase;

#[derive(Parser, Debug)]
#[command(about = "Benchmark 3: release at scale, gate vs the upstream fix's kubectl hook")]
struct Args {
    /// Claims per tenant, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "100,1000,5000")]
    sizes: Vec<usize>,
    /// Rounds per size (each round: one gated and one baseline tenant).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Measure the gate first in odd rounds (round 1 included) and the
    /// baseline first in even ones; without it, the other way round. A
    /// median taken over separate invocations keeps the order alternating.
    #[arg(long)]
    gate_first: bool,
    /// Repeat a size only if its first round took less than this (seconds)
    /// per measurement; by default every size runs every round (the figures
    /// are medians of `--rounds`).
    #[arg(long, default_value_t = f64::INFINITY)]
    repeat_under: f64,
    /// Claims and Pods created concurrently while building a tenant.
    #[arg(long, default_value_t = 16)]
    create_concurrency: usize,
    /// How often the record is polled, in milliseconds.
    #[arg(long, default_value_t = 100)]
    poll_ms: u64,
    /// Extra worker flags (repeatable), e.g. --worker-arg=--wait-bound=30m.
    #[arg(long = "worker-arg", allow_hyphen_values = true)]
    worker_args: Vec<String>,
    /// Let each `kubectl delete pod` wait for the Pod to be gone (kubectl's default).
    #[arg(long)]
    baseline_pod_wait: bool,
}

#[derive(Clone, Debug)]
struct GateRun {
    seconds: f64,
    /// When the ledger held none of the tenant's disks (the management
    /// side's PVs gone), seconds after the DELETE; `Err`: when the watch
    /// stopped with disks still there.
    disks_freed: Result<f64, f64>,
    requests: Requests,
    milestones: Milestones,
    worker_steps: BTreeMap<&'static str, f64>,
    load: String,
}

#[derive(Clone, Debug)]
struct BaselineRun {
    seconds: f64,
    /// When the ledger held none of the tenant's disks, watched from the
    /// start beside the kubectl steps (the baseline waits for the tenant's
    /// PVs only; the disks behind them may go before or after it ends).
    /// `Err`: when the watch stopped with disks still there.
    disks_freed: Result<f64, f64>,
    processes: usize,
    requests: usize,
    steps: Vec<(String, f64)>,
    milestones: Milestones,
    load: String,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    println!("bench-release (benchmark 3)");
    println!("{}", scale::machine());
    println!(
        "sizes {:?}, rounds up to {} (repeated only under {}s), create concurrency {}, {} first in odd rounds",
        args.sizes,
        args.rounds,
        args.repeat_under,
        args.create_concurrency,
        if args.gate_first { "gate" } else { "baseline" }
    );

    let started = Instant::now();
    let cp = common::cluster::control_plane();
    println!(
        "control plane: {} (logs in {})",
        cp.management.server,
        cp.state.join("logs").display()
    );
    let gate = scale::install_gate(cp, "release", &args.worker_args, scale::WORKER_TRACE_LOG).await;
    println!(
        "gate installed: worker flags {:?} (defaults otherwise), worker log {}",
        args.worker_args,
        gate.worker_log_path().display()
    );
    let sim = common::sim::Simulator::start(cp, &volume_gate::profile::Profile::cozystack());
    println!("simulator: log {}", sim.process.log.display());
    let cache_dir = cp.state.join("bench-kubectl-cache");

    let mut results: BTreeMap<usize, (Vec<GateRun>, Vec<BaselineRun>)> = BTreeMap::new();
    for &size in &args.sizes {
        let w = Workload::for_size(size);
        println!("\n== size {size}: {}", w.describe());
        // Round 1 measures both; a measurement is repeated only while its
        // first run took less than --repeat-under seconds.
        let (mut gate_rounds, mut base_rounds) = (args.rounds, args.rounds);
        for round in 1..=args.rounds {
            let (need_g, need_b) = (round <= gate_rounds, round <= base_rounds);
            if !need_g && !need_b {
                break;
            }
            let setup_timeout = Duration::from_secs(600 + size as u64);
            // The two tenants are built at once: each has a controller
            // manager of its own, whose client-side rate limit paces binding.
            let build = |app: String| async move {
                let t = Tenant::create(cp, &app).await;
                t.wait_custody().await;
                let took = w.create(&t, args.create_concurrency, setup_timeout).await;
                (t, took)
            };
            let (g, b) = tokio::join!(
                async {
                    if need_g {
                        Some(build(format!("g{size}r{round}")).await)
                    } else {
                        None
                    }
                },
                async {
                    if need_b {
                        Some(build(format!("b{size}r{round}")).await)
                    } else {
                        None
                    }
                },
            );
            let took = |x: &Option<(Tenant, Duration)>| {
                x.as_ref()
                    .map_or("-".to_string(), |(_, d)| format!("{:.0}s", d.as_secs_f64()))
            };
            println!(
                "  round {round}: tenants built (gate {}, baseline {})",
                took(&g),
                took(&b)
            );
            let (g, b) = (g.map(|x| x.0), b.map(|x| x.0));

            // Odd rounds measure the baseline first, even rounds the gate
            // (the other way round with --gate-first): neither always meets
            // a control plane the other has warmed.
            let run_g = async || match &g {
                Some(g) => Some(gated(cp, &gate, &sim, g, args.poll_ms).await),
                None => None,
            };
            let run_b = async || match &b {
                Some(b) => Some(
                    baseline(
                        cp,
                        &sim,
                        b,
                        &cache_dir,
                        args.baseline_pod_wait,
                        args.poll_ms,
                    )
                    .await,
                ),
                None => None,
            };
            let (gr, br) = if (round % 2 == 1) != args.gate_first {
                let br = run_b().await;
                (run_g().await, br)
            } else {
                let gr = run_g().await;
                (gr, run_b().await)
            };
            print_round(size, round, gr.as_ref(), br.as_ref());
            // The gated tenant's teardown runs on; the baseline tenant's
            // volumes are gone, so its release finds nothing left.
            for t in g.iter().chain(b.iter()) {
                scale::teardown(t, Duration::from_secs(900)).await;
            }
            let e = results.entry(size).or_default();
            if let Some(gr) = gr {
                if round == 1 && gr.seconds >= args.repeat_under {
                    gate_rounds = 1;
                    println!(
                        "  (gate took {:.0}s >= {}s: not repeated)",
                        gr.seconds, args.repeat_under
                    );
                }
                e.0.push(gr);
            }
            if let Some(br) = br {
                if round == 1 && br.seconds >= args.repeat_under {
                    base_rounds = 1;
                    println!(
                        "  (baseline took {:.0}s >= {}s: not repeated)",
                        br.seconds, args.repeat_under
                    );
                }
                e.1.push(br);
            }
        }
    }

    println!("\n== summary (median [min..max] over rounds)");
    let mut ratio_parts = Vec::new();
    let mut per_volume_gate: BTreeMap<usize, f64> = BTreeMap::new();
    let mut req_parts = Vec::new();
    let mut worst_ratio: f64 = 0.0;
    let mut worst_rpv: f64 = 0.0;
    for (size, (gs, bs)) in &results {
        let n = *size as f64;
        let gt = stats(&gs.iter().map(|r| r.seconds).collect::<Vec<_>>());
        let bt = stats(&bs.iter().map(|r| r.seconds).collect::<Vec<_>>());
        let gpv = stats(
            &gs.iter()
                .map(|r| 1000.0 * r.seconds / n)
                .collect::<Vec<_>>(),
        );
        let bpv = stats(
            &bs.iter()
                .map(|r| 1000.0 * r.seconds / n)
                .collect::<Vec<_>>(),
        );
        let ratio = gt.median / bt.median;
        let tenant_rpv = stats(
            &gs.iter()
                .map(|r| r.requests.tenant as f64 / n)
                .collect::<Vec<_>>(),
        );
        let mgmt_rpv = stats(
            &gs.iter()
                .map(|r| (r.requests.management - r.requests.management_lease) as f64 / n)
                .collect::<Vec<_>>(),
        );
        let all_rpv = stats(
            &gs.iter()
                .map(|r| (r.requests.tenant + r.requests.management) as f64 / n)
                .collect::<Vec<_>>(),
        );
        let base_rpv = stats(&bs.iter().map(|r| r.requests as f64 / n).collect::<Vec<_>>());
        println!("size {size}:");
        println!("  gate      time s {gt}  | ms/volume {gpv}");
        println!("  baseline  time s {bt}  | ms/volume {bpv}");
        println!("  gate/baseline time ratio (of medians) {ratio:.3}");
        println!(
            "  worker requests/volume: tenant API {tenant_rpv}, management API (without Lease renewals) {mgmt_rpv}, all {all_rpv}"
        );
        println!("  baseline (kubectl) requests/volume {base_rpv}");
        let freed = |xs: Vec<Result<f64, f64>>| -> String {
            let v: Vec<f64> = xs.into_iter().flatten().collect();
            if v.is_empty() {
                "-".into()
            } else {
                stats(&v).to_string()
            }
        };
        println!(
            "  disks freed (management side) s: gate {}, baseline {}",
            freed(gs.iter().map(|r| r.disks_freed).collect()),
            freed(bs.iter().map(|r| r.disks_freed).collect())
        );
        per_volume_gate.insert(*size, gpv.median);
        ratio_parts.push(format!("{size}={ratio:.2}"));
        worst_ratio = worst_ratio.max(ratio);
        worst_rpv = worst_rpv.max(all_rpv.median);
        req_parts.push(format!("{size}={:.3}", all_rpv.median));
    }
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    let growth = match (
        per_volume_gate.first_key_value(),
        per_volume_gate.last_key_value(),
    ) {
        (Some((s0, v0)), Some((s1, v1))) if s0 != s1 => format!(
            "{:.2} ({s1}/{s0}; target <= 1.5: {})",
            v1 / v0,
            verdict(v1 / v0 <= 1.5)
        ),
        _ => "n/a (one size)".into(),
    };
    println!("total wall time {:.0}s", started.elapsed().as_secs_f64());
    println!(
        "RATIO gate/baseline time: {} (target < 1: {}) | gate time/volume growth {growth} | worker requests/volume {} (target <= 3: {})",
        ratio_parts.join(" "),
        verdict(worst_ratio < 1.0),
        req_parts.join(" "),
        verdict(worst_rpv <= 3.0)
    );
    drop(sim);
}

fn print_round(size: usize, round: usize, g: Option<&GateRun>, b: Option<&BaselineRun>) {
    let n = size as f64;
    if let Some(g) = g {
        println!(
            "  round {round} gate: {:.2}s ({:.2} ms/volume) load {} | worker requests: tenant {} ({:.3}/vol), management {} ({} Lease) ({:.3}/vol)",
            g.seconds,
            1000.0 * g.seconds / n,
            g.load,
            g.requests.tenant,
            g.requests.tenant as f64 / n,
            g.requests.management,
            g.requests.management_lease,
            (g.requests.management - g.requests.management_lease) as f64 / n
        );
        println!(
            "      tenant requests: {}",
            fmt_kinds(&g.requests.tenant_by_kind)
        );
        println!(
            "      management requests: {}",
            fmt_kinds(&g.requests.management_by_kind)
        );
        println!(
            "      worker log: {}",
            g.worker_steps
                .iter()
                .map(|(k, v)| format!("{k} {v:.2}s"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        println!(
            "      observed: {}; disks freed (management side) {}",
            g.milestones,
            fmt_freed(g.disks_freed)
        );
    }
    if let Some(b) = b {
        println!(
            "  round {round} baseline: {:.2}s ({:.2} ms/volume) load {} | {} kubectl processes, {} requests ({:.3}/vol)",
            b.seconds,
            1000.0 * b.seconds / n,
            b.load,
            b.processes,
            b.requests,
            b.requests as f64 / n
        );
        println!(
            "      steps: {}",
            b.steps
                .iter()
                .map(|(k, v)| format!("{k} {v:.2}s"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        println!(
            "      observed: {}; disks freed (management side) {}",
            b.milestones,
            fmt_freed(b.disks_freed)
        );
    }
    if let (Some(g), Some(b)) = (g, b) {
        println!(
            "  round {round} ratio gate/baseline {:.3}",
            g.seconds / b.seconds
        );
    }
}

/// Deletes the parent and waits for `Released`; counts the worker's requests.
async fn gated(
    cp: &ControlPlane,
    gate: &common::gate::Gate,
    sim: &common::sim::Simulator,
    t: &Tenant,
    poll_ms: u64,
) -> GateRun {
    let observer = Observer::start(&t.api).await;
    let servers: HashSet<String> = [t.cluster.server.clone()].into();
    let offset = gate.worker_log_len();
    let load = loadavg();
    let wall0 = jiff::Timestamp::now();
    let t0 = Instant::now();
    observer.arm(t0);
    t.delete_parent().await;
    let seen = scale::poll_phase(
        t,
        Phase::Released,
        Duration::from_millis(poll_ms),
        Duration::from_secs(3600),
    )
    .await;
    let seconds = seen.duration_since(t0).as_secs_f64();
    let disks_freed = disks_freed(sim, t, t0, Duration::from_millis(poll_ms)).await;
    observer.wait_pvs_gone(Duration::from_secs(5)).await;
    // Custody ends right after Released: let those requests land too.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let requests = scale::count_requests(
        &gate.worker_log_path(),
        offset,
        &cp.management.server,
        &servers,
    );
    let worker_steps = worker_steps(&gate.worker_log_path(), offset, wall0, &t.name);
    GateRun {
        seconds,
        disks_freed,
        requests,
        milestones: observer.milestones(),
        worker_steps,
        load,
    }
}

/// Seconds after `t0` at which the ledger held none of `t`'s disks, polled
/// every `every` (its precision); `Err(seconds after t0)` when some are
/// still there 30 minutes after the watch began (for the baseline, its
/// start: a release longer than that ends after the watch does).
async fn disks_freed(
    sim: &common::sim::Simulator,
    t: &Tenant,
    t0: Instant,
    every: Duration,
) -> Result<f64, f64> {
    let bound = Instant::now() + Duration::from_secs(1800);
    loop {
        if sim.volumes_of(&t.namespace, &t.name).is_empty() {
            return Ok(t0.elapsed().as_secs_f64());
        }
        if Instant::now() > bound {
            return Err(t0.elapsed().as_secs_f64());
        }
        tokio::time::sleep(every).await;
    }
}

fn fmt_freed(freed: Result<f64, f64>) -> String {
    match freed {
        Ok(at) => format!("{at:.1}s"),
        Err(at) => format!("some still on storage when the watch stopped at {at:.0}s"),
    }
}

/// When the worker logged its steps for tenant `name`, seconds after `wall0`.
fn worker_steps(
    log: &Path,
    from: u64,
    wall0: jiff::Timestamp,
    name: &str,
) -> BTreeMap<&'static str, f64> {
    let bytes = std::fs::read(log).unwrap_or_default();
    let text = String::from_utf8_lossy(&bytes[(from as usize).min(bytes.len())..]).to_string();
    let mut out = BTreeMap::new();
    for line in text.lines() {
        if line.contains("\"requesting\"") || !line.contains(name) {
            continue;
        }
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let msg = v.get("message").and_then(|m| m.as_str()).unwrap_or("");
        let reason = v.get("reason").and_then(|m| m.as_str()).unwrap_or("");
        let step = match (msg, reason) {
            (_, "ReleaseStarted") => "1 started",
            (_, "InventoryTaken") => "2 inventory written",
            ("claims and holding pods deleted", _) => "3 claims+pods deleted",
            (_, "Released") => "4 Released written",
            ("custody ended: finalizer removed", _) => "5 custody ended",
            _ => continue,
        };
        let Some(ts) = v
            .get("timestamp")
            .and_then(|t| t.as_str())
            .and_then(|t| t.parse::<jiff::Timestamp>().ok())
        else {
            continue;
        };
        let secs = ts.duration_since(wall0).as_secs_f64();
        out.entry(step).or_insert(secs);
    }
    out
}

/// The seed's Step 1b, each step a kubectl process, sequentially.
async fn baseline(
    cp: &ControlPlane,
    sim: &common::sim::Simulator,
    t: &Tenant,
    cache_dir: &Path,
    pod_wait: bool,
    poll_ms: u64,
) -> BaselineRun {
    let observer = Observer::start(&t.api).await;
    let kubeconfig = t.cluster.kubeconfig.clone();
    let mut k = Kubectl {
        cp,
        kubeconfig,
        cache_dir: cache_dir.to_path_buf(),
        processes: 0,
        requests: 0,
    };
    let load = loadavg();
    let t0 = Instant::now();
    observer.arm(t0);
    let mut steps = Vec::new();
    // The disks are watched from the start, beside the kubectl steps: the
    // management side frees them on its own clock, not after the last wait.
    let freed = disks_freed(sim, t, t0, Duration::from_millis(poll_ms));
    let run = async {
        let mut mark = Instant::now();
        let mut step = |name: &str, mark: &mut Instant| {
            steps.push((name.to_string(), mark.elapsed().as_secs_f64()));
            *mark = Instant::now();
        };

        let (ok, _) = k.run(&["get", "--raw", "/readyz"]).await;
        assert!(ok, "baseline: tenant API not ready");
        step("readyz", &mut mark);
        let (ok, out) = k.run(&["get", "pv", "-o", "name"]).await;
        assert!(ok, "baseline: get pv");
        let pvs: Vec<String> = out
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.trim().to_string())
            .collect();
        step("get pv", &mut mark);
        let (ok, _) = k
            .run(&["delete", "pvc", "--all", "--all-namespaces", "--wait=false"])
            .await;
        assert!(ok, "baseline: delete pvc");
        step("delete pvc --all", &mut mark);
        let (ok, out) = k
            .run(&["get", "pods", "--all-namespaces", "-o", "json"])
            .await;
        assert!(ok, "baseline: get pods");
        let list: serde_json::Value = serde_json::from_str(&out).expect("pods JSON");
        let pods: Vec<Pod> = serde_json::from_value(list["items"].clone()).expect("pods");
        let holding: Vec<(String, String)> = pods
            .iter()
            .filter(|p| !volume_gate::worker::release::claims::claims_of(p).is_empty())
            .map(|p| {
                (
                    p.metadata.namespace.clone().unwrap_or_default(),
                    p.metadata.name.clone().unwrap_or_default(),
                )
            })
            .collect();
        step("get pods", &mut mark);
        let wait_flag = if pod_wait {
            "--wait=true"
        } else {
            "--wait=false"
        };
        for (ns, name) in &holding {
            let (ok, _) = k.run(&["delete", "pod", "-n", ns, name, wait_flag]).await;
            assert!(ok, "baseline: delete pod {ns}/{name}");
        }
        step(&format!("delete pod x{}", holding.len()), &mut mark);
        // The PVs are waited for one after another, so the first may wait
        // for nearly the whole release: at the real provisioner's 5
        // requests/s (~0.4 s a volume) a fixed 1,200 s failed at 5,000
        // claims (the first PV waited on was still there after 20 minutes).
        // The timeout only has to stay out of the measurement's way.
        let timeout = format!("--timeout={}s", 1200 + pvs.len());
        for pv in &pvs {
            let (ok, _) = k.run(&["wait", "--for=delete", pv, &timeout]).await;
            assert!(ok, "baseline: wait {pv}");
        }
        step(&format!("wait pv x{}", pvs.len()), &mut mark);
        t0.elapsed().as_secs_f64()
    };
    let (seconds, disks_freed) = tokio::join!(run, freed);
    observer.wait_pvs_gone(Duration::from_secs(5)).await;
    BaselineRun {
        seconds,
        disks_freed,
        processes: k.processes,
        requests: k.requests,
        steps,
        milestones: observer.milestones(),
        load,
    }
}

struct Kubectl<'a> {
    cp: &'a ControlPlane,
    kubeconfig: PathBuf,
    cache_dir: PathBuf,
    processes: usize,
    requests: usize,
}

impl Kubectl<'_> {
    /// Runs one kubectl process with `-v=6` (one log line per request);
    /// returns (success, stdout).
    async fn run(&mut self, args: &[&str]) -> (bool, String) {
        let mut cmd = self.cp.kubectl(&self.kubeconfig);
        cmd.arg("--cache-dir")
            .arg(&self.cache_dir)
            .arg("-v=6")
            .args(args);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let out = tokio::process::Command::from(cmd)
            .output()
            .await
            .expect("spawn kubectl");
        self.processes += 1;
        let stderr = String::from_utf8_lossy(&out.stderr);
        self.requests += stderr
            .lines()
            .filter(|l| l.contains("\"Response\""))
            .count();
        if !out.status.success() {
            eprintln!(
                "kubectl {args:?} failed: {}",
                stderr
                    .lines()
                    .filter(|l| !l.contains("\"Response\""))
                    .collect::<Vec<_>>()
                    .join(" | ")
            );
        }
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
        )
    }
}
