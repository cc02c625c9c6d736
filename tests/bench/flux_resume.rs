//! Benchmark 6: how soon real Flux finishes a teardown once the volumes are
//! free, with and without the worker's retry request.
//!
//!     cargo run --release --example bench-flux-resume -- --phases 10s,2m,8m --reps 3
//!
//! The gate is installed as the fixture installs it, the simulator runs the
//! tenant chart's real pre-delete hook (`--flux=false --run-jobs`), and
//! Flux's real helm-controller runs with its own default retry delays (750 ms
//! growing to 15 min). Each tenant is a light tenant cluster installed through
//! Flux from the tenant chart, with two claims held by a running Pod, and a
//! driver made slow (`harness.volume-gate.test/free-after` on R-csi) so the
//! phase lasts about as long as the `--phases` value: the hook is refused and
//! fails while it runs, and Flux backs off.
//!
//! Two rounds, one after the other, with every tenant of a round (each phase
//! length, `--reps` times) deleted at once:
//! - **with the request**: the worker as shipped, which writes
//!   `reconcile.fluxcd.io/requestedAt` with `Released`;
//! - **without**: the same worker restarted with a profile whose
//!   `parent.reconcileRequestAnnotation` is empty, so only Flux's backoff
//!   retries the uninstall.
//!
//! Per tenant, from a watch on its parent opened before it was created: the
//! phase (the parent's DELETE to the first version recording `Released`),
//! and after `Released`: the delay until the hook runs again (Flux's retry,
//! from the simulator's log; 0 when the run in progress at that moment went
//! on to the end), and the delay until the parent is gone, which adds the
//! hook's remaining steps and Helm's uninstall. No assertion is made on any
//! figure.

use volume_gate_testkit as common;
#[path = "scale_common.rs"]
mod scale;

use std::time::{Duration, Instant};

use clap::Parser;
use common::history::Seen;
use common::tenant::{Tenant, TenantOptions};
use scale::{loadavg, stats};
use volume_gate::record::Phase;

#[derive(Parser, Debug)]
#[command(
    about = "Benchmark 6: delay from Released to the parent gone, on real Flux, with and without the retry request"
)]
struct Args {
    /// How long the slow driver takes to free a volume (Go durations), one
    /// phase length per value.
    #[arg(long, value_delimiter = ',', default_value = "10s,2m,8m")]
    phases: Vec<String>,
    /// Tenants per phase length and round.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Bound on one round (DELETE to the last parent gone).
    #[arg(long, default_value = "40m")]
    round_timeout: String,
    /// helm-controller's workers (`--concurrent`; Flux's default is 4).
    #[arg(long, default_value_t = 4)]
    flux_concurrent: u32,
}

struct Sample {
    phase: String,
    /// DELETE to `Released` seen.
    released: Duration,
    /// `Released` seen to the start of the hook's next run (Flux's retry).
    resumed: Duration,
    /// `Released` seen to the parent gone.
    after: Duration,
}

/// When the first run of `t`'s hook Job after `since` started, from the
/// simulator's log (`TIME job N/R-pre-cleanup running pod ...`).
fn next_hook_start(
    sim: &common::sim::Simulator,
    t: &Tenant,
    since: jiff::Timestamp,
) -> Option<jiff::Timestamp> {
    sim.hook_runs(&t.namespace, &t.name)
        .into_iter()
        .map(|r| r.started)
        .find(|at| *at > since)
}

