//! volume-gate on the real control plane, installed from `manifests/`, with
//! the simulated driver, kubelet and Cozystack teardown.

mod common;

use std::time::Duration;

use common::tenant::{STORAGE_CLASS, Tenant};
use kube::api::{Api, DeleteParams, ListParams};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use volume_gate::record::Phase;

fn env() -> &'static common::Env {
    common::gated()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_tenant_frees_every_volume_with_the_gate_installed() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("closed")).await;
    t.wait_custody().await;
    t.tenant_namespace("apps").await;
    for c in ["data-a", "data-b", "single"] {
        t.claim("apps", c, STORAGE_CLASS).await;
    }
    t.pod("apps", "two-claims", &["data-a", "data-b"]).await;
    t.pod("apps", "one-claim", &["single"]).await;
    t.statefulset("apps", "db", 1).await;
    t.ephemeral_pod("apps", "scratch").await;
    t.wait_settled(5, 4).await;
    assert_eq!(env.sim.volumes_of(&t.namespace, &t.name).len(), 5);

    t.delete_parent().await;
    t.wait_parent_gone(Duration::from_secs(180)).await;

    let left = env.sim.volumes_of(&t.namespace, &t.name);
    assert!(left.is_empty(), "volumes left on storage after the gated teardown: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_csi_release_delete_reaches_the_client_with_its_message() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("refuse")).await;
    t.wait_custody().await;
    let err = t.hr_api().delete(&format!("{}-csi", t.name), &DeleteParams::default()).await.expect_err("refused");
    let msg = err.to_string();
    assert!(msg.contains("volume-gate") && msg.contains("CSI driver release") && msg.contains(&t.name), "{msg}");
    assert!(msg.contains("kubectl annotate"), "the message names the override command: {msg}");
    assert!(t.hr_api().get_opt(&format!("{}-csi", t.name)).await.unwrap().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_delete_of_the_parent_changes_nothing() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("dryrun")).await;
    t.wait_custody().await;
    let before = t.parent().await.unwrap();
    t.hr_api().delete(&t.name, &DeleteParams { dry_run: true, ..Default::default() }).await.expect("dry-run delete accepted");
    let after = t.parent().await.expect("parent still exists");
    assert!(after.metadata.deletion_timestamp.is_none(), "a dry run set no deletionTimestamp");
    assert_eq!(after.metadata.resource_version, before.metadata.resource_version, "nothing was written");
    assert_eq!(t.record().await.phase, None, "no phase started");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_keeps_pvc_protection_until_its_pod_is_gone() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("pvcprot")).await;
    t.tenant_namespace("apps").await;
    t.claim("apps", "held", STORAGE_CLASS).await;
    t.pod("apps", "holder", &["held"]).await;
    t.wait_settled(1, 1).await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(t.api.clone(), "apps");
    claims.delete("held", &DeleteParams::default()).await.unwrap();
    let c = claims.get("held").await.expect("claim still there while mounted");
    assert!(c.metadata.deletion_timestamp.is_some());
    assert!(
        c.metadata.finalizers.unwrap_or_default().contains(&"kubernetes.io/pvc-protection".to_string()),
        "the real controller manager added pvc-protection"
    );
    Api::<Pod>::namespaced(t.api.clone(), "apps").delete("holder", &DeleteParams::default()).await.unwrap();
    common::wait::eventually("claim gone once its pod is", Duration::from_secs(60), || {
        let claims = claims.clone();
        async move { if claims.get_opt("held").await.map_err(|e| e.to_string())?.is_none() { Ok(()) } else { Err("still there".into()) } }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_tenant_namespace_leaves_zero_volumes() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("nsdel")).await;
    t.wait_custody().await;
    t.tenant_namespace("apps").await;
    t.claim("apps", "a", STORAGE_CLASS).await;
    t.pod("apps", "p", &["a"]).await;
    t.wait_settled(1, 1).await;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(t.management.clone());
    namespaces.delete(&t.namespace, &DeleteParams::default()).await.unwrap();
    common::wait::eventually("tenant namespace gone", Duration::from_secs(240), || {
        let namespaces = namespaces.clone();
        let ns = t.namespace.clone();
        async move { if namespaces.get_opt(&ns).await.map_err(|e| e.to_string())?.is_none() { Ok(()) } else { Err("terminating".into()) } }
    })
    .await;
    let left = env.sim.volumes_of(&t.namespace, &t.name);
    assert!(left.is_empty(), "volumes left after deleting the namespace: {left:?}");
    let _ = Phase::Released;
    let _ = ListParams::default();
}
