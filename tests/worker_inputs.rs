//! What the worker reads, and why none of it steers it
//! (`docs/worker-inputs.md`): every row of that table walked. A row
//! `walked` is a case here, run on the real control plane with the shipped
//! manifests as someone who may edit a tenant's namespace (`mallory`, no
//! override permission); a row proven elsewhere names its test, which must
//! exist. A row with no case, or a case with no row, fails the walk; every
//! case runs (at once: each has tenants of its own) before it fails, so a
//! red run lists every row that is wrong.

use volume_gate_testkit as common;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use common::tenant::{RETAIN_STORAGE_CLASS, STORAGE_CLASS, Tenant, TenantOptions};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, DynamicObject, PostParams};
use serde_json::json;
use volume_gate::record::Phase;

fn env() -> &'static common::Env {
    common::gated_short()
}

const CLUSTER_LABEL: &str = "cluster.x-k8s.io/cluster-name";

/// A gone tenant's kept disk: `r` in `ns` had one Retain volume, was
/// deleted and overridden, and the tenant chart's hook deleted its
/// DataVolume: its management PV is Released, kept for it. Returns the
/// tenant, its management PV, and that PV's old claim (the DataVolume's
/// name).
async fn kept_disk_of_a_gone_tenant(ns: &str, r: &str) -> (Tenant, String, String) {
    let env = env();
    let gone = Tenant::create(env.cp, TenantOptions::new(r).in_namespace(ns)).await;
    gone.wait_custody().await;
    gone.with_claims_of(&[("kept", RETAIN_STORAGE_CLASS)]).await;
    gone.delete_parent().await;
    let record = gone
        .wait_blocked_with_left(1, Duration::from_secs(120))
        .await;
    let infra = record
        .inventory
        .and_then(|i| i.volumes.first().and_then(|v| v.infra.clone()))
        .expect("the Retain volume's disk");
    assert!(infra.kept, "{infra:?}");
    let pv = infra.pv.clone().expect("its management PV");
    gone.grant_override("platform-admins").await;
    let alice = env.cp.client_as("alice", &["platform-admins"]).await;
    gone.annotate_override(&alice, "abandoned; its Retain disk is kept")
        .await
        .expect("override accepted");
    gone.wait_parent_gone(Duration::from_secs(120)).await;
    let pvs: Api<PersistentVolume> = Api::all(gone.management.clone());
    common::wait::eventually("the kept PV Released", Duration::from_secs(60), || async {
        let p = pvs.get(&pv).await.map_err(|e| e.to_string())?;
        match p.status.as_ref().and_then(|s| s.phase.as_deref()) {
            Some("Released") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    (gone, pv, infra.name)
}

/// The kept disk `pv` of `gone` is still kept: on storage, reclaim policy
/// Retain, kept for it.
async fn still_kept(gone: &Tenant, pv: &str, residue: &[String]) {
    let env = env();
    assert_eq!(
        env.sim.volumes_of(&gone.namespace, &gone.name),
        residue,
        "the gone tenant's disk is still on storage"
    );
    let p = Api::<PersistentVolume>::all(gone.management.clone())
        .get(pv)
        .await
        .expect("the kept PV is still there");
    assert_eq!(
        p.spec
            .as_ref()
            .and_then(|s| s.persistent_volume_reclaim_policy.as_deref()),
        Some("Retain")
    );
    let keys = common::keys();
    assert_eq!(
        p.metadata
            .annotations
            .unwrap_or_default()
            .get(&keys.kept_for)
            .map(String::as_str),
        Some(format!("{}/{}", gone.namespace, gone.name).as_str())
    );
}

/// A PVC `name` in `ns` made by `client`, labelled for tenant `r`, naming
/// PV `volume_name` if given; it binds to nothing (no such class).
async fn decoy_claim(
    client: &kube::Client,
    ns: &str,
    name: &str,
    r: &str,
    volume_name: Option<&str>,
) {
    let claim: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {CLUSTER_LABEL: r}},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "no-such-class",
                 "volumeName": volume_name,
                 "resources": {"requests": {"storage": "1Gi"}}}}))
    .unwrap();
    Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &claim)
        .await
        .expect("an editor may create a PVC");
}

async fn a_claim_under_a_gone_tenants_name_does_not_let_its_kept_disk_go_in_a_siblings_teardown() {
    let env = env();
    let cp = env.cp;
    let ns = cp.unique("tenant-siblings");
    cp.namespace(&ns).await;
    let (gone, pv, old_claim) = kept_disk_of_a_gone_tenant(&ns, &cp.unique("gone")).await;
    let residue = env.sim.wait_disks(&gone.namespace, &gone.name, 1).await;

    let sibling = Tenant::create(
        cp,
        TenantOptions::new(&cp.unique("sibling")).in_namespace(&ns),
    )
    .await;
    sibling.wait_custody().await;
    sibling.with_held_claims(&["data"]).await;
    // Mallory edits the namespace: a claim under the gone claim's name,
    // labelled for the sibling, which she then deletes.
    let m = common::editor::mallory(cp, &[&ns]).await;
    decoy_claim(&m, &ns, &old_claim, &sibling.name, None).await;
    sibling.delete_parent().await;
    sibling.wait_parent_gone(Duration::from_secs(180)).await;
    assert!(
        env.sim.volumes_of(&ns, &sibling.name).is_empty(),
        "the sibling's own disk was freed"
    );
    still_kept(&gone, &pv, &residue).await;
}

