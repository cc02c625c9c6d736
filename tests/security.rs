//! Security properties on the real control plane, with the gate installed
//! from `manifests/`: least privilege (checked by the API server's own
//! authorizer), no secret material in any log, hostile kubeconfig Secrets,
//! two workers racing for the Lease, the webhook killed under load, the
//! serving certificate rotated under load, and forged override stamps.
//! What they are made of is in `tests/security/`.
//!
//! Every test but the RBAC one takes `common::serial()`: they kill, restart
//! or race shared processes, or rely on the webhook answering.

use volume_gate_testkit as common;
#[path = "security/mod.rs"]
mod security;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::gate::{helmrelease_resource, http_get};
use common::tenant::{STORAGE_CLASS, Tenant, kcp_resource};
use common::wait::eventually;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use security::hostile::{self, assert_worker_alive, wait_blocked_with};
use security::racer::{HolderSamples, lease_holder, start_racer, wait_lease_holder};
use security::webhook::{AdmissionStreams, DeleteLoad, leaf_in, served_leaf};
use security::{Timed, env, gate, logs, rbac};
use serde_json::json;
use volume_gate::record::Phase;

// ---------------------------------------------------------------------------
// 1. Least privilege
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_accounts_have_exactly_the_justified_permissions_and_nothing_else() {
    let _timed =
        Timed::start("service_accounts_have_exactly_the_justified_permissions_and_nothing_else");
    let admin = env().cp.management_client().await;

    // The shipped RBAC is what was reviewed: no more, no less.
    let shipped = rbac::shipped_grants();
    rbac::assert_shipped_is_reviewed(&shipped);

    // Every shipped grant is effective at the real API server, and
    // nothing that is not justified is.
    let mut failures = rbac::ineffective_grants(&admin, &shipped).await;
    failures.extend(rbac::unjustified_permissions(&admin).await);
    assert!(
        failures.is_empty(),
        "least privilege violated:\n  {}",
        failures.join("\n  ")
    );
}

// ---------------------------------------------------------------------------
// 2. No secret material in logs
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_contains_tokens_kubeconfig_credentials_or_pem_blocks() {
    let _s = common::serial();
    let _timed = Timed::start("no_log_contains_tokens_kubeconfig_credentials_or_pem_blocks");
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("nolog")).await;
    t.wait_custody().await;
    t.tenant_namespace("apps").await;
    for c in ["data-a", "data-b"] {
        t.claim("apps", c, STORAGE_CLASS).await;
    }
    t.pod("apps", "two-claims", &["data-a", "data-b"]).await;
    t.statefulset("apps", "db", 1).await;
    t.wait_settled(3, 2).await;
    assert_eq!(env.sim.volumes_of(&t.namespace, &t.name).len(), 3);
    t.delete_parent().await;
    t.wait_parent_gone(Duration::from_secs(180)).await;
    assert!(
        env.sim.volumes_of(&t.namespace, &t.name).is_empty(),
        "the teardown freed every volume"
    );

    // The secrets of this run, and every log of it.
    let secrets = logs::secrets(&env.cp.state, &t.cluster.kubeconfig);
    let logs = logs::all_logs(env);
    assert!(
        logs[logs::WORKERS_LOG].contains(&t.name),
        "the worker logged this teardown (the scan looks at the right logs)"
    );

    let (ours, theirs) = logs::findings(&logs, &secrets);
    assert!(
        ours.is_empty(),
        "volume-gate logged secret material:\n  {}",
        ours.join("\n  ")
    );
    assert!(
        theirs.is_empty(),
        "secret material in logs not written by volume-gate (harness/simulator/Kubernetes):\n  {}",
        theirs.join("\n  ")
    );
}

