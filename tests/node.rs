//! The chart as a user installs it (issue 31), on a real node of the
//! management cluster (`harness up --node`: the kubelet of the release the
//! harness is built from, containerd with runc, a CNI bridge;
//! `tests/harness/node.go`). volume-gate's image is assembled from the binary
//! the tests run and imported under the name the chart's values give; the
//! chart is installed by the real `helm` with its default values (cert-manager
//! issuing the webhook's certificate), with no post-renderer: the webhook and
//! the worker run in containers on the kubelet, Ready by the probes the
//! chart gives them, and the API server calls the webhook through its
//! Service.

use volume_gate_testkit as common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::chart::{helm, helm_ok};
use common::tenant::{Tenant, is_csi_release_refusal};
use common::wait::eventually;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams};
use volume_gate::record::Phase;

const NS: &str = "volume-gate";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_as_installed_runs_on_the_node_serves_admission_frees_a_tenant_upgrades_under_load_and_uninstalls()
 {
    let cp = common::cluster::control_plane_with_node();
    let env = common::env(common::EnvConfig::ungated());
    let client = cp.management_client().await;
    let installed = common::node::install_chart(cp, NS).await;
    let image = installed.image.clone();
    let chart = installed.chart.clone();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);

    // The API server calls the webhook through its Service: a tenant's CSI
    // driver release is refused with the gate's message.
    let t = Tenant::create(env.cp, &env.cp.unique("node")).await;
    t.assert_csi_release_deletion_refused().await;

    // The worker in its Pod takes custody, and the teardown frees every
    // volume: the tenant's API reached by the node's IP, the management
    // API by the kubernetes Service, the Lease held under the Pod's name.
    t.wait_custody().await;
    // It leads through its Lease, under its Pod's name (POD_NAME from the
    // downward API), with the Pod's projected ServiceAccount token.
    let lease = Api::<Lease>::namespaced(client.clone(), NS)
        .get("volume-gate-worker")
        .await
        .expect("the worker's Lease");
    let holder = lease
        .spec
        .and_then(|s| s.holder_identity)
        .unwrap_or_default();
    let workers: Vec<String> = pods
        .list(
            &ListParams::default()
                .labels("app.kubernetes.io/name=volume-gate,app.kubernetes.io/component=worker"),
        )
        .await
        .expect("the worker Pods")
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    assert!(
        workers.contains(&holder),
        "the Lease is held by {holder:?}, one of {workers:?}"
    );
    t.incident_workload().await;
    assert_eq!(env.sim.volumes_of(&t.namespace, &t.name).len(), 4);
    t.delete_parent().await;
    t.wait_phase(Phase::Released, Duration::from_secs(240))
        .await;
    t.wait_parent_gone(Duration::from_secs(180)).await;
    let left = env.sim.volumes_of(&t.namespace, &t.name);
    assert!(left.is_empty(), "volumes left on storage: {left:?}");
    // The tenant chart's pre-delete hook ran as a real Job: its Pod started
    // in a container on the node, in Cozystack's hook image (the kubelet's
    // Events outlive the Pod, which the hook's delete policy removes).
    let events: Vec<Event> = Api::<Event>::namespaced(client.clone(), &t.namespace)
        .list(&ListParams::default())
        .await
        .expect("the tenant namespace's Events")
        .items;
    let started: Vec<&Event> = events
        .iter()
        .filter(|e| {
            e.reason.as_deref() == Some("Started")
                && e.involved_object.kind.as_deref() == Some("Pod")
                && e.involved_object
                    .name
                    .as_deref()
                    .is_some_and(|n| n.contains("-pre-cleanup-"))
        })
        .collect();
    assert!(
        !started.is_empty()
            && started.iter().all(|e| {
                e.source.as_ref().and_then(|s| s.host.as_deref()) == Some(common::node::NODE)
                    || e.reporting_instance.as_deref() == Some(common::node::NODE)
            }),
        "the hook's Pod started on {}: {:?}",
        common::node::NODE,
        events
            .iter()
            .map(|e| (
                e.reason.clone(),
                e.involved_object.name.clone(),
                e.source.clone()
            ))
            .collect::<Vec<_>>()
    );

    // A rolling upgrade (a new image tag, as a release brings) under a
    // steady stream of admission requests: every one is answered by the
    // gate while old webhook Pods stop and new ones start.
    let u = Tenant::create(env.cp, &env.cp.unique("upgrade")).await;
    u.wait_custody().await;
    let next = common::node::import_volume_gate_image_as(
        cp,
        &common::gate::binary(),
        &image.replace(":", ":upgrade-"),
    );
    let tag = next.rsplit(':').next().unwrap().to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(dry_run_deletions(
        u.hr_api(),
        u.name.clone(),
        3,
        stop.clone(),
    ));
    let kubeconfig = cp.management.kubeconfig.to_str().unwrap().to_string();
    // The same upgrade places both roles as the chart's scheduling values
    // say (priorityClassName, nodeSelector, tolerations), on the node
    // tainted meanwhile: the new Pods run only where all three let them.
    let placement = Placement::prepare(cp, &client).await;
    let upgrade = {
        let (chart, kubeconfig, tag) = (chart.clone(), kubeconfig.clone(), tag.clone());
        let values = placement.values.clone();
        tokio::task::spawn_blocking(move || {
            let tag = format!("image.tag={tag}");
            helm_ok(
                "helm upgrade",
                &[
                    "upgrade",
                    "volume-gate",
                    chart.to_str().unwrap(),
                    "--namespace",
                    NS,
                    "--kubeconfig",
                    &kubeconfig,
                    "--reuse-values",
                    "--set",
                    &tag,
                    "-f",
                    values.to_str().unwrap(),
                    "--wait",
                    "--timeout",
                    "4m",
                ],
            )
        })
    };
    let notes = upgrade.await.expect("helm upgrade");
    for component in ["webhook", "worker"] {
        let replicas = Api::<Deployment>::namespaced(client.clone(), NS)
            .get(&format!("volume-gate-{component}"))
            .await
            .unwrap_or_else(|e| panic!("the {component} Deployment: {e}"))
            .spec
            .replicas
            .unwrap_or(1) as usize;
        rolled_out(&pods, component, &next, replicas).await;
        placement.check(&pods, component, replicas).await;
    }
    stop.store(true, Ordering::SeqCst);
    let load = load.await.expect("load");
    println!(
        "rolling upgrade: {} admission requests refused by the gate, {} failed",
        load.refused,
        load.failed.len()
    );
    assert!(
        load.failed.is_empty(),
        "{} of {} admission requests failed during the rolling upgrade, first: {:?}",
        load.failed.len(),
        load.failed.len() + load.refused,
        load.failed.iter().take(3).collect::<Vec<_>>()
    );
    assert!(load.refused > 0, "the load ran");
    placement.untaint();

    // The chart's NOTES say how to see the state; run exactly what they
    // print (`kubectl exec` into the worker, the CLI in the image): it
    // lists the tenant the gate has in custody.
    let status = notes
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("kubectl ") && l.contains(" exec deploy/volume-gate-worker "))
        .unwrap_or_else(|| panic!("the NOTES name the status command:\n{notes}"));
    assert!(
        notes.contains("docs/operations.md"),
        "the NOTES name the runbook:\n{notes}"
    );
    let words: Vec<&str> = status.split_whitespace().skip(1).collect();
    let out = cp
        .kubectl(&cp.management.kubeconfig)
        .args(&words)
        .output()
        .expect("kubectl exec");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{status}: {table}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = table
        .lines()
        .find(|l| {
            l.split_whitespace()
                .take(2)
                .eq([u.namespace.as_str(), u.name.as_str()])
        })
        .unwrap_or_else(|| panic!("`{status}` lists {}/{}:\n{table}", u.namespace, u.name));
    println!("{status}:\n{table}");
    assert!(row.contains("NotStarted"), "{row}");

    // A tenant namespace deleted while its control plane and its CSI
    // controller run as Pods in it, as Kamaji and the tenant chart run
    // them: the namespace controller deletes everything at once and a
    // terminating namespace makes nothing new, so the gate holds its
    // deletes of what is named for the tenant (Deployments, ReplicaSets,
    // Pods) until the tenant's volumes are released. Released through the
    // tenant's own API, every volume freed by its driver, and no Pod of
    // either deleted while the phase needed it.
    namespace_deletion_keeps_what_the_phase_runs_on(env).await;

    // The uninstall as Cozystack does it: a plain `helm uninstall` (a
    // Package's removal has helm-controller uninstall its release the same
    // way), whose pre-delete hook runs `volume-gate custody hand-back` in a
    // Pod on the node. While a tenant is mid-release it refuses, naming
    // that tenant, and leaves the gate as it was.
    let m = Tenant::create(env.cp, &env.cp.unique("midway")).await;
    m.wait_custody().await;
    m.hold_in_teardown(&env.sim).await;
    let uninstall = [
        "uninstall",
        "volume-gate",
        "--namespace",
        NS,
        "--kubeconfig",
        &kubeconfig,
        "--wait",
        "--timeout",
        "4m",
    ];
    let refused = helm(&uninstall);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&refused.stdout),
        String::from_utf8_lossy(&refused.stderr)
    );
    assert!(
        !refused.status.success(),
        "helm uninstall went through: {said}"
    );
    // Helm 4 names the hook's Job that failed.
    assert!(said.contains("volume-gate-uninstall"), "{said}");
    let log = hook_log(&pods).await;
    assert!(
        log.contains(&format!("{}/{}", m.namespace, m.name)) && log.contains("volume-gate status"),
        "the hook names the tenant mid-release and what to do:\n{log}"
    );
    // As it was: the webhook configurations in place, the CSI release still
    // refused, and the worker back at work (it releases the tenant).
    m.assert_csi_release_deletion_refused().await;
    m.set_driver(&env.sim, true).await;
    m.wait_phase(Phase::Released, Duration::from_secs(180))
        .await;

    // Once no tenant is mid-release, the same command hands custody back
    // (the worker stopped, the webhook configurations deleted, the
    // finalizer removed) and removes the rest: the live tenant keeps
    // nothing of the gate, and no Pod of it is left.
    helm_ok("helm uninstall", &uninstall);
    u.assert_out_of_custody().await;
    no_pod_left(&pods, "app.kubernetes.io/name=volume-gate").await;
    for kind in [
        "validatingwebhookconfigurations",
        "mutatingwebhookconfigurations",
    ] {
        let left = std::process::Command::new(common::cluster::kubectl_binary())
            .args([
                "--kubeconfig",
                &kubeconfig,
                "get",
                kind,
                "volume-gate",
                "--ignore-not-found",
                "-o",
                "name",
            ])
            .output()
            .expect("kubectl get");
        assert!(left.stdout.is_empty(), "{kind} volume-gate left");
    }
}

