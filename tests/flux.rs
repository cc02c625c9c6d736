//! The real Flux helm-controller (v1.6.0, built from the Go module proxy by
//! `tests/flux/build.sh`) on the harness's management API server, with a
//! chart delivered as Cozystack delivers its charts: a HelmRelease's
//! `chartRef` to an `ExternalArtifact` whose status points at a tarball
//! served on loopback. The ground the gated teardown on real Flux stands on.

mod common;

use std::time::Duration;

use common::flux::Flux;
use common::gate::helmrelease_resource;
use common::wait::eventually;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use serde_json::json;

/// The Ready condition of a HelmRelease: (status, reason, message).
fn ready(hr: &DynamicObject) -> Option<(String, String, String)> {
    let c = hr.data["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == "Ready")?;
    let s = |k: &str| c[k].as_str().unwrap_or("").to_string();
    Some((s("status"), s("reason"), s("message")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_helm_controller_installs_and_uninstalls_a_chart_from_an_external_artifact() {
    let cp = common::cluster::control_plane();
    let flux = Flux::start(cp).await;
    let client = cp.management_client().await;
    let ns = cp.unique("flux-demo");
    cp.namespace(&ns).await;
    flux.publish_chart(&client, &ns, "demo-chart", "demo").await;

    let hrs: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &helmrelease_resource());
    let mut hr = DynamicObject::new("demo", &helmrelease_resource()).within(&ns);
    hr.data = json!({"spec": {"interval": "10m", "chartRef": {"kind": "ExternalArtifact", "name": "demo-chart"},
                               "values": {"greeting": "from flux"}}});
    hrs.create(&PostParams::default(), &hr).await.expect("create the HelmRelease");

    // Installed: Ready=True is where an installed release stays.
    eventually("HelmRelease demo Ready=True", Duration::from_secs(120), || {
        let hrs = hrs.clone();
        assert!(flux.process.alive(), "helm-controller exited; its log:\n{}", flux.log());
        async move {
            let hr = hrs.get("demo").await.map_err(|e| e.to_string())?;
            match ready(&hr) {
                Some((s, _, _)) if s == "True" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    let configs: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let cm = configs.get("demo-config").await.expect("the chart's ConfigMap");
    assert_eq!(cm.data.unwrap_or_default()["greeting"], "from flux", "the release's values were rendered");
    let labels = cm.metadata.labels.unwrap_or_default();
    assert_eq!(labels.get("helm.toolkit.fluxcd.io/name").map(String::as_str), Some("demo"), "helm-controller marks what it installs: {labels:?}");
    let annotations = cm.metadata.annotations.unwrap_or_default();
    assert_eq!(annotations.get("meta.helm.sh/release-name").map(String::as_str), Some("demo"), "{annotations:?}");
    assert_eq!(annotations.get("meta.helm.sh/release-namespace"), Some(&ns), "{annotations:?}");
    let hr = hrs.get("demo").await.unwrap();
    let finalizers = hr.metadata.finalizers.unwrap_or_default();
    assert!(finalizers.contains(&"finalizers.fluxcd.io".to_string()), "{finalizers:?}");
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let storage = secrets.list(&ListParams::default().labels("owner=helm")).await.unwrap();
    assert_eq!(storage.items.len(), 1, "Helm's release record, as a Secret");

    // Deleted: helm-controller uninstalls, then lets the HelmRelease go.
    hrs.delete("demo", &DeleteParams::default()).await.expect("delete the HelmRelease");
    eventually("HelmRelease demo gone", Duration::from_secs(120), || {
        let hrs = hrs.clone();
        async move { if hrs.get_opt("demo").await.map_err(|e| e.to_string())?.is_none() { Ok(()) } else { Err("still there".to_string()) } }
    })
    .await;
    assert!(configs.get_opt("demo-config").await.unwrap().is_none(), "the uninstall removed the chart's objects");
    assert!(secrets.list(&ListParams::default().labels("owner=helm")).await.unwrap().items.is_empty(), "and Helm's record");
    assert!(flux.process.alive(), "helm-controller still running; its log:\n{}", flux.log());
}
