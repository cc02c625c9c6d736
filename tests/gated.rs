//! volume-gate on the real control plane, installed from `manifests/`, with
//! the simulated driver, kubelet and Cozystack teardown.

use volume_gate_testkit as common;

use std::time::Duration;

use common::exposition;
use common::tenant::{STORAGE_CLASS, Tenant, TenantOptions};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::api::{Api, DeleteParams};
use serde_json::json;
use volume_gate::record::Phase;

fn env() -> &'static common::Env {
    common::gated()
}

const TEARDOWN: &str = "volume_gate_tenant_teardown_seconds";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_processes_say_who_leads_and_when_the_serving_certificate_expires() {
    let env = env();
    // One worker, leading: the Lease is its.
    let text = env.worker_metrics().await;
    assert_eq!(
        exposition::value(&text, "volume_gate_worker_leader", &[]),
        Some(1.0),
        "{text}"
    );
    // The webhook's certificate, as the file it serves says (read here
    // with x509-parser, not the webhook's code).
    let pem = std::fs::read(env.gate_certs().join("tls.crt")).expect("the served certificate");
    let (_, pem) = x509_parser::pem::parse_x509_pem(&pem).expect("PEM");
    let cert = pem.parse_x509().expect("X.509");
    let not_after = cert.validity().not_after.timestamp() as f64;
    let text = env.webhook_metrics().await;
    assert_eq!(
        exposition::value(
            &text,
            "volume_gate_certificate_expiry_timestamp_seconds",
            &[]
        ),
        Some(not_after),
        "{text}"
    );
    // The webhook does not lead anything: its leader gauge stays 0.
    assert_eq!(
        exposition::value(&text, "volume_gate_worker_leader", &[]),
        Some(0.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_tenant_frees_every_volume_with_the_gate_installed() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("closed")).await;
    t.wait_custody().await;
    t.incident_workload().await;
    t.ephemeral_pod("apps", "scratch").await;
    t.wait_settled(5, 4).await;
    assert_eq!(env.sim.volumes_of(&t.namespace, &t.name).len(), 5);

    t.delete_parent().await;
    t.wait_parent_gone(Duration::from_secs(180)).await;

    let left = env.sim.volumes_of(&t.namespace, &t.name);
    assert!(
        left.is_empty(),
        "volumes left on storage after the gated teardown: {left:?}"
    );
    // The write that records Released also asks Flux to retry the uninstall
    // now (what `flux reconcile` writes), and nothing before it did.
    t.assert_released_write_requests_a_retry();
    // Every version that carried a phase carried its mirror where
    // Cozystack's Application API shows it to the tenant's owner (the
    // `apps.cozystack.io-` annotations): the phase and the message.
    let keys = common::keys();
    let visible = common::profile().parent.visible_annotation_prefix;
    let mut phases = Vec::new();
    for seen in t.history.all() {
        let common::history::Seen::Parent(p) = seen else {
            continue;
        };
        let a = p.metadata.annotations.clone().unwrap_or_default();
        if let Some(phase) = a.get(&keys.phase) {
            for key in [&keys.phase, &keys.message] {
                assert_eq!(
                    a.get(&format!("{visible}{key}")),
                    a.get(key),
                    "{key} mirrored in version {:?}",
                    p.metadata.resource_version
                );
            }
            phases.push(phase.clone());
        }
    }
    assert!(
        phases.iter().any(|p| p == "Released"),
        "the history saw the record: {phases:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_csi_release_delete_reaches_the_client_with_its_message() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("refuse")).await;
    t.wait_custody().await;
    let msg = t.assert_csi_release_deletion_refused().await;
    assert!(
        msg.contains("kubectl annotate"),
        "the message names the override command: {msg}"
    );
    assert!(
        t.hr_api()
            .get_opt(
                &common::profile()
                    .csi_release_name(&t.name)
                    .expect("Cozystack has a CSI release")
            )
            .await
            .unwrap()
            .is_some()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_delete_of_the_parent_changes_nothing() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("dryrun")).await;
    t.wait_custody().await;
    let before = t.parent().await.unwrap();
    t.hr_api()
        .delete(
            &t.name,
            &DeleteParams {
                dry_run: true,
                ..Default::default()
            },
        )
        .await
        .expect("dry-run delete accepted");
    let after = t.parent().await.expect("parent still exists");
    assert!(
        after.metadata.deletion_timestamp.is_none(),
        "a dry run set no deletionTimestamp"
    );
    // Flux's helm-controller (status) and the worker (the inventory) may
    // write the release at any time, so the resourceVersion is no witness:
    // what a delete writes must be as before.
    assert_eq!(
        after.metadata.deletion_grace_period_seconds, None,
        "a dry run set no grace period"
    );
    assert!(
        after
            .metadata
            .finalizers
            .unwrap_or_default()
            .contains(&common::profile().custody_finalizer),
        "custody is kept"
    );
    assert_eq!(
        after.metadata.generation, before.metadata.generation,
        "the spec is as before"
    );
    assert_eq!(t.record().await.phase, None, "no phase started");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_keeps_pvc_protection_until_its_pod_is_gone() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("pvcprot")).await;
    t.tenant_namespace("apps").await;
    t.claim("apps", "held", STORAGE_CLASS).await;
    t.pod("apps", "holder", &["held"]).await;
    t.wait_settled(1, 1).await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(t.api.clone(), "apps");
    claims
        .delete("held", &DeleteParams::default())
        .await
        .unwrap();
    let c = claims
        .get("held")
        .await
        .expect("claim still there while mounted");
    assert!(c.metadata.deletion_timestamp.is_some());
    assert!(
        c.metadata
            .finalizers
            .unwrap_or_default()
            .contains(&"kubernetes.io/pvc-protection".to_string()),
        "the real controller manager added pvc-protection"
    );
    Api::<Pod>::namespaced(t.api.clone(), "apps")
        .delete("holder", &DeleteParams::default())
        .await
        .unwrap();
    common::wait::eventually(
        "claim gone once its pod is",
        Duration::from_secs(60),
        || {
            let claims = claims.clone();
            async move {
                if claims
                    .get_opt("held")
                    .await
                    .map_err(|e| e.to_string())?
                    .is_none()
                {
                    Ok(())
                } else {
                    Err("still there".into())
                }
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_tenant_namespace_leaves_zero_volumes() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("nsdel")).await;
    t.wait_custody().await;
    t.incident_workload().await;
    let before = t.infra_objects(None).await;
    t.delete_namespace().await;
    // Released is recorded only once both layers are gone. (What follows,
    // helm-controller uninstalling the children, can fail once against the
    // stopped tenant API and wait out this suite's 10-minute retry delay; on
    // Flux's defaults it is retried within a second, by then the admin
    // kubeconfig is gone and the uninstall skipped: docs/reliability.md.)
    let record = t
        .wait_phase(Phase::Released, Duration::from_secs(240))
        .await;
    assert_eq!(record.inventory.map(|i| i.total), Some(4));
    let left = env.sim.volumes_of(&t.namespace, &t.name);
    assert!(
        left.is_empty(),
        "volumes left after deleting the namespace: {left:?}"
    );
    let infra = t.infra_objects(Some(&before)).await;
    assert!(infra.is_empty(), "{infra:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_tenant_api_blocks_loudly_and_an_authorized_override_finishes_the_teardown() {
    let env = env();
    // The hook as it was at the incident: upstream's later DataVolume step
    // would delete the abandoned disk's DataVolume by label after the override.
    let t = Tenant::create(
        env.cp,
        TenantOptions::new(&env.cp.unique("silent")).values(json!({"deleteDataVolumes": false})),
    )
    .await;
    t.wait_custody().await;
    t.with_held_claims(&["data"]).await;
    // A port that accepts connections and never answers: an API server that exists and is silent.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    t.point_kubeconfig_at(&format!(
        "https://127.0.0.1:{}",
        silent.local_addr().unwrap().port()
    ))
    .await;

    let deleted = std::time::Instant::now();
    t.delete_parent().await;
    let record = t.wait_phase(Phase::Blocked, Duration::from_secs(60)).await;
    let message = record.message.unwrap_or_default();
    assert!(
        message.contains("did not answer /readyz within 3s"),
        "{message}"
    );
    // The worker names the tenant, its phase and how long it has waited
    // (the series VolumeGateTenantBlocked reads); it stays Blocked until
    // the override below, so this cannot be missed.
    let this = [
        ("tenant_namespace", t.namespace.as_str()),
        ("tenant", t.name.as_str()),
    ];
    common::wait::eventually(
        "the tenant's teardown series, Blocked",
        Duration::from_secs(30),
        || async {
            let text = env.worker_metrics().await;
            let blocked = [this[0], this[1], ("phase", "Blocked")];
            match exposition::value(&text, TEARDOWN, &blocked) {
                Some(waited)
                    if waited >= 0.0 && waited <= deleted.elapsed().as_secs_f64() + 1.0 =>
                {
                    Ok(())
                }
                other => Err(format!(
                    "{other:?} in {:?}",
                    exposition::samples(&text, TEARDOWN)
                )),
            }
        },
    )
    .await;
    t.wait_event("Warning", "Blocked", |note| note.contains("/readyz"))
        .await;
    // Nothing wedged silently: the CSI release is still held, and says why.
    let err = t
        .hr_api()
        .delete(
            &common::profile()
                .csi_release_name(&t.name)
                .expect("Cozystack has a CSI release"),
            &DeleteParams::default(),
        )
        .await
        .expect_err("held");
    assert!(err.to_string().contains("phase Blocked"), "{err}");

    // Someone who may edit releases but lacks the override permission cannot abandon the volumes.
    grant_release_editing(&t, "editors").await;
    let mallory = env
        .cp
        .client_as("mallory", &["editors", "system:authenticated"])
        .await;
    let err = t
        .annotate_override(&mallory, "let me")
        .await
        .expect_err("unauthorized override refused");
    assert!(
        err.to_string().contains("may not record an override")
            && err.to_string().contains("\"override\""),
        "{err}"
    );

    // An authorized person can, and the teardown then finishes.
    t.grant_override("platform-admins").await;
    let alice = env
        .cp
        .client_as("alice", &["platform-admins", "system:authenticated"])
        .await;
    t.annotate_override(&alice, "tenant abandoned; API unrecoverable (ticket 42)")
        .await
        .expect("authorized override accepted");
    let record = t
        .wait_phase(Phase::Overridden, Duration::from_secs(30))
        .await;
    let ov = record.override_.expect("override recorded");
    assert_eq!(ov.by.as_deref(), Some("alice"), "stamped from userInfo");
    t.wait_event("Warning", "Overridden", |note| note.contains("alice"))
        .await;
    t.wait_parent_gone(Duration::from_secs(120)).await;
    // The override abandoned the disk, by decision: it is still on storage.
    assert_eq!(env.sim.volumes_of(&t.namespace, &t.name).len(), 1);
    // Its teardown over, the tenant has no series: the cardinality is the
    // tenants being torn down, not every tenant there was.
    common::wait::eventually(
        "the tenant's teardown series gone",
        Duration::from_secs(30),
        || async {
            let text = env.worker_metrics().await;
            let left: Vec<_> = exposition::samples(&text, TEARDOWN)
                .into_iter()
                .filter(|s| {
                    this.iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
                })
                .collect();
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("{left:?}"))
            }
        },
    )
    .await;
    drop(silent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_record_stamps_and_custody_removal_are_refused() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("forge")).await;
    t.wait_custody().await;
    let admin = t.hr_api();
    let profile = common::profile();
    // The record's keys by their names under the profile's prefix.
    let forge = |key: &str, value: &str| json!({"metadata": {"annotations": {format!("{}{key}", profile.annotation_prefix): value}}});
    for (key, value) in [
        ("phase", "Released"),
        ("volumes", "{}"),
        ("override-by", "root"),
    ] {
        let err = admin
            .patch(
                &t.name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&forge(key, value)),
            )
            .await
            .expect_err("forged key refused");
        assert!(err.to_string().contains(key), "{key}: {err}");
    }
    let parent = t.parent().await.unwrap();
    let finalizers: Vec<String> = parent
        .metadata
        .finalizers
        .unwrap_or_default()
        .into_iter()
        .filter(|f| *f != profile.custody_finalizer)
        .collect();
    let err = admin
        .patch(
            &t.name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&json!({"metadata": {"finalizers": finalizers}})),
        )
        .await
        .expect_err("custody finalizer removal refused");
    assert!(
        err.to_string()
            .contains("only the volume-gate worker ends custody"),
        "{err}"
    );
}

