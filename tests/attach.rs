//! Attach and detach with Kubernetes' own parts (the attach/detach
//! controller in the tenant's controller manager, the real
//! external-attacher and external-provisioner beside the driver): a tenant
//! whose node died keeps its volumes attached, and the teardown says so by
//! name until someone declares the node out of service; and a driver that
//! is slow but keeps freeing is waited for, however long it takes in all.

use volume_gate_testkit as common;

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::json;
use volume_gate::record::Phase;

use common::history::Seen;
use common::tenant::Tenant;

/// The tenant's one node, as the simulator's kubelet registers it.
const NODE: &str = "sim-node";

/// Short bounds: a pass waits 10s for the PVs before Blocked.
fn env() -> &'static common::Env {
    common::gated_short()
}

fn ready(n: &Node) -> Option<String> {
    n.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| c.status.clone())
}

/// The node's VM dies with two volumes attached and a Pod using them: the
/// kubelet's heartbeats stop, Kubernetes marks the node NotReady, and the
/// Pod the worker deletes stays Terminating (nothing confirms it), so the
/// attach/detach controller keeps the volumes attached and the
/// external-provisioner does not delete them. The worker's Blocked names
/// the Pod, the node and each VolumeAttachment, and the remedy; once the
/// node is tainted out-of-service (what an operator does for a node known
/// to be off), Kubernetes force-deletes the Pod, detaches, the provisioner
/// frees the volumes and the teardown finishes with none left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_nodes_attachments_block_the_teardown_by_name_until_the_node_is_declared_out_of_service()
 {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("deadnode")).await;
    t.wait_custody().await;
    t.with_held_claims(&["a", "b"]).await;
    let disks = env.sim.wait_disks(&t.namespace, &t.name, 2).await;

    let vas: Api<VolumeAttachment> = Api::all(t.api.clone());
    let attached: Vec<String> = vas
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|va| va.status.as_ref().is_some_and(|s| s.attached))
        .map(|va| va.metadata.name.unwrap())
        .collect();
    assert_eq!(
        attached.len(),
        2,
        "the Pod runs on attached volumes: {attached:?}"
    );

    // The node dies (its VM is gone): observed through a watch on the Node.
    let nodes: Api<Node> = Api::all(t.api.clone());
    let patch = json!({"metadata": {"annotations": {"harness.volume-gate.test/node": "down"}}});
    t.hr_api()
        .patch(&t.name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("mark the node down");
    let died = Instant::now();
    tokio::time::timeout(
        Duration::from_secs(180),
        kube::runtime::wait::await_condition(nodes.clone(), NODE, |n: Option<&Node>| {
            n.and_then(ready).is_some_and(|s| s != "True")
        }),
    )
    .await
    .expect("the node goes NotReady")
    .unwrap();
    let not_ready_after = died.elapsed();

    t.delete_parent().await;
    let deleted = Instant::now();
    let record = t.wait_phase(Phase::Blocked, Duration::from_secs(90)).await;
    let blocked_after = deleted.elapsed();
    let message = record.message.unwrap_or_default();
    for needle in [
        &format!("NotReady: {NODE} since"),
        &format!(
            "kubectl taint node {NODE} node.kubernetes.io/out-of-service=nodeshutdown:NoExecute"
        ),
        &format!("mounted by Pod apps/holder on {NODE} Terminating since"),
        &format!("VolumeAttachment {} on {NODE} attached", attached[0]),
        &format!("VolumeAttachment {} on {NODE} attached", attached[1]),
    ] {
        assert!(
            message.contains(needle.as_str()),
            "Blocked names {needle:?}: {message}"
        );
    }
    assert_eq!(
        env.sim.volumes_of(&t.namespace, &t.name),
        disks,
        "nothing freed while attached to the dead node"
    );

    // The operator declares the node out of service.
    let taint = json!({"spec": {"taints": [{
        "key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown", "effect": "NoExecute"}]}});
    nodes
        .patch(NODE, &PatchParams::default(), &Patch::Merge(&taint))
        .await
        .expect("taint the node out of service");
    let tainted = Instant::now();
    t.wait_parent_gone(Duration::from_secs(300)).await;
    let gone_after = tainted.elapsed();
    assert!(
        env.sim.volumes_of(&t.namespace, &t.name).is_empty(),
        "no volume left"
    );
    println!(
        "dead node: NotReady {:.0}s after its kubelet stopped; Blocked {:.1}s after the parent's deletion \
         (wait bound 10s); after the out-of-service taint the parent was gone in {:.1}s",
        not_ready_after.as_secs_f64(),
        blocked_after.as_secs_f64(),
        gone_after.as_secs_f64()
    );
}

/// A driver that frees one volume at a time, 3 s each (a backend that
/// serializes its storage operations, or provisioners at their client's
/// rate limit on a big tenant): five volumes take 15 s, longer than the
/// 10 s wait bound, but one is freed every 3 s. The bound counts from the
/// last volume freed, so the teardown never says `Blocked` and ends with
/// none left; a bound counted from the pass's start would have reported
/// a working driver as stuck.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_driver_that_keeps_freeing_is_waited_for_past_the_bound_without_blocked() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("slowfree")).await;
    t.wait_custody().await;
    t.with_held_claims(&["a", "b", "c", "d", "e"]).await;
    env.sim.wait_disks(&t.namespace, &t.name, 5).await;
    t.set_free_after(&env.sim, "3s serially").await;

    t.delete_parent().await;
    let deleted = Instant::now();
    let record = t
        .wait_phase(Phase::Released, Duration::from_secs(180))
        .await;
    let released_after = deleted.elapsed();
    t.wait_parent_gone(Duration::from_secs(120)).await;

    let blocked: Vec<String> = t
        .history
        .all()
        .iter()
        .filter_map(Seen::record)
        .filter(|r| r.phase == Some(Phase::Blocked))
        .map(|r| r.message.unwrap_or_default())
        .collect();
    assert!(
        blocked.is_empty(),
        "a driver that keeps freeing is never reported Blocked: {blocked:?}"
    );
    assert!(
        released_after > Duration::from_secs(10),
        "the freeing took longer than the 10 s bound (else this proves nothing): {released_after:?}"
    );
    let inventory = record.inventory.expect("the record keeps its inventory");
    assert_eq!((inventory.freed, inventory.total), (5, 5), "all five freed");
    assert!(
        env.sim.volumes_of(&t.namespace, &t.name).is_empty(),
        "no volume left"
    );
    println!(
        "slow driver (3 s a volume, one at a time): Released {:.1}s after the parent's deletion, \
         against a wait bound of 10 s, with no Blocked",
        released_after.as_secs_f64()
    );
}
