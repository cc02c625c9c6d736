//! The real Flux helm-controller (v1.6.0, built from the Go module proxy by
//! `tests/flux/build.sh`) on the harness's management API server, with a
//! chart delivered as Cozystack delivers its charts: a HelmRelease's
//! `chartRef` to an `ExternalArtifact` whose status points at a tarball
//! served on loopback. The ground the gated teardown on real Flux stands on.

use volume_gate_testkit as common;

use std::time::Duration;

use common::flux::{Flux, MIN_RETRY_DELAY, ready_condition as ready};
use common::gate::helmrelease_resource;
use common::history::{ParentHistory, Seen};
use common::wait::eventually;
use k8s_openapi::api::core::v1::{ConfigMap, Event, Secret};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

/// This binary's helm-controller, a fresh namespace `prefix-N`, and the
/// demo chart published there as ExternalArtifact `demo-chart`.
async fn with_chart(prefix: &str) -> (&'static Flux, kube::Client, String) {
    let cp = common::cluster::control_plane();
    let flux = common::flux::flux(cp).await;
    let client = cp.management_client().await;
    let ns = cp.unique(prefix);
    cp.namespace(&ns).await;
    flux.publish_chart(&client, &ns, "demo-chart", "demo").await;
    (flux, client, ns)
}