async fn a_claim_of_another_namespace_naming_a_kept_disk_does_not_let_it_go() {
    let env = env();
    let cp = env.cp;
    let ns = cp.unique("tenant-keeper");
    cp.namespace(&ns).await;
    let (gone, pv, _) = kept_disk_of_a_gone_tenant(&ns, &cp.unique("gone")).await;
    let residue = env.sim.wait_disks(&gone.namespace, &gone.name, 1).await;

    // Mallory's own namespace and tenant; her claim names the kept disk.
    let own = cp.unique("tenant-mallory");
    cp.namespace(&own).await;
    let hers = Tenant::create(
        cp,
        TenantOptions::new(&cp.unique("hers")).in_namespace(&own),
    )
    .await;
    hers.wait_custody().await;
    hers.with_held_claims(&["data"]).await;
    let m = common::editor::mallory(cp, &[&own]).await;
    decoy_claim(&m, &own, "borrowed", &hers.name, Some(&pv)).await;
    hers.delete_parent().await;
    hers.wait_parent_gone(Duration::from_secs(180)).await;
    still_kept(&gone, &pv, &residue).await;
}

async fn a_parent_with_no_cluster_does_not_pin_a_live_volume_of_another_namespace() {
    let env = env();
    let cp = env.cp;
    let victim = Tenant::create(cp, &cp.unique("pinned")).await;
    victim.wait_custody().await;
    victim.with_held_claims(&["data"]).await;
    let disks = victim.infra_objects(None).await.volumes;
    let [disk] = disks.as_slice() else {
        panic!("one management PV: {disks:?}")
    };

    // Mallory's parent with nothing behind it, and a claim of her namespace
    // labelled for it that names the victim's disk.
    let own = cp.unique("tenant-decoy");
    cp.namespace(&own).await;
    let m = common::editor::mallory(cp, &[&own]).await;
    let decoy = "kubernetes-decoy";
    let d = Tenant::attach(cp, &own, decoy, &victim.cluster).await;
    let hrs: Api<DynamicObject> =
        Api::namespaced_with(m.clone(), &own, &common::gate::helmrelease_resource());
    common::tenant::paper_parent(&hrs, decoy).await;
    decoy_claim(&m, &own, "pin", decoy, Some(disk)).await;
    d.delete_parent().await;
    // Unreachable, with no inventory: what is its own is kept.
    d.wait_phase(Phase::Blocked, Duration::from_secs(60)).await;
    let p = Api::<PersistentVolume>::all(victim.management.clone())
        .get(disk)
        .await
        .expect("the victim's disk");
    let keys = common::keys();
    assert!(
        !p.metadata
            .labels
            .clone()
            .unwrap_or_default()
            .contains_key(&keys.kept),
        "the victim's disk was not pinned for the decoy: {:?}",
        p.metadata
    );
    assert_eq!(
        p.spec
            .as_ref()
            .and_then(|s| s.persistent_volume_reclaim_policy.as_deref()),
        Some("Delete")
    );
    // Its owner's teardown frees it.
    victim.delete_parent().await;
    victim.wait_parent_gone(Duration::from_secs(180)).await;
    assert!(
        env.sim
            .volumes_of(&victim.namespace, &victim.name)
            .is_empty()
    );
}

