//! Cozystack's teardown itself, WITHOUT the gate, as every test runs it: the
//! tenant chart's pre-delete hook (`tests/fixtures/charts/kubernetes`), run
//! by the real helm-controller as a Job that the simulator's management node
//! executes; its step order and failure rules (`docs/design.md` §1); Flux's
//! own retries of a failed uninstall; and what deleting a TenantControlPlane
//! does. The gated tests rely on this world behaving as Cozystack's, so it is
//! pinned down here, from the hook's output (the simulator's log, one line
//! per output line) and from the API state.

use volume_gate_testkit as common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::cluster::repo_root;
use common::flux::ready_condition;
use common::history::Seen;
use common::sim::JobRun;
use common::tenant::{Tenant, TenantOptions, kcp_resource, tcp_resource};
use common::wait::eventually;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject};
use kube::core::GroupVersionKind;
use serde_json::json;

/// This binary's world: no gate, and helm-controller retrying a failed
/// uninstall after 1 s growing to 8 s, so that Flux's own retries (not a
/// request) happen within a test's bounds.
fn env() -> &'static common::Env {
    common::ungated_with_flux_retry("1s", "8s")
}

fn runs(env: &common::Env, t: &Tenant) -> Vec<JobRun> {
    env.sim.hook_runs(&t.namespace, &t.name)
}

fn render(runs: &[JobRun]) -> String {
    runs.iter()
        .map(JobRun::render)
        .collect::<Vec<_>>()
        .join("\n")
}

/// Waits until the runs of `t`'s hook satisfy `check` (the simulator's log
/// is append-only: a run once logged stays logged).
async fn wait_runs<T>(
    env: &common::Env,
    t: &Tenant,
    what: &str,
    timeout: Duration,
    check: impl Fn(&[JobRun]) -> Option<T>,
) -> T {
    eventually(what, timeout, || {
        let runs = runs(env, t);
        let got = check(&runs);
        async move { got.ok_or_else(|| format!("hook runs so far:\n{}", render(&runs))) }
    })
    .await
}

/// Waits for the parent to be gone, then for every run of its hook to have
/// ended in the log (the simulator logs an exit after reporting it), and
/// returns the runs.
async fn runs_once_gone(env: &common::Env, t: &Tenant) -> Vec<JobRun> {
    t.wait_parent_gone(Duration::from_secs(120)).await;
    wait_runs(
        env,
        t,
        "every run of the hook ended",
        Duration::from_secs(30),
        |r| r.iter().all(|r| r.exit.is_some()).then(|| r.to_vec()),
    )
    .await
}

/// The position of the first output line of `run` containing `needle`.
fn line_of(run: &JobRun, needle: &str) -> usize {
    run.output
        .iter()
        .position(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no line containing {needle:?} in\n{}", run.render()))
}

/// Whether helm-controller ever recorded a failed uninstall of the parent.
fn uninstall_ever_failed(t: &Tenant) -> bool {
    t.history.all().iter().any(|s| match s {
        Seen::Parent(p) => {
            ready_condition(p).is_some_and(|(_, reason, _)| reason == "UninstallFailed")
        }
        Seen::Gone => false,
    })
}

// ---------------------------------------------------------------------------
// Admission policies of our own (admissionregistration.k8s.io/v1), to make
// one DELETE of the teardown fail the way a refusing webhook would.

fn policy_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(
            "admissionregistration.k8s.io",
            "v1",
            "ValidatingAdmissionPolicy",
        ),
        "validatingadmissionpolicies",
    )
}

fn binding_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(
            "admissionregistration.k8s.io",
            "v1",
            "ValidatingAdmissionPolicyBinding",
        ),
        "validatingadmissionpolicybindings",
    )
}

/// Installs a policy `name` refusing the DELETEs of `resource` (in `group`)
/// for which `expression` is false, bound to namespace `namespace` only.
async fn refuse_deletes(
    t: &Tenant,
    name: &str,
    group: &str,
    resource: &str,
    expression: &str,
    message: &str,
) {
    let policy = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [group], "apiVersions": ["*"], "operations": ["DELETE"], "resources": [resource]}]},
            "validations": [{"expression": expression, "message": message}],
        },
    });
    let binding = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": t.namespace}}},
        },
    });
    common::manifests::apply(&t.management, &policy).await;
    common::manifests::apply(&t.management, &binding).await;
}

