//! Cozystack's own platform upgrade on live tenants, with the gate installed
//! (issue 40): the chart sources of every tenant's parent and children move
//! as Cozystack moves them, by the platform's own controllers, and nothing
//! is refused, nothing uninstalled, no volume touched; a namespace editor's
//! move of the same sources stays refused.
//!
//! What moves them is the platform's, not a stand-in: the real
//! cozystack-controller (`tests/cozystack`), whose
//! `ApplicationDefinitionHelmReconciler` rewrites every parent's
//! `spec.chartRef` when the ApplicationDefinition changes; and the real
//! helm-controller, running as Cozystack runs it (identity, flags, its own
//! retry delays: `FluxConfig::cozystack`), which upgrades each parent from
//! its new chart and applies the children that chart renders, their
//! sources moved too. The upgrade here renames every artifact, as a
//! platform release that renames the PackageSource or its variant does
//! (`<source>-<variant>-<component>`), and bumps the charts' versions, so
//! each release is really upgraded from its new source.

use volume_gate_testkit as common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::cozystack::{self, CozystackController};
use common::tenant::{Tenant, TenantOptions};
use common::wait::eventually;
use futures::StreamExt;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::runtime::watcher;
use serde_json::{Value, json};
use volume_gate::record::Phase;

/// The renamed PackageSource's artifacts after the upgrade.
const UPGRADED: &str = "cozystack-kubernetes-application-v2-kubevirt-kubernetes";
const TENANTS: usize = 3;

fn env() -> &'static common::Env {
    common::env(common::EnvConfig {
        flux: common::flux::FluxConfig::cozystack(),
        ..common::EnvConfig::gated()
    })
}

/// A copy of fixture chart `chart` at `version`, its values' `artifactPrefix`
/// (the tenant chart's children's sources) set to `prefix` when given.
fn chart_version(dir: &Path, chart: &str, version: &str, prefix: Option<&str>) -> PathBuf {
    let from = common::cluster::repo_root()
        .join("tests/fixtures/charts")
        .join(chart);
    let to = dir.join(chart);
    let status = std::process::Command::new("cp")
        .arg("-r")
        .arg(&from)
        .arg(&to)
        .status()
        .expect("cp");
    assert!(status.success());
    let meta = to.join("Chart.yaml");
    let text = std::fs::read_to_string(&meta).unwrap();
    std::fs::write(
        &meta,
        text.replace("version: 1.0.0", &format!("version: {version}")),
    )
    .unwrap();
    if let Some(prefix) = prefix {
        let values = to.join("values.yaml");
        let text = std::fs::read_to_string(&values).unwrap();
        let old = format!("artifactPrefix: {}-", cozystack::PARENT_ARTIFACT);
        assert!(
            text.contains(&old),
            "the tenant chart names its children's artifacts"
        );
        std::fs::write(
            &values,
            text.replace(&old, &format!("artifactPrefix: {prefix}-")),
        )
        .unwrap();
    }
    to
}

