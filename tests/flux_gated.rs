//! volume-gate on the real control plane with the real Flux helm-controller:
//! tenants installed from a tenant chart in the shape of Cozystack's
//! `kubernetes` application and torn down by its real pre-delete hook (a
//! shell Job run by the simulator's management node), retried by Flux's own
//! backoff. helm-controller here waits at least `MIN_RETRY_DELAY` (10
//! minutes) before retrying a failed uninstall, so a teardown that ends
//! within a few minutes was resumed by the worker's retry request.

use volume_gate_testkit as common;

use std::time::Duration;

use common::tenant::Tenant;
use volume_gate::record::Phase;

/// The hook's lines in the simulator's log for tenant `t` (the Job is
/// `R-pre-cleanup`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_real_flux_the_gate_fails_the_hook_until_the_volumes_are_freed_and_the_retry_request_finishes_the_teardown()
 {
    let env = common::gated();
    let t = Tenant::create(env.cp, &env.cp.unique("real")).await;
    t.wait_custody().await;
    t.incident_workload().await;
    assert_eq!(
        env.sim.volumes_of(&t.namespace, &t.name).len(),
        4,
        "one disk per claim"
    );

    // A driver that frees slowly: stopped until the hook has failed once.
    t.set_driver(&env.sim, false).await;
    t.delete_parent().await;

    // While the phase runs the gate holds: the hook's step 3 is refused,
    // the hook fails, and helm-controller records the failed uninstall
    // (what an operator sees in `kubectl get hr`).
    let message = t
        .next_uninstall_failed(Duration::from_secs(120), |_| true)
        .await;
    // Helm v4: "... failed early due to stalled resources: [Job/N/R-pre-cleanup status: 'Failed']".
    assert!(
        message.contains(&format!("Job/{}/{}-pre-cleanup", t.namespace, t.name))
            && message.contains("Failed"),
        "Flux names the failed hook: {message}"
    );
    let hook = env.sim.hook_lines(&t.namespace, &t.name);
    assert!(
        hook.iter()
            .any(|l| l.contains("denied the request") && l.contains("volume-gate")),
        "the hook's output carries the gate's refusal:\n{}",
        hook.join("\n")
    );
    assert!(
        hook.iter().any(|l| l.contains("exit 1 (Failed)")),
        "the refused run failed:\n{}",
        hook.join("\n")
    );

    t.set_driver(&env.sim, true).await;
    t.wait_parent_gone(Duration::from_secs(300)).await;
    let left = env.sim.volumes_of(&t.namespace, &t.name);
    assert!(
        left.is_empty(),
        "volumes left on storage after the teardown on real Flux: {left:?}\nsimulator log:\n{}",
        env.sim.log()
    );

    // The hook ran twice: refused at step 3 with the gate's message, then,
    // after Released, to the end.
    let hook = env.sim.hook_lines(&t.namespace, &t.name);
    let runs = hook.iter().filter(|l| l.contains(" running ")).count();
    assert!(
        runs >= 2,
        "the hook ran again after the refusal:\n{}",
        hook.join("\n")
    );
    assert!(
        hook.last()
            .is_some_and(|l| l.contains("exit 0 (Succeeded)")),
        "the last run succeeded:\n{}",
        hook.join("\n")
    );
    assert!(
        hook.iter()
            .any(|l| l.contains("Cleanup completed successfully")),
        "{}",
        hook.join("\n")
    );

    // What resumed it: the write that recorded Released asked for a retry,
    // and nothing before it did.
    let finalizers = t.assert_released_write_requests_a_retry();
    // And ends custody: helm-controller patches finalizers from the version
    // it read, so a custody finalizer still on the version it acts on would
    // be put back, refused on an object being deleted, and cost a backoff.
    assert_eq!(
        finalizers,
        [common::flux::FLUX_FINALIZER],
        "custody ends in the Released write"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_real_flux_deleting_the_tenant_namespace_frees_every_volume() {
    let env = common::gated();
    let t = Tenant::create(env.cp, &env.cp.unique("realns")).await;
    t.wait_custody().await;
    t.incident_workload().await;
    assert_eq!(
        env.sim.volumes_of(&t.namespace, &t.name).len(),
        4,
        "one disk per claim"
    );

    t.delete_namespace().await;
    t.wait_phase(Phase::Released, Duration::from_secs(180))
        .await;
    // The parent goes: its uninstall in the terminating namespace can fail
    // once (Helm cannot create the hook until Helm's release Secret is
    // deleted) and the worker's repeated request brings the next attempt.
    // The namespace itself is not awaited: the children's uninstall races
    // the tenant API server's stop (both are released together), and a
    // child that lost the race waits for helm-controller's next retry,
    // 10 minutes in this suite (seconds with Flux's default backoff).
    t.wait_parent_gone(Duration::from_secs(120)).await;
    let left = env.sim.volumes_of(&t.namespace, &t.name);
    assert!(
        left.is_empty(),
        "volumes left after deleting the namespace on real Flux: {left:?}"
    );
}
