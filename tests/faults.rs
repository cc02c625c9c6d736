//! Faults on the real control plane: a stopped driver, a killed worker, a
//! tenant API that goes away mid-phase, Retain residue. After each: zero
//! leaked volumes, or Blocked naming the exact residue, never a silent loss.

use volume_gate_testkit as common;

use std::time::Duration;

use k8s_openapi::api::rbac::v1::Role;
use kube::api::{Api, PostParams};

use common::tenant::{RETAIN_STORAGE_CLASS, STORAGE_CLASS, Tenant};
use volume_gate::record::{Inventory, Phase};

/// Short bounds: a pass waits 8s for the PVs before Blocked.
fn env() -> &'static common::Env {
    let args = [
        "--wait-bound",
        "8s",
        "--retry-base",
        "1s",
        "--retry-max",
        "3s",
        "--probe-timeout",
        "3s",
        "--lease-duration",
        "3s",
    ];
    common::gated_with(args.map(String::from).to_vec())
}

async fn tenant_with_volumes(app: &str, claims: &[&str]) -> Tenant {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique(app)).await;
    t.wait_custody().await;
    t.with_held_claims(claims).await;
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_driver_blocks_naming_each_remaining_volume_and_recovery_frees_them() {
    let _serial = common::serial();
    let env = env();
    let t = tenant_with_volumes("stuck", &["a", "b"]).await;
    let disks = env.sim.volumes_of(&t.namespace, &t.name);
    assert_eq!(disks.len(), 2);
    let handles = t.volume_handles().await;
    assert_eq!(handles.len(), 2);
    t.set_driver(&env.sim, false).await;

    t.delete_parent().await;
    let record = t.wait_phase(Phase::Blocked, Duration::from_secs(60)).await;
    let message = record.message.unwrap_or_default();
    for h in &handles {
        assert!(
            message.contains(h),
            "Blocked names volumeHandle {h}: {message}"
        );
    }
    assert!(
        message.contains("csi.volume-gate.test"),
        "and the driver: {message}"
    );
    t.wait_event("Warning", "Blocked", |note| note.contains(&handles[0]))
        .await;
    assert_eq!(
        env.sim.volumes_of(&t.namespace, &t.name),
        disks,
        "nothing freed, nothing lost while the driver is stopped"
    );

    // The driver comes back: the retry frees everything and the teardown ends.
    t.set_driver(&env.sim, true).await;
    t.wait_parent_gone(Duration::from_secs(90)).await;
    assert!(env.sim.volumes_of(&t.namespace, &t.name).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_after_the_inventory_and_again_mid_wait_is_replaced_and_the_next_one_finishes()
 {
    let _serial = common::serial();
    let env = env();
    let t = tenant_with_volumes("killed", &["a", "b", "c"]).await;
    t.set_driver(&env.sim, false).await;
    t.delete_parent().await;

    // Killed as soon as the inventory is in the record.
    t.wait_inventory().await;
    env.gate.as_ref().unwrap().lock().unwrap().kill_worker();
    env.gate.as_ref().unwrap().lock().unwrap().start_worker();

    // Killed again while it waits for the PVs (the driver is stopped).
    let record = t
        .history
        .next_record(
            "a new pass waiting on the PVs",
            Duration::from_secs(60),
            |r| match (&r.phase, &r.message, &r.inventory) {
                (Some(Phase::Releasing), Some(m), Some(_)) => {
                    m.contains("deleting claims") || m.contains("freed")
                }
                (Some(Phase::Blocked), _, Some(_)) => true,
                _ => false,
            },
        )
        .await;
    let inventory = record.inventory.expect("inventory");
    assert_eq!(inventory.total, 3, "the inventory survived the first kill");
    env.gate.as_ref().unwrap().lock().unwrap().kill_worker();
    env.gate.as_ref().unwrap().lock().unwrap().start_worker();

    t.set_driver(&env.sim, true).await;
    t.wait_parent_gone(Duration::from_secs(120)).await;
    assert!(
        env.sim.volumes_of(&t.namespace, &t.name).is_empty(),
        "the third worker finished the job"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_api_killed_mid_phase_blocks_and_the_phase_finishes_when_it_returns() {
    let _serial = common::serial();
    let env = env();
    let t = tenant_with_volumes("apidown", &["a"]).await;
    t.set_driver(&env.sim, false).await;
    t.delete_parent().await;
    t.wait_inventory().await;
    env.cp.cluster_down(&t.cluster.name);
    let record = t.wait_phase(Phase::Blocked, Duration::from_secs(60)).await;
    let message = record.message.unwrap_or_default();
    assert!(message.contains("tenant API"), "{message}");
    assert_eq!(
        record.inventory.map(|i| i.total),
        Some(1),
        "the inventory is kept while the API is away"
    );

    env.cp.cluster_up(&t.cluster.name);
    t.set_driver(&env.sim, true).await;
    t.wait_parent_gone(Duration::from_secs(120)).await;
    assert!(env.sim.volumes_of(&t.namespace, &t.name).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retain_volumes_are_named_as_residue_and_an_override_keeps_them_on_storage() {
    let _serial = common::serial();
    let env = env();
    // The tenant chart's hook as upstream ships it: its DataVolume step
    // deletes the tenant's DataVolumes by label once the teardown goes on,
    // whatever their volume's reclaim policy.
    let t = Tenant::create(env.cp, &env.cp.unique("retain")).await;
    t.wait_custody().await;
    t.with_claims_of(&[("kept", RETAIN_STORAGE_CLASS), ("freed", STORAGE_CLASS)])
        .await;
    t.delete_parent().await;

    // Blocked with the Delete volume freed (not an earlier Blocked that a
    // slow detach can cause, naming both).
    let record = t.wait_blocked_with_left(1, Duration::from_secs(120)).await;
    let message = record.message.clone().unwrap_or_default();
    assert!(
        message.contains("Retain") && message.contains("override"),
        "{message}"
    );
    let inv: Inventory = record.inventory.expect("inventory");
    assert_eq!(
        (inv.total, inv.left()),
        (2, 1),
        "the Delete volume was freed, the Retain one is residue"
    );
    let kept = inv.remaining().next().expect("the residue");
    let handle = kept.handle.clone().expect("its volumeHandle");
    assert!(
        kept.is_retain() && message.contains(&handle),
        "the residue is named by its volumeHandle: {message}"
    );
    // Its disk was kept before the inventory saying so was written: the
    // management PV behind it now has reclaim policy Retain.
    let infra = kept.infra.clone().expect("its DataVolume");
    assert!(infra.kept, "the record says the disk is kept: {infra:?}");
    let disks = t.kept_disks().await;
    let pv = disks
        .iter()
        .find(|d| d.metadata.name == infra.pv)
        .unwrap_or_else(|| panic!("the kept disk {:?} is labelled: {disks:?}", infra.pv));
    assert_eq!(
        pv.spec
            .as_ref()
            .unwrap()
            .persistent_volume_reclaim_policy
            .as_deref(),
        Some("Retain")
    );
    // On storage, only the retained disk stays (the freed one's management
    // PVC goes a moment after its DataVolume: wait for it, it never comes back).
    let residue = env.sim.wait_disks(&t.namespace, &t.name, 1).await;

    t.grant_override("platform-admins").await;
    let alice = env.cp.client_as("alice", &["platform-admins"]).await;
    t.annotate_override(&alice, "retained by design; archived")
        .await
        .expect("override accepted");
    let note = t.wait_event("Warning", "Overridden", |_| true).await;
    let pv_name = infra.pv.clone().unwrap();
    for needle in [
        "1 disk stays on storage, kept",
        pv_name.as_str(),
        "kubectl get pv -l",
    ] {
        assert!(
            note.contains(needle),
            "the Warning says what stays ({needle:?}): {note}"
        );
    }
    t.wait_parent_gone(Duration::from_secs(120)).await;
    // The hook's DataVolume step ran: the Retain disk's DataVolume is gone,
    // its management PV Released, and the disk is still on storage.
    assert!(
        t.datavolumes()
            .get_opt(&infra.name)
            .await
            .unwrap()
            .is_none(),
        "the hook deleted the DataVolume by label"
    );
    common::wait::eventually("the kept PV Released", Duration::from_secs(60), || async {
        let pvs = t.kept_disks().await;
        match pvs
            .iter()
            .find(|d| d.metadata.name.as_deref() == Some(pv_name.as_str()))
        {
            Some(d) if d.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Released") => {
                Ok(())
            }
            other => Err(format!("{:?}", other.map(|d| d.status.clone()))),
        }
    })
    .await;
    assert_eq!(
        env.sim.volumes_of(&t.namespace, &t.name),
        residue,
        "exactly the residue stays, by decision"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_changes_to_the_parent_survive_the_record_writes_and_the_custody_removal() {
    let _serial = common::serial();
    let env = env();
    let t = tenant_with_volumes("concurrent", &["a"]).await;
    let patch = |v: serde_json::Value| {
        let api = t.hr_api();
        let name = t.name.clone();
        async move {
            api.patch(
                &name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&v),
            )
            .await
            .expect("patch parent")
        }
    };
    // Two finalizers of others: one before ours (removed mid-phase, which
    // shifts our index), one that holds the parent after custody ends.
    let mut finalizers = vec!["example.com/early".to_string()];
    finalizers.extend(
        t.parent()
            .await
            .unwrap()
            .metadata
            .finalizers
            .unwrap_or_default(),
    );
    finalizers.push("example.com/hold".to_string());
    patch(serde_json::json!({"metadata": {"finalizers": finalizers}})).await;
    t.set_driver(&env.sim, false).await;
    t.delete_parent().await;
    t.wait_inventory().await;
    // Others write to the parent while the phase runs.
    patch(serde_json::json!({"metadata": {"annotations": {"example.com/owner": "team-a"}}})).await;
    let remaining: Vec<String> = t
        .parent()
        .await
        .unwrap()
        .metadata
        .finalizers
        .unwrap_or_default()
        .into_iter()
        .filter(|f| f != "example.com/early")
        .collect();
    patch(serde_json::json!({"metadata": {"finalizers": remaining}})).await;

    t.set_driver(&env.sim, true).await;
    let after = common::wait::eventually(
        "custody ended, the other finalizer kept",
        Duration::from_secs(90),
        || async {
            let p = t.parent().await.ok_or("parent gone too early")?;
            let f = p.metadata.finalizers.clone().unwrap_or_default();
            if f.contains(&common::profile().custody_finalizer) {
                Err(format!("{f:?}"))
            } else {
                Ok(p)
            }
        },
    )
    .await;
    let annotations = after.metadata.annotations.unwrap_or_default();
    assert_eq!(
        annotations.get("example.com/owner").map(String::as_str),
        Some("team-a"),
        "not clobbered by the record writes"
    );
    assert_eq!(
        annotations.get(&common::keys().phase).map(String::as_str),
        Some("Released")
    );
    assert!(
        after
            .metadata
            .finalizers
            .unwrap_or_default()
            .contains(&"example.com/hold".to_string())
    );
    assert!(env.sim.volumes_of(&t.namespace, &t.name).is_empty());
    patch(serde_json::json!({"metadata": {"finalizers": null}})).await;
    t.wait_parent_gone(Duration::from_secs(60)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_worker_exits_by_itself_and_the_next_one_leads() {
    // The kubelet stops a Pod with SIGTERM, and kills it only after the
    // grace period: a worker must exit by itself and release its Lease.
    // (It once kept waiting on a clone of its leadership receiver.)
    let _serial = common::serial();
    let env = env();
    let t = tenant_with_volumes("sigterm", &["a"]).await;
    let gate = env.gate.as_ref().unwrap();
    let next = {
        let mut g = gate.lock().unwrap();
        let status = g.terminate_worker(Duration::from_secs(60));
        let log = g.worker_log();
        let status = status.unwrap_or_else(|e| panic!("{e}; its log:\n{log}"));
        assert!(
            status.success(),
            "the worker exited with {status} after SIGTERM; its log:\n{log}"
        );
        g.start_worker();
        g.worker_identity()
    };
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
        kube::Api::namespaced(env.cp.management_client().await, "volume-gate");
    common::wait::eventually(
        "the new worker holds the Lease",
        Duration::from_secs(60),
        || async {
            let l = leases
                .get("volume-gate-worker")
                .await
                .map_err(|e| e.to_string())?;
            let holder = l.spec.and_then(|s| s.holder_identity).unwrap_or_default();
            if holder == next {
                Ok(())
            } else {
                Err(format!("held by {holder:?}"))
            }
        },
    )
    .await;
    // And it acts: the tenant is released.
    t.delete_parent().await;
    t.wait_parent_gone(Duration::from_secs(120)).await;
    assert!(
        env.sim.volumes_of(&t.namespace, &t.name).is_empty(),
        "the new leader freed the volume"
    );
}

/// The CSI controller loses its rights mid-phase (its Role `R-kcsi` edited
/// by a cluster admin, which the gate does not review: only deletes of the
/// identity are): the driver, acting with its ServiceAccount's token, gets
/// the API server's own 403 when it goes to delete a DataVolume; the
/// external-provisioner reports it in an Event on the PV and retries, and
/// the worker's Blocked quotes it. With the rights back, the retry frees
/// everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drivers_rbac_removed_mid_phase_surfaces_as_the_api_servers_403_in_the_record() {
    let _serial = common::serial();
    let env = env();
    let t = tenant_with_volumes("rbac", &["a", "b"]).await;
    let disks = env.sim.volumes_of(&t.namespace, &t.name);
    assert_eq!(disks.len(), 2);
    // Hold the phase at "PVs released, not freed" while the Role changes.
    t.set_driver(&env.sim, false).await;
    t.delete_parent().await;
    t.wait_phase(Phase::Blocked, Duration::from_secs(60)).await;

    let roles = Api::<Role>::namespaced(t.management.clone(), &t.namespace);
    let name = format!("{}-kcsi", t.name);
    let full = roles.get(&name).await.expect("the controller's Role");
    let mut cut = full.clone();
    for rule in cut.rules.iter_mut().flatten() {
        if rule.resources.iter().flatten().any(|r| r == "datavolumes") {
            rule.verbs = vec!["create".into()];
        }
    }
    cut.metadata.managed_fields = None;
    roles
        .replace(&name, &PostParams::default(), &cut)
        .await
        .expect("a cluster admin edits the Role mid-phase");
    t.set_driver(&env.sim, true).await;

    let record = t
        .history
        .next_record("Blocked quoting the 403", Duration::from_secs(120), |r| {
            r.phase == Some(Phase::Blocked)
                && r.message
                    .as_deref()
                    .is_some_and(|m| m.contains("VolumeFailedDelete") && m.contains("forbidden"))
        })
        .await;
    let message = record.message.unwrap_or_default();
    let subject = format!("system:serviceaccount:{}:{name}", t.namespace);
    assert!(
        message.contains(&subject) && message.contains("cannot get resource"),
        "the API server's own refusal, naming the controller's ServiceAccount {subject}: {message}"
    );
    assert_eq!(
        env.sim.volumes_of(&t.namespace, &t.name),
        disks,
        "nothing freed without the rights"
    );

    let mut back = roles.get(&name).await.unwrap();
    back.rules = full.rules.clone();
    roles
        .replace(&name, &PostParams::default(), &back)
        .await
        .expect("the rights restored");
    t.wait_parent_gone(Duration::from_secs(180)).await;
    assert!(env.sim.volumes_of(&t.namespace, &t.name).is_empty());
}
