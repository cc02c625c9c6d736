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

use std::time::Duration;

use common::tenant::Tenant;
use common::wait::eventually;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams};
use volume_gate::record::Phase;

const NS: &str = "volume-gate";

/// The Pods of one of the chart's components, all Running and Ready on the
/// node, and their image.
async fn ready_on_the_node(pods: &Api<Pod>, component: &str, replicas: usize) -> Vec<Pod> {
    let selector =
        format!("app.kubernetes.io/name=volume-gate,app.kubernetes.io/component={component}");
    eventually(
        &format!("{replicas} {component} Pods Running and Ready on {}", common::node::NODE),
        Duration::from_secs(180),
        || async {
            let list = pods
                .list(&ListParams::default().labels(&selector))
                .await
                .map_err(|e| e.to_string())?;
            let ready: Vec<Pod> = list
                .items
                .iter()
                .filter(|p| {
                    let on_node = p.spec.as_ref().and_then(|s| s.node_name.as_deref())
                        == Some(common::node::NODE);
                    let ready = p
                        .status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
                    on_node && ready
                })
                .cloned()
                .collect();
            if ready.len() == replicas {
                Ok(ready)
            } else {
                Err(format!(
                    "{} of {} ready: {:?}",
                    ready.len(),
                    list.items.len(),
                    list.items
                        .iter()
                        .map(|p| (p.metadata.name.clone(), p.status.as_ref().map(|s| (s.phase.clone(), s.container_statuses.clone()))))
                        .collect::<Vec<_>>()
                ))
            }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_as_installed_runs_on_the_node_ready_by_its_probes_and_serves_admission_through_its_service()
{
    let cp = common::cluster::control_plane_with_node();
    let env = common::env(common::EnvConfig::ungated());
    let client = cp.management_client().await;
    cp.namespace(NS).await;
    let image = common::node::import_volume_gate_image(cp, &common::gate::binary());
    let _cert_manager = common::certmanager::start(cp, NS).await;

    let chart = common::cluster::repo_root().join("manifests/chart/volume-gate");
    common::chart::helm_ok(
        "helm install",
        &[
            "install",
            "volume-gate",
            chart.to_str().unwrap(),
            "--namespace",
            NS,
            "--kubeconfig",
            cp.management.kubeconfig.to_str().unwrap(),
            "--wait",
            "--timeout",
            "4m",
        ],
    );

    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    for (component, deployment) in [("webhook", "volume-gate-webhook"), ("worker", "volume-gate-worker")] {
        let replicas = Api::<Deployment>::namespaced(client.clone(), NS)
            .get(deployment)
            .await
            .unwrap_or_else(|e| panic!("Deployment {deployment}: {e}"))
            .spec
            .replicas
            .unwrap_or(1) as usize;
        for pod in ready_on_the_node(&pods, component, replicas).await {
            let status = pod.status.unwrap_or_default();
            let containers = status.container_statuses.unwrap_or_default();
            assert!(
                containers.iter().all(|c| c.image.ends_with(&image) || c.image == image),
                "{component} runs {image}: {containers:?}"
            );
        }
    }

    // The API server calls the webhook through its Service: a tenant's CSI
    // driver release is refused with the gate's message.
    let t = Tenant::create(env.cp, &env.cp.unique("node")).await;
    let err = t
        .hr_api()
        .delete(
            &common::profile().csi_release_name(&t.name),
            &DeleteParams::default(),
        )
        .await
        .expect_err("the CSI driver release's deletion is refused");
    let msg = err.to_string();
    assert!(
        msg.contains("volume-gate") && msg.contains("CSI driver release") && msg.contains(&t.name),
        "{msg}"
    );

    // The worker in its Pod takes custody, and the teardown frees every
    // volume: the tenant's API reached by the node's IP, the management
    // API by the kubernetes Service, the Lease held under the Pod's name.
    t.wait_custody().await;
    t.incident_workload().await;
    assert_eq!(env.sim.volumes_of(&t.namespace, &t.name).len(), 4);
    t.delete_parent().await;
    t.wait_phase(Phase::Released, Duration::from_secs(240)).await;
    t.wait_parent_gone(Duration::from_secs(180)).await;
    let left = env.sim.volumes_of(&t.namespace, &t.name);
    assert!(left.is_empty(), "volumes left on storage: {left:?}");
}
