//! Benchmark 4: the footprint of the webhook and the worker on a
//! management cluster with many tenants, against the same processes with
//! none (the floor).
//!
//!     cargo run --release --example bench-footprint -- --tenants 1000
//!
//! On the harness's real management API server (kube-apiserver + etcd), with
//! the fixture's CRDs and the gate installed as the fixture installs it
//! (manifests, RBAC, TokenRequest identities, shipped webhook
//! configurations, both roles as local processes with their default flags):
//!
//! 1. **floor**, `--rounds` times: install the gate with 0 tenants, wait
//!    until the worker leads and has listed parents and namespaces, read
//!    VmRSS/VmHWM/RssAnon of both from /proc; send the admission burst A
//!    (`--burst` dry-run CREATEs of parent HelmReleases with ~2 KiB specs,
//!    each reviewed by the mutating and the validating webhook, at
//!    `--burst-concurrency`), read the webhook again; uninstall.
//! 2. create `--tenants` tenants with bounded concurrency: a namespace, the
//!    parent `kubernetes-<t>` and `--children` child releases (`<R>-csi`,
//!    `<R>-cilium`, ...) each with a realistic ~2 KiB spec (chart, source,
//!    remediation, values), the parent labels Cozystack uses.
//! 3. **N tenants**, `--rounds` times: install the gate; wait until the
//!    worker has taken custody of every parent (the finalizer is on all of
//!    them) and settled; read both; burst A; read the webhook; burst B
//!    (per tenant a dry-run DELETE of `<R>-csi`, refused after a fresh read
//!    of the parent, and a dry-run annotation patch of `<R>-cilium`); read
//!    the webhook; uninstall and strip the custody finalizers (no webhook is
//!    installed then) so the next round takes custody again.
//!
//! No assertion is made on any figure; the last line is the ratio line.

use volume_gate_testkit as common;
#[path = "scale_common.rs"]
mod scale;

use std::time::{Duration, Instant};

use clap::Parser;
use common::cluster::ControlPlane;
use common::gate::helmrelease_resource;
use futures::StreamExt;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use scale::{Mem, mib, proc_mem, stats};
use serde_json::{Value, json};

#[derive(Parser, Debug)]
#[command(about = "Benchmark 4: webhook and worker memory with N tenants vs none")]
struct Args {
    #[arg(long, default_value_t = 1000)]
    tenants: usize,
    /// Child releases per tenant (19 makes 20,000 releases for 1,000 tenants).
    #[arg(long, default_value_t = 19)]
    children: usize,
    /// Approximate size of each release's spec, in bytes.
    #[arg(long, default_value_t = 2048)]
    spec_bytes: usize,
    #[arg(long, default_value_t = 16)]
    create_concurrency: usize,
    /// Dry-run parent CREATEs in burst A.
    #[arg(long, default_value_t = 2000)]
    burst: usize,
    #[arg(long, default_value_t = 32)]
    burst_concurrency: usize,
    /// Install/measure/uninstall rounds for each configuration.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Seconds to let the worker settle after it has taken custody.
    #[arg(long, default_value_t = 15)]
    settle: u64,
}

const CHILDREN: [&str; 24] = [
    "csi",
    "cilium",
    "coredns",
    "cert-manager",
    "cert-manager-crds",
    "fluxcd",
    "fluxcd-operator",
    "gateway-api-crds",
    "gpu-operator",
    "ingress-nginx",
    "metrics-server",
    "monitoring-agents",
    "prometheus-operator-crds",
    "velero",
    "vertical-pod-autoscaler",
    "vertical-pod-autoscaler-crds",
    "victoria-metrics-operator",
    "kubevirt-cdi",
    "cilium-networkpolicy",
    "snapshot-controller",
    "external-dns",
    "linstor-csi",
    "node-problem-detector",
    "descheduler",
];