/// A Role letting `group` get and patch the tenant's releases: a tenant
/// operator, without the override verb.
async fn grant_release_editing(t: &Tenant, group: &str) {
    let role = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "release-editors", "namespace": t.namespace},
        "rules": [{"apiGroups": ["helm.toolkit.fluxcd.io"], "resources": ["helmreleases"], "verbs": ["get", "patch"]}]});
    let binding = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "release-editors", "namespace": t.namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "release-editors"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": group}]});
    common::manifests::apply(&t.management, &role).await;
    common::manifests::apply(&t.management, &binding).await;
    common::tenant::wait_authorized(
        &t.management,
        group,
        &t.namespace,
        "helm.toolkit.fluxcd.io",
        "helmreleases",
        "patch",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relabelling_a_child_away_from_a_tenant_in_teardown_is_refused() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("relabel")).await;
    t.wait_custody().await;
    t.with_held_claims(&["a"]).await;
    // Hold the phase open: the driver is stuck, the tenant is being deleted.
    t.set_driver(&env.sim, false).await;
    t.delete_parent().await;
    t.wait_phase(Phase::Releasing, Duration::from_secs(30))
        .await;
    for child in ["cilium", "csi"] {
        let name = format!("{}-{child}", t.name);
        let patch = json!({"metadata": {"labels": {"cozystack.io/target-cluster-name": "kubernetes-nobody"}}});
        let err = t
            .hr_api()
            .patch(
                &name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .expect_err("relabel refused");
        assert!(
            err.to_string().contains("refusing to relabel"),
            "{child}: {err}"
        );
    }
    t.set_driver(&env.sim, true).await;
    t.wait_parent_gone(Duration::from_secs(120)).await;
    assert!(env.sim.volumes_of(&t.namespace, &t.name).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_installed_webhook_configurations_are_the_shipped_ones_but_for_where_the_webhook_is() {
    let env = env();
    let client = env.cp.management_client().await;
    for shipped in common::manifests::base_documents()
        .iter()
        .filter(|d| common::manifests::is_webhook_configuration(d))
    {
        let kind = shipped["kind"].as_str().unwrap();
        let gvk = kube::core::GroupVersionKind::gvk("admissionregistration.k8s.io", "v1", kind);
        let (ar, _) = kube::discovery::pinned_kind(&client, &gvk).await.unwrap();
        let live = Api::<kube::api::DynamicObject>::all_with(client.clone(), &ar)
            .get("volume-gate")
            .await
            .unwrap();
        let live_hooks = live.data["webhooks"].as_array().unwrap();
        let shipped_hooks = shipped["webhooks"].as_array().unwrap();
        assert_eq!(live_hooks.len(), shipped_hooks.len(), "{kind}");
        for (l, s) in live_hooks.iter().zip(shipped_hooks) {
            for field in [
                "name",
                "rules",
                "failurePolicy",
                "sideEffects",
                "timeoutSeconds",
                "matchPolicy",
                "admissionReviewVersions",
                "matchConditions",
            ] {
                assert_eq!(l[field], s[field], "{kind} {} {field}", s["name"]);
            }
            if !s["objectSelector"].is_null() {
                assert_eq!(
                    l["objectSelector"], s["objectSelector"],
                    "{kind} {}",
                    s["name"]
                );
            }
            assert!(
                l["clientConfig"]["url"]
                    .as_str()
                    .unwrap()
                    .ends_with(s["clientConfig"]["service"]["path"].as_str().unwrap())
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_collection_is_judged_object_by_object() {
    // The namespace controller and `kubectl delete --all` send DELETECOLLECTION;
    // the API server reviews each object with an empty request name. The
    // gate once judged those by that empty name: the CSI release and every
    // guarded object named after the tenant went through.
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("collection")).await;
    t.wait_custody().await;
    let csi = common::profile()
        .csi_release_name(&t.name)
        .expect("Cozystack has a CSI release");
    let dry = DeleteParams {
        dry_run: true,
        ..Default::default()
    };
    let by_name = |n: &str| kube::api::ListParams::default().fields(&format!("metadata.name={n}"));
    let err = t
        .hr_api()
        .delete_collection(&dry, &by_name(&csi))
        .await
        .expect_err("the CSI release is held");
    assert!(
        err.to_string().contains(&format!(
            "refusing to delete HelmRelease {}/{csi}",
            t.namespace
        )),
        "{err}"
    );

    // In teardown, the guarded objects are held too.
    t.with_held_claims(&["data"]).await;
    t.set_driver(&env.sim, false).await;
    t.delete_parent().await;
    t.wait_inventory().await;
    let tcps: Api<kube::api::DynamicObject> = Api::namespaced_with(
        t.management.clone(),
        &t.namespace,
        &common::tenant::tcp_resource(),
    );
    let err = tcps
        .delete_collection(&dry, &by_name(&t.name))
        .await
        .expect_err("the tenant control plane is held");
    assert!(
        err.to_string()
            .contains("refusing to delete TenantControlPlane"),
        "{err}"
    );
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(t.management.clone(), &t.namespace);
    let kubeconfig = common::profile().kubeconfig_secret_name(&t.name);
    let err = secrets
        .delete_collection(&dry, &by_name(&kubeconfig))
        .await
        .expect_err("the admin kubeconfig is held");
    assert!(
        err.to_string().contains(&format!(
            "refusing to delete Secret {}/{kubeconfig}",
            t.namespace
        )),
        "{err}"
    );

    t.set_driver(&env.sim, true).await;
    t.wait_parent_gone(Duration::from_secs(120)).await;
    assert!(env.sim.volumes_of(&t.namespace, &t.name).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hook_that_passes_early_cannot_uninstall_the_csi_controllers_identity_while_the_phase_runs()
 {
    // Cozystack's hook with the KamajiControlPlane already gone: step 3 is
    // a no-op, step 4's refusal only warns, the hook exits 0 and Helm's
    // uninstall deletes every object of the parent release it can. The
    // controller's ServiceAccount and RBAC must stay until the disks are
    // freed: the simulated driver frees a volume only as that identity.
    // (The KamajiControlPlane owns the TenantControlPlane, Kamaji's
    // provider's controller reference: it goes with its dependents
    // orphaned, as `kubectl delete --cascade=orphan` deletes it, or the
    // garbage collector would take the tenant's API server with it.)
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("early")).await;
    t.wait_custody().await;
    t.with_held_claims(&["a", "b"]).await;
    let kcps: Api<kube::api::DynamicObject> = Api::namespaced_with(
        t.management.clone(),
        &t.namespace,
        &common::tenant::kcp_resource(),
    );
    kcps.delete(&t.name, &DeleteParams::orphan())
        .await
        .expect("outside teardown the control plane may go");
    // Hold the phase open (a driver that frees nothing yet) until the uninstall has been tried.
    t.set_driver(&env.sim, false).await;
    t.delete_parent().await;
    // helm-controller records Helm's uninstall, which deleted what it could
    // and failed on what the gate refused (Helm v4: "failed to delete
    // release"; the refusals are in its log).
    t.next_uninstall_failed(Duration::from_secs(120), |m| {
        m.contains("failed to delete release")
    })
    .await;
    let flux_log = common::flux::running(env.cp).await.log();
    let refused = flux_log
        .lines()
        .filter(|l| {
            l.contains("Failed to delete release")
                && l.contains(&format!("\"name\":\"{}\"", t.name))
        })
        .collect::<Vec<_>>();
    assert!(
        refused
            .iter()
            .any(|l| l.contains("volume-gate: refusing to delete")),
        "the gate refused the uninstall's deletes: {refused:?}"
    );
    assert_ne!(t.record().await.phase, Some(Phase::Released), "mid-phase");
    let sa = Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(
        t.management.clone(),
        &t.namespace,
    );
    assert!(
        sa.get_opt(&format!("{}-kcsi", t.name))
            .await
            .unwrap()
            .is_some(),
        "the controller's ServiceAccount stays"
    );
    let crb = Api::<k8s_openapi::api::rbac::v1::ClusterRoleBinding>::all(t.management.clone());
    assert!(
        crb.get_opt(&format!("{}-kcsi-binding", t.name))
            .await
            .unwrap()
            .is_some(),
        "its ClusterRoleBinding stays"
    );

    t.set_driver(&env.sim, true).await;
    t.wait_parent_gone(Duration::from_secs(180)).await;
    let left = env.sim.volumes_of(&t.namespace, &t.name);
    assert!(left.is_empty(), "volumes left: {left:?}");
    let key = format!("{}/{}", t.namespace, t.name);
    let log = env.sim.log();
    assert!(
        !log.lines()
            .any(|l| l.contains(&key) && l.contains(" identity-missing ")),
        "the driver never lacked its identity:\n{}",
        log.lines()
            .filter(|l| l.contains(&key))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // And once done, the uninstall took the identity with the rest.
    assert!(
        sa.get_opt(&format!("{}-kcsi", t.name))
            .await
            .unwrap()
            .is_none(),
        "uninstalled after the phase"
    );
}