/// A release's history as Flux records it (`status.history`, newest
/// first): `(version, chart name, chart version)`. helm-controller clears
/// it when it uninstalls a release (a target change), so a reinstall starts
/// again at version 1 with one entry.
fn history(hr: &DynamicObject) -> Vec<(i64, String, String)> {
    hr.data["status"]["history"]
        .as_array()
        .map(|h| {
            h.iter()
                .map(|s| {
                    (
                        s["version"].as_i64().unwrap_or(0),
                        s["chartName"].as_str().unwrap_or("").to_string(),
                        s["chartVersion"].as_str().unwrap_or("").to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Waits until HelmRelease `name` is Ready at history version 2 of chart
/// `chart` at `version` from artifact `artifact`; returns its history.
async fn upgraded(
    hrs: &Api<DynamicObject>,
    name: &str,
    artifact: &str,
    chart: &str,
    version: &str,
) -> Vec<(i64, String, String)> {
    eventually(
        &format!("{name} upgraded from {artifact}"),
        Duration::from_secs(180),
        || {
            let hrs = hrs.clone();
            async move {
                let hr = hrs.get(name).await.map_err(|e| e.to_string())?;
                let source = hr.data["spec"]["chartRef"]["name"].as_str().unwrap_or("");
                let ready = common::flux::ready_condition(&hr);
                let h = history(&hr);
                let latest = h.first().cloned().unwrap_or_default();
                if source == artifact
                    && matches!(&ready, Some((s, _, _)) if s == "True")
                    && latest.1 == chart
                    && latest.2.split('+').next() == Some(version)
                {
                    Ok(h)
                } else {
                    Err(format!("source {source}, ready {ready:?}, history {h:?}"))
                }
            }
        },
    )
    .await
}

/// The gate's decisions in its log from byte `offset` on.
fn decisions_since(log: &Path, offset: usize) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .get(offset..)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["message"] == "admission decision")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_platform_upgrade_moves_live_tenants_sources_with_no_refusal_no_uninstall_and_every_volume_intact()
 {
    let env = env();
    let cp = env.cp;
    let admin = cp.management_client().await;
    let flux = common::flux::running(cp).await;
    let mut tenants = Vec::new();
    for i in 0..TENANTS {
        let t = Tenant::create(
            cp,
            TenantOptions::new(&cp.unique(&format!("platform{i}"))).light(),
        )
        .await;
        t.with_held_claims(&["data", "wal"]).await;
        t.wait_custody().await;
        t.wait_cluster_bound().await;
        tenants.push(t);
    }
    let disks: BTreeMap<String, Vec<String>> = tenants
        .iter()
        .map(|t| (t.name.clone(), env.sim.volumes_of(&t.namespace, &t.name)))
        .collect();
    assert!(disks.values().all(|d| d.len() == 2), "{disks:?}");

    // Cozystack's ApplicationDefinition for Kubernetes, as the platform
    // runs with it now, and the real cozystack-controller: it makes the
    // parents what the definition says (its labels, the values Secret).
    let definitions: Api<DynamicObject> =
        Api::all_with(admin.clone(), &cozystack::application_definition_resource());
    let controller = CozystackController::start(cp).await;
    common::manifests::apply(
        &admin,
        &cozystack::kubernetes_application_definition(cozystack::PARENT_ARTIFACT),
    )
    .await;
    for t in &tenants {
        eventually(
            &format!("cozystack-controller reconciled {}", t.name),
            Duration::from_secs(60),
            || async {
                let p = t.parent().await.ok_or("no parent")?;
                match p
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("sharding.fluxcd.io/key"))
                {
                    Some(v) if v == "tenants" => Ok(()),
                    other => Err(format!("shard label {other:?}")),
                }
            },
        )
        .await;
    }

    // Watched from before the upgrade: the tenant side of each CSI driver
    // release (its StorageClasses), which an uninstall would delete.
    let mut deleted_classes = Vec::new();
    for t in &tenants {
        let classes: Api<k8s_openapi::api::storage::v1::StorageClass> = Api::all(t.api.clone());
        let stream = watcher(classes, watcher::Config::default());
        deleted_classes.push(tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            let mut deleted = Vec::new();
            while let Some(Ok(e)) = stream.next().await {
                if let watcher::Event::Delete(sc) = e {
                    deleted.push(sc.metadata.name.unwrap_or_default());
                }
            }
            deleted
        }));
    }
    let gate_log = env
        .gate
        .as_ref()
        .expect("gated")
        .lock()
        .unwrap()
        .webhook
        .log
        .clone();
    let offset = std::fs::read_to_string(&gate_log).unwrap_or_default().len();

    // The platform upgrade: the new release's artifacts (the tenant chart
    // 2.0.0, whose children name the new artifacts; the CSI and addon
    // charts 1.1.0), then the ApplicationDefinition naming the new parent
    // artifact.
    let scratch = tempfile::tempdir().unwrap();
    let kubernetes = chart_version(scratch.path(), "kubernetes", "2.0.0", Some(UPGRADED));
    let csi = chart_version(scratch.path(), "csi", "1.1.0", None);
    let demo = chart_version(scratch.path(), "demo", "1.1.0", None);
    let ns = cozystack::ARTIFACT_NAMESPACE;
    flux.publish_chart_dir(&admin, ns, UPGRADED, &kubernetes)
        .await;
    flux.publish_chart_dir(&admin, ns, &format!("{UPGRADED}-kubevirt-csi-node"), &csi)
        .await;
    for addon in ["cilium", "coredns"] {
        flux.publish_chart_dir(&admin, ns, &format!("{UPGRADED}-{addon}"), &demo)
            .await;
    }
    definitions
        .patch(
            "kubernetes",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"release": {"chartRef": {"name": UPGRADED}}}})),
        )
        .await
        .expect("the ApplicationDefinition names the new artifact");

    // Every parent and child upgraded from its new source: history version
    // 2 over version 1, the release never uninstalled.
    for t in &tenants {
        let hrs = t.hr_api();
        let h = upgraded(&hrs, &t.name, UPGRADED, "kubernetes", "2.0.0").await;
        assert_eq!(
            h.iter().map(|s| s.0).collect::<Vec<_>>(),
            [2, 1],
            "{}: upgraded, not reinstalled: {h:?}",
            t.name
        );
        for (child, component, chart) in [
            ("csi", "kubevirt-csi-node", "csi"),
            ("cilium", "cilium", "demo"),
            ("coredns", "coredns", "demo"),
        ] {
            let name = format!("{}-{child}", t.name);
            let artifact = format!("{UPGRADED}-{component}");
            let h = upgraded(&hrs, &name, &artifact, chart, "1.1.0").await;
            assert_eq!(
                h.iter().map(|s| s.0).collect::<Vec<_>>(),
                [2, 1],
                "{name}: upgraded, not reinstalled: {h:?}"
            );
        }
    }
    assert!(controller.process.alive(), "{}", controller.log());

    // Nothing was refused: every write of the platform's controllers the
    // gate judged while it ran was allowed, the moves among them.
    let decisions = decisions_since(&gate_log, offset);
    let platform = [
        cozystack::FLUX.username(),
        cozystack::COZYSTACK_CONTROLLER.username(),
    ];
    let refused: Vec<&Value> = decisions
        .iter()
        .filter(|d| d["verdict"] != "allowed")
        .collect();
    assert!(
        refused.is_empty(),
        "refused during the upgrade: {refused:?}"
    );
    let moves: Vec<(String, String)> = decisions
        .iter()
        .filter(|d| d["reason"] == "platform-source-move")
        .map(|d| {
            (
                d["user"].as_str().unwrap_or("").to_string(),
                d["name"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    for t in &tenants {
        assert!(
            moves.contains(&(platform[1].clone(), t.name.clone())),
            "cozystack-controller moved {}'s source through the gate: {moves:?}",
            t.name
        );
        assert!(
            moves.contains(&(platform[0].clone(), format!("{}-csi", t.name))),
            "helm-controller moved {}-csi's source through the gate: {moves:?}",
            t.name
        );
    }

    // No tenant-side object of a CSI driver release was deleted, and every
    // volume is where it was, still in custody, nothing recorded.
    for (t, watch) in tenants.iter().zip(deleted_classes) {
        watch.abort();
        let deleted = watch.await.unwrap_or_default();
        assert!(
            deleted.is_empty(),
            "{}: StorageClasses deleted: {deleted:?}",
            t.name
        );
        assert_eq!(
            env.sim.volumes_of(&t.namespace, &t.name),
            disks[&t.name],
            "{}: its disks",
            t.name
        );
        assert_eq!(t.pv_count().await, 2, "{}: its PVs", t.name);
        assert_eq!(t.record().await.phase, None, "{}: no phase began", t.name);
        t.wait_custody().await;
    }

    // A namespace editor's move of the same sources is still a retarget:
    // refused, for the parent and for the CSI driver release.
    let t = &tenants[0];
    let mallory = common::editor::mallory(cp, &[&t.namespace]).await;
    let hrs: Api<DynamicObject> =
        Api::namespaced_with(mallory, &t.namespace, &common::gate::helmrelease_resource());
    for (name, to) in [
        (t.name.clone(), cozystack::PARENT_ARTIFACT.to_string()),
        (format!("{}-csi", t.name), format!("{UPGRADED}-cilium")),
    ] {
        let moved = hrs
            .patch(
                &name,
                &PatchParams::default().dry_run(),
                &Patch::Merge(json!({"spec": {"chartRef": {"name": to}}})),
            )
            .await;
        match moved {
            Err(kube::Error::Api(s)) => assert!(
                s.message.contains("volume-gate") && s.message.contains("the chart it installs"),
                "{name}: {}",
                s.message
            ),
            other => panic!("{name}: mallory's move of its source was not refused: {other:?}"),
        }
    }

    // And the upgraded tenants are still torn down as before: deleting one
    // frees its volumes first.
    let last = tenants.last().unwrap();
    last.delete_parent().await;
    last.wait_phase(Phase::Released, Duration::from_secs(180))
        .await;
    last.wait_parent_gone(Duration::from_secs(180)).await;
    assert!(env.sim.volumes_of(&last.namespace, &last.name).is_empty());
}
