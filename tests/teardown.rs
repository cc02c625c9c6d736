//! The simulated Cozystack teardown itself, WITHOUT the gate: the pre-delete
//! hook's step order and failure rules (`docs/design.md` §1), Flux's retries, and
//! what deleting a TenantControlPlane does. The gated tests rely on this
//! world behaving as Cozystack does, so it is pinned down here, from the
//! simulator's log (one line per action) and from the API state.

mod common;

use std::time::Duration;

use common::cluster::repo_root;
use common::tenant::{Tenant, kcp_resource, tcp_resource};
use common::wait::eventually;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject};
use kube::core::GroupVersionKind;
use serde_json::json;

fn env() -> &'static common::Env {
    common::ungated()
}

// ---------------------------------------------------------------------------
// The simulator's log: `time component tenant action details`.

#[derive(Debug, Clone)]
struct LogLine {
    at: jiff::Timestamp,
    component: String,
    tenant: String,
    action: String,
    details: String,
}

fn token(s: &str) -> Option<(&str, &str)> {
    let s = s.trim_start();
    if s.is_empty() {
        return None;
    }
    let end = s.find(' ').unwrap_or(s.len());
    Some((&s[..end], &s[end..]))
}

fn parse_line(line: &str) -> Option<LogLine> {
    let (at, rest) = token(line)?;
    let (component, rest) = token(rest)?;
    let (tenant, rest) = token(rest)?;
    let (action, rest) = token(rest)?;
    Some(LogLine {
        at: at.parse().ok()?,
        component: component.to_string(),
        tenant: tenant.to_string(),
        action: action.to_string(),
        details: rest.trim().to_string(),
    })
}

/// The simulator's lines about tenant `N/R`, in log order.
fn lines_of(env: &common::Env, t: &Tenant) -> Vec<LogLine> {
    let key = format!("{}/{}", t.namespace, t.name);
    env.sim
        .log()
        .lines()
        .filter_map(parse_line)
        .filter(|l| l.tenant == key)
        .collect()
}

/// The hook's attempt number of a line (`attempt=N ...`).
fn attempt_of(l: &LogLine) -> Option<u32> {
    l.details
        .strip_prefix("attempt=")?
        .split(' ')
        .next()?
        .parse()
        .ok()
}

/// The hook's lines of attempt `n`.
fn hook_lines(lines: &[LogLine], n: u32) -> Vec<LogLine> {
    lines
        .iter()
        .filter(|l| l.component == "hook" && attempt_of(l) == Some(n))
        .cloned()
        .collect()
}

/// The step numbers of hook lines in order, consecutive repeats collapsed
/// (`step4b`, the datastore Secret, is part of step 4); `done` is not a step.
fn step_sequence(hook: &[LogLine]) -> Vec<u32> {
    let mut seq: Vec<u32> = Vec::new();
    for n in hook.iter().filter_map(step_of) {
        if seq.last() != Some(&n) {
            seq.push(n);
        }
    }
    seq
}

/// The step number of a hook line (`step4b` is step 4), if it is a step.
fn step_of(l: &LogLine) -> Option<u32> {
    let rest = l.action.strip_prefix("step")?;
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    Some(
        digits
            .parse()
            .unwrap_or_else(|_| panic!("unparseable step in {l:?}")),
    )
}

/// Flux's failed uninstalls of the parent release R (not of a child).
fn parent_failures<'a>(lines: &'a [LogLine], t: &Tenant) -> Vec<&'a LogLine> {
    let prefix = format!("HelmRelease {}: ", t.name);
    lines
        .iter()
        .filter(|l| {
            l.component == "flux"
                && l.action == "uninstall-failed"
                && l.details.starts_with(&prefix)
        })
        .collect()
}

