//! VolumeSnapshots with the gate installed (`docs/design.md` §5 step 5): a tenant
//! that serves snapshot.storage.k8s.io has its snapshots deleted by the
//! worker and their contents waited for, so storage keeps nothing of the
//! tenant; a tenant without that API is released as well, the absent API
//! skipped rather than reported as a failure.
//!
//! Snapshots are taken and freed by Kubernetes' own snapshot-controller and
//! csi-snapshotter (external-snapshotter), in the tenant cluster beside the
//! tenant's driver and in the management cluster beside its storage, as on
//! the KubeVirt path: a tenant snapshot is a VolumeSnapshot of the
//! DataVolume's PVC in the tenant's management namespace, and the snapshot
//! on storage is the management storage's.

use volume_gate_testkit as common;

/// The worker's Warning Events. helm-controller may record one
/// UninstallFailed: the gate refuses the hook while the management cluster
/// frees the disks after the tenant's PVs are gone.
const WORKER_WARNINGS: [&str; 3] = ["Blocked", "Overridden", "FreedFromManagement"];

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::tenant::{
    SNAPSHOT_GROUP, STORAGE_CLASS, Taken, Tenant, content_resource, snapshot_resource,
};
use common::wait::eventually;
use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::{Value, json};
use volume_gate::record::{Phase, Record};

fn env() -> &'static common::Env {
    common::gated()
}

/// Whether the tenant API serves the snapshot group at all.
async fn snapshot_api_served(t: &Tenant) -> Result<bool, String> {
    let groups = t.api.list_api_groups().await.map_err(|e| e.to_string())?;
    Ok(groups.groups.iter().any(|g| g.name == SNAPSHOT_GROUP))
}

/// What a watch on the tenant API saw: `Delete` events by name, and the
/// names seen with a deletionTimestamp.
#[derive(Default, Debug)]
struct Seen {
    synced: bool,
    terminating: Vec<String>,
    deleted: Vec<String>,
}

/// Watches `ar` in the tenant cluster from now on, recording deletions.
fn watch_deletions(
    t: &Tenant,
    ar: &ApiResource,
) -> (Arc<Mutex<Seen>>, tokio::task::JoinHandle<()>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let api: Api<DynamicObject> = Api::all_with(t.api.clone(), ar);
    let s = seen.clone();
    let task = tokio::spawn(async move {
        let stream = watcher(api, watcher::Config::default()).default_backoff();
        futures::pin_mut!(stream);
        while let Some(ev) = stream.next().await {
            // The tenant API is stopped at the end of the teardown: errors are expected then.
            let Ok(ev) = ev else { continue };
            let mut seen = s.lock().unwrap();
            match ev {
                watcher::Event::InitDone => seen.synced = true,
                watcher::Event::Apply(o) | watcher::Event::InitApply(o) => {
                    if o.metadata.deletion_timestamp.is_some() {
                        seen.terminating.push(o.metadata.name.unwrap_or_default());
                    }
                }
                watcher::Event::Delete(o) => seen.deleted.push(o.metadata.name.unwrap_or_default()),
                watcher::Event::Init => {}
            }
        }
    });
    (seen, task)
}

async fn wait_synced(seen: &Arc<Mutex<Seen>>, what: &str) {
    eventually(
        &format!("watch on {what} synced"),
        Duration::from_secs(30),
        || {
            let synced = seen.lock().unwrap().synced;
            async move {
                if synced {
                    Ok(())
                } else {
                    Err("listing".into())
                }
            }
        },
    )
    .await;
}

/// Every (phase, message) a parent showed, in order.
type Shown = Arc<Mutex<Vec<(Option<Phase>, Option<String>)>>>;