/// Waits until a dry-run DELETE through `api` of `name` is refused by the
/// policy (the API server's policy cache lags the objects).
async fn wait_refused(api: &Api<DynamicObject>, name: &str, message: &str) {
    eventually(
        &format!("policy refusing DELETE of {name} active"),
        Duration::from_secs(30),
        || {
            let api = api.clone();
            async move {
                match api
                    .delete(
                        name,
                        &DeleteParams {
                            dry_run: true,
                            ..Default::default()
                        },
                    )
                    .await
                {
                    Err(kube::Error::Api(s)) if s.message.contains(message) => Ok(()),
                    other => Err(format!(
                        "dry-run DELETE not refused yet: {:?}",
                        other.map(|_| ())
                    )),
                }
            }
        },
    )
    .await
}

async fn delete_binding(t: &Tenant, name: &str) {
    let api: Api<DynamicObject> = Api::all_with(t.management.clone(), &binding_resource());
    api.delete(name, &DeleteParams::default())
        .await
        .expect("delete policy binding");
}

async fn delete_policy(t: &Tenant, name: &str) {
    let _ = Api::<DynamicObject>::all_with(t.management.clone(), &binding_resource())
        .delete(name, &DeleteParams::default())
        .await;
    let _ = Api::<DynamicObject>::all_with(t.management.clone(), &policy_resource())
        .delete(name, &DeleteParams::default())
        .await;
}

fn kcps(t: &Tenant) -> Api<DynamicObject> {
    Api::namespaced_with(t.management.clone(), &t.namespace, &kcp_resource())
}

fn tcps(t: &Tenant) -> Api<DynamicObject> {
    Api::namespaced_with(t.management.clone(), &t.namespace, &tcp_resource())
}

// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hook_runs_steps_one_to_six_in_order_and_then_flux_finishes_the_uninstall() {
    // Serialized with the test that deletes the DataVolume CRD: a CRD going
    // away under step 5 would fail this run for a reason not its own.
    let _serial = common::serial();
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("order")).await;

    t.delete_parent().await;
    let runs = runs_once_gone(env, &t).await;
    assert_eq!(runs.len(), 1, "one run was enough:\n{}", render(&runs));
    let run = &runs[0];
    assert_eq!(
        run.steps(),
        vec![1, 2, 3, 4, 5, 6],
        "the hook's steps, in order:\n{}",
        run.render()
    );
    assert!(run.succeeded(), "{}", run.render());
    assert_eq!(
        run.output.last().map(String::as_str),
        Some("Cleanup completed successfully"),
        "the hook ended after step 6:\n{}",
        run.render()
    );
    assert!(
        !run.output
            .iter()
            .any(|l| l.contains("WARNING") || l.contains("Error from server")),
        "no step failed or warned:\n{}",
        run.render()
    );
    assert_eq!(
        run.output
            .iter()
            .filter(|l| l.starts_with("  suspend "))
            .count(),
        3,
        "step 1 suspended the three children:\n{}",
        run.render()
    );
    assert!(!uninstall_ever_failed(&t), "the uninstall did not fail");

    // API state: the whole tenant went, the hook's part and Helm's.
    for child in ["csi", "cilium", "coredns"] {
        assert!(
            t.hr_api()
                .get_opt(&format!("{}-{child}", t.name))
                .await
                .unwrap()
                .is_none(),
            "child {child} gone"
        );
    }
    assert!(
        kcps(&t).get_opt(&t.name).await.unwrap().is_none(),
        "KamajiControlPlane gone"
    );
    assert!(
        tcps(&t).get_opt(&t.name).await.unwrap().is_none(),
        "TenantControlPlane gone"
    );
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(t.management.clone(), &t.namespace);
    assert!(
        deployments
            .get_opt(&format!("{}-kcsi-controller", t.name))
            .await
            .unwrap()
            .is_none(),
        "Helm's uninstall took the chart's objects"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_kcp_delete_aborts_the_hook_and_flux_retries_it_from_step_one() {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("kcpref")).await;
    let policy = format!("refuse-kcp-delete-{}", t.namespace);
    let message = format!("test policy {policy} refuses KamajiControlPlane deletion");
    refuse_deletes(
        &t,
        &policy,
        "controlplane.cluster.x-k8s.io",
        "kamajicontrolplanes",
        "request.operation != 'DELETE'",
        &message,
    )
    .await;
    wait_refused(&kcps(&t), &t.name, &message).await;

    t.delete_parent().await;
    // helm-controller records the failed uninstall...
    let failed = t
        .next_uninstall_failed(Duration::from_secs(120), |_| true)
        .await;
    assert!(
        failed.contains(&format!("{}-pre-cleanup", t.name)),
        "Flux names the failed hook: {failed}"
    );
    // ...and retries it on its own: a new Job, from step 1 again.
    let runs = wait_runs(env, &t, "two runs ended", Duration::from_secs(90), |r| {
        (r.iter().filter(|r| r.exit.is_some()).count() >= 2).then(|| r.to_vec())
    })
    .await;
    for run in runs.iter().filter(|r| r.exit.is_some()) {
        assert_eq!(
            run.steps(),
            vec![1, 2, 3],
            "ran from step 1 and stopped at step 3:\n{}",
            run.render()
        );
        assert_eq!(
            run.exit.as_deref(),
            Some("exit 1 (Failed)"),
            "{}",
            run.render()
        );
        assert!(
            run.output.last().is_some_and(|l| l.contains(&message)),
            "ended with the refused KamajiControlPlane DELETE (set -e):\n{}",
            run.render()
        );
    }
    assert_ne!(runs[0].pod, runs[1].pod, "each retry is a new Job");
    let tcp = tcps(&t)
        .get(&t.name)
        .await
        .expect("TenantControlPlane still there");
    assert!(
        tcp.metadata.deletion_timestamp.is_none(),
        "step 4 never ran"
    );
    let kcp = kcps(&t)
        .get(&t.name)
        .await
        .expect("KamajiControlPlane still there");
    assert!(
        kcp.metadata.deletion_timestamp.is_none(),
        "the KamajiControlPlane DELETE was refused"
    );

    // The refusal ends: Flux's next retry goes all the way.
    delete_binding(&t, &policy).await;
    let runs = runs_once_gone(env, &t).await;
    let last = runs.last().unwrap();
    assert!(
        runs.len() > 2,
        "the completing run is a later one:\n{}",
        render(&runs)
    );
    assert_eq!(last.steps(), vec![1, 2, 3, 4, 5, 6], "{}", last.render());
    assert!(last.succeeded(), "{}", last.render());
    assert!(
        kcps(&t).get_opt(&t.name).await.unwrap().is_none(),
        "KamajiControlPlane gone"
    );
    assert!(
        tcps(&t).get_opt(&t.name).await.unwrap().is_none(),
        "TenantControlPlane gone"
    );
    delete_policy(&t, &policy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_child_delete_makes_step_two_strip_the_children_finalizers_and_carry_on_to_step_three()
 {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("childref")).await;
    let cilium = format!("{}-cilium", t.name);
    let policy = format!("refuse-child-delete-{}", t.namespace);
    let message = format!("test policy {policy} refuses deleting {cilium}");
    refuse_deletes(
        &t,
        &policy,
        "helm.toolkit.fluxcd.io",
        "helmreleases",
        &format!("request.name != '{cilium}'"),
        &message,
    )
    .await;
    wait_refused(&t.hr_api(), &cilium, &message).await;

    t.delete_parent().await;
    let run = wait_runs(
        env,
        &t,
        "the first run ended",
        Duration::from_secs(120),
        |r| r.first().filter(|r| r.exit.is_some()).cloned(),
    )
    .await;
    let refused = line_of(&run, &message);
    let warned = line_of(
        &run,
        &format!("WARNING: the child HelmReleases of {} did not go", t.name),
    );
    let cleared = line_of(
        &run,
        &format!("clear the finalizers of helmrelease.helm.toolkit.fluxcd.io/{cilium}"),
    );
    let step3 = line_of(&run, "Step 3:");
    assert!(
        line_of(&run, "Step 2:") < refused
            && refused < step3
            && warned < cleared
            && cleared < step3,
        "refused, warned, stripped, then step 3:\n{}",
        run.render()
    );
    assert!(
        run.succeeded(),
        "nothing aborted the hook:\n{}",
        run.render()
    );
    assert_eq!(run.steps(), vec![1, 2, 3, 4, 5, 6], "{}", run.render());

    // The refused child is still there, never deleted, its finalizers gone.
    let c = t
        .hr_api()
        .get(&cilium)
        .await
        .expect("the refused child still exists");
    assert!(
        c.metadata.deletion_timestamp.is_none(),
        "its DELETE was refused"
    );
    assert!(
        c.metadata.finalizers.unwrap_or_default().is_empty(),
        "its finalizers were stripped"
    );
    for child in ["csi", "coredns"] {
        let name = format!("{}-{child}", t.name);
        eventually(
            &format!("child {name} gone"),
            Duration::from_secs(60),
            || {
                let api = t.hr_api();
                let name = name.clone();
                async move {
                    match api.get_opt(&name).await.map_err(|e| e.to_string())? {
                        None => Ok(()),
                        Some(o) => Err(format!("finalizers {:?}", o.metadata.finalizers)),
                    }
                }
            },
        )
        .await;
    }
    assert!(
        kcps(&t).get_opt(&t.name).await.unwrap().is_none(),
        "step 3 deleted the KamajiControlPlane"
    );

    // Helm's own delete of the child is refused too, and fails the
    // uninstall; once the policy goes, Flux's retry finishes it.
    delete_policy(&t, &policy).await;
    t.wait_parent_gone(Duration::from_secs(120)).await;
    assert!(
        t.hr_api().get_opt(&cilium).await.unwrap().is_none(),
        "{cilium} went with the release"
    );
}

const DATAVOLUME_CRD: &str = "datavolumes.cdi.kubevirt.io";

fn crd_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("apiextensions.k8s.io", "v1", "CustomResourceDefinition"),
        "customresourcedefinitions",
    )
}