// ---------------------------------------------------------------------------
// 3. Hostile kubeconfig Secrets
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_kubeconfig_secrets_block_with_a_clear_message_and_the_worker_survives() {
    let _s = common::serial();
    let _timed = Timed::start(
        "hostile_kubeconfig_secrets_block_with_a_clear_message_and_the_worker_survives",
    );
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("hostile")).await;
    t.wait_custody().await;
    t.tenant_namespace("apps").await;
    t.claim("apps", "data", STORAGE_CLASS).await;
    t.pod("apps", "holder", &["data"]).await;
    // The simulator is connected to this tenant (its kubelet ran the Pod) and
    // keeps that connection while the API answers: it does not re-read the
    // Secret, so whatever runs the exec plugin below is not the simulator.
    t.wait_settled(1, 1).await;
    let secret = format!(
        "{}/{}",
        t.namespace,
        common::profile().kubeconfig_secret_name(&t.name)
    );
    let worker_pid = gate().worker.as_ref().and_then(|w| w.pid());
    assert!(worker_pid.is_some());

    // (a) Garbage bytes, not YAML, not even UTF-8, with a canary inside.
    let canary = format!("vg-canary-{}", env.cp.unique("c"));
    hostile::set_kubeconfig_bytes(&t, &hostile::garbage(&canary)).await;
    t.delete_parent().await;
    let m = wait_blocked_with(&t, "unparseable", Duration::from_secs(60)).await;
    assert!(m.contains(&secret), "(a) names the Secret: {m}");
    assert!(
        !m.contains(&canary),
        "(a) the message does not echo the Secret's content: {m}"
    );
    assert_worker_alive(worker_pid, "garbage bytes").await;

    // (b) A 900 KiB body.
    hostile::set_kubeconfig_bytes(&t, &hostile::huge()).await;
    let m = wait_blocked_with(&t, "bytes", Duration::from_secs(60)).await;
    assert!(
        m.contains(&secret) && m.contains("unparseable"),
        "(b) names the Secret and the problem: {m}"
    );
    assert!(
        m.len() < 2000,
        "(b) the message is one line, not the body: {} bytes",
        m.len()
    );
    assert_worker_alive(worker_pid, "a 900 KiB kubeconfig").await;

    // (c) A server where nothing listens.
    hostile::set_kubeconfig_bytes(&t, &hostile::served_at(&t, "https://127.0.0.1:1")).await;
    let m = wait_blocked_with(&t, "127.0.0.1:1", Duration::from_secs(60)).await;
    assert!(
        m.contains("not ready") || m.contains("did not answer"),
        "(c) says the tenant API does not answer: {m}"
    );
    assert!(
        m.to_lowercase().contains("refused") || m.contains("Connect"),
        "(c) says why (connection refused): {m}"
    );
    assert_worker_alive(worker_pid, "an unreachable server").await;

    // (d) An exec plugin that would run a shell command in the worker; the
    // file it would write records who ran it.
    let pwned = PathBuf::from(format!(
        "/tmp/volume-gate-pwned-{}-{}",
        std::process::id(),
        env.cp.unique("p")
    ));
    let _ = std::fs::remove_file(&pwned);
    hostile::set_kubeconfig_bytes(&t, &hostile::exec_plugin(&t, &pwned)).await;
    let m = wait_blocked_with(&t, "exec plugin", Duration::from_secs(60)).await;
    assert!(
        m.contains(&secret) && m.contains("unparseable"),
        "(d) names the Secret and the problem: {m}"
    );
    // One more full pass with the same Secret, so a delayed execution would show.
    let first = hostile::attempt(&m).expect("attempt number in the message");
    wait_blocked_with(
        &t,
        &format!("(attempt {}", first + 1),
        Duration::from_secs(60),
    )
    .await;
    if let Ok(who) = std::fs::read_to_string(&pwned) {
        panic!(
            "the exec plugin ran (file {} created by the child of PID {}; worker PID {worker_pid:?}, simulator PID {:?})",
            pwned.display(),
            who.trim(),
            env.sim.process.pid()
        );
    }
    assert_worker_alive(worker_pid, "an exec plugin").await;
    let log = gate().worker_log();
    assert!(
        !log.contains(&canary) && !log.contains("volume-gate-pwned"),
        "the worker log does not echo Secret contents"
    );

    // The same worker then does its job once the Secret is sound again.
    hostile::restore_kubeconfig(&t).await;
    t.wait_parent_gone(Duration::from_secs(120)).await;
    assert!(
        env.sim.volumes_of(&t.namespace, &t.name).is_empty(),
        "released after the hostile Secrets"
    );
    assert!(!pwned.exists());
    assert_worker_alive(worker_pid, "the release").await;
}