#[derive(Clone, Debug, Default)]
struct Round {
    worker_synced: Mem,
    webhook_idle: Mem,
    webhook_after_a: Mem,
    webhook_after_b: Option<Mem>,
    worker_end: Mem,
    custody_seconds: f64,
    worker_sockets_at_custody: usize,
    worker_sockets: usize,
    burst_a_rps: f64,
    burst_b_rps: Option<f64>,
    burst_b_refused: usize,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    assert!(
        args.children <= CHILDREN.len(),
        "at most {} children",
        CHILDREN.len()
    );
    println!("bench-footprint (benchmark 4)");
    println!("{}", scale::machine());
    let started = Instant::now();
    let cp = common::cluster::control_plane();
    println!(
        "control plane: {} (logs in {})",
        cp.management.server,
        cp.state.join("logs").display()
    );
    common::gate::apply_crds(cp).await;
    let client = cp.management_client().await;
    cp.namespace("bench-burst").await;
    let sample = parent_body("sample", args.spec_bytes);
    println!(
        "release objects: parent body {} bytes, child body {} bytes (JSON of metadata labels + spec)",
        serde_json::to_vec(&sample).unwrap().len(),
        serde_json::to_vec(&child_body("sample", "csi", args.spec_bytes))
            .unwrap()
            .len()
    );

    println!("\n== floor: 0 tenants");
    let mut floor = Vec::new();
    for round in 1..=args.rounds {
        let r = measure(cp, &client, &args, 0, &format!("floor{round}")).await;
        print_round("0 tenants", round, &r);
        floor.push(r);
    }

    println!(
        "\n== creating {} tenants ({} releases)",
        args.tenants,
        args.tenants * (1 + args.children)
    );
    let t = Instant::now();
    create_tenants(&client, &args).await;
    println!(
        "created in {:.0}s; management apiserver RSS {:.0} MiB",
        t.elapsed().as_secs_f64(),
        apiserver_rss(cp).map_or(f64::NAN, mib)
    );

    println!("\n== {} tenants", args.tenants);
    let mut full = Vec::new();
    for round in 1..=args.rounds {
        let r = measure(cp, &client, &args, args.tenants, &format!("t{round}")).await;
        print_round(&format!("{} tenants", args.tenants), round, &r);
        full.push(r);
        strip_custody(&client, &args).await;
    }