/// HelmRelease `name` of the demo chart with `values`, carrying Flux's
/// finalizer already (see `common::flux::MIN_RETRY_DELAY`).
async fn create_release(hrs: &Api<DynamicObject>, name: &str, values: serde_json::Value) {
    let mut hr = DynamicObject::new(name, &helmrelease_resource())
        .within(hrs.namespace().unwrap_or_default());
    hr.metadata.finalizers = Some(vec![common::flux::FLUX_FINALIZER.into()]);
    hr.data = json!({"spec": {"interval": "10m", "chartRef": {"kind": "ExternalArtifact", "name": "demo-chart"}, "values": values}});
    hrs.create(&PostParams::default(), &hr)
        .await
        .expect("create the HelmRelease");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_helm_controller_installs_and_uninstalls_a_chart_from_an_external_artifact() {
    let (flux, client, ns) = with_chart("flux-demo").await;

    let hrs: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns, &helmrelease_resource());
    create_release(&hrs, "demo", json!({"greeting": "from flux"})).await;

    // Installed: Ready=True is where an installed release stays.
    eventually(
        "HelmRelease demo Ready=True",
        Duration::from_secs(120),
        || {
            let hrs = hrs.clone();
            assert!(
                flux.process.alive(),
                "helm-controller exited; its log:\n{}",
                flux.log()
            );
            async move {
                let hr = hrs.get("demo").await.map_err(|e| e.to_string())?;
                match ready(&hr) {
                    Some((s, _, _)) if s == "True" => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            }
        },
    )
    .await;
    let configs: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let cm = configs
        .get("demo-config")
        .await
        .expect("the chart's ConfigMap");
    assert_eq!(
        cm.data.unwrap_or_default()["greeting"],
        "from flux",
        "the release's values were rendered"
    );
    let labels = cm.metadata.labels.unwrap_or_default();
    assert_eq!(
        labels
            .get("helm.toolkit.fluxcd.io/name")
            .map(String::as_str),
        Some("demo"),
        "helm-controller marks what it installs: {labels:?}"
    );
    let annotations = cm.metadata.annotations.unwrap_or_default();
    assert_eq!(
        annotations
            .get("meta.helm.sh/release-name")
            .map(String::as_str),
        Some("demo"),
        "{annotations:?}"
    );
    assert_eq!(
        annotations.get("meta.helm.sh/release-namespace"),
        Some(&ns),
        "{annotations:?}"
    );
    let hr = hrs.get("demo").await.unwrap();
    let finalizers = hr.metadata.finalizers.unwrap_or_default();
    assert!(
        finalizers.contains(&"finalizers.fluxcd.io".to_string()),
        "{finalizers:?}"
    );
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let storage = secrets
        .list(&ListParams::default().labels("owner=helm"))
        .await
        .unwrap();
    assert_eq!(storage.items.len(), 1, "Helm's release record, as a Secret");

    // Deleted: helm-controller uninstalls, then lets the HelmRelease go.
    hrs.delete("demo", &DeleteParams::default())
        .await
        .expect("delete the HelmRelease");
    eventually("HelmRelease demo gone", Duration::from_secs(120), || {
        let hrs = hrs.clone();
        async move {
            if hrs
                .get_opt("demo")
                .await
                .map_err(|e| e.to_string())?
                .is_none()
            {
                Ok(())
            } else {
                Err("still there".to_string())
            }
        }
    })
    .await;
    assert!(
        configs.get_opt("demo-config").await.unwrap().is_none(),
        "the uninstall removed the chart's objects"
    );
    assert!(
        secrets
            .list(&ListParams::default().labels("owner=helm"))
            .await
            .unwrap()
            .items
            .is_empty(),
        "and Helm's record"
    );
    assert!(
        flux.process.alive(),
        "helm-controller still running; its log:\n{}",
        flux.log()
    );
}

/// What the gate does to an uninstall, played by an in-API-server policy so
/// that only Flux is under test: a DELETE of the release's ConfigMap is
/// refused while the hold lasts. Helm's uninstall then fails, helm-controller
/// records `UninstallFailed` with the refusal's message (what an operator sees
/// in `kubectl get hr`) and backs off, here for at least `MIN_RETRY_DELAY`
/// (10 minutes). After the hold ends, `reconcile.fluxcd.io/requestedAt` (what
/// the worker writes with `Released`) makes it retry at once: the HelmRelease
/// is gone within a bound far below that delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_delete_fails_the_uninstall_and_a_reconcile_request_retries_it_during_deletion() {
    let (_, client, ns) = with_chart("flux-held").await;
    let policy = format!("hold-{ns}");
    common::manifests::apply(&client, &json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": policy},
        "spec": {"failurePolicy": "Fail",
                 "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["DELETE"], "resources": ["configmaps"]}]},
                 "validations": [{"expression": "oldObject.metadata.name != 'held-config'", "message": "held: the volumes are not released yet"}]}})).await;
    common::manifests::apply(&client, &json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": policy},
        "spec": {"policyName": policy, "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}}})).await;

    let hrs: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns, &helmrelease_resource());
    let history = ParentHistory::open(hrs.clone(), "held").await;
    create_release(&hrs, "held", json!({})).await;
    let ready_true = |s: &Seen| match s {
        Seen::Parent(p) => ready(p)
            .filter(|(status, _, _)| status == "True")
            .map(|_| ()),
        Seen::Gone => None,
    };
    history
        .next_matching("Ready=True", Duration::from_secs(120), ready_true)
        .await;
    // The policy is live once it refuses a dry-run delete of what it holds.
    let configs: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    eventually("the hold refuses", Duration::from_secs(30), || {
        let configs = configs.clone();
        async move {
            match configs
                .delete(
                    "held-config",
                    &DeleteParams {
                        dry_run: true,
                        ..Default::default()
                    },
                )
                .await
            {
                Err(e) if e.to_string().contains("held") => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;

    hrs.delete("held", &DeleteParams::default())
        .await
        .expect("delete the HelmRelease");
    let failed = history
        .next_matching(
            "Ready=False UninstallFailed",
            Duration::from_secs(120),
            |s| match s {
                Seen::Parent(p) => ready(p)
                    .filter(|(status, reason, _)| status == "False" && reason == "UninstallFailed"),
                Seen::Gone => None,
            },
        )
        .await;
    assert!(
        failed.2.contains("Helm uninstall failed for release") && failed.2.contains("held"),
        "{failed:?}"
    );
    // The refusal's own words reach the operator in the Warning Event
    // (`kubectl describe hr`), which quotes Helm's log.
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    eventually(
        "an UninstallFailed Event quoting the refusal",
        Duration::from_secs(60),
        || {
            let events = events.clone();
            async move {
                let list = events
                    .list(&ListParams::default().fields("involvedObject.name=held"))
                    .await
                    .map_err(|e| e.to_string())?;
                let found = list.items.iter().any(|e| {
                    e.reason.as_deref() == Some("UninstallFailed")
                        && e.type_.as_deref() == Some("Warning")
                        && e.message
                            .as_deref()
                            .is_some_and(|m| m.contains("held: the volumes are not released yet"))
                });
                if found {
                    Ok(())
                } else {
                    Err(format!(
                        "{:?}",
                        list.items
                            .iter()
                            .map(|e| (&e.reason, &e.message))
                            .collect::<Vec<_>>()
                    ))
                }
            }
        },
    )
    .await;
    assert!(
        configs.get_opt("held-config").await.unwrap().is_some(),
        "the held object stayed"
    );
    assert!(
        hrs.get_opt("held").await.unwrap().is_some(),
        "the HelmRelease waits for its uninstall"
    );

    // The hold ends (the phase recorded the volumes gone) and the retry is
    // asked for, as the worker asks in its Released write.
    let bindings: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &kube::api::ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk(
                "admissionregistration.k8s.io",
                "v1",
                "ValidatingAdmissionPolicyBinding",
            ),
            "validatingadmissionpolicybindings",
        ),
    );
    bindings
        .delete(&policy, &DeleteParams::default())
        .await
        .expect("end the hold");
    eventually("the hold ended", Duration::from_secs(30), || {
        let configs = configs.clone();
        async move {
            configs
                .delete(
                    "held-config",
                    &DeleteParams {
                        dry_run: true,
                        ..Default::default()
                    },
                )
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    })
    .await;
    let request = json!({"metadata": {"annotations": {"reconcile.fluxcd.io/requestedAt": jiff::Timestamp::now().to_string()}}});
    hrs.patch("held", &PatchParams::default(), &Patch::Merge(&request))
        .await
        .expect("request a reconcile");
    // Bounded well below the first scheduled retry (MIN_RETRY_DELAY): only
    // the request can have brought this uninstall.
    history
        .next_matching(
            &format!("HelmRelease gone (its next scheduled retry is {MIN_RETRY_DELAY} away)"),
            Duration::from_secs(120),
            |s| matches!(s, Seen::Gone).then_some(()),
        )
        .await;
    assert!(
        configs.get_opt("held-config").await.unwrap().is_none(),
        "the retried uninstall removed the chart's objects"
    );
}