// ---------------------------------------------------------------------------
// 4. Two workers racing
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_worker_never_acts_while_the_leader_lives() {
    let _s = common::serial();
    let _timed = Timed::start("a_second_worker_never_acts_while_the_leader_lives");
    let env = env();
    let admin = env.cp.management_client().await;
    let leader = wait_lease_holder(&admin).await;
    assert!(
        leader.starts_with("test-worker-"),
        "the fixture's worker leads: {leader}"
    );
    let leader_pid = gate().worker.as_ref().and_then(|w| w.pid());

    // The racer, on standby; the Lease watched for the whole deletion.
    let racer = start_racer(env).await;
    let samples = HolderSamples::start(&admin);

    let t = Tenant::create(env.cp, &env.cp.unique("race")).await;
    t.wait_custody().await;
    t.tenant_namespace("apps").await;
    for c in ["a", "b"] {
        t.claim("apps", c, STORAGE_CLASS).await;
    }
    t.pod("apps", "holder", &["a", "b"]).await;
    t.wait_settled(2, 1).await;
    t.delete_parent().await;
    t.wait_parent_gone(Duration::from_secs(180)).await;
    assert!(
        env.sim.volumes_of(&t.namespace, &t.name).is_empty(),
        "the tenant was fully released"
    );

    let seen = samples.stop().await;
    assert!(
        seen.len() >= 10,
        "the Lease was sampled throughout: {} samples",
        seen.len()
    );
    let holders: BTreeSet<Option<String>> = seen.iter().cloned().collect();
    assert_eq!(
        holders,
        BTreeSet::from([Some(leader.clone())]),
        "exactly one holder, the first worker, all along"
    );

    assert!(
        racer.alive(),
        "the racer stayed up on standby: {}",
        racer.log_text()
    );
    let log = racer.log_text();
    assert!(
        !log.contains("leading: starting the controller"),
        "the racer never led:\n{log}"
    );
    for needle in [
        t.name.as_str(),
        "custody ended",
        "InventoryTaken",
        "ReleaseStarted",
        "claims and holding pods deleted",
        "reconcile",
    ] {
        assert!(
            !log.contains(needle),
            "the racer never acted ({needle:?} in its log):\n{log}"
        );
    }
    let leader_log = gate().worker_log();
    assert!(
        leader_log
            .lines()
            .any(|l| l.contains("custody ended") && l.contains(&t.name)),
        "the leader ended custody of {} itself",
        t.name
    );

    racer.kill(libc::SIGTERM);
    assert!(!racer.alive());
    assert_eq!(
        lease_holder(&admin).await.as_deref(),
        Some(leader.as_str()),
        "stopping the standby left the Lease alone"
    );
    let still = gate().worker.as_ref().map(|w| (w.alive(), w.pid()));
    assert_eq!(still, Some((true, leader_pid)), "the leader kept running");
}