async fn an_override_on_a_cut_record_keeps_every_disk_that_is_not_delete() {
    let env = env();
    let cp = env.cp;
    let t = Tenant::create(cp, &cp.unique("crowded")).await;
    t.wait_custody().await;
    // Enough volumes with long claim names that the record cannot hold
    // them all (the inventory is cut at 96 KiB); one in ten is Retain.
    let names: Vec<String> = (0..220)
        .map(|i| format!("{i:03}-{}", "x".repeat(246)))
        .collect();
    let claims: Vec<(&str, &str)> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            (
                n.as_str(),
                if i % 10 == 0 {
                    RETAIN_STORAGE_CLASS
                } else {
                    STORAGE_CLASS
                },
            )
        })
        .collect();
    // Bound, mounted by nothing (a Pod of 220 volumes is not the point).
    t.tenant_namespace("apps").await;
    for (name, class) in &claims {
        t.claim("apps", name, class).await;
    }
    t.wait_settled(claims.len(), 0).await;
    let retained = claims
        .iter()
        .filter(|(_, c)| *c == RETAIN_STORAGE_CLASS)
        .count();
    // The driver stops: nothing is freed, the record is cut, and an
    // administrator overrides.
    t.set_driver(&env.sim, false).await;
    t.delete_parent().await;
    let record = t.wait_phase(Phase::Blocked, Duration::from_secs(300)).await;
    let inv = record.inventory.expect("inventory");
    assert!(
        inv.truncated,
        "the record was cut: {} of {} listed",
        inv.volumes.len(),
        inv.total
    );
    assert_eq!(inv.total, claims.len());
    t.grant_override("platform-admins").await;
    let alice = cp.client_as("alice", &["platform-admins"]).await;
    t.annotate_override(&alice, "abandoned")
        .await
        .expect("override accepted");
    t.wait_event("Warning", "Overridden", |_| true).await;
    // Every disk of a Retain volume is kept, named in the record or not.
    let kept = t.kept_disks().await;
    let retain_claims: Vec<&str> = claims
        .iter()
        .filter(|(_, c)| *c == RETAIN_STORAGE_CLASS)
        .map(|(n, _)| *n)
        .collect();
    let tenant_pvs: Vec<PersistentVolume> = Api::<PersistentVolume>::all(t.api.clone())
        .list(&Default::default())
        .await
        .expect("the tenant's PVs")
        .items;
    let retain_handles: Vec<String> = tenant_pvs
        .iter()
        .filter(|p| {
            p.spec
                .as_ref()
                .and_then(|s| s.claim_ref.as_ref())
                .and_then(|r| r.name.as_deref())
                .is_some_and(|n| retain_claims.contains(&n))
        })
        .filter_map(|p| {
            p.spec
                .as_ref()?
                .csi
                .as_ref()
                .map(|c| c.volume_handle.clone())
        })
        .collect();
    assert_eq!(retain_handles.len(), retained);
    for handle in &retain_handles {
        assert!(
            kept.iter().any(|pv| pv
                .spec
                .as_ref()
                .and_then(|s| s.claim_ref.as_ref())
                .and_then(|r| r.name.as_deref())
                == Some(handle.as_str())),
            "the disk of Retain volume {handle} is kept ({} kept)",
            kept.len()
        );
    }
}

/// The table's rows: `(id, proven by)`, in order.
fn table() -> Vec<(String, String)> {
    let doc = std::fs::read_to_string(common::cluster::repo_root().join("docs/worker-inputs.md"))
        .expect("docs/worker-inputs.md");
    let body = doc
        .split_once("<!-- worker-inputs:begin -->")
        .and_then(|(_, rest)| rest.split_once("<!-- worker-inputs:end -->"))
        .map(|(table, _)| table)
        .expect("the table between its markers");
    body.lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .map(|l| {
            let id = l.split('`').next().unwrap_or_default().to_string();
            let proven = l
                .trim_end()
                .trim_end_matches('|')
                .rsplit('|')
                .next()
                .unwrap_or_default()
                .trim()
                .to_string();
            (id, proven)
        })
        .collect()
}

type Case = Pin<Box<dyn Future<Output = ()> + Send>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_of_the_worker_inputs_table_is_walked() {
    let mut cases: BTreeMap<&str, fn() -> Case> = BTreeMap::new();
    cases.insert("claim.name-of-a-gone-claim", || {
        Box::pin(
            a_claim_under_a_gone_tenants_name_does_not_let_its_kept_disk_go_in_a_siblings_teardown(
            ),
        )
    });
    cases.insert("claim.volume-name-across-namespaces", || {
        Box::pin(a_claim_of_another_namespace_naming_a_kept_disk_does_not_let_it_go())
    });
    cases.insert("claim.volume-name-pins-nothing", || {
        Box::pin(a_parent_with_no_cluster_does_not_pin_a_live_volume_of_another_namespace())
    });
    cases.insert("record.cut-inventory", || {
        Box::pin(an_override_on_a_cut_record_keeps_every_disk_that_is_not_delete())
    });

    let rows = table();
    assert!(rows.len() >= cases.len(), "the table was read: {rows:?}");
    let mut wrong = Vec::new();
    let mut running = Vec::new();
    for (id, proven) in &rows {
        if proven == "walked" {
            match cases.remove(id.as_str()) {
                Some(case) => running.push((id.clone(), tokio::spawn(case()))),
                None => wrong.push(format!("{id}: walked, but no case here")),
            }
            continue;
        }
        // `path` `test name`: the test exists there.
        let parts: Vec<&str> = proven.split('`').filter(|p| !p.trim().is_empty()).collect();
        let [path, test] = parts.as_slice() else {
            wrong.push(format!("{id}: \"{proven}\" names no test (`path` `name`)"));
            continue;
        };
        let text =
            std::fs::read_to_string(common::cluster::repo_root().join(path)).unwrap_or_default();
        if !text.contains(&format!("fn {test}(")) {
            wrong.push(format!("{id}: {path} has no test {test}"));
        }
    }
    for id in cases.keys() {
        wrong.push(format!("{id}: a case with no row"));
    }
    for (id, case) in running {
        if let Err(e) = case.await {
            wrong.push(format!("{id}: {e}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "rows that are wrong:\n{}",
        wrong.join("\n")
    );
}