/// The tenant's Pods (its control plane's, `R-<hash>-<id>`; its CSI
/// controller's, `R-kcsi-controller-...`) as a watch opened before the
/// namespace deletion sees them go: each deletion is checked against the
/// parent as it is then (read fresh), which must be done or gone.
async fn namespace_deletion_keeps_what_the_phase_runs_on(env: &common::Env) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let n = Tenant::create(
        env.cp,
        common::tenant::TenantOptions::new(&env.cp.unique("nsroad")).in_pods(),
    )
    .await;
    n.with_held_claims(&["data", "wal"]).await;
    n.wait_custody().await;
    n.wait_cluster_bound().await;
    let disks = env.sim.volumes_of(&n.namespace, &n.name);
    assert_eq!(disks.len(), 2, "{disks:?}");
    let pods: Api<Pod> = Api::namespaced(n.management.clone(), &n.namespace);
    let running: Vec<String> = pods
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .filter_map(|p| p.metadata.name)
        .collect();
    for part in [
        format!("{}-", n.name),
        format!("{}-kcsi-controller-", n.name),
    ] {
        assert!(
            running.iter().any(|p| p.starts_with(&part)),
            "a Pod {part}* runs on the node: {running:?}"
        );
    }
    let hrs = n.hr_api();
    let parent = n.name.clone();
    let prefix = format!("{}-", n.name);
    // Each Pod of the tenant seen being deleted, and those deleted while
    // the parent was there and not done.
    let found: Arc<std::sync::Mutex<(std::collections::BTreeSet<String>, Vec<String>)>> =
        Default::default();
    let record_into = found.clone();
    let watch = tokio::spawn(async move {
        let mut stream =
            std::pin::pin!(watcher(pods, watcher::Config::default()).applied_objects());
        while let Some(Ok(p)) = stream.next().await {
            let name = p.metadata.name.clone().unwrap_or_default();
            if p.metadata.deletion_timestamp.is_none()
                || !name.starts_with(&prefix)
                || record_into.lock().unwrap().0.contains(&name)
            {
                continue;
            }
            let now = hrs.get_opt(&parent).await.ok().flatten();
            let done = now.as_ref().is_none_or(|p| {
                volume_gate::record::Record::from_annotations(
                    &common::keys(),
                    &p.metadata.annotations.clone().unwrap_or_default(),
                )
                .is_done()
            });
            let mut f = record_into.lock().unwrap();
            if !done {
                f.1.push(name.clone());
            }
            f.0.insert(name);
        }
    });
    n.delete_namespace().await;
    let record = n
        .wait_phase(Phase::Released, Duration::from_secs(300))
        .await;
    // Through the tenant's own API: every volume freed by its driver,
    // none from the management side for want of it (read before the
    // namespace, and its Events, go).
    let inventory = record.inventory.expect("an inventory");
    assert_eq!((inventory.total, inventory.left()), (2, 0), "{inventory:?}");
    let events = n.events().await;
    assert!(
        !events
            .iter()
            .any(|(_, reason, _)| reason == "FreedFromManagement"),
        "released without the tenant's API: {events:?}"
    );
    // Once it is done, the namespace controller's next sync deletes its
    // Pods. (The namespace itself goes when helm-controller has let the
    // child releases go, on Flux's retry backoff, which Cozystack keeps:
    // 750 ms doubling up to 15 min after each refused attempt, minutes by
    // the end of a teardown; not waited for here.)
    eventually(
        "the watch saw the tenant's Pods go",
        Duration::from_secs(300),
        || async {
            let n = found.lock().unwrap().0.len();
            if n >= 2 {
                Ok(())
            } else {
                Err(format!("{n} seen"))
            }
        },
    )
    .await;
    watch.abort();
    let early = found.lock().unwrap().1.clone();
    assert!(
        early.is_empty(),
        "Pods of {} deleted while its volumes were not released: {early:?}",
        n.name
    );
    assert!(
        env.sim.volumes_of(&n.namespace, &n.name).is_empty(),
        "volumes left on storage"
    );
}