// ---------------------------------------------------------------------------
// 5. The webhook killed under load
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_killed_under_load_lets_nothing_through_and_a_restarted_one_refuses_again() {
    let _s = common::serial();
    let _timed = Timed::start(
        "a_webhook_killed_under_load_lets_nothing_through_and_a_restarted_one_refuses_again",
    );
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("wkill")).await;
    t.wait_custody().await;
    // Hold the tenant in teardown, not done: its API cannot be reached, and
    // it holds a disk no inventory names.
    common::tenant::unreleasable_disk(&t.management, &t.namespace, &t.name).await;
    t.point_kubeconfig_at("https://127.0.0.1:1").await;
    t.delete_parent().await;
    t.wait_phase(Phase::Blocked, Duration::from_secs(60)).await;

    // DELETEs of R-csi and of the KamajiControlPlane for 10s; the webhook
    // killed once it has refused some.
    let csi = common::profile()
        .csi_release_name(&t.name)
        .expect("Cozystack has a CSI release");
    let hrs = t.hr_api();
    let kcps: Api<DynamicObject> =
        Api::namespaced_with(t.management.clone(), &t.namespace, &kcp_resource());
    let load = DeleteLoad::start(
        vec![
            (hrs.clone(), csi.clone(), "HelmRelease R-csi"),
            (kcps.clone(), t.name.clone(), "KamajiControlPlane R"),
        ],
        Duration::from_secs(10),
    );
    load.wait_refused(6).await;
    let old_pid = {
        let gate = gate();
        let pid = gate.webhook.pid();
        gate.webhook.kill(libc::SIGKILL);
        pid
    };
    let (total, a) = load.finish().await;
    assert!(
        a.succeeded.is_empty(),
        "DELETEs got through the gate: {:?} ({a:?})",
        a.succeeded
    );
    assert!(
        a.other.is_empty(),
        "every attempt was refused by the gate or failed closed: {:?}",
        a.other
    );
    assert!(
        a.refused >= 6 && a.webhook_down >= 1,
        "both refusals (up) and failures (down) were seen: {a:?}"
    );
    assert_eq!(a.refused + a.webhook_down, total);
    for (api, name) in [(&hrs, csi.as_str()), (&kcps, t.name.as_str())] {
        let o = api
            .get_opt(name)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{name} still exists"));
        assert!(
            o.metadata.deletion_timestamp.is_none(),
            "{name} was not marked for deletion"
        );
    }
    eprintln!(
        "webhook kill: {} attempts, {} refused, {} failed closed",
        total, a.refused, a.webhook_down
    );

    // A new webhook, started as the fixture starts it, refuses again.
    {
        let mut gate = gate();
        let fresh = gate.spawn_webhook();
        assert_ne!(fresh.pid(), old_pid);
        gate.webhook = fresh;
    }
    let admin_port = gate().webhook_admin;
    eventually(
        "restarted webhook /readyz",
        Duration::from_secs(60),
        || async {
            assert!(
                gate().webhook.alive(),
                "the restarted webhook exited: {}",
                gate().webhook_log()
            );
            match http_get(admin_port, "/readyz").await {
                Ok((200, _)) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let msg = eventually(
        "the restarted webhook refuses the CSI release delete",
        Duration::from_secs(30),
        || async {
            match hrs.delete(&csi, &DeleteParams::default()).await {
                Ok(_) => panic!("the CSI release delete was allowed after the restart"),
                Err(e) if e.to_string().contains("volume-gate: refusing to delete") => {
                    Ok(e.to_string())
                }
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await;
    assert!(
        msg.contains("CSI driver release")
            && msg.contains(&t.name)
            && msg.contains("kubectl annotate"),
        "{msg}"
    );
    let err = kcps
        .delete(&t.name, &DeleteParams::default())
        .await
        .expect_err("KamajiControlPlane delete refused");
    assert!(
        err.to_string().contains("volume-gate: refusing to delete"),
        "{err}"
    );

    // And the gate works end to end again: the tenant finishes once
    // reachable and its disk that no inventory names is gone.
    hostile::restore_kubeconfig(&t).await;
    common::tenant::delete_unreleasable_disk(&t.management, &t.namespace, &t.name).await;
    t.wait_parent_gone(Duration::from_secs(120)).await;
}

// ---------------------------------------------------------------------------
// 6. Certificate rotated under load
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotating_the_serving_certificate_under_load_fails_no_admission() {
    let _s = common::serial();
    let _timed = Timed::start("rotating_the_serving_certificate_under_load_fails_no_admission");
    let env = env();
    let (port, certs) = {
        let gate = gate();
        (gate.webhook_port, gate.certs.clone())
    };
    let ns = env.cp.unique("rotation");
    env.cp.namespace(&ns).await;
    let api: Api<DynamicObject> = Api::namespaced_with(
        env.cp.management_client().await,
        &ns,
        &helmrelease_resource(),
    );

    let old_leaf = leaf_in(&certs.join("tls.crt"));
    assert_eq!(
        served_leaf(port, &certs.join("ca.crt")).await.unwrap(),
        old_leaf,
        "the webhook serves tls.crt before the rotation"
    );

    // Two streams of parent creates (dry run), each admitted in custody.
    let streams = AdmissionStreams::start(&api, &security::webhook::parent("rotation"), 2);
    streams.wait_until("the stream flows", |n| n >= 20).await;

    security::webhook::rotate_serving_certificate(&certs);
    let new_leaf = leaf_in(&certs.join("tls.crt"));
    assert_ne!(new_leaf, old_leaf, "a new serving certificate was written");
    let rotated_at = Instant::now();
    eventually(
        "the webhook serves the new certificate",
        Duration::from_secs(30),
        || async {
            match served_leaf(port, &certs.join("ca.crt")).await {
                Ok(leaf) if leaf == new_leaf => Ok(()),
                Ok(_) => Err("still the old certificate".into()),
                Err(e) => Err(e),
            }
        },
    )
    .await;
    eprintln!(
        "new certificate served {:?} after the rotation",
        rotated_at.elapsed()
    );
    let at_switch = streams.admitted();
    let switched = Instant::now();
    // Load continues across several more reload ticks (500 ms) of the webhook.
    streams
        .wait_until("the stream keeps flowing after the switch", |n| {
            n >= at_switch + 30 && switched.elapsed() >= Duration::from_secs(2)
        })
        .await;
    eprintln!(
        "rotation: {at_switch} admissions before the switch, {} after",
        streams.admitted() - at_switch
    );
    let (total, failures) = streams.stop().await;
    assert!(
        failures.is_empty(),
        "{} failed admissions across the rotation (of {}): {failures:?}",
        failures.len(),
        total + failures.len()
    );
    assert!(
        total >= 50,
        "at least 50 admissions across the rotation, got {total}"
    );
    assert!(gate().webhook.alive(), "the webhook was not restarted");
    assert!(
        gate()
            .webhook_log()
            .contains("serving certificate reloaded"),
        "the webhook reloaded, without a restart"
    );
    // The next connection shows it, with a fresh handshake.
    assert_eq!(
        served_leaf(port, &certs.join("ca.crt")).await.unwrap(),
        new_leaf
    );
}

// ---------------------------------------------------------------------------
// 7. Forged input through the real API server
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn override_stamps_come_from_the_requester_and_an_empty_reason_is_refused() {
    let _s = common::serial();
    let _timed =
        Timed::start("override_stamps_come_from_the_requester_and_an_empty_reason_is_refused");
    let env = env();
    let t = Tenant::create(env.cp, &env.cp.unique("stamps")).await;
    t.wait_custody().await;
    // Held in teardown: no API, and a disk no inventory names.
    common::tenant::unreleasable_disk(&t.management, &t.namespace, &t.name).await;
    t.point_kubeconfig_at("https://127.0.0.1:1").await;
    t.delete_parent().await;
    t.wait_phase(Phase::Blocked, Duration::from_secs(60)).await;

    t.grant_override("stamp-admins").await;
    let user = env.cp.unique("carol");
    let carol = env
        .cp
        .client_as(&user, &["stamp-admins", "system:authenticated"])
        .await;
    let api: Api<DynamicObject> =
        Api::namespaced_with(carol.clone(), &t.namespace, &helmrelease_resource());
    let keys = common::keys();

    // An empty (or blank) reason is refused, even from someone allowed.
    for reason in ["", "   "] {
        let err = t
            .annotate_override(&carol, reason)
            .await
            .expect_err("override without a reason refused");
        assert!(
            err.to_string().contains("needs a reason"),
            "{reason:?}: {err}"
        );
    }
    let annotations = t
        .parent()
        .await
        .unwrap()
        .metadata
        .annotations
        .unwrap_or_default();
    assert!(
        !annotations.contains_key(&keys.override_reason),
        "nothing recorded: {annotations:?}"
    );

    // Forging the stamps in the same patch: the webhook writes its own.
    let forged = json!({"metadata": {"annotations": {
        &keys.override_reason: "tenant abandoned (ticket 7)",
        &keys.override_by: "somebody-else",
        &keys.override_at: "2001-01-01T00:00:00Z",
    }}});
    let before = jiff::Timestamp::now();
    api.patch(&t.name, &PatchParams::default(), &Patch::Merge(&forged))
        .await
        .expect("an authorized override is accepted");
    let annotations = t
        .parent()
        .await
        .unwrap()
        .metadata
        .annotations
        .unwrap_or_default();
    assert_eq!(
        annotations.get(&keys.override_by).map(String::as_str),
        Some(user.as_str()),
        "stamped from userInfo: {annotations:?}"
    );
    let at: jiff::Timestamp = annotations
        .get(&keys.override_at)
        .expect("override-at")
        .parse()
        .expect("RFC 3339");
    assert!(
        (at.as_second() - before.as_second()).abs() <= 60,
        "override-at is the time of the request, not the forged one: {at}"
    );

    let record = t
        .wait_phase(Phase::Overridden, Duration::from_secs(60))
        .await;
    assert_eq!(
        record.override_.and_then(|o| o.by).as_deref(),
        Some(user.as_str())
    );
    let message = record.message.unwrap_or_default();
    assert!(
        message.contains(&user) && !message.contains("somebody-else"),
        "{message}"
    );
    let note = t
        .wait_event("Warning", "Overridden", |note| note.contains(&user))
        .await;
    assert!(!note.contains("somebody-else"), "{note}");
    t.wait_parent_gone(Duration::from_secs(120)).await;
}
