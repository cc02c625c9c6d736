//! The Helm chart installed by the real `helm` (v4, from the Go module
//! proxy) on the real API server, then upgraded while a tenant is in
//! teardown, then uninstalled by a plain `helm uninstall` (its pre-delete
//! hook hands custody back).
//!
//! The webhook and the worker run as local processes under the
//! ServiceAccounts the chart created, the worker with the arguments of the
//! Deployment the chart rendered. The one change to what the chart renders
//! is a post-renderer (`common::chart::install_point_at_local_plugin`) that
//! points each webhook at the local process instead of the Service, which
//! the API server here cannot route to.

use volume_gate_testkit as common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::chart::{
    WEBHOOK_CONFIGURATIONS, helm_local, helm_ok, webhook_configuration,
    worker_args_of_the_deployment,
};
use common::gate::{Gate, free_port, generate_certs, helmrelease_resource};
use common::tenant::Tenant;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams};
use volume_gate::record::Phase;

const NS: &str = "volume-gate";

/// `t`, being deleted, ends `Released` and gone, with no volume left.
async fn released_with_no_volume_left(env: &common::Env, t: &Tenant) {
    t.wait_phase(Phase::Released, Duration::from_secs(180))
        .await;
    t.wait_parent_gone(Duration::from_secs(180)).await;
    assert!(
        env.sim.volumes_of(&t.namespace, &t.name).is_empty(),
        "0 volumes left"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_installs_upgrades_during_a_teardown_and_uninstalls_the_gate() {
    let env = common::ungated();
    let cp = env.cp;
    let client = cp.management_client().await;
    cp.namespace(NS).await;
    let certs = cp.state.join("helm-gate-certs");
    let ca = generate_certs(&certs);
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let ca_value = format!("certificates.caBundle={ca}");
    let values = [
        "--set",
        "certificates.mode=secret",
        "--set",
        &ca_value,
        // The test suite's short bounds, through the chart's values.
        "--set",
        "worker.waitBound=90s",
        "--set",
        "worker.retryBase=1s",
        "--set",
        "worker.retryMax=5s",
        "--set",
        "worker.probeTimeout=3s",
    ];
    let kubeconfig = &cp.management.kubeconfig;

    // Install.
    helm_local("install", NS, kubeconfig, &base, &values);
    let worker_args = worker_args_of_the_deployment(&client, NS).await;
    assert!(
        worker_args.contains(&"--wait-bound=90s".to_string()),
        "{worker_args:?}"
    );
    let mut gate = Gate::start_webhook(cp, certs.clone(), port, worker_args).await;
    gate.start_worker_and_wait(cp).await;

    // A tenant deleted under the installed gate: every volume freed.
    let a = Tenant::create(cp, &cp.unique("helmed")).await;
    a.wait_custody().await;
    a.incident_workload().await;
    a.delete_parent().await;
    released_with_no_volume_left(env, &a).await;

    // A tenant held in teardown (its driver stopped), and an upgrade that
    // changes replicas and flags meanwhile: a guarded delete is tried all
    // along and never let through.
    let b = Tenant::create(cp, &cp.unique("upgraded")).await;
    b.wait_custody().await;
    b.incident_workload().await;
    b.set_driver(&env.sim, false).await;
    b.delete_parent().await;
    b.wait_inventory().await;
    let stop = Arc::new(AtomicBool::new(false));
    let (tried, let_through) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let prober = {
        let (stop, tried, let_through) = (stop.clone(), tried.clone(), let_through.clone());
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), &b.namespace, &helmrelease_resource());
        let csi = common::profile()
            .csi_release_name(&b.name)
            .expect("Cozystack has a CSI release");
        tokio::spawn(async move {
            // Paced, so the upgrade is not starved on a small machine.
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            while !stop.load(Ordering::SeqCst) {
                tick.tick().await;
                let dry = DeleteParams {
                    dry_run: true,
                    ..Default::default()
                };
                tried.fetch_add(1, Ordering::SeqCst);
                if api.delete(&csi, &dry).await.is_ok() {
                    let_through.fetch_add(1, Ordering::SeqCst);
                }
            }
        })
    };
    let mut upgrade = values.to_vec();
    upgrade.extend([
        "--set",
        "webhook.replicas=3",
        "--set",
        "worker.replicas=1",
        "--set",
        "worker.maxConcurrentReleases=2",
    ]);
    helm_local("upgrade", NS, kubeconfig, &base, &upgrade);
    // The rollout, as the kubelet would do it: the old replicas go, new
    // ones start with the upgraded Deployment's arguments.
    let deployments = Api::<Deployment>::namespaced(client.clone(), NS);
    let replicas = |d: Deployment| d.spec.replicas.unwrap();
    assert_eq!(
        replicas(deployments.get("volume-gate-webhook").await.unwrap()),
        3
    );
    assert_eq!(
        replicas(deployments.get("volume-gate-worker").await.unwrap()),
        1
    );
    let worker_args = worker_args_of_the_deployment(&client, NS).await;
    assert!(
        worker_args.contains(&"--max-concurrent-releases=2".to_string()),
        "{worker_args:?}"
    );
    gate.kill_worker();
    gate.webhook.kill(libc::SIGTERM);
    let mut gate = Gate::start_webhook(cp, certs.clone(), port, worker_args).await;
    gate.start_worker_and_wait(cp).await;
    stop.store(true, Ordering::SeqCst);
    prober.await.unwrap();
    assert!(tried.load(Ordering::SeqCst) > 0);
    assert_eq!(
        let_through.load(Ordering::SeqCst),
        0,
        "a dry-run DELETE of the CSI release was allowed during the upgrade ({} tried)",
        tried.load(Ordering::SeqCst)
    );
    assert_ne!(b.record().await.phase, Some(Phase::Released));

    // Break-glass (docs/operations.md, "Break-glass: stop the gate
    // refusing"), during the held teardown: the validating configuration
    // deleted, the API server stops asking the gate, and the worker keeps
    // custody and the record; `helm upgrade --reuse-values` puts it back.
    let before = b.record().await;
    let csi_api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &b.namespace, &helmrelease_resource());
    let csi = common::profile()
        .csi_release_name(&b.name)
        .expect("Cozystack has a CSI release");
    let dry = DeleteParams {
        dry_run: true,
        ..Default::default()
    };
    Api::<DynamicObject>::all_with(
        client.clone(),
        &webhook_configuration(WEBHOOK_CONFIGURATIONS[0].0, WEBHOOK_CONFIGURATIONS[0].1),
    )
    .delete("volume-gate", &DeleteParams::default())
    .await
    .expect("delete the validating webhook configuration");
    common::wait::eventually(
        "the API server to stop asking the gate",
        Duration::from_secs(30),
        || async {
            csi_api
                .delete(&csi, &dry)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        },
    )
    .await;
    b.assert_in_custody().await;
    let during = b.record().await;
    assert_eq!(
        (during.phase, during.inventory.map(|i| i.total)),
        (before.phase, before.inventory.map(|i| i.total)),
        "the record is intact"
    );
    let mut restore = upgrade.clone();
    restore.push("--reuse-values");
    helm_local("upgrade", NS, kubeconfig, &base, &restore);
    common::wait::eventually(
        "the gate to refuse again",
        Duration::from_secs(30),
        || async {
            match csi_api.delete(&csi, &dry).await {
                Err(e) if common::tenant::is_csi_release_refusal(&e.to_string(), &b.name) => Ok(()),
                other => Err(format!("{:?}", other.map(|_| ()))),
            }
        },
    )
    .await;
    b.assert_in_custody().await;
    b.set_driver(&env.sim, true).await;
    released_with_no_volume_left(env, &b).await;

    // A plain `helm uninstall`, as Cozystack removes a package: its
    // pre-delete hook (`volume-gate custody hand-back`, run here by the
    // simulated node from the binary the tests built) hands custody back,
    // so a live tenant keeps nothing of the gate. The worker runs here as a
    // local process, which the hook's scaling of its Deployment cannot
    // stop: it is stopped first.
    let c = Tenant::create(cp, &cp.unique("handback")).await;
    c.wait_custody().await;
    gate.kill_worker();
    helm_ok(
        "uninstall",
        &[
            "uninstall",
            "volume-gate",
            "--namespace",
            NS,
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
            "--wait",
        ],
    );
    gate.webhook.kill(libc::SIGTERM);

    for (kind, plural) in WEBHOOK_CONFIGURATIONS {
        let left =
            Api::<DynamicObject>::all_with(client.clone(), &webhook_configuration(kind, plural))
                .list(&ListParams::default())
                .await
                .unwrap();
        assert!(
            left.items
                .iter()
                .all(|o| o.metadata.name.as_deref() != Some("volume-gate")),
            "{kind} left"
        );
    }
    let roles: Vec<String> = Api::<ClusterRole>::all(client.clone())
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|r| r.metadata.name)
        .filter(|n| n.starts_with("volume-gate"))
        .collect();
    assert!(roles.is_empty(), "ClusterRoles left: {roles:?}");
    let bindings: Vec<String> = Api::<ClusterRoleBinding>::all(client.clone())
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|r| r.metadata.name)
        .filter(|n| n.starts_with("volume-gate"))
        .collect();
    assert!(
        bindings.is_empty(),
        "ClusterRoleBindings left: {bindings:?}"
    );
    let accounts: Vec<String> = Api::<ServiceAccount>::namespaced(client.clone(), NS)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|r| r.metadata.name)
        .filter(|n| n.starts_with("volume-gate"))
        .collect();
    assert!(accounts.is_empty(), "ServiceAccounts left: {accounts:?}");
    c.assert_out_of_custody().await;
}