    println!(
        "\n== summary, MiB (median [min..max] over {} rounds)",
        args.rounds
    );
    let col = |rs: &[Round], f: &dyn Fn(&Round) -> Option<u64>| {
        stats(&rs.iter().filter_map(f).map(mib).collect::<Vec<_>>())
    };
    type Line = (&'static str, Box<dyn Fn(&Round) -> Option<u64>>);
    let lines: Vec<Line> = vec![
        (
            "worker VmRSS after sync+custody",
            Box::new(|r: &Round| Some(r.worker_synced.rss)),
        ),
        (
            "worker VmHWM (peak) at end",
            Box::new(|r: &Round| Some(r.worker_end.hwm)),
        ),
        (
            "worker RssAnon after sync",
            Box::new(|r: &Round| Some(r.worker_synced.anon)),
        ),
        (
            "webhook VmRSS idle",
            Box::new(|r: &Round| Some(r.webhook_idle.rss)),
        ),
        (
            "webhook VmRSS after burst A",
            Box::new(|r: &Round| Some(r.webhook_after_a.rss)),
        ),
        (
            "webhook VmHWM after burst A",
            Box::new(|r: &Round| Some(r.webhook_after_a.hwm)),
        ),
        (
            "webhook VmRSS after burst B",
            Box::new(|r: &Round| r.webhook_after_b.map(|m| m.rss)),
        ),
        (
            "webhook VmHWM after burst B",
            Box::new(|r: &Round| r.webhook_after_b.map(|m| m.hwm)),
        ),
    ];
    println!(
        "{:<34} {:>28} {:>28}",
        "",
        "0 tenants",
        format!("{} tenants", args.tenants)
    );
    for (name, f) in &lines {
        println!(
            "{:<34} {:>28} {:>28}",
            name,
            col(&floor, f.as_ref()).to_string(),
            col(&full, f.as_ref()).to_string()
        );
    }
    let custody = stats(&full.iter().map(|r| r.custody_seconds).collect::<Vec<_>>());
    println!(
        "worker: custody of all {} parents taken in {custody} s",
        args.tenants
    );
    let rps_a = stats(&full.iter().map(|r| r.burst_a_rps).collect::<Vec<_>>());
    let rps_b = stats(
        &full
            .iter()
            .filter_map(|r| r.burst_b_rps)
            .collect::<Vec<_>>(),
    );
    println!("bursts through the API server: A {rps_a} req/s, B {rps_b} req/s");
    println!("total wall time {:.0}s", started.elapsed().as_secs_f64());

    let worker_peak = col(&full, &|r: &Round| Some(r.worker_end.hwm)).max;
    let webhook_peak = col(&full, &|r: &Round| {
        r.webhook_after_b
            .map(|m| m.hwm)
            .or(Some(r.webhook_after_a.hwm))
    })
    .max;
    let worker_floor = col(&floor, &|r: &Round| Some(r.worker_end.hwm)).median;
    let webhook_floor = col(&floor, &|r: &Round| Some(r.webhook_after_a.hwm)).median;
    println!(
        "RATIO {} tenants / 0: worker peak {:.1}/{:.1} MiB = {:.2}x, webhook peak {:.1}/{:.1} MiB = {:.2}x (target < 64 MiB each: worker {}, webhook {})",
        args.tenants,
        worker_peak,
        worker_floor,
        worker_peak / worker_floor,
        webhook_peak,
        webhook_floor,
        webhook_peak / webhook_floor,
        if worker_peak < 64.0 { "met" } else { "MISSED" },
        if webhook_peak < 64.0 { "met" } else { "MISSED" },
    );
}

fn print_round(what: &str, round: usize, r: &Round) {
    let m = |x: Mem| {
        format!(
            "RSS {:.1} HWM {:.1} anon {:.1}",
            mib(x.rss),
            mib(x.hwm),
            mib(x.anon)
        )
    };
    println!("  {what} round {round}:");
    println!(
        "    worker after sync{}: {}",
        if r.custody_seconds > 0.0 {
            format!(" + custody ({:.1}s)", r.custody_seconds)
        } else {
            String::new()
        },
        m(r.worker_synced)
    );
    println!(
        "    worker sockets: {} once custody was taken, {} after settling",
        r.worker_sockets_at_custody, r.worker_sockets
    );
    println!("    worker at end: {}", m(r.worker_end));
    println!("    webhook idle: {}", m(r.webhook_idle));
    println!(
        "    webhook after burst A ({:.0} req/s): {}",
        r.burst_a_rps,
        m(r.webhook_after_a)
    );
    if let (Some(b), Some(rps)) = (r.webhook_after_b, r.burst_b_rps) {
        println!(
            "    webhook after burst B ({rps:.0} req/s, {} refused as expected): {}",
            r.burst_b_refused,
            m(b)
        );
    }
}

/// Open sockets of a process (its connections, listeners included).
fn sockets(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| {
                    std::fs::read_link(e.path())
                        .is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))
                })
                .count()
        })
        .unwrap_or(0)
}

fn apiserver_rss(cp: &ControlPlane) -> Option<u64> {
    let info: Value =
        serde_json::from_str(&std::fs::read_to_string(cp.state.join("management/info.json")).ok()?)
            .ok()?;
    proc_mem(info["apiserver_pid"].as_u64()? as u32).map(|m| m.rss)
}