fn render(lines: &[LogLine]) -> String {
    lines
        .iter()
        .map(|l| format!("{} {} {} {}", l.at, l.component, l.action, l.details))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A Go duration as the simulator prints it (`1s`, `500ms`, `1m30s`).
fn go_duration(s: &str) -> Duration {
    let mut total = Duration::ZERO;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .expect("unit after number");
        let value: f64 = rest[..num_len]
            .parse()
            .unwrap_or_else(|_| panic!("duration {s}"));
        let unit_len = rest[num_len..]
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len() - num_len);
        let unit = &rest[num_len..num_len + unit_len];
        let scale = match unit {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            other => panic!("unit {other} in duration {s}"),
        };
        total += Duration::from_secs_f64(value * scale);
        rest = &rest[num_len + unit_len..];
    }
    total
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

/// Waits until the simulator's log about `t` satisfies `check`.
async fn wait_log<T>(
    env: &common::Env,
    t: &Tenant,
    what: &str,
    timeout: Duration,
    check: impl Fn(&[LogLine]) -> Option<T>,
) -> T {
    eventually(what, timeout, || {
        let lines = lines_of(env, t);
        let got = check(&lines);
        async move { got.ok_or_else(|| format!("log so far:\n{}", render(&lines))) }
    })
    .await
}

/// Waits until the parent is gone and Flux has logged removing its
/// finalizer (the simulator logs an action after the API call that does
/// it, so the parent can be seen gone before the line is written), and
/// returns the log about `t`.
async fn wait_teardown_logged(env: &common::Env, t: &Tenant, timeout: Duration) -> Vec<LogLine> {
    t.wait_parent_gone(timeout).await;
    let removed = format!("HelmRelease {}: finalizers.fluxcd.io removed", t.name);
    wait_log(
        env,
        t,
        "Flux's line about removing the parent's finalizer",
        Duration::from_secs(30),
        |lines| {
            lines
                .iter()
                .any(|l| {
                    l.component == "flux" && l.action == "finalizer-removed" && l.details == removed
                })
                .then(|| lines.to_vec())
        },
    )
    .await
}

// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hook_runs_steps_one_to_six_in_order_and_then_flux_removes_its_finalizer() {
    // Serialized with the test that deletes the DataVolume CRD: a CRD going
    // away under step 5 would fail this attempt for a reason not its own.
    let _serial = common::serial();
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("order")).await;

    t.delete_parent().await;
    let lines = wait_teardown_logged(env, &t, Duration::from_secs(120)).await;
    let attempt1 = hook_lines(&lines, 1);
    assert_eq!(
        step_sequence(&attempt1),
        vec![1, 2, 3, 4, 5, 6],
        "the hook's steps, in order, in attempt 1:\n{}",
        render(&lines)
    );
    assert!(
        hook_lines(&lines, 2).is_empty(),
        "one attempt was enough:\n{}",
        render(&lines)
    );
    let last = attempt1.last().expect("hook lines");
    assert_eq!(
        last.action,
        "done",
        "the hook ended after step 6:\n{}",
        render(&lines)
    );
    assert!(
        attempt1.iter().all(|l| !l.details.contains("FAILED")),
        "no step failed:\n{}",
        render(&attempt1)
    );
    assert!(
        attempt1
            .iter()
            .any(|l| l.action == "step1" && l.details.contains("suspended 3 child HelmReleases")),
        "step 1 suspended the three children:\n{}",
        render(&attempt1)
    );

    // Then, and only then, Flux finishes the uninstall and removes its finalizer.
    let parent_finalizer = format!("HelmRelease {}: finalizers.fluxcd.io removed", t.name);
    let done_at = lines
        .iter()
        .position(|l| l.component == "hook" && l.action == "done")
        .unwrap();
    let removed_at = lines
        .iter()
        .position(|l| {
            l.component == "flux"
                && l.action == "finalizer-removed"
                && l.details == parent_finalizer
        })
        .unwrap_or_else(|| panic!("no line `{parent_finalizer}`:\n{}", render(&lines)));
    let uninstalled_at = lines
        .iter()
        .position(|l| {
            l.component == "flux"
                && l.action == "uninstalled"
                && l.details.starts_with(&format!("HelmRelease {}:", t.name))
        })
        .unwrap_or_else(|| panic!("no uninstalled line:\n{}", render(&lines)));
    assert!(
        done_at < uninstalled_at && uninstalled_at < removed_at,
        "hook done, then chart objects, then the finalizer:\n{}",
        render(&lines)
    );
    assert!(lines[removed_at].at >= last.at);

    // API state: the whole tenant went.
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_kcp_delete_aborts_the_hook_and_flux_retries_it_from_step_one_with_growing_backoff()
 {
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
    // Three failed attempts: 1s, 2s and 4s of backoff (--retry-base 1s, --retry-max 4s).
    let failed = |lines: &[LogLine]| {
        let n = lines
            .iter()
            .filter(|l| {
                l.component == "hook"
                    && l.action == "step3"
                    && l.details.contains("FAILED, hook aborted")
            })
            .count();
        let retries = parent_failures(lines, &t).len();
        (n >= 3 && retries >= 3).then_some(())
    };
    wait_log(
        env,
        &t,
        "three attempts failing at step 3",
        Duration::from_secs(60),
        failed,
    )
    .await;
    let lines = lines_of(env, &t);

    for n in 1..=3 {
        let hook = hook_lines(&lines, n);
        assert_eq!(
            step_sequence(&hook),
            vec![1, 2, 3],
            "attempt {n} ran from step 1 and stopped at step 3:\n{}",
            render(&lines)
        );
        let last = hook.last().unwrap();
        assert!(
            last.action == "step3"
                && last.details.contains("FAILED, hook aborted")
                && last.details.contains(&message),
            "attempt {n} ended with the refused KamajiControlPlane DELETE:\n{}",
            render(&hook)
        );
    }
    // Step 4 was never reached: no hook line past step 3, and the control plane is untouched.
    let beyond: Vec<_> = lines
        .iter()
        .filter(|l| l.component == "hook" && step_of(l).is_some_and(|n| n >= 4))
        .cloned()
        .collect();
    assert!(
        beyond.is_empty(),
        "no step past 3 while the KCP DELETE is refused:\n{}",
        render(&beyond)
    );
    assert!(
        !lines
            .iter()
            .any(|l| l.component == "hook" && l.action == "done"),
        "{}",
        render(&lines)
    );
    let tcp = tcps(&t)
        .get(&t.name)
        .await
        .expect("TenantControlPlane still there");
    assert!(
        tcp.metadata.deletion_timestamp.is_none(),
        "the TenantControlPlane was not deleted"
    );
    let kcp = kcps(&t)
        .get(&t.name)
        .await
        .expect("KamajiControlPlane still there");
    assert!(
        kcp.metadata.deletion_timestamp.is_none(),
        "the KamajiControlPlane DELETE was refused"
    );

    // Flux's backoff grows between attempts, and is honoured.
    let failures = parent_failures(&lines, &t);
    let delays: Vec<Duration> = failures
        .iter()
        .map(|l| {
            go_duration(
                l.details
                    .rsplit_once("retrying in ")
                    .unwrap_or_else(|| panic!("no delay in {l:?}"))
                    .1
                    .trim(),
            )
        })
        .collect();
    assert!(
        delays[0] < delays[1] && delays[1] < delays[2],
        "backoff grows: {delays:?}"
    );
    for n in 1..=2usize {
        let retried = lines
            .iter()
            .find(|l| {
                l.component == "flux"
                    && l.action == "uninstall"
                    && l.details.contains(&format!("attempt {}:", n + 1))
            })
            .unwrap_or_else(|| panic!("no attempt {}:\n{}", n + 1, render(&lines)));
        let waited = Duration::try_from(retried.at.duration_since(failures[n - 1].at))
            .unwrap_or(Duration::ZERO);
        assert!(
            waited + Duration::from_millis(20) >= delays[n - 1],
            "attempt {} came {waited:?} after failure {n}, before its backoff of {:?}",
            n + 1,
            delays[n - 1]
        );
    }

    // The refusal ends: the next retry goes all the way and the teardown completes.
    delete_binding(&t, &policy).await;
    let lines = wait_teardown_logged(env, &t, Duration::from_secs(90)).await;
    let done = lines
        .iter()
        .find(|l| l.component == "hook" && l.action == "done")
        .unwrap_or_else(|| panic!("{}", render(&lines)));
    let n = attempt_of(done).unwrap();
    assert!(n > 3, "the completing run is a later attempt: {n}");
    assert_eq!(
        step_sequence(&hook_lines(&lines, n)),
        vec![1, 2, 3, 4, 5, 6],
        "the completing attempt ran every step:\n{}",
        render(&lines)
    );
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
    let lines = wait_teardown_logged(env, &t, Duration::from_secs(120)).await;
    let hook = hook_lines(&lines, 1);
    let warned = hook
        .iter()
        .position(|l| {
            l.action == "step2"
                && l.details.contains("WARNING")
                && l.details.contains(&cilium)
                && l.details.contains(&message)
        })
        .unwrap_or_else(|| {
            panic!(
                "step 2 warned about the refused DELETE of {cilium}:\n{}",
                render(&lines)
            )
        });
    let cleared = hook
        .iter()
        .position(|l| {
            l.action == "step2"
                && l.details
                    .ends_with(&format!("force-cleared finalizers on HelmRelease {cilium}"))
        })
        .unwrap_or_else(|| {
            panic!(
                "step 2 force-cleared the finalizers of {cilium}:\n{}",
                render(&lines)
            )
        });
    let step3 = hook
        .iter()
        .position(|l| {
            l.action == "step3"
                && l.details
                    .contains(&format!("deleted KamajiControlPlane {}", t.name))
        })
        .unwrap_or_else(|| panic!("attempt 1 carried on to step 3:\n{}", render(&lines)));
    assert!(
        warned < cleared && cleared < step3,
        "warn, strip, then step 3:\n{}",
        render(&hook)
    );
    assert!(
        !hook.iter().any(|l| l.details.contains("FAILED")),
        "nothing aborted the hook:\n{}",
        render(&hook)
    );
    assert_eq!(
        hook.last().map(|l| l.action.as_str()),
        Some("done"),
        "attempt 1 completed:\n{}",
        render(&hook)
    );

    // The refused child is still there, never deleted, and its finalizers are gone.
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
        assert!(
            t.hr_api()
                .get_opt(&format!("{}-{child}", t.name))
                .await
                .unwrap()
                .is_none(),
            "child {child} deleted"
        );
    }
    assert!(
        kcps(&t).get_opt(&t.name).await.unwrap().is_none(),
        "step 3 deleted the KamajiControlPlane"
    );

    delete_policy(&t, &policy).await;
    let _ = t.hr_api().delete(&cilium, &DeleteParams::default()).await;
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
    let lines = wait_teardown_logged(env, &t, Duration::from_secs(120)).await;
    let hook = hook_lines(&lines, 1);
    assert!(
        hook.iter().any(|l| l.action == "step5"
            && l.details
                .contains("DataVolumes not served (CDI not installed): skipped")),
        "step 5 was skipped:\n{}",
        render(&lines)
    );
    assert!(
        !lines.iter().any(|l| l.details.contains("FAILED")),
        "no step failed:\n{}",
        render(&lines)
    );
    assert!(
        parent_failures(&lines, &t).is_empty(),
        "the uninstall did not fail:\n{}",
        render(&lines)
    );
    assert_eq!(
        step_sequence(&hook),
        vec![1, 2, 3, 4, 5, 6],
        "step 6 ran after the skipped step 5:\n{}",
        render(&hook)
    );
    assert_eq!(
        hook.last().map(|l| l.action.as_str()),
        Some("done"),
        "the first attempt completed:\n{}",
        render(&hook)
    );

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
    let secret_name = format!("{}-admin-kubeconfig", t.name);

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
        "tenant API server (harness cluster {}) stopped",
        t.cluster.name
    );
    wait_log(
        env,
        &t,
        "kamaji stopped the tenant API server",
        Duration::from_secs(30),
        |lines| {
            lines
                .iter()
                .any(|l| l.component == "kamaji" && l.action == "stopped" && l.details == stopped)
                .then_some(())
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