/// The log of the uninstall hook's Pod (its Job is kept when it fails).
async fn hook_log(pods: &Api<Pod>) -> String {
    let hook = pods
        .list(&ListParams::default().labels("batch.kubernetes.io/job-name=volume-gate-uninstall"))
        .await
        .expect("list the hook's Pods")
        .items
        .into_iter()
        .next()
        .expect("the uninstall hook's Pod");
    pods.logs(
        hook.metadata.name.as_deref().unwrap_or_default(),
        &Default::default(),
    )
    .await
    .expect("the hook's log")
}

/// What a stream of admission requests met: the gate's refusal (served),
/// or anything else (an allowed deletion the gate did not earn, or the API
/// server failing to call the webhook).
#[derive(Default)]
struct Load {
    refused: usize,
    failed: Vec<String>,
}

/// Sends dry-run deletions of tenant `name`'s CSI driver release through
/// `api` (its namespace's HelmReleases), `workers` at a time, until `stop`:
/// each must come back refused by the gate.
async fn dry_run_deletions(
    api: Api<DynamicObject>,
    name: String,
    workers: usize,
    stop: Arc<AtomicBool>,
) -> Load {
    let release = common::profile()
        .csi_release_name(&name)
        .expect("Cozystack has a CSI release");
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let (api, release, stop) = (api.clone(), release.clone(), stop.clone());
        let name = name.clone();
        tasks.push(tokio::spawn(async move {
            let mut load = Load::default();
            let dry_run = DeleteParams {
                dry_run: true,
                ..Default::default()
            };
            while !stop.load(Ordering::SeqCst) {
                match api.delete(&release, &dry_run).await {
                    Err(e) => {
                        let msg = e.to_string();
                        if is_csi_release_refusal(&msg, &name) {
                            load.refused += 1;
                        } else {
                            load.failed.push(msg);
                        }
                    }
                    Ok(_) => load.failed.push("allowed".into()),
                }
            }
            load
        }));
    }
    let mut total = Load::default();
    for task in tasks {
        let load = task.await.expect("load task");
        total.refused += load.refused;
        total.failed.extend(load.failed);
    }
    total
}