/// One install/measure/uninstall round with `tenants` tenants present.
async fn measure(
    cp: &ControlPlane,
    client: &kube::Client,
    args: &Args,
    tenants: usize,
    tag: &str,
) -> Round {
    let mut r = Round::default();
    let t0 = Instant::now();
    let gate = scale::install_gate(cp, tag, &[], "info").await;
    if tenants > 0 {
        wait_custody(client, tenants).await;
        r.custody_seconds = t0.elapsed().as_secs_f64();
        r.worker_sockets_at_custody = sockets(gate.worker_pid());
    }
    // The worker lists parents and namespaces when it starts leading; with
    // custody taken (or nothing to take) let its queues drain.
    tokio::time::sleep(Duration::from_secs(args.settle)).await;
    r.worker_synced = proc_mem(gate.worker_pid()).unwrap_or_default();
    r.worker_sockets = sockets(gate.worker_pid());
    r.webhook_idle = proc_mem(gate.webhook_pid()).unwrap_or_default();

    let (rps, _) = burst_a(client, args).await;
    r.burst_a_rps = rps;
    r.webhook_after_a = proc_mem(gate.webhook_pid()).unwrap_or_default();
    if tenants > 0 {
        let (rps, refused) = burst_b(client, tenants, args.burst_concurrency).await;
        r.burst_b_rps = Some(rps);
        r.burst_b_refused = refused;
        r.webhook_after_b = proc_mem(gate.webhook_pid());
    }
    r.worker_end = proc_mem(gate.worker_pid()).unwrap_or_default();
    let metrics = gate.worker_metrics().await;
    let line = metrics
        .lines()
        .find(|l| l.starts_with("volume_gate_tenants{phase=\"NotStarted\"}"))
        .unwrap_or("(no gauge)")
        .to_string();
    println!("    worker gauge: {line}");
    gate.uninstall(cp).await;
    r
}

async fn wait_custody(client: &kube::Client, tenants: usize) {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &helmrelease_resource());
    let lp = ListParams::default().labels("apps.cozystack.io/application.kind=Kubernetes");
    let finalizer = common::profile().custody_finalizer;
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        if let Ok(list) = api.list_metadata(&lp).await {
            let held = list
                .items
                .iter()
                .filter(|p| {
                    p.metadata
                        .namespace
                        .as_deref()
                        .is_some_and(|n| n.starts_with("tenant-f"))
                })
                .filter(|p| {
                    p.metadata
                        .finalizers
                        .as_ref()
                        .is_some_and(|f| f.contains(&finalizer))
                })
                .count();
            if held >= tenants {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "custody of {held}/{tenants} after 600s"
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Burst A: dry-run CREATEs of parents in one namespace (nothing persists).
async fn burst_a(client: &kube::Client, args: &Args) -> (f64, usize) {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), "bench-burst", &helmrelease_resource());
    let t = Instant::now();
    let errors = futures::stream::iter(0..args.burst)
        .map(|i| {
            let api = api.clone();
            let name = format!("kubernetes-burst-{i:05}");
            let mut o =
                scale::parent_object("bench-burst", &name, parent_body(&name, args.spec_bytes));
            o.data = parent_body(&name, args.spec_bytes);
            async move {
                api.create(
                    &PostParams {
                        dry_run: true,
                        ..Default::default()
                    },
                    &o,
                )
                .await
                .is_err()
            }
        })
        .buffer_unordered(args.burst_concurrency)
        .filter(|e| futures::future::ready(*e))
        .count()
        .await;
    if errors > 0 {
        println!("    burst A: {errors} requests failed");
    }
    (args.burst as f64 / t.elapsed().as_secs_f64(), errors)
}