/// Records every (phase, message) the parent shows until it is gone.
fn follow_record(t: &Tenant) -> (Shown, tokio::task::JoinHandle<()>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (api, name, s) = (t.hr_api(), t.name.clone(), seen.clone());
    let task = tokio::spawn(async move {
        loop {
            match api.get_opt(&name).await {
                Ok(None) => return,
                Ok(Some(p)) => {
                    let r = Record::from_annotations(
                        &common::keys(),
                        &p.metadata.annotations.unwrap_or_default(),
                    );
                    let entry = (r.phase, r.message);
                    let mut seen = s.lock().unwrap();
                    if seen.last() != Some(&entry) {
                        seen.push(entry);
                    }
                }
                Err(_) => {}
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    (seen, task)
}

fn storage_record(env: &common::Env, file: &str) -> Value {
    let text = std::fs::read_to_string(env.sim.storage.join(file))
        .unwrap_or_else(|e| panic!("read {file}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {file}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_volume_snapshot_is_deleted_by_the_worker_and_storage_keeps_nothing_of_the_tenant()
 {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("snap")).await;
    t.wait_custody().await;
    t.install_snapshot_api().await;

    t.tenant_namespace("apps").await;
    t.claim("apps", "data", STORAGE_CLASS).await;
    t.pod("apps", "holder", &["data"]).await;
    t.wait_settled(1, 1).await;
    let volumes = env.sim.volumes_of(&t.namespace, &t.name);
    assert_eq!(volumes.len(), 1, "one volume provisioned: {volumes:?}");

    // Kubernetes' snapshot-controller and csi-snapshotter take it: ready,
    // bound to a content.
    let Taken {
        uid,
        content: content_name,
    } = t
        .take_snapshot("apps", "data-snap", "data", "sim-snapshots")
        .await;

    // The KubeVirt driver's CreateSnapshot: a VolumeSnapshot of the
    // DataVolume's PVC in the tenant's management namespace, named
    // snapshot-<UID of the tenant's VolumeSnapshot>, with the infra labels;
    // the content's snapshot handle is its name.
    let infra_name = format!("snapshot-{uid}");
    let infra = t
        .infra_snapshots()
        .get(&infra_name)
        .await
        .unwrap_or_else(|e| panic!("VolumeSnapshot {}/{infra_name}: {e}", t.namespace));
    assert_eq!(
        json!([infra.data.pointer("/spec/source/persistentVolumeClaimName")]),
        json!(t.volume_handles().await),
        "of the DataVolume's PVC behind the tenant volume"
    );
    assert_eq!(
        infra
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("cluster.x-k8s.io/cluster-name")),
        Some(&t.name),
        "labelled with the tenant's infra labels: {:?}",
        infra.metadata.labels
    );
    // The management storage's snapshot of the management disk.
    let on_storage = env.sim.volumes_of(&t.namespace, &t.name);
    assert_eq!(
        on_storage.len(),
        2,
        "one volume and one snapshot: {on_storage:?}"
    );
    let records: Vec<(String, Value)> = on_storage
        .iter()
        .map(|f| (f.clone(), storage_record(env, f)))
        .collect();
    let (snap_file, rec) = records
        .iter()
        .find(|(_, r)| r["kind"] == "snapshot")
        .unwrap_or_else(|| panic!("a snapshot on storage: {records:?}"));
    let (disk_file, _) = records
        .iter()
        .find(|(_, r)| r["kind"] == "volume")
        .unwrap_or_else(|| panic!("a disk on storage: {records:?}"));
    assert_eq!(rec["layer"], "management", "{rec}");
    assert_eq!(
        rec["sourceVolumeHandle"].as_str(),
        Some(disk_file.as_str()),
        "taken of the tenant volume's disk: {rec}"
    );
    assert_eq!(
        snap_file,
        &format!(
            "{}.{}.snapshot-{}",
            t.namespace,
            t.name,
            infra.metadata.uid.as_deref().unwrap_or_default()
        ),
        "named after the management VolumeSnapshot"
    );
    let snap_file = snap_file.clone();
    let contents: Api<DynamicObject> = Api::all_with(t.api.clone(), &content_resource());
    let content = contents
        .get(&content_name)
        .await
        .expect("VolumeSnapshotContent");
    assert_eq!(
        content
            .data
            .pointer("/spec/deletionPolicy")
            .and_then(Value::as_str),
        Some("Delete")
    );
    assert_eq!(
        content
            .data
            .pointer("/status/snapshotHandle")
            .and_then(Value::as_str),
        Some(infra_name.as_str())
    );

    // Watch the snapshot API through the teardown: the tenant API server is
    // stopped at its end, so what happened to them must be seen as it happens.
    let (vs_seen, vs_watch) = watch_deletions(&t, &snapshot_resource());
    let (vsc_seen, vsc_watch) = watch_deletions(&t, &content_resource());
    wait_synced(&vs_seen, "VolumeSnapshots").await;
    wait_synced(&vsc_seen, "VolumeSnapshotContents").await;

    t.delete_parent().await;
    t.wait_parent_gone(Duration::from_secs(180)).await;
    vs_watch.abort();
    vsc_watch.abort();

    // Nothing but the worker deletes VolumeSnapshots in this world (the hook
    // and Flux never touch the tenant cluster's objects), and it had to be
    // done while the driver was still there to free the snapshot.
    {
        let vs_seen = vs_seen.lock().unwrap();
        assert!(
            vs_seen.terminating.iter().any(|n| n == "data-snap"),
            "the VolumeSnapshot was deleted: {vs_seen:?}"
        );
        assert!(
            vs_seen.deleted.iter().any(|n| n == "data-snap"),
            "and went: {vs_seen:?}"
        );
        let vsc_seen = vsc_seen.lock().unwrap();
        assert!(
            vsc_seen.deleted.contains(&content_name),
            "its content {content_name} went: {vsc_seen:?}"
        );
    }

    // The tenant's driver deleted the management VolumeSnapshot (its
    // DeleteSnapshot) before it was uninstalled, and the management
    // storage freed the snapshot behind it.
    let log = env.sim.log();
    let tenant_key = format!(" {}/{} ", t.namespace, t.name);
    let ours: Vec<&str> = log.lines().filter(|l| l.contains(&tenant_key)).collect();
    let position = |what: &str, pred: &dyn Fn(&str) -> bool| {
        ours.iter()
            .position(|l| pred(l))
            .unwrap_or_else(|| panic!("{what}:\n{}", ours.join("\n")))
    };
    let unsnapped = position("the driver deleted the management VolumeSnapshot", &|l| {
        l.contains(" snapshot ")
            && l.contains(&format!(
                "deleted VolumeSnapshot {}/{infra_name}",
                t.namespace
            ))
    });
    position("the management storage freed the snapshot", &|l| {
        l.contains(" deleted ") && l.contains(&format!("snapshot {snap_file} "))
    });
    let deactivated = ours
        .iter()
        .position(|l| l.contains(" deactivated "))
        .unwrap_or(usize::MAX);
    assert!(
        unsnapped < deactivated,
        "the snapshot was deleted before the driver went:\n{}",
        ours.join("\n")
    );

    let events = eventually("Released event", Duration::from_secs(30), || async {
        let ev = t.events().await;
        if ev.iter().any(|(_, r, _)| r == "Released") {
            Ok(ev)
        } else {
            Err(format!("{ev:?}"))
        }
    })
    .await;
    assert!(
        !events
            .iter()
            .any(|(ty, reason, _)| ty == "Warning" && WORKER_WARNINGS.contains(&reason.as_str())),
        "released without a warning of the worker's: {events:?}"
    );

    let left = env.sim.volumes_of(&t.namespace, &t.name);
    assert!(
        !left.contains(&snap_file),
        "the snapshot was freed: {left:?}"
    );
    assert!(
        left.is_empty(),
        "storage holds nothing of the tenant (no volume, no snapshot): {left:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_without_the_snapshot_api_is_released_and_never_reports_a_snapshot_failure() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("nosnap")).await;
    t.wait_custody().await;
    assert_eq!(
        snapshot_api_served(&t).await,
        Ok(false),
        "this tenant cluster has no snapshot API"
    );
    t.tenant_namespace("apps").await;
    t.claim("apps", "data", STORAGE_CLASS).await;
    t.pod("apps", "holder", &["data"]).await;
    t.wait_settled(1, 1).await;
    assert_eq!(env.sim.volumes_of(&t.namespace, &t.name).len(), 1);

    let (records, follower) = follow_record(&t);
    t.delete_parent().await;
    t.wait_parent_gone(Duration::from_secs(180)).await;
    follower.abort();

    let records = records.lock().unwrap().clone();
    assert!(
        records.iter().any(|(p, _)| p.is_some()),
        "the record was followed: {records:?}"
    );
    assert!(
        !records.iter().any(|(p, _)| *p == Some(Phase::Blocked)),
        "never Blocked: {records:?}"
    );
    for (_, message) in &records {
        let m = message.as_deref().unwrap_or_default().to_lowercase();
        assert!(
            !m.contains("snapshot"),
            "the record mentions snapshots: {message:?}"
        );
    }

    let events = eventually("Released event", Duration::from_secs(30), || async {
        let ev = t.events().await;
        if ev.iter().any(|(_, r, _)| r == "Released") {
            Ok(ev)
        } else {
            Err(format!("{ev:?}"))
        }
    })
    .await;
    assert!(
        !events
            .iter()
            .any(|(ty, reason, _)| ty == "Warning" && WORKER_WARNINGS.contains(&reason.as_str())),
        "no Warning of the worker's: {events:?}"
    );
    for (_, reason, note) in &events {
        assert!(
            !note.to_lowercase().contains("snapshot"),
            "event {reason} mentions snapshots: {note}"
        );
    }
    let left = env.sim.volumes_of(&t.namespace, &t.name);
    assert!(
        left.is_empty(),
        "storage holds nothing of the tenant: {left:?}"
    );
}

/// A snapshot the tenant asked to keep (its class's deletionPolicy Retain):
/// the worker deletes the tenant's VolumeSnapshot, its content stays, so its
/// driver never calls DeleteSnapshot and the management VolumeSnapshot
/// behind it and the snapshot on storage stay too; `Released` says so
/// instead of waiting for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_whose_content_is_retain_is_kept_and_released_names_it() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("keepsnap")).await;
    t.wait_custody().await;
    let kept = t.with_snapshot("sim-snapshots-retain").await;
    t.infra_snapshots()
        .get(&kept)
        .await
        .unwrap_or_else(|e| panic!("the management VolumeSnapshot {kept}: {e}"));

    t.delete_parent().await;
    let record = t
        .wait_phase(Phase::Released, Duration::from_secs(180))
        .await;
    let message = record.message.unwrap_or_default();
    assert!(
        message.contains(&format!(
            "but 1 snapshot kept: VolumeSnapshot {kept} in the management cluster, not deleted by the tenant's \
             driver (a tenant content with deletionPolicy Retain"
        )),
        "Released names the kept snapshot: {message}"
    );
    t.wait_parent_gone(Duration::from_secs(180)).await;

    t.assert_infra_snapshot_kept(&kept).await;
    let left = env.sim.volumes_of(&t.namespace, &t.name);
    assert_eq!(
        left.len(),
        1,
        "only the kept snapshot is on storage: {left:?}"
    );
    assert_eq!(storage_record(env, &left[0])["kind"], "snapshot");
}