/// The chart's `component` Pods: exactly `replicas`, all running `image`,
/// none terminating.
async fn rolled_out(pods: &Api<Pod>, component: &str, image: &str, replicas: usize) {
    let selector =
        format!("app.kubernetes.io/name=volume-gate,app.kubernetes.io/component={component}");
    eventually(
        &format!("the {component} rolled out, the old Pods gone"),
        Duration::from_secs(180),
        || async {
            let list = pods
                .list(&ListParams::default().labels(&selector))
                .await
                .map_err(|e| e.to_string())?;
            let seen: Vec<(Option<String>, String, bool)> = list
                .items
                .iter()
                .map(|p| {
                    let image = p
                        .spec
                        .as_ref()
                        .map(|s| s.containers[0].image.clone().unwrap_or_default())
                        .unwrap_or_default();
                    (
                        p.metadata.name.clone(),
                        image,
                        p.metadata.deletion_timestamp.is_some(),
                    )
                })
                .collect();
            if seen.len() == replicas && seen.iter().all(|(_, i, deleting)| i == image && !deleting)
            {
                Ok(())
            } else {
                Err(format!("{seen:?}"))
            }
        },
    )
    .await
}

/// The chart's scheduling values as the node test sets them: a
/// PriorityClass it creates, a nodeSelector on the node's own hostname
/// label, and a toleration of a NoSchedule taint it puts on the node.
struct Placement {
    cp: &'static common::cluster::ControlPlane,
    values: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

const PRIORITY_CLASS: &str = "volume-gate-test-critical";
const PRIORITY: i32 = 1_000_000;
const TAINT: &str = "volume-gate.test/dedicated=gate:NoSchedule";

impl Placement {
    async fn prepare(cp: &'static common::cluster::ControlPlane, client: &kube::Client) -> Self {
        use k8s_openapi::api::core::v1::Node;
        use k8s_openapi::api::scheduling::v1::PriorityClass;
        Api::<PriorityClass>::all(client.clone())
            .create(
                &Default::default(),
                &PriorityClass {
                    metadata: kube::api::ObjectMeta {
                        name: Some(PRIORITY_CLASS.into()),
                        ..Default::default()
                    },
                    value: Some(PRIORITY),
                    ..Default::default()
                },
            )
            .await
            .expect("create the PriorityClass");
        let node = Api::<Node>::all(client.clone())
            .get(common::node::NODE)
            .await
            .expect("the node");
        let hostname = node
            .metadata
            .labels
            .unwrap_or_default()
            .get("kubernetes.io/hostname")
            .cloned()
            .expect("the kubelet labels its node with its hostname");
        common::process::run_ok(
            cp.kubectl(&cp.management.kubeconfig).args([
                "taint",
                "node",
                common::node::NODE,
                TAINT,
            ]),
            "taint the node",
        );
        let (key, rest) = TAINT.split_once('=').unwrap();
        let (value, effect) = rest.split_once(':').unwrap();
        let role = format!(
            "  priorityClassName: {PRIORITY_CLASS}\n  nodeSelector:\n    kubernetes.io/hostname: {hostname}\n  \
             tolerations:\n    - {{key: {key}, operator: Equal, value: {value}, effect: {effect}}}\n"
        );
        let dir = tempfile::tempdir().unwrap();
        let values = dir.path().join("placement.yaml");
        std::fs::write(&values, format!("webhook:\n{role}worker:\n{role}")).unwrap();
        Placement {
            cp,
            values,
            _dir: dir,
        }
    }