/// Burst B: per tenant, a dry-run DELETE of R-csi (refused: the gate reads
/// the parent fresh) and a dry-run annotation patch of R-cilium.
async fn burst_b(client: &kube::Client, tenants: usize, concurrency: usize) -> (f64, usize) {
    let hr = helmrelease_resource();
    let t = Instant::now();
    let results: Vec<(bool, bool)> = futures::stream::iter(0..tenants)
        .map(|i| {
            let ns = tenant_ns(i);
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &hr);
            let r = tenant_parent(i);
            async move {
                let dp = DeleteParams {
                    dry_run: true,
                    ..Default::default()
                };
                let refused = api
                    .delete(
                        &common::profile()
                            .csi_release_name(&r)
                            .expect("Cozystack has a CSI release"),
                        &dp,
                    )
                    .await
                    .is_err();
                let patch =
                    json!({"metadata": {"annotations": {"bench.volume-gate.test/touched": "yes"}}});
                let pp = PatchParams {
                    dry_run: true,
                    ..Default::default()
                };
                let patched = api
                    .patch(&format!("{r}-cilium"), &pp, &Patch::Merge(&patch))
                    .await
                    .is_ok();
                (refused, patched)
            }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await;
    let refused = results.iter().filter(|r| r.0).count();
    let patched = results.iter().filter(|r| r.1).count();
    if patched < tenants {
        println!("    burst B: {} child patches failed", tenants - patched);
    }
    ((2 * tenants) as f64 / t.elapsed().as_secs_f64(), refused)
}

fn tenant_ns(i: usize) -> String {
    format!("tenant-f{i:04}")
}

fn tenant_parent(i: usize) -> String {
    format!("kubernetes-f{i:04}")
}

/// A parent's body as Cozystack writes it: chart from the apps repository,
/// remediation, and the tenant cluster's values; padded to `bytes`.
fn parent_body(name: &str, bytes: usize) -> Value {
    let app = name.trim_start_matches("kubernetes-");
    let mut body = json!({"spec": {
        "chart": {"spec": {
            "chart": "kubernetes", "version": ">= 0.0.0-0", "reconcileStrategy": "Revision",
            "sourceRef": {"kind": "HelmRepository", "name": "cozystack-apps", "namespace": "cozy-public"}}},
        "interval": "5m", "timeout": "10m",
        "install": {"remediation": {"retries": -1}},
        "upgrade": {"force": true, "remediation": {"retries": -1}},
        "values": {
            "host": format!("{app}.example.org"),
            "storageClass": "replicated",
            "version": "v1.33",
            "controlPlane": {"replicas": 2, "apiServer": {"resourcesPreset": "large"}, "controllerManager": {"resourcesPreset": "micro"},
                             "scheduler": {"resourcesPreset": "micro"}, "konnectivity": {"server": {"resourcesPreset": "micro"}}},
            "nodeGroups": {"md0": {"minReplicas": 0, "maxReplicas": 10, "instanceType": "u1.medium", "ephemeralStorage": "20Gi",
                                   "roles": ["ingress-nginx"], "resources": {"cpu": "", "memory": ""}, "gpus": []}},
            "addons": {
                "certManager": {"enabled": true, "valuesOverride": {}},
                "cilium": {"valuesOverride": {}},
                "gatewayAPI": {"enabled": false},
                "ingressNginx": {"enabled": true, "hosts": [format!("*.{app}.example.org")], "valuesOverride": {}},
                "gpuOperator": {"enabled": false, "valuesOverride": {}},
                "fluxcd": {"enabled": false, "valuesOverride": {}},
                "monitoringAgents": {"enabled": true, "valuesOverride": {}},
                "verticalPodAutoscaler": {"valuesOverride": {}},
                "velero": {"enabled": false, "valuesOverride": {}},
                "coredns": {"valuesOverride": {}}
            }
        }
    }});
    pad(&mut body, bytes);
    body
}

fn child_body(parent: &str, child: &str, bytes: usize) -> Value {
    let mut body = json!({"spec": {
        "chart": {"spec": {
            "chart": format!("cozy-{child}"), "version": ">= 0.0.0-0", "reconcileStrategy": "Revision",
            "sourceRef": {"kind": "HelmRepository", "name": "cozystack-system", "namespace": "cozy-system"}}},
        "interval": "5m", "timeout": "10m", "releaseName": child, "targetNamespace": format!("cozy-{child}"),
        "storageNamespace": format!("cozy-{child}"),
        "kubeConfig": {"secretRef": {"name": common::profile().kubeconfig_secret_name(parent), "key": common::profile().kubeconfig.keys[0]}},
        "install": {"createNamespace": true, "remediation": {"retries": -1}},
        "upgrade": {"force": true, "remediation": {"retries": -1}},
        "dependsOn": [{"name": parent, "namespace": "tenant"}, {"name": format!("{parent}-cilium"), "namespace": "tenant"}],
        "values": {"fullnameOverride": child, "replicaCount": 1, "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}}}
    }});
    pad(&mut body, bytes);
    body
}

/// Pads `spec.values` with a note so the spec is about `bytes` long.
fn pad(body: &mut Value, bytes: usize) {
    let len = serde_json::to_vec(&body["spec"]).unwrap().len();
    if len + 20 < bytes {
        body["spec"]["values"]["notes"] = json!("x".repeat(bytes - len - 20));
    }
}

async fn create_tenants(client: &kube::Client, args: &Args) {
    let hr = helmrelease_resource();
    let children = &CHILDREN[..args.children];
    let created = futures::stream::iter(0..args.tenants)
        .map(|i| {
            let client = client.clone();
            let hr = hr.clone();
            async move {
                let ns = tenant_ns(i);
                let r = tenant_parent(i);
                let nsapi: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
                let n = serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap();
                let _ = nsapi.create(&PostParams::default(), &n).await;
                let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &hr);
                let mut parent = scale::parent_object(&ns, &r, parent_body(&r, args.spec_bytes));
                parent.metadata.finalizers = Some(vec!["finalizers.fluxcd.io".into()]);
                create_ok(&api, &parent).await;
                // Children of one tenant concurrently too, within the same bound.
                futures::stream::iter(children.iter())
                    .map(|c| {
                        let api = api.clone();
                        let mut o = DynamicObject::new(&format!("{r}-{c}"), &hr).within(&ns);
                        o.metadata.labels = Some(
                            [
                                ("cozystack.io/target-cluster-name".to_string(), r.clone()),
                                (
                                    "helm.toolkit.fluxcd.io/name".to_string(),
                                    format!("{r}-{c}"),
                                ),
                            ]
                            .into(),
                        );
                        o.metadata.finalizers = Some(vec!["finalizers.fluxcd.io".into()]);
                        o.data = child_body(&r, c, args.spec_bytes);
                        async move { create_ok(&api, &o).await }
                    })
                    .buffer_unordered(4)
                    .collect::<Vec<()>>()
                    .await;
            }
        })
        .buffer_unordered((args.create_concurrency / 4).max(1))
        .enumerate()
        .fold(0usize, |n, _| async move {
            if (n + 1) % 100 == 0 {
                eprintln!("    ... {} tenants", n + 1);
            }
            n + 1
        })
        .await;
    assert_eq!(created, args.tenants);
}

async fn create_ok(api: &Api<DynamicObject>, o: &DynamicObject) {
    for attempt in 0..5 {
        match api.create(&PostParams::default(), o).await {
            Ok(_) => return,
            Err(kube::Error::Api(s)) if s.code == 409 => return,
            Err(e) if attempt < 4 => {
                eprintln!(
                    "    create {}: {e}; retrying",
                    o.metadata.name.as_deref().unwrap_or("?")
                );
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => panic!("create {}: {e}", o.metadata.name.as_deref().unwrap_or("?")),
        }
    }
}

/// With the gate uninstalled, removes the custody finalizer from every
/// parent, so the next round's worker takes custody again.
async fn strip_custody(client: &kube::Client, args: &Args) {
    let hr = helmrelease_resource();
    futures::stream::iter(0..args.tenants)
        .map(|i| {
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &tenant_ns(i), &hr);
            async move {
                let patch = json!({"metadata": {"finalizers": ["finalizers.fluxcd.io"]}});
                if let Err(e) = api
                    .patch(
                        &tenant_parent(i),
                        &PatchParams::default(),
                        &Patch::Merge(&patch),
                    )
                    .await
                {
                    eprintln!("    strip custody {}: {e}", tenant_parent(i));
                }
            }
        })
        .buffer_unordered(args.create_concurrency)
        .collect::<Vec<()>>()
        .await;
}
