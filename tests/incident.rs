//! The seed's incident, reproduced on the real control plane with no gate,
//! on real Flux and the tenant chart's real pre-delete hook: deleting a
//! tenant, or its namespace, leaves every one of its volumes on storage.
//! This is the bug volume-gate closes; these tests prove the harness can
//! show it (so the gated tests can fail).
//!
//! The world here is the seed's: the Proxmox path, where a volume is the
//! tenant CSI driver's alone (profile `infra: null`: no management object
//! behind it), so only the driver can free it. The KubeVirt path, with a
//! DataVolume behind each volume, is in `teardown.rs`.

use volume_gate_testkit as common;

use std::time::Duration;

/// The seed's incident on real Flux, with no gate: the tenant chart's real
/// pre-delete hook suspends and deletes the child releases (the CSI driver
/// among them) before anyone deleted a claim, then the control plane, and
/// every volume stays on storage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_gate_the_real_teardown_leaks_every_volume() {
    let (env, t, before) = ungated_tenant_with_volumes("leak").await;

    t.delete_parent().await;
    t.wait_parent_gone(Duration::from_secs(180)).await;
    // The TenantControlPlane object goes at once and the simulator stops the
    // tenant API when its watch delivers that, so the parent can be gone a
    // moment before (seen in CI at 14bd4b8): wait for the tenant API's end in
    // the simulator's log (append-only), after which nothing can free a volume.
    t.wait_api_stopped(&env.sim, Duration::from_secs(120)).await;

    let after = env.sim.volumes_of(&t.namespace, &t.name);
    assert_eq!(
        after, before,
        "THE INCIDENT, on real Flux: the hook took the CSI driver away before the claims, so every volume stayed"
    );
    let runs = env.sim.hook_runs(&t.namespace, &t.name);
    let render = || {
        runs.iter()
            .map(|r| r.render())
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(runs.len(), 1, "one run of the hook did it:\n{}", render());
    assert!(
        runs[0]
            .output
            .iter()
            .any(|l| l == "Cleanup completed successfully"),
        "{}",
        render()
    );
}

/// The incident on real Flux by the other road, with no gate: deleting the
/// tenant's namespace deletes the CSI driver's release and the control plane
/// with everything else, and no one deleted a claim: once the tenant API is
/// stopped nothing can free a volume, and every one is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_gate_deleting_the_tenant_namespace_leaks_every_volume() {
    let (env, t, before) = ungated_tenant_with_volumes("leakns").await;

    t.delete_namespace().await;
    t.wait_api_stopped(&env.sim, Duration::from_secs(180)).await;

    let after = env.sim.volumes_of(&t.namespace, &t.name);
    assert_eq!(
        after, before,
        "THE INCIDENT, on real Flux, by namespace deletion: every volume stayed"
    );
}

/// With no gate, on real Flux: a tenant (namespace prefix `prefix`) with the
/// seed's workload, and the 4 volumes on storage.
async fn ungated_tenant_with_volumes(
    prefix: &str,
) -> (&'static common::Env, common::tenant::Tenant, Vec<String>) {
    let env = common::ungated_one_layer();
    let t = common::tenant::Tenant::create(env.cp, &env.cp.unique(prefix)).await;
    t.incident_workload().await;
    let before = env.sim.volumes_of(&t.namespace, &t.name);
    assert_eq!(
        before.len(),
        4,
        "the driver provisioned one disk per claim: {before:?}"
    );
    (env, t, before)
}
