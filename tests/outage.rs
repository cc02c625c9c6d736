//! What a gate outage refuses, and what it does not: the webhook
//! configurations send the gate exactly the operations a refusal protects a
//! volume from. With the gate up, 1,300 everyday operations reach it
//! zero times; with no replica answering, every everyday operation still
//! succeeds and every guarded one is refused (failurePolicy Fail).

use volume_gate_testkit as common;

use std::time::Duration;

use common::tenant::{Tenant, datavolume_resource, kcp_resource, resource, tcp_resource};
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use serde_json::{Value, json};

fn env() -> &'static common::Env {
    common::gated()
}

const SYSTEM_NS: &str = "cozy-system";

fn hr() -> ApiResource {
    common::gate::helmrelease_resource()
}

fn machine_resource() -> ApiResource {
    resource("cluster.x-k8s.io", "v1beta1", "Machine", "machines")
}

fn claim_resource() -> ApiResource {
    resource("", "v1", "PersistentVolumeClaim", "persistentvolumeclaims")
}

fn deployment_resource() -> ApiResource {
    resource("apps", "v1", "Deployment", "deployments")
}

fn api(client: &kube::Client, ns: &str, ar: &ApiResource) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, ar)
}

async fn create(client: &kube::Client, ns: &str, ar: &ApiResource, doc: Value) {
    let name = doc["metadata"]["name"].as_str().unwrap().to_string();
    api(client, ns, ar)
        .create(
            &PostParams::default(),
            &serde_json::from_value(doc).unwrap(),
        )
        .await
        .unwrap_or_else(|e| panic!("create {} {ns}/{name}: {e}", ar.kind));
}

fn merge(v: Value) -> Patch<Value> {
    Patch::Merge(v)
}

fn flux_deployment(name: &str, release: &str) -> Value {
    json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": {"helm.toolkit.fluxcd.io/name": release}},
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [{"name": "c", "image": "x"}]}}}})
}

fn system_release(name: &str) -> Value {
    json!({"apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
        "metadata": {"name": name, "labels": {"cozystack.io/system-app": "true"}, "finalizers": ["finalizers.fluxcd.io"]},
        "spec": common::flux::inert_spec(name)})
}

fn parent_release(name: &str) -> Value {
    json!({"apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
        "metadata": {"name": name, "labels": {
            "apps.cozystack.io/application.kind": "Kubernetes",
            "apps.cozystack.io/application.group": "apps.cozystack.io",
            "apps.cozystack.io/application.name": name.trim_start_matches("kubernetes-")}},
        "spec": common::flux::inert_spec("kubernetes")})
}