fn duration(s: &str) -> Duration {
    volume_gate::args::parse_duration(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

async fn round(
    cp: &'static common::cluster::ControlPlane,
    sim: &'static common::sim::Simulator,
    args: &Args,
    label: &str,
) -> Vec<Sample> {
    let mut tenants = Vec::new();
    for phase in &args.phases {
        for _ in 0..args.reps {
            let app = cp.unique("b");
            let t = Tenant::create(cp, TenantOptions::new(&app).light()).await;
            t.wait_custody().await;
            t.with_held_claims(&["a", "b"]).await;
            t.set_free_after(sim, phase).await;
            tenants.push((phase.clone(), t));
        }
    }
    println!(
        "[{label}] {} tenants ready (load {}); deleting all at once",
        tenants.len(),
        loadavg()
    );
    let timeout = duration(&args.round_timeout);
    let mut tasks = Vec::new();
    for (phase, t) in tenants {
        let label = label.to_string();
        tasks.push(tokio::spawn(async move {
            let start = Instant::now();
            t.delete_parent().await;
            t.history
                .next_matching("Released", timeout, |s| {
                    (s.record().and_then(|r| r.phase) == Some(Phase::Released)).then_some(())
                })
                .await;
            let released = start.elapsed();
            let released_at = jiff::Timestamp::now();
            t.history
                .next_matching("parent gone", timeout, |s| matches!(s, Seen::Gone).then_some(()))
                .await;
            let gone = start.elapsed();
            let left = sim.volumes_of(&t.namespace, &t.name);
            assert!(left.is_empty(), "{}: volumes left {left:?}", t.name);
            // No run after Released: the run in progress when it was
            // recorded went on past step 3 and finished the job.
            let resumed = next_hook_start(sim, &t, released_at).map_or(Duration::ZERO, |at| {
                Duration::from_millis((at.as_millisecond() - released_at.as_millisecond()).max(0) as u64)
            });
            println!(
                "[{label}] {} (free-after {phase}): Released at {:.1}s; the hook ran again {:.1}s after, the parent gone {:.1}s after",
                t.name,
                released.as_secs_f64(),
                resumed.as_secs_f64(),
                (gone - released).as_secs_f64()
            );
            Sample { phase, released, resumed, after: gone - released }
        }));
    }
    let mut samples = Vec::new();
    for task in tasks {
        samples.push(task.await.expect("a tenant's teardown"));
    }
    samples
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let cp = common::cluster::control_plane();
    let mut gate = scale::install_gate(cp, "flux", &common::gate::test_worker_args(), "info").await;
    let sim: &'static common::sim::Simulator = Box::leak(Box::new(common::sim::Simulator::start(
        cp,
        &volume_gate::profile::Profile::cozystack(),
    )));
    common::flux::flux_with(
        cp,
        common::flux::FluxConfig {
            min_retry_delay: "750ms",
            max_retry_delay: "15m",
            concurrent: args.flux_concurrent,
        },
    )
    .await;
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "machine: {cores} cores; helm-controller retry delays 750ms..15m (its defaults), --concurrent={}; phases {:?}, {} per phase",
        args.flux_concurrent, args.phases, args.reps
    );

    let with = round(cp, sim, &args, "with request").await;

    // The same worker, with a profile that asks Flux for nothing.
    let mut profile = volume_gate::profile::Profile::cozystack();
    profile.parent.reconcile_request_annotation = String::new();
    let file = cp.state.join("profile-no-request.json");
    std::fs::write(&file, serde_json::to_string(&profile).expect("profile"))
        .expect("write profile");
    let mut worker_args = common::gate::test_worker_args();
    worker_args.extend(["--profile".to_string(), file.display().to_string()]);
    gate.restart_worker_with(worker_args).await;
    let without = round(cp, sim, &args, "without request").await;

    println!(
        "\nSeconds after Released, median / min / max: until the hook runs again (Flux's retry), and until the parent is gone."
    );
    println!(
        "| phase (free-after) | n | phase median (s) | hook again, with request | hook again, without | gone, with request | gone, without |"
    );
    println!("|---|---|---|---|---|---|---|");
    for phase in &args.phases {
        let pick = |v: &[Sample], f: fn(&Sample) -> Duration| -> Vec<f64> {
            v.iter()
                .filter(|s| &s.phase == phase)
                .map(|s| f(s).as_secs_f64())
                .collect()
        };
        let p = stats(&pick(&with, |s| s.released));
        let cell = |v: &[Sample], f: fn(&Sample) -> Duration| {
            let x = stats(&pick(v, f));
            format!("{:.1} / {:.1} / {:.1}", x.median, x.min, x.max)
        };
        println!(
            "| {phase} | {} | {:.1} | {} | {} | {} | {} |",
            p.n,
            p.median,
            cell(&with, |s| s.resumed),
            cell(&without, |s| s.resumed),
            cell(&with, |s| s.after),
            cell(&without, |s| s.after)
        );
    }
}