/// Whether the management API serves DataVolumes, as the hook asks it.
async fn datavolumes_served(client: &kube::Client) -> Result<bool, String> {
    match client
        .list_api_group_resources("cdi.kubevirt.io/v1beta1")
        .await
    {
        Ok(list) => Ok(list.resources.iter().any(|r| r.name == "datavolumes")),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
        Err(e) => Err(e.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn step_five_without_the_datavolume_crd_is_skipped_not_a_failure() {
    let _serial = common::serial();
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("nocdi")).await;

    // This binary's own management cluster, without CDI.
    let crds: Api<DynamicObject> = Api::all_with(t.management.clone(), &crd_resource());
    crds.delete(DATAVOLUME_CRD, &DeleteParams::default())
        .await
        .expect("delete the DataVolume CRD");
    eventually("the DataVolume API gone", Duration::from_secs(60), || {
        let (crds, client) = (crds.clone(), t.management.clone());
        async move {
            let crd_present = crds
                .get_opt(DATAVOLUME_CRD)
                .await
                .map_err(|e| e.to_string())?
                .is_some();
            let served = datavolumes_served(&client).await?;
            if !crd_present && !served {
                Ok(())
            } else {
                Err(format!("CRD present: {crd_present}, served: {served}"))
            }
        }
    })
    .await;

    t.delete_parent().await;
    let runs = runs_once_gone(env, &t).await;
    assert_eq!(runs.len(), 1, "the first run completed:\n{}", render(&runs));
    let run = &runs[0];
    assert!(
        run.output
            .iter()
            .any(|l| l == "  CDI is not installed: no DataVolumes"),
        "step 5 was skipped:\n{}",
        run.render()
    );
    assert_eq!(
        run.steps(),
        vec![1, 2, 3, 4, 5, 6],
        "step 6 ran after the skipped step 5:\n{}",
        run.render()
    );
    assert!(run.succeeded(), "{}", run.render());
    assert!(!uninstall_ever_failed(&t), "the uninstall did not fail");

    // Leave the cluster as the other tests of this binary found it.
    common::manifests::apply_file(
        &t.management,
        &repo_root().join("tests/fixtures/crds/management/cdi.kubevirt.io.yaml"),
    )
    .await;
    eventually("the DataVolume API back", Duration::from_secs(60), || {
        let client = t.management.clone();
        async move {
            if datavolumes_served(&client).await? {
                Ok(())
            } else {
                Err("not served".into())
            }
        }
    })
    .await;
}

/// The tenant API's `/readyz`, bounded: its body, or why it did not answer.
async fn readyz(client: &kube::Client) -> Result<String, String> {
    let req = http::Request::get("/readyz").body(Vec::new()).unwrap();
    match tokio::time::timeout(Duration::from_secs(3), client.request_text(req)).await {
        Err(_) => Err("no answer within 3s".into()),
        Ok(Err(e)) => Err(e.to_string()),
        Ok(Ok(body)) => Ok(body),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_tenant_control_plane_stops_the_tenant_api_server_and_gc_removes_the_admin_kubeconfig()
 {
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("tcpdel")).await;
    let secrets: Api<Secret> = Api::namespaced(t.management.clone(), &t.namespace);
    let secret_name = common::profile().kubeconfig_secret_name(&t.name);

    let body = readyz(&t.api)
        .await
        .expect("the tenant API answers /readyz before");
    assert_eq!(body.trim(), "ok");
    let tcp = tcps(&t).get(&t.name).await.expect("TenantControlPlane");
    let secret = secrets
        .get(&secret_name)
        .await
        .expect("admin kubeconfig Secret");
    let owners = secret.metadata.owner_references.unwrap_or_default();
    assert!(
        owners
            .iter()
            .any(|o| o.kind == "TenantControlPlane" && Some(&o.uid) == tcp.metadata.uid.as_ref()),
        "owned by the TCP: {owners:?}"
    );

    tcps(&t)
        .delete(&t.name, &DeleteParams::background())
        .await
        .expect("delete the TenantControlPlane");

    let why = eventually(
        "tenant API /readyz stops answering",
        Duration::from_secs(60),
        || async {
            match readyz(&t.api).await {
                Ok(body) => Err(format!("still answers: {body}")),
                Err(e) => Ok(e),
            }
        },
    )
    .await;
    eprintln!("tenant /readyz after the TCP went: {why}");
    // It was stopped (not a blip): the simulator's Kamaji stopped that very cluster.
    let stopped = format!(
        "{}/{} stopped tenant API server (harness cluster {}) stopped",
        t.namespace, t.name, t.cluster.name
    );
    eventually(
        "kamaji stopped the tenant API server",
        Duration::from_secs(30),
        || {
            let seen = env
                .sim
                .log()
                .lines()
                .any(|l| l.contains(" kamaji ") && l.contains(&stopped));
            async move {
                if seen {
                    Ok(())
                } else {
                    Err("not yet".to_string())
                }
            }
        },
    )
    .await;
    assert!(readyz(&t.api).await.is_err(), "and it stays down");

    // Generous: the garbage collector learns of the TenantControlPlane kind
    // only at its next discovery resync (30s) after the CRDs were applied.
    eventually(
        "garbage collector removes the admin kubeconfig Secret",
        Duration::from_secs(120),
        || {
            let (secrets, name) = (secrets.clone(), secret_name.clone());
            async move {
                match secrets.get_opt(&name).await.map_err(|e| e.to_string())? {
                    None => Ok(()),
                    Some(s) => Err(format!(
                        "still there (deletionTimestamp {:?})",
                        s.metadata.deletion_timestamp
                    )),
                }
            }
        },
    )
    .await;
    assert!(
        tcps(&t).get_opt(&t.name).await.unwrap().is_none(),
        "the TenantControlPlane is gone"
    );
}

/// Whether `t`'s CSI driver ever ran DeleteVolume (deleted a DataVolume), by
/// the simulator's log.
fn driver_deleted_a_datavolume(env: &common::Env, t: &Tenant) -> bool {
    let key = format!(" {}/{} ", t.namespace, t.name);
    env.sim
        .log()
        .lines()
        .any(|l| l.contains(&key) && l.contains(" datavolume deleted "))
}

/// The KubeVirt path without the gate, with the hook as it was at the
/// incident (no DataVolume step): step 2 takes the CSI driver before anyone
/// deleted a claim, so no DeleteVolume ever runs; the tenant's PVs go with
/// its API, and every DataVolume, with its PVC, PV and disk, stays in the
/// management cluster. Both layers leak.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_gate_the_incident_era_hook_leaks_both_layers() {
    let _serial = common::serial();
    let env = env();
    let t = Tenant::create(
        env.cp,
        TenantOptions::new(&env.cp.unique("leak2")).values(json!({"deleteDataVolumes": false})),
    )
    .await;
    t.incident_workload().await;
    let disks = env.sim.volumes_of(&t.namespace, &t.name);
    assert_eq!(disks.len(), 4, "{disks:?}");
    let infra = t.infra_objects(None).await;
    assert_eq!(infra.datavolumes.len(), 4, "{infra:?}");
    // A tenant that stays, in the same namespace, with a disk of its own:
    // the report must never name it.
    let live = Tenant::create(
        env.cp,
        TenantOptions::new(&env.cp.unique("live"))
            .in_namespace(&t.namespace)
            .light(),
    )
    .await;
    live.with_held_claims(&["data"]).await;
    let live_infra = live.infra_objects(None).await;
    assert_eq!(live_infra.datavolumes.len(), 1, "{live_infra:?}");

    t.delete_parent().await;
    let runs = runs_once_gone(env, &t).await;
    t.wait_api_stopped(&env.sim, Duration::from_secs(120)).await;
    assert!(
        runs.iter().any(|r| r
            .output
            .iter()
            .any(|l| l == "  this hook predates the DataVolume step: none deleted")),
        "{}",
        render(&runs)
    );
    // Nothing can free a disk now: the driver and the tenant API are gone,
    // and nothing deletes a DataVolume.
    assert_eq!(
        env.sim.volumes_of(&t.namespace, &t.name),
        disks,
        "THE INCIDENT on the KubeVirt path: every disk stayed"
    );
    assert_eq!(
        t.infra_objects(Some(&infra)).await,
        infra,
        "every DataVolume, PVC and PV stayed in the management cluster"
    );
    assert!(!driver_deleted_a_datavolume(env, &t), "no DeleteVolume ran");

    // What an operator installing volume-gate afterwards finds:
    // `volume-gate orphans` lists exactly what leaked, and not the tenant
    // that is still there.
    orphans_lists_exactly_the_leak(env, &t, &infra, &live).await;
}

/// `(kind, name)` of each object in `infra`, as the report names them.
fn leaked_objects(infra: &common::tenant::InfraObjects) -> BTreeSet<(String, String)> {
    let of = |kind: &str, names: &[String]| {
        names
            .iter()
            .map(|n| (kind.to_string(), n.clone()))
            .collect::<Vec<_>>()
    };
    [
        of("DataVolume", &infra.datavolumes),
        of("PersistentVolumeClaim", &infra.claims),
        of("PersistentVolume", &infra.volumes),
    ]
    .concat()
    .into_iter()
    .collect()
}

/// Runs the real `volume-gate orphans` with `kubeconfig`; its stdout.
fn orphans(kubeconfig: &std::path::Path, args: &[&str]) -> String {
    common::process::run_ok(
        std::process::Command::new(common::gate::binary())
            .arg("orphans")
            .args(args)
            .env("KUBECONFIG", kubeconfig),
        &format!("volume-gate orphans {args:?}"),
    )
}

/// The report's rows as `(kind, name)`, and the tenants they name.
fn rows(report: &serde_json::Value) -> (BTreeSet<(String, String)>, BTreeSet<String>) {
    let orphans = report["orphans"].as_array().expect("orphans array");
    let objects = orphans
        .iter()
        .map(|o| {
            (
                o["kind"].as_str().unwrap().to_string(),
                o["name"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let tenants = orphans
        .iter()
        .filter_map(|o| o["tenant"].as_str().map(str::to_string))
        .collect();
    (objects, tenants)
}

/// The report on the cluster the incident left, run as the worker's
/// ServiceAccount with the shipped ClusterRole (what `kubectl exec` into the
/// worker's Pod runs as): exactly `infra`, all of `t`, never `live`'s.
async fn orphans_lists_exactly_the_leak(
    env: &common::Env,
    t: &Tenant,
    infra: &common::tenant::InfraObjects,
    live: &Tenant,
) {
    let leaked = leaked_objects(infra);
    assert!(
        !infra.claims.is_empty() && !infra.volumes.is_empty(),
        "the leak has all three layers: {infra:?}"
    );
    // The worker's identity as shipped: its ServiceAccount, ClusterRole and
    // binding from manifests/base (no worker runs in this binary's world).
    let client = env.cp.management_client().await;
    for doc in common::manifests::base_documents().iter().filter(|d| {
        let name = d["metadata"]["name"].as_str().unwrap_or("");
        match common::manifests::kind_of(d) {
            "Namespace" => true,
            "ServiceAccount" | "ClusterRole" | "ClusterRoleBinding" => {
                name == common::gate::WORKER_SA
            }
            _ => false,
        }
    }) {
        common::manifests::apply(&client, doc).await;
    }
    let worker = env
        .cp
        .service_account_kubeconfig(common::gate::NAMESPACE, common::gate::WORKER_SA)
        .await;
    let mine = format!("{}/{}", t.namespace, t.name);

    let report: serde_json::Value =
        serde_json::from_str(&orphans(&worker, &["-n", &t.namespace, "-o", "json"]))
            .expect("the JSON report");
    let (objects, tenants) = rows(&report);
    assert_eq!(
        objects, leaked,
        "exactly the leaked DataVolumes, PVCs and PVs: {report:#}"
    );
    assert_eq!(tenants, BTreeSet::from([mine.clone()]), "{report:#}");
    assert_eq!(report["skipped"], json!([]), "every kind is served here");

    // Cluster-wide: what is listed of this namespace is the same, and no
    // row names a tenant whose parent exists (earlier tests' leaks may be
    // listed: their tenants are gone too).
    let report: serde_json::Value =
        serde_json::from_str(&orphans(&worker, &["-o", "json"])).expect("the JSON report");
    let here: BTreeSet<(String, String)> = report["orphans"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["tenant"].as_str() == Some(mine.as_str()))
        .map(|o| {
            (
                o["kind"].as_str().unwrap().to_string(),
                o["name"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(here, leaked, "{report:#}");
    let parents: Api<DynamicObject> =
        Api::all_with(client.clone(), &common::gate::helmrelease_resource());
    let existing: BTreeSet<String> = parents
        .list_metadata(&kube::api::ListParams::default())
        .await
        .expect("list HelmReleases")
        .items
        .iter()
        .map(|p| {
            format!(
                "{}/{}",
                p.metadata.namespace.as_deref().unwrap_or(""),
                p.metadata.name.as_deref().unwrap_or("")
            )
        })
        .collect();
    assert!(
        existing.contains(&format!("{}/{}", live.namespace, live.name)),
        "the live tenant's parent exists: {existing:?}"
    );
    let (objects, tenants) = rows(&report);
    assert!(
        tenants.is_disjoint(&existing),
        "a tenant that exists is named: {:?}",
        tenants.intersection(&existing).collect::<Vec<_>>()
    );
    let live_objects = leaked_objects(&live.infra_objects(None).await);
    assert!(
        objects.is_disjoint(&live_objects),
        "the live tenant's disks are listed: {report:#}"
    );

    // The table, with the operator's own kubeconfig: a header and one row
    // per leaked object, each naming the object.
    let table = orphans(&env.cp.management.kubeconfig, &["-n", &t.namespace]);
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("KIND") && lines[0].contains("FREE WITH"),
        "{table}"
    );
    assert_eq!(lines.len(), 1 + leaked.len(), "{table}");
    for (kind, name) in &leaked {
        assert!(
            lines[1..].iter().any(|l| {
                let cells: Vec<&str> = l.split_whitespace().collect();
                cells.first() == Some(&kind.as_str()) && cells.get(2) == Some(&name.as_str())
            }),
            "no row for {kind} {name}:\n{table}"
        );
    }
}

/// Upstream's later answer, step 5 (`--wait=false`, no check): it deletes
/// the tenant's DataVolumes by label behind the driver's back, and once the
/// VM's attachments go with the VM (Cluster API's cascade deletes the
/// Machine, CAPK its VM), their disks are freed,
/// in a run that reaches step 5. It decides by a label and checks nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_gate_upstreams_datavolume_step_frees_the_disks_behind_the_drivers_back() {
    let _serial = common::serial();
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("step5")).await;
    t.incident_workload().await;
    assert_eq!(env.sim.volumes_of(&t.namespace, &t.name).len(), 4);

    t.delete_parent().await;
    let runs = runs_once_gone(env, &t).await;
    let deleted = runs
        .iter()
        .flat_map(|r| r.output.iter())
        .filter(|l| {
            l.starts_with("datavolume.cdi.kubevirt.io \"")
                && l.ends_with(&format!("\" deleted from {} namespace", t.namespace))
        })
        .count();
    assert_eq!(
        deleted,
        4,
        "step 5 deleted each DataVolume:\n{}",
        render(&runs)
    );
    // Freed disks never come back: wait for the ledger to empty.
    env.sim.wait_disks(&t.namespace, &t.name, 0).await;
    assert!(
        !driver_deleted_a_datavolume(env, &t),
        "the driver freed nothing: the hook's label did"
    );
}