/// Requests the gate has answered so far (every endpoint, every verdict).
async fn gate_requests() -> u64 {
    let port = env().gate.as_ref().unwrap().lock().unwrap().webhook_admin;
    let (_, text) = common::gate::http_get(port, "/metrics")
        .await
        .expect("webhook /metrics");
    let count: u64 = text
        .lines()
        .filter(|l| l.starts_with("volume_gate_admission_duration_seconds_count"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum();
    assert!(
        text.contains("volume_gate_admission_duration_seconds"),
        "the webhook exports its request histogram:\n{text}"
    );
    count
}

/// A tenant in teardown that can never be released (a parent with no API
/// behind it, only a disk no inventory names), with every object the gate
/// guards for it.
async fn tenant_in_teardown(client: &kube::Client, ns: &str, r: &str) {
    env().cp.namespace(ns).await;
    common::tenant::unreleasable_disk(client, ns, r).await;
    create(client, ns, &hr(), parent_release(r)).await;
    let hr_body = |name: String, labels: Value| {
        json!({"apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
            "metadata": {"name": name, "labels": labels}, "spec": common::flux::inert_spec("x")})
    };
    create(
        client,
        ns,
        &hr(),
        hr_body(
            common::profile()
                .csi_release_name(r)
                .expect("Cozystack has a CSI release"),
            json!({"cozystack.io/target-cluster-name": r}),
        ),
    )
    .await;
    create(
        client,
        ns,
        &hr(),
        hr_body(
            format!("{r}-coredns"),
            json!({"cozystack.io/target-cluster-name": r}),
        ),
    )
    .await;
    let plain = |api_version: &str, kind: &str, name: &str| json!({"apiVersion": api_version, "kind": kind, "metadata": {"name": name}, "spec": {}});
    create(
        client,
        ns,
        &kcp_resource(),
        plain(
            "controlplane.cluster.x-k8s.io/v1alpha1",
            "KamajiControlPlane",
            r,
        ),
    )
    .await;
    create(
        client,
        ns,
        &tcp_resource(),
        plain("kamaji.clastix.io/v1alpha1", "TenantControlPlane", r),
    )
    .await;
    create(
        client,
        ns,
        &resource("cluster.x-k8s.io", "v1beta1", "Cluster", "clusters"),
        plain("cluster.x-k8s.io/v1beta1", "Cluster", r),
    )
    .await;
    create(client, ns, &resource("", "v1", "Secret", "secrets"), json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": common::profile().kubeconfig_secret_name(r), "labels": {"kamaji.clastix.io/component": "admin-kubeconfig"}}})).await;
    create(
        client,
        ns,
        &deployment_resource(),
        flux_deployment(&format!("{r}-kcsi-controller"), r),
    )
    .await;
    create(client, ns, &resource("", "v1", "ServiceAccount", "serviceaccounts"), json!({"apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": format!("{r}-kcsi"), "annotations": {"meta.helm.sh/release-name": r, "meta.helm.sh/release-namespace": ns}}})).await;
    let parents = api(client, ns, &hr());
    common::wait::eventually(
        &format!("custody of {r}"),
        Duration::from_secs(30),
        || async {
            let p = parents.get(r).await.map_err(|e| e.to_string())?;
            if p.metadata
                .finalizers
                .unwrap_or_default()
                .iter()
                .any(|f| *f == common::profile().custody_finalizer)
            {
                Ok(())
            } else {
                Err("no custody".into())
            }
        },
    )
    .await;
    parents
        .delete(r, &DeleteParams::default())
        .await
        .expect("delete the parent: in custody, allowed without the gate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everyday_operations_never_reach_the_gate_and_survive_its_outage_while_guarded_ones_are_refused()
 {
    let env = env();
    let client = env.cp.management_client().await;
    let t = Tenant::create(env.cp, &env.cp.unique("daily")).await;
    t.wait_custody().await;
    // The worker's own write of the binding is a record change, sent to the gate.
    t.wait_cluster_bound().await;
    let (ns, r) = (t.namespace.clone(), t.name.clone());
    env.cp.namespace(SYSTEM_NS).await;
    create(&client, SYSTEM_NS, &hr(), system_release("cozy-cilium")).await;
    // A worker Machine of the tenant's Cluster, made by hand (its
    // infrastructure named, not made: Cluster API waits for it).
    create(
        &client,
        &ns,
        &machine_resource(),
        json!({"apiVersion": "cluster.x-k8s.io/v1beta1", "kind": "Machine",
        "metadata": {"name": "md-0-abcde", "labels": {"cluster.x-k8s.io/cluster-name": r}},
        "spec": common::capi::cozystack_machine_spec(&r, "md-0-abcde")}),
    )
    .await;
    // A disk of the tenant on the management side, as the KubeVirt CSI
    // controller labels it, and a claim labelled the same (of a class no
    // provisioner serves): CDI writes such objects all the time.
    create(&client, &ns, &datavolume_resource(), json!({"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
        "metadata": {"name": "disk-daily", "labels": {"cluster.x-k8s.io/cluster-name": r}},
        "spec": {"source": {"blank": {}}, "storage": {"resources": {"requests": {"storage": "1Gi"}}, "storageClassName": "sim-none"}}})).await;
    create(&client, &ns, &claim_resource(), json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "claim-daily", "labels": {"cluster.x-k8s.io/cluster-name": r}},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "sim-none", "resources": {"requests": {"storage": "1Gi"}}}})).await;
    // A disk the worker kept (label `kept`), which the PV controller and
    // the worker write to all the time; only its acknowledgement is sent.
    let pv_resource = resource("", "v1", "PersistentVolume", "persistentvolumes");
    let kept_pvs: Api<DynamicObject> = Api::all_with(client.clone(), &pv_resource);
    let kept_pv = env.cp.unique("kept-daily");
    kept_pvs
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"apiVersion": "v1", "kind": "PersistentVolume",
                "metadata": {"name": kept_pv, "labels": {common::keys().kept: "true"}},
                "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "sim-none",
                    "hostPath": {"path": "/nonexistent/kept-daily"}}}))
            .unwrap(),
        )
        .await
        .expect("create a kept PV");
    let disks = api(&client, &ns, &datavolume_resource());
    let claims = api(&client, &ns, &claim_resource());
    let system = api(&client, SYSTEM_NS, &hr());
    let releases = api(&client, &ns, &hr());
    let machines = api(&client, &ns, &machine_resource());
    let pp = PatchParams::default();

    // With the gate up: 1,300 everyday operations, none sent to it.
    let before = gate_requests().await;
    for i in 0..100 {
        let ops: [(&Api<DynamicObject>, &str, Value); 13] = [
            (
                &kept_pvs,
                &kept_pv,
                json!({"metadata": {"annotations": {"example.com/checked": format!("{i}")}}}),
            ),
            (
                &system,
                "cozy-cilium",
                json!({"spec": {"interval": format!("{}m", 5 + i % 3)}}),
            ),
            (
                &system,
                "cozy-cilium",
                json!({"metadata": {"annotations": {"reconcile.fluxcd.io/requestedAt": format!("t{i}")}}}),
            ),
            (
                &system,
                "cozy-cilium",
                json!({"metadata": {"labels": {"rollout": format!("r{i}")}}}),
            ),
            (&releases, &r, json!({"spec": {"values": {"replicas": i}}})),
            (
                &releases,
                &r,
                json!({"metadata": {"annotations": {"reconcile.fluxcd.io/requestedAt": format!("t{i}")}}}),
            ),
            (
                &releases,
                &format!("{r}-cilium"),
                json!({"spec": {"values": {"i": i}}}),
            ),
            (
                &releases,
                &format!("{r}-coredns"),
                json!({"spec": {"suspend": i % 2 == 0}}),
            ),
            (
                &machines,
                "md-0-abcde",
                json!({"metadata": {"labels": {"node-role": format!("w{i}")}}}),
            ),
            (
                &machines,
                "md-0-abcde",
                json!({"metadata": {"annotations": {"cluster.x-k8s.io/paused": format!("{}", i % 2 == 0)}}}),
            ),
            (
                &machines,
                "md-0-abcde",
                json!({"metadata": {"finalizers": if i % 2 == 0 { json!(["machine.cluster.x-k8s.io"]) } else { json!(null) }}}),
            ),
            (
                &disks,
                "disk-daily",
                json!({"metadata": {"annotations": {"cdi.kubevirt.io/storage.condition.running": format!("{}", i % 2 == 0)}}}),
            ),
            (
                &claims,
                "claim-daily",
                json!({"metadata": {"labels": {"app": format!("a{i}")}}}),
            ),
        ];
        for (api, name, patch) in ops {
            api.patch(name, &pp, &merge(patch.clone()))
                .await
                .unwrap_or_else(|e| panic!("everyday {name} {patch}: {e}"));
        }
    }
    let after = gate_requests().await;
    eprintln!(
        "1300 everyday operations: {} admission requests reached the gate",
        after - before
    );
    assert_eq!(after - before, 0, "everyday operations reached the gate");

    // A tenant in teardown, not done, for the guarded operations below.
    let (ns2, r2) = ("tenant-leaving", "kubernetes-leaving");
    tenant_in_teardown(&client, ns2, r2).await;

    // The outage: no webhook replica answers, and no worker runs.
    {
        let mut gate = env.gate.as_ref().unwrap().lock().unwrap();
        gate.webhook.kill(libc::SIGKILL);
        gate.kill_worker();
    }

    // Everyday operations all succeed.
    let everyday: Vec<(&str, Result<(), kube::Error>)> = vec![
        ("system release: spec edit", system.patch("cozy-cilium", &pp, &merge(json!({"spec": {"interval": "7m"}}))).await.map(drop)),
        (
            "system release: finalizer added",
            system.patch("cozy-cilium", &pp, &merge(json!({"metadata": {"finalizers": ["finalizers.fluxcd.io", "example.com/hold"]}}))).await.map(drop),
        ),
        (
            "system release: reconcile request",
            system.patch("cozy-cilium", &pp, &merge(json!({"metadata": {"annotations": {"reconcile.fluxcd.io/requestedAt": "now"}}}))).await.map(drop),
        ),
        ("system release: delete", system.delete("cozy-cilium", &DeleteParams::default()).await.map(drop)),
        ("Flux-managed Deployment: delete", {
            create(&client, SYSTEM_NS, &deployment_resource(), flux_deployment("cilium-operator", "cozy-cilium")).await;
            api(&client, SYSTEM_NS, &deployment_resource()).delete("cilium-operator", &DeleteParams::default()).await.map(drop)
        }),
        ("CAPI Machine: label", machines.patch("md-0-abcde", &pp, &merge(json!({"metadata": {"labels": {"node-role": "down"}}}))).await.map(drop)),
        (
            "CAPI Machine: annotation",
            machines.patch("md-0-abcde", &pp, &merge(json!({"metadata": {"annotations": {"cluster.x-k8s.io/paused": "true"}}}))).await.map(drop),
        ),
        (
            "CAPI Machine: finalizer",
            machines.patch("md-0-abcde", &pp, &merge(json!({"metadata": {"finalizers": ["machine.cluster.x-k8s.io"]}}))).await.map(drop),
        ),
        (
            "tenant disk DataVolume: annotation",
            disks.patch("disk-daily", &pp, &merge(json!({"metadata": {"annotations": {"cdi.kubevirt.io/storage.bind.immediate.requested": "true"}}}))).await.map(drop),
        ),
        ("tenant disk PVC: label", claims.patch("claim-daily", &pp, &merge(json!({"metadata": {"labels": {"app": "down"}}}))).await.map(drop)),
        ("tenant disk DataVolume: delete", disks.delete("disk-daily", &DeleteParams::default()).await.map(drop)),
        (
            "kept PV: annotation",
            kept_pvs.patch(&kept_pv, &pp, &merge(json!({"metadata": {"annotations": {"example.com/checked": "down"}}}))).await.map(drop),
        ),
        ("tenant parent: spec edit", releases.patch(&r, &pp, &merge(json!({"spec": {"values": {"replicas": 9}}}))).await.map(drop)),
        (
            "tenant parent: annotation",
            releases.patch(&r, &pp, &merge(json!({"metadata": {"annotations": {"reconcile.fluxcd.io/requestedAt": "now"}}}))).await.map(drop),
        ),
        ("child: spec edit", releases.patch(&format!("{r}-cilium"), &pp, &merge(json!({"spec": {"values": {"mtu": 1400}}}))).await.map(drop)),
        ("child: suspend", releases.patch(&format!("{r}-coredns"), &pp, &merge(json!({"spec": {"suspend": true}}))).await.map(drop)),
        ("creating a tenant", {
            env.cp.namespace("tenant-newcomer").await;
            api(&client, "tenant-newcomer", &hr())
                .create(&PostParams::default(), &serde_json::from_value(parent_release("kubernetes-newcomer")).unwrap())
                .await
                .map(drop)
        }),
    ];
    let failed: Vec<String> = everyday
        .iter()
        .filter_map(|(what, r)| r.as_ref().err().map(|e| format!("{what}: {e}")))
        .collect();
    assert!(
        failed.is_empty(),
        "everyday operations refused while the gate is down:\n{}",
        failed.join("\n")
    );

    // Every guarded operation is refused.
    let (profile, keys) = (common::profile(), common::keys());
    let annotate = |k: &str, v: &str| merge(json!({"metadata": {"annotations": {k: v}}}));
    let custody_removed: Vec<String> = t
        .parent()
        .await
        .unwrap()
        .metadata
        .finalizers
        .unwrap_or_default()
        .into_iter()
        .filter(|f| *f != profile.custody_finalizer)
        .collect();
    let leaving = |ar: &ApiResource| api(&client, ns2, ar);
    let guarded: Vec<(&str, Result<(), kube::Error>)> = vec![
        ("CSI release: delete", releases.delete(&profile.csi_release_name(&r).expect("Cozystack has a CSI release"), &DeleteParams::default()).await.map(drop)),
        ("child in teardown: delete", leaving(&hr()).delete(&format!("{r2}-coredns"), &DeleteParams::default()).await.map(drop)),
        ("CSI release in teardown: delete", leaving(&hr()).delete(&profile.csi_release_name(r2).expect("Cozystack has a CSI release"), &DeleteParams::default()).await.map(drop)),
        ("KamajiControlPlane: delete", leaving(&kcp_resource()).delete(r2, &DeleteParams::default()).await.map(drop)),
        ("TenantControlPlane: delete", leaving(&tcp_resource()).delete(r2, &DeleteParams::default()).await.map(drop)),
        (
            "CAPI Cluster: delete",
            leaving(&resource("cluster.x-k8s.io", "v1beta1", "Cluster", "clusters")).delete(r2, &DeleteParams::default()).await.map(drop),
        ),
        (
            "admin kubeconfig Secret: delete",
            leaving(&resource("", "v1", "Secret", "secrets")).delete(&profile.kubeconfig_secret_name(r2), &DeleteParams::default()).await.map(drop),
        ),
        (
            "release object (the CSI controller's ServiceAccount): delete",
            leaving(&resource("", "v1", "ServiceAccount", "serviceaccounts")).delete(&format!("{r2}-kcsi"), &DeleteParams::default()).await.map(drop),
        ),
        ("kcsi controller: delete", leaving(&deployment_resource()).delete(&format!("{r2}-kcsi-controller"), &DeleteParams::default()).await.map(drop)),
        ("record key: phase", releases.patch(&r, &pp, &annotate(&keys.phase, "Released")).await.map(drop)),
        ("override stamp", releases.patch(&r, &pp, &annotate(&keys.override_by, "root")).await.map(drop)),
        ("custody finalizer: removed", releases.patch(&r, &pp, &merge(json!({"metadata": {"finalizers": custody_removed}}))).await.map(drop)),
        (
            "child: relabelled away",
            releases
                .patch(&format!("{r}-cilium"), &pp, &merge(json!({"metadata": {"labels": {"cozystack.io/target-cluster-name": "kubernetes-nobody"}}})))
                .await
                .map(drop),
        ),
        (
            "tenant disk PVC: infra label removed",
            claims.patch("claim-daily", &pp, &merge(json!({"metadata": {"labels": {"cluster.x-k8s.io/cluster-name": null}}}))).await.map(drop),
        ),
        ("parent without custody: delete", api(&client, "tenant-newcomer", &hr()).delete("kubernetes-newcomer", &DeleteParams::default()).await.map(drop)),
        (
            "CSI release: retargeted",
            releases.patch(&profile.csi_release_name(&r).expect("Cozystack has a CSI release"), &pp, &merge(json!({"spec": {"releaseName": "moved"}}))).await.map(drop),
        ),
        (
            "parent: another chart",
            releases.patch(&r, &pp, &merge(json!({"spec": {"chartRef": {"name": "elsewhere"}}}))).await.map(drop),
        ),
        (
            "kept PV: acknowledged",
            kept_pvs.patch(&kept_pv, &pp, &annotate(&keys.kept_acknowledged, "kept on purpose")).await.map(drop),
        ),
        (
            "a release's status, not by helm-controller",
            releases.patch_status(&format!("{r}-cilium"), &pp, &merge(json!({"status": {"storageNamespace": "default"}}))).await.map(drop),
        ),
    ];
    let mut let_through = Vec::new();
    for (what, result) in &guarded {
        match result {
            Err(kube::Error::Api(s))
                if s.message.contains("failed calling webhook")
                    && s.message.contains("volume-gate") => {}
            other => let_through.push(format!(
                "{what}: {:?}",
                other.as_ref().map_err(|e| e.to_string())
            )),
        }
    }
    assert!(
        let_through.is_empty(),
        "guarded operations not refused while the gate is down:\n{}",
        let_through.join("\n")
    );
}
