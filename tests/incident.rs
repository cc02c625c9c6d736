//! The seed's incident, reproduced on the real control plane with no gate:
//! deleting a tenant through Cozystack's teardown leaves every one of its
//! volumes on storage. This is the bug volume-gate closes; these tests prove
//! the harness can show it (so the gated tests can fail).

mod common;

use std::time::Duration;

use common::tenant::Tenant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_gate_tenant_teardown_leaks_every_volume() {
    let env = common::ungated();
    let t = Tenant::create(env.cp, &env.cp.unique("leak")).await;
    t.incident_workload().await;
    let before = env.sim.volumes_of(&t.namespace, &t.name);
    assert_eq!(
        before.len(),
        4,
        "the driver provisioned one disk per claim: {before:?}"
    );

    t.delete_parent().await;
    t.wait_parent_gone(Duration::from_secs(120)).await;

    let after = env.sim.volumes_of(&t.namespace, &t.name);
    assert_eq!(
        after, before,
        "THE INCIDENT: with no gate, the teardown removed the CSI driver before anyone deleted the claims, so every \
         volume stayed on storage with the tenant's data; this is the bug volume-gate closes"
    );
    // And nothing is left that could name them: the tenant API is gone.
    assert!(
        env.sim.log().contains("stop"),
        "the tenant API server was stopped:\n{}",
        env.sim.log()
    );
}