    /// The `component`'s Pods are Running and Ready on the node, the
    /// tainted one, with the priority the API server resolved from the
    /// class (its Priority admission) and the values' selector and
    /// toleration.
    async fn check(&self, pods: &Api<Pod>, component: &str, replicas: usize) {
        let (key, _) = TAINT.split_once('=').unwrap();
        for pod in common::node::ready_on_the_node(pods, component, replicas).await {
            let name = pod.metadata.name.clone().unwrap_or_default();
            let spec = pod.spec.unwrap_or_default();
            assert_eq!(
                (spec.priority_class_name.as_deref(), spec.priority),
                (Some(PRIORITY_CLASS), Some(PRIORITY)),
                "{name}"
            );
            assert_eq!(
                spec.node_selector
                    .unwrap_or_default()
                    .get("kubernetes.io/hostname")
                    .map(String::as_str),
                Some(common::node::NODE),
                "{name}"
            );
            assert!(
                spec.tolerations
                    .unwrap_or_default()
                    .iter()
                    .any(|t| t.key.as_deref() == Some(key)),
                "{name}"
            );
        }
        // The node is still tainted: the toleration is what let them run.
        let out = self
            .cp
            .kubectl(&self.cp.management.kubeconfig)
            .args([
                "get",
                "node",
                common::node::NODE,
                "-o",
                "jsonpath={.spec.taints[*].key}",
            ])
            .output()
            .expect("kubectl get node");
        let taints = String::from_utf8_lossy(&out.stdout);
        assert!(taints.split_whitespace().any(|t| t == key), "{taints}");
    }

    /// Takes the taint off: the tenants' Pods to come do not tolerate it.
    fn untaint(&self) {
        let (key, _) = TAINT.split_once('=').unwrap();
        common::process::run_ok(
            self.cp.kubectl(&self.cp.management.kubeconfig).args([
                "taint",
                "node",
                common::node::NODE,
                &format!("{key}-"),
            ]),
            "untaint the node",
        );
    }
}

/// Waits until no Pod matches `selector`.
async fn no_pod_left(pods: &Api<Pod>, selector: &str) {
    eventually(
        &format!("no Pod {selector} left"),
        Duration::from_secs(120),
        || async {
            let left = pods
                .list(&ListParams::default().labels(selector))
                .await
                .map_err(|e| e.to_string())?;
            if left.items.is_empty() {
                Ok(())
            } else {
                Err(format!("{} left", left.items.len()))
            }
        },
    )
    .await
}
