//! The chart's alerts on Prometheus' own rule engine: `promtool` of
//! Prometheus 3.16.0 (built from the Go module proxy by
//! `tests/prometheus/build.sh`), never a re-implementation of PromQL.
//!
//! - Without a control plane: the PrometheusRule as `helm template` renders
//!   it passes `promtool check rules` in each monitoring shape, with the
//!   alerts each shape should have (the `absent()` ones only when something
//!   scrapes); and the converter from scrapes to a promtool test file
//!   (`testkit::prometheus`) writes what Prometheus' scrape loop would.
//! - On the real control plane (this binary's own, with the gate installed):
//!   each alert is fired by the condition it names and silenced by the remedy
//!   `docs/operations.md` gives. A scraper reads `/metrics` of the real
//!   webhook and worker every [`SCRAPE_PERIOD`] while the scenario runs, as a
//!   PodMonitor target would be labelled; the rounds become a `promtool test
//!   rules` file whose `alert_rule_test` entries assert the alert fires, with
//!   its labels, at the step where its condition has held for the rule's
//!   `for`, not one step before, and no longer once the remedy shows in a
//!   scrape.
//!
//! Time is compressed, honestly: promtool's `interval` maps one scrape round
//! to one rule-evaluation step (a round every few seconds stands for
//! [`Timeline::interval`] of rule time), so these tests check the rule
//! expressions and their `for` over the real series' shape (which series
//! exist, when they go stale, their values), not wall-clock time. The values
//! are what was scraped: a duration a gauge measures is real time; only an
//! absolute timestamp (the certificate's `notAfter`) is re-anchored to the
//! compressed clock (`testkit::prometheus`, module docs), so that `value -
//! time()` in a rule is the real remaining validity at that scrape.
//!
//! Not fired here: the `kube_deployment_status_replicas_available` half of
//! `VolumeGateWebhookUnavailable` (kube-state-metrics' series; no
//! kube-state-metrics runs here and the tests do not fake its series).

use volume_gate_testkit as common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::chart::template;
use common::prometheus::{
    AlertCheck, Point, Round, Series, Target, parse_exposition, pod_monitor_target, promtool,
    rule_file,
};
use serde_json::Value;

/// The release namespace the rules are rendered for: the gate's own, so
/// the scraped targets carry it as a PodMonitor in it would.
const NS: &str = common::gate::NAMESPACE;

/// Real time between two scrape rounds.
const SCRAPE_PERIOD: Duration = Duration::from_secs(2);

// ---------------------------------------------------------------------
// The rendered rules, without a control plane.
// ---------------------------------------------------------------------

/// The PrometheusRule `helm template` renders into [`NS`] with `sets`.
fn rendered_rule(sets: &[&str]) -> Value {
    let mut all = vec!["monitoring.prometheusRule.enabled=true"];
    all.extend_from_slice(sets);
    let docs = template(NS, &all);
    docs.get(&("PrometheusRule".into(), NS.into(), "volume-gate".into()))
        .unwrap_or_else(|| panic!("no PrometheusRule rendered with {all:?}"))
        .clone()
}

/// A scratch directory for one test's files.
fn scratch(name: &str) -> PathBuf {
    let dir = common::scratch::dir("alerts").join(name);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run_promtool(dir: &Path, args: &[&str]) -> String {
    let out = promtool(dir, args);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "promtool {args:?} in {} failed:\n{text}",
        dir.display()
    );
    text
}

/// Alert names of a rendered PrometheusRule, by name, and whether each
/// uses `absent(`.
fn alert_names(rule: &Value) -> Vec<(String, bool)> {
    common::prometheus::alerts(rule)
        .into_iter()
        .map(|(name, r)| {
            let absent = r["expr"].as_str().unwrap_or("").contains("absent(");
            (name, absent)
        })
        .collect()
}

#[test]
fn the_rendered_rules_pass_promtool_check_in_each_monitoring_shape() {
    // (shape, values, whether something scrapes the processes)
    let shapes: [(&str, &[&str], bool); 3] = [
        ("rule only", &[], false),
        (
            "rule and podMonitor",
            &["monitoring.podMonitor.enabled=true"],
            true,
        ),
        (
            "rule, scraped elsewhere",
            &["monitoring.prometheusRule.scrapedElsewhere=true"],
            true,
        ),
    ];
    for (shape, sets, scraped) in shapes {
        let rule = rendered_rule(sets);
        let dir = scratch(&format!("check-{}", shape.replace([' ', ','], "-")));
        std::fs::write(dir.join("rules.yaml"), rule_file(&rule, false)).unwrap();
        let out = run_promtool(&dir, &["check", "rules", "rules.yaml"]);
        let rules_in_file: usize = rule["spec"]["groups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["rules"].as_array().map_or(0, Vec::len))
            .sum();
        assert_eq!(
            rules_in_file,
            common::chart::ALERTS.len(),
            "{shape}: every rule is an alert"
        );
        assert!(
            out.contains(&format!("SUCCESS: {rules_in_file} rules found")),
            "{shape}: promtool read every rule of the rendered file ({rules_in_file}):\n{out}"
        );
        let names = alert_names(&rule);
        let mut got: Vec<&str> = names.iter().map(|(n, _)| n.as_str()).collect();
        got.sort_unstable();
        let mut want = common::chart::ALERTS.to_vec();
        want.sort_unstable();
        assert_eq!(got, want, "{shape}: the alerts");
        // absent() fires on a series nobody scrapes: only where something
        // does, and only in the alerts on a process being gone.
        let absent: Vec<&str> = names
            .iter()
            .filter(|(_, a)| *a)
            .map(|(n, _)| n.as_str())
            .collect();
        let want_absent: &[&str] = if scraped { ON_ABSENT_SERIES } else { &[] };
        assert_eq!(absent, want_absent, "{shape}: the alerts using absent()");
    }
}

/// The alerts with an `absent()` part where something scrapes (in name
/// order, as [`alert_names`] lists them).
const ON_ABSENT_SERIES: &[&str] = &["VolumeGateWebhookUnavailable", "VolumeGateWorkerDown"];

// ---------------------------------------------------------------------
// The converter (pure), checked here and against promtool itself.
// ---------------------------------------------------------------------

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn the_exposition_reader_takes_labels_escapes_and_special_values_and_refuses_what_it_cannot_place()
{
    let text = "# HELP a_total Something.\n# TYPE a_total counter\n\
                a_total{k=\"v\",q=\"say \\\"hi\\\"\\\\n\\n\",} 3.5\n\
                b 1e3\nc{} +Inf\nd -Inf\ne NaN\n# EOF\n";
    let s = parse_exposition(text).unwrap();
    assert_eq!(s.len(), 5);
    assert_eq!(s[0].name, "a_total");
    assert_eq!(s[0].labels, labels(&[("k", "v"), ("q", "say \"hi\"\\n\n")]));
    assert_eq!(s[0].value, 3.5);
    assert_eq!(s[1].value, 1000.0);
    assert_eq!(s[2].value, f64::INFINITY);
    assert_eq!(s[3].value, f64::NEG_INFINITY);
    assert!(s[4].value.is_nan());
    assert!(
        parse_exposition("x 1 1700000000000")
            .unwrap_err()
            .contains("timestamp")
    );
    assert!(
        parse_exposition("x{a=\"1\"} 1\nx{a=\"1\"} 2")
            .unwrap_err()
            .contains("twice")
    );
    assert!(parse_exposition("x{a=1} 1").is_err());
    assert!(parse_exposition("x{a=\"1} 1").is_err());
}

fn target(container: &str, port: u16) -> Target {
    pod_monitor_target(
        "ns",
        "volume-gate",
        &format!("{container}-0"),
        container,
        "admin",
        &format!("127.0.0.1:{port}"),
    )
}

fn round(wall: f64, targets: Vec<(Target, Result<&str, &str>)>) -> Round {
    Round {
        wall,
        targets: targets
            .into_iter()
            .map(|(t, r)| (t, r.map(String::from).map_err(String::from)))
            .collect(),
    }
}

fn points_of(series: &Series, name: &str, want: &[(&str, &str)]) -> Vec<Point> {
    let mut found: Vec<_> = series.matching(name, want).collect();
    assert_eq!(found.len(), 1, "one series {name}{want:?}: {found:?}");
    found.pop().unwrap().1.to_vec()
}

#[test]
fn a_series_gone_from_a_scrape_is_written_stale_once_and_a_failed_scrape_stales_all_and_sets_up_0()
{
    use Point::{Missing, Stale, Value as V};
    let w = target("worker", 1);
    let rounds = vec![
        round(100.0, vec![(w.clone(), Ok("a{p=\"x\"} 1\nb 2\n"))]),
        round(102.0, vec![(w.clone(), Ok("a{p=\"y\"} 1\nb 3\n"))]),
        round(104.0, vec![(w.clone(), Ok("a{p=\"y\"} 1\nb 4\n"))]),
        round(106.0, vec![(w.clone(), Err("connection refused"))]),
        round(108.0, vec![(w.clone(), Err("connection refused"))]),
        round(110.0, vec![(w.clone(), Ok("b 5\n"))]),
    ];
    let s = Series::from_rounds(&rounds, 60, &[]).unwrap();
    assert_eq!(s.start, 100);
    assert_eq!(
        points_of(&s, "a", &[("p", "x")]),
        [V(1.0), Stale, Missing, Missing, Missing, Missing]
    );
    assert_eq!(
        points_of(&s, "a", &[("p", "y")]),
        [Missing, V(1.0), V(1.0), Stale, Missing, Missing]
    );
    assert_eq!(
        points_of(&s, "b", &[]),
        [V(2.0), V(3.0), V(4.0), Stale, Missing, V(5.0)]
    );
    assert_eq!(
        points_of(&s, "up", &[("container", "worker")]),
        [V(1.0), V(1.0), V(1.0), V(0.0), V(0.0), V(1.0)]
    );
    // Every series carries the PodMonitor's target labels.
    let (l, _) = s.matching("b", &[]).next().unwrap();
    assert_eq!(l, &w);
}

#[test]
fn a_target_that_goes_away_has_its_series_staled_and_its_replacement_is_a_new_series() {
    use Point::{Missing, Stale, Value as V};
    let (old, new) = (target("worker", 1), target("worker", 2));
    let rounds = vec![
        round(0.0, vec![(old.clone(), Ok("m 1\n"))]),
        round(2.0, vec![(new.clone(), Ok("m 2\n"))]),
    ];
    let s = Series::from_rounds(&rounds, 30, &[]).unwrap();
    assert_eq!(
        points_of(&s, "m", &[("instance", "127.0.0.1:1")]),
        [V(1.0), Stale]
    );
    assert_eq!(
        points_of(&s, "m", &[("instance", "127.0.0.1:2")]),
        [Missing, V(2.0)]
    );
}

#[test]
fn target_labels_win_and_a_clashing_scraped_label_is_kept_as_exported() {
    let t = target("webhook", 1);
    let rounds = vec![round(
        0.0,
        vec![(t, Ok("m{namespace=\"tenant-a\",x=\"1\"} 1\n"))],
    )];
    let s = Series::from_rounds(&rounds, 60, &[]).unwrap();
    let (l, _) = s.matching("m", &[]).next().unwrap();
    assert_eq!(l["namespace"], "ns");
    assert_eq!(l["exported_namespace"], "tenant-a");
    assert_eq!(l["x"], "1");
}

#[test]
fn an_absolute_timestamp_is_reanchored_to_the_compressed_clock_and_other_values_are_kept() {
    use Point::Value as V;
    let t = target("webhook", 1);
    // Scrapes 2s apart of a certificate that expires at 1000 (wall), each
    // standing for 60s of rule time from start 100.
    let rounds = vec![
        round(100.5, vec![(t.clone(), Ok("exp 1000\nd 7\nnone 0\n"))]),
        round(102.5, vec![(t, Ok("exp 1000\nd 9\nnone 0\n"))]),
    ];
    let s = Series::from_rounds(&rounds, 60, &["exp", "none"]).unwrap();
    // value - time() is the real remaining time at each scrape: 899.5 and 897.5.
    assert_eq!(points_of(&s, "exp", &[]), [V(999.5), V(1057.5)]);
    // 0, the gauge's "no certificate yet" (the worker's), is no time.
    assert_eq!(points_of(&s, "none", &[]), [V(0.0), V(0.0)]);
    assert_eq!(points_of(&s, "d", &[]), [V(7.0), V(9.0)]);
    assert_eq!(s.eval_time(3), "180s");
}

/// The notation the converter writes is what promtool reads: a rule on a
/// series that goes stale and one on `up`, checked by promtool, passes, and
/// the same file with a wrong expectation fails.
#[test]
fn promtool_reads_the_converters_file_as_prometheus_would_have_stored_the_scrapes() {
    let dir = scratch("converter");
    std::fs::write(
        dir.join("rules.yaml"),
        r#"{"groups": [{"name": "g", "rules": [
            {"alert": "Gone", "expr": "absent(m{container=\"worker\"})", "for": "60s"},
            {"alert": "Down", "expr": "up == 0", "for": "0s"}
        ]}]}"#,
    )
    .unwrap();
    let w = target("worker", 1);
    let rounds: Vec<Round> = (0..6)
        .map(|i| {
            let scraped = if (2..4).contains(&i) {
                Err("refused")
            } else {
                Ok("m 1\n")
            };
            round(10.0 + 2.0 * f64::from(i), vec![(w.clone(), scraped)])
        })
        .collect();
    let s = Series::from_rounds(&rounds, 60, &[]).unwrap();
    let gone = |step, firing: bool| AlertCheck {
        step,
        alertname: "Gone".into(),
        // absent() keeps the equality matchers' labels.
        firing: if firing {
            vec![labels(&[("container", "worker")])]
        } else {
            vec![]
        },
    };
    let checks = vec![
        // Stale at step 2: absent at once (no 5m lookback), firing a step later.
        gone(2, false),
        gone(3, true),
        gone(4, false),
        AlertCheck {
            step: 2,
            alertname: "Down".into(),
            firing: vec![w.clone()],
        },
    ];
    std::fs::write(
        dir.join("test.yaml"),
        s.unit_test_file(&["rules.yaml"], &checks),
    )
    .unwrap();
    run_promtool(&dir, &["test", "rules", "test.yaml"]);

    // And a wrong expectation fails: promtool really checks these.
    let wrong = vec![gone(2, true)];
    std::fs::write(
        dir.join("wrong.yaml"),
        s.unit_test_file(&["rules.yaml"], &wrong),
    )
    .unwrap();
    let out = promtool(&dir, &["test", "rules", "wrong.yaml"]);
    assert!(
        !out.status.success(),
        "promtool accepted a wrong expectation"
    );
}

// ---------------------------------------------------------------------
// Firing on the real processes.
// ---------------------------------------------------------------------

fn env() -> &'static common::Env {
    common::gated_short()
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Where the scraper finds the two processes now: (pod, container, admin
/// address) of each, as the gate runs them. A worker that was stopped is
/// still scraped at its last address (its pod is there, its container
/// down), until another one is started.
fn targets_now(env: &common::Env) -> Vec<(Target, u16)> {
    let gate = env.gate.as_ref().expect("the gate").lock().unwrap();
    let mut out = vec![(
        pod_monitor_target(
            NS,
            "volume-gate",
            "volume-gate-webhook-0",
            "webhook",
            "admin",
            &format!("127.0.0.1:{}", gate.webhook_admin),
        ),
        gate.webhook_admin,
    )];
    if gate.worker_admin != 0 {
        out.push((
            pod_monitor_target(
                NS,
                "volume-gate",
                &format!("volume-gate-worker-{}", gate.worker_identity()),
                "worker",
                "admin",
                &format!("127.0.0.1:{}", gate.worker_admin),
            ),
            gate.worker_admin,
        ));
    }
    out
}

/// Scrapes both processes every [`SCRAPE_PERIOD`] until dropped.
struct Scraper {
    rounds: Arc<Mutex<Vec<Round>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Scraper {
    fn start(env: &'static common::Env) -> Scraper {
        let rounds = Arc::new(Mutex::new(Vec::new()));
        let task = {
            let rounds = rounds.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(SCRAPE_PERIOD);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    let wall = unix_now();
                    let mut targets = Vec::new();
                    for (target, port) in targets_now(env) {
                        let scraped = match tokio::time::timeout(
                            Duration::from_secs(1),
                            common::gate::http_get(port, "/metrics"),
                        )
                        .await
                        {
                            Ok(Ok((200, body))) => Ok(body),
                            Ok(Ok((code, body))) => Err(format!("HTTP {code}: {body}")),
                            Ok(Err(e)) => Err(e),
                            Err(_) => Err("scrape timed out".into()),
                        };
                        targets.push((target, scraped));
                    }
                    rounds.lock().unwrap().push(Round { wall, targets });
                }
            })
        };
        Scraper { rounds, task }
    }

    /// The index of the first round `i` from `from` on for which
    /// `holds(rounds, i)` is true, waiting for it up to `within`. `holds`
    /// may read rounds up to `i` only: each round is checked once, when it
    /// is taken.
    async fn wait_round(
        &self,
        what: &str,
        from: usize,
        within: Duration,
        holds: impl Fn(&[Round], usize) -> bool,
    ) -> usize {
        let next = std::cell::Cell::new(from);
        common::wait::eventually(what, within, || {
            let rounds = self.rounds.lock().unwrap();
            let n = rounds.len();
            let found = (next.get()..n).find(|&i| holds(&rounds, i));
            next.set(n.max(next.get()));
            drop(rounds);
            async move { found.ok_or(format!("not in rounds {from}..{n}")) }
        })
        .await
    }

    /// Waits until round `i` has been taken.
    async fn wait_len(&self, i: usize) {
        self.wait_round(
            &format!("scrape round {i}"),
            i,
            SCRAPE_PERIOD * (i as u32 + 30),
            |_, _| true,
        )
        .await;
    }

    /// How many rounds have been taken.
    fn len(&self) -> usize {
        self.rounds.lock().unwrap().len()
    }

    /// Stops scraping; the rounds taken.
    fn finish(self) -> Vec<Round> {
        self.task.abort();
        self.rounds.lock().unwrap().clone()
    }
}

/// The samples of metric `name` that `container`'s scrape in `round`
/// returned with all of `want` among their labels; `None` if its scrape
/// failed.
fn scraped(
    round: &Round,
    container: &str,
    name: &str,
    want: &[(&str, &str)],
) -> Option<Vec<common::prometheus::Sample>> {
    let (_, text) = round
        .targets
        .iter()
        .find(|(t, _)| t["container"] == container)?;
    let text = text.as_ref().ok()?;
    let samples = parse_exposition(text).expect("the exposition parses");
    Some(
        samples
            .into_iter()
            .filter(|s| {
                s.name == name
                    && want
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).is_some_and(|x| x == v))
            })
            .collect(),
    )
}

/// A Prometheus duration (`90s`, `5m`, `1h30m`, `2d`) in seconds.
fn duration_secs(d: &str) -> u64 {
    let mut total = 0;
    let mut num = String::new();
    for c in d.chars() {
        if c.is_ascii_digit() {
            num.push(c);
            continue;
        }
        let n: u64 = num.parse().unwrap_or_else(|_| panic!("bad duration {d:?}"));
        num.clear();
        total += n * match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86400,
            'w' => 7 * 86400,
            _ => panic!("bad duration {d:?}"),
        };
    }
    assert!(num.is_empty(), "bad duration {d:?}");
    total
}

/// A scenario's rounds on promtool: the rules rendered with `sets` (their
/// annotations dropped, see `testkit::prometheus::rule_file`), the series
/// as Prometheus would have stored the rounds, and `checks`; panics with
/// promtool's report if any check fails.
fn assert_on_promtool(
    name: &str,
    sets: &[&str],
    series: &Series,
    checks: &[AlertCheck],
) -> PathBuf {
    let rule = rendered_rule(sets);
    let dir = scratch(name);
    std::fs::write(dir.join("rules.yaml"), rule_file(&rule, true)).unwrap();
    std::fs::write(
        dir.join("test.yaml"),
        series.unit_test_file(&["rules.yaml"], checks),
    )
    .unwrap();
    run_promtool(&dir, &["test", "rules", "test.yaml"]);
    dir
}

/// `alertname` fires at `step` with exactly `firing` (their label sets).
fn check(step: usize, alertname: &str, firing: &[&BTreeMap<String, String>]) -> AlertCheck {
    AlertCheck {
        step,
        alertname: alertname.into(),
        firing: firing.iter().map(|l| (*l).clone()).collect(),
    }
}

/// Checks for an alert that became pending at step `pending`, needs
/// `steps` of `for`, and is silenced at step `silenced`: not firing one
/// step before `for` has passed, firing with `labels` from then until the
/// step before the remedy shows, not firing from that step on.
fn fire_and_silence(
    alertname: &str,
    labels: &BTreeMap<String, String>,
    pending: usize,
    steps: usize,
    silenced: usize,
) -> Vec<AlertCheck> {
    let fires = pending + steps;
    assert!(
        fires < silenced,
        "{alertname}: the remedy (step {silenced}) came before the condition had held for `for` (step {fires})"
    );
    let mut checks = Vec::new();
    if steps > 0 {
        checks.push(check(fires - 1, alertname, &[]));
    }
    checks.push(check(fires, alertname, &[labels]));
    checks.push(check(silenced - 1, alertname, &[labels]));
    checks.push(check(silenced, alertname, &[]));
    checks
}

/// The worker's gauge of each tenant in teardown: seconds since its
/// deletion, by `tenant_namespace`, `tenant` and `phase`.
const TEARDOWN: &str = "volume_gate_tenant_teardown_seconds";
/// The webhook's serving certificate's `notAfter`, Unix seconds.
const CERT_EXPIRY: &str = "volume_gate_certificate_expiry_timestamp_seconds";
/// 1 on the worker that leads, 0 on one that waits.
const LEADER: &str = "volume_gate_worker_leader";

/// Values the firing tests render the rules with: what a PodMonitor
/// scrapes, and a tenant Blocked for a minute is reported (the smallest
/// `blockedAfterMinutes`), so the test waits one real minute.
const FIRING_SETS: &[&str] = &[
    "monitoring.podMonitor.enabled=true",
    "monitoring.prometheusRule.blockedAfterMinutes=1",
];
const BLOCKED_AFTER_SECS: f64 = 60.0;

/// Rule time one scrape round stands for, for an alert whose `for` is
/// `for_secs`: the `for` spans five rounds, and never less than the real
/// time between rounds (time is compressed, never stretched).
fn interval_for(for_secs: u64) -> u64 {
    (for_secs / 5).max(SCRAPE_PERIOD.as_secs())
}

/// The `for` of `alert` as rendered with [`FIRING_SETS`], in seconds.
fn for_secs(alert: &str) -> u64 {
    let rule = rendered_rule(FIRING_SETS);
    common::prometheus::alerts(&rule)[alert]["for"]
        .as_str()
        .map_or(0, duration_secs)
}

/// The labels `alert` fires with: `own` (what its expression keeps) and
/// the rule's `labels` (severity), as rendered with [`FIRING_SETS`].
fn alert_labels(alert: &str, own: &[(&str, &str)]) -> BTreeMap<String, String> {
    let rule = rendered_rule(FIRING_SETS);
    let mut out = labels(own);
    if let Some(extra) = common::prometheus::alerts(&rule)[alert]["labels"].as_object() {
        for (k, v) in extra {
            out.insert(k.clone(), v.as_str().unwrap().to_string());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_held_blocked_fires_tenant_blocked_naming_it_and_a_driver_freeing_again_silences_it()
 {
    use common::tenant::Tenant;
    use volume_gate::record::Phase;
    const ALERT: &str = "VolumeGateTenantBlocked";
    let _serial = common::serial();
    let env = env();
    let interval = interval_for(for_secs(ALERT));
    let t = Tenant::create(env.cp, &env.cp.unique("blocked")).await;
    t.wait_custody().await;
    t.with_held_claims(&["data"]).await;
    // The driver frees nothing: the teardown is held Blocked.
    t.set_driver(&env.sim, false).await;
    let scraper = Scraper::start(env);
    t.delete_parent().await;
    t.wait_phase(Phase::Blocked, Duration::from_secs(90)).await;

    // The condition, as the alert names it: in teardown longer than
    // blockedAfterMinutes, Blocked within the last 15 minutes (of rule
    // time: 15 min / interval rounds).
    let who = [
        ("tenant_namespace", t.namespace.as_str()),
        ("tenant", t.name.as_str()),
    ];
    let window = (15 * 60 / interval) as usize;
    let held = scraper
        .wait_round(
            "the tenant in teardown longer than blockedAfterMinutes, Blocked lately",
            0,
            Duration::from_secs(180),
            |rounds, i| {
                let waited = scraped(&rounds[i], "worker", TEARDOWN, &who)
                    .is_some_and(|s| s.iter().any(|s| s.value > BLOCKED_AFTER_SECS));
                let blocked = [who[0], who[1], ("phase", "Blocked")];
                let blocked_lately = rounds[i.saturating_sub(window)..=i].iter().any(|r| {
                    scraped(r, "worker", TEARDOWN, &blocked).is_some_and(|s| !s.is_empty())
                });
                waited && blocked_lately
            },
        )
        .await;
    let steps = (for_secs(ALERT).div_ceil(interval)) as usize;
    scraper.wait_len(held + steps + 2).await;

    // The remedy: the driver frees the volumes again; the teardown ends
    // (Released) and the tenant's series leave the scrape.
    t.set_driver(&env.sim, true).await;
    t.wait_parent_gone(Duration::from_secs(120)).await;
    let silenced = scraper
        .wait_round(
            "the tenant's teardown series gone from the scrape",
            held,
            Duration::from_secs(60),
            |rounds, i| scraped(&rounds[i], "worker", TEARDOWN, &who).is_some_and(|s| s.is_empty()),
        )
        .await;
    scraper.wait_len(silenced + 1).await;
    let rounds = scraper.finish();
    let series = Series::from_rounds(&rounds, interval, &[CERT_EXPIRY]).unwrap();
    let labels = alert_labels(ALERT, &who);
    assert_on_promtool(
        "tenant-blocked",
        FIRING_SETS,
        &series,
        &fire_and_silence(ALERT, &labels, held, steps, silenced),
    );
}

/// Seconds the webhook's certificate has left at `round`'s scrape.
fn cert_left(round: &Round) -> Option<f64> {
    let s = scraped(round, "webhook", CERT_EXPIRY, &[])?;
    let [s] = s.as_slice() else { return None };
    Some(s.value - round.wall)
}

/// The runbook's renewal of a Secret-mode certificate: `volume-gate certs
/// generate --reuse-ca` into the files the webhook serves (it reloads
/// them without a restart), valid `days`.
fn renew_certificate(certs: &Path, days: u32) {
    common::process::run_ok(
        std::process::Command::new(common::gate::binary())
            .args(["certs", "generate", "--reuse-ca", "--san", "127.0.0.1"])
            .arg(format!("--days={days}"))
            .arg("--out")
            .arg(certs),
        "volume-gate certs generate --reuse-ca",
    );
}

/// The first round from `from` on whose webhook scrape shows a certificate
/// with `days` left (within a minute: it was issued just now).
async fn wait_certificate(scraper: &Scraper, from: usize, days: u32) -> usize {
    let want = f64::from(days) * 86400.0;
    scraper
        .wait_round(
            &format!("the webhook serving a {days}-day certificate"),
            from,
            Duration::from_secs(60),
            |rounds, i| cert_left(&rounds[i]).is_some_and(|left| (want - left).abs() < 60.0),
        )
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_with_10_days_left_fires_certificate_expiring_one_with_30_does_not_and_renewal_silences_it()
 {
    const ALERT: &str = "VolumeGateCertificateExpiring";
    let _serial = common::serial();
    let env = env();
    let interval = interval_for(for_secs(ALERT));
    let steps = for_secs(ALERT).div_ceil(interval) as usize;
    let certs = env.gate.as_ref().unwrap().lock().unwrap().certs.clone();
    let scraper = Scraper::start(env);

    // 30 days left: more than certificateWarnDays, for longer than `for`.
    renew_certificate(&certs, 30);
    let thirty = wait_certificate(&scraper, 0, 30).await;
    scraper.wait_len(thirty + steps + 2).await;
    // 10 days left: the condition the alert names.
    renew_certificate(&certs, 10);
    let ten = wait_certificate(&scraper, thirty, 10).await;
    scraper.wait_len(ten + steps + 2).await;
    // The runbook's remedy: a renewal (a year, the default).
    renew_certificate(&certs, 365);
    let renewed = wait_certificate(&scraper, ten, 365).await;
    scraper.wait_len(renewed + 1).await;

    let rounds = scraper.finish();
    let series = Series::from_rounds(&rounds, interval, &[CERT_EXPIRY]).unwrap();
    let labels = alert_labels(ALERT, &[]);
    let mut checks: Vec<AlertCheck> = (thirty..ten).map(|i| check(i, ALERT, &[])).collect();
    checks.extend(fire_and_silence(ALERT, &labels, ten, steps, renewed));
    assert_on_promtool("certificate-expiring", FIRING_SETS, &series, &checks);
}

/// Another identity holding the worker's Lease and renewing it every
/// second (the Lease's duration, 4s, as the tests' workers have it), until
/// dropped: then it lapses like any holder's that stopped.
struct ForeignHolder {
    task: tokio::task::JoinHandle<()>,
}

impl ForeignHolder {
    const IDENTITY: &'static str = "volume-gate-worker-of-another-installation";

    async fn take(env: &common::Env) -> ForeignHolder {
        use k8s_openapi::api::coordination::v1::Lease;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
        use kube::api::{Api, Patch, PatchParams};
        let leases: Api<Lease> =
            Api::namespaced(env.cp.management_client().await, common::gate::NAMESPACE);
        let write = move |leases: Api<Lease>, first: bool| async move {
            let now = serde_json::to_value(MicroTime(jiff::Timestamp::now())).unwrap();
            let mut spec = serde_json::json!({"holderIdentity": ForeignHolder::IDENTITY,
                "leaseDurationSeconds": 4, "renewTime": now});
            if first {
                spec["acquireTime"] = now;
            }
            leases
                .patch(
                    "volume-gate-worker",
                    &PatchParams::default(),
                    &Patch::Merge(serde_json::json!({ "spec": spec })),
                )
                .await
                .map(|_| ())
        };
        write(leases.clone(), true)
            .await
            .expect("write another holder into the worker's Lease");
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                let _ = write(leases.clone(), false).await;
            }
        });
        ForeignHolder { task }
    }
}

impl Drop for ForeignHolder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The worker's leader gauge in `round`; `None` if its scrape failed.
fn leader(round: &Round) -> Option<f64> {
    let s = scraped(round, "worker", LEADER, &[])?;
    let [s] = s.as_slice() else { return None };
    Some(s.value)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_worker_holding_the_lease_fires_no_leader_and_the_holder_letting_go_silences_it() {
    const ALERT: &str = "VolumeGateNoLeader";
    let _serial = common::serial();
    let env = env();
    let interval = interval_for(for_secs(ALERT));
    let steps = for_secs(ALERT).div_ceil(interval) as usize;
    let scraper = Scraper::start(env);
    let gate = || env.gate.as_ref().unwrap().lock().unwrap();
    scraper
        .wait_round("the worker leading", 0, Duration::from_secs(60), |r, i| {
            leader(&r[i]) == Some(1.0)
        })
        .await;

    // The worker stops (releasing the Lease), another identity takes the
    // Lease and keeps it, and the worker comes back to wait for it: a
    // worker runs, none leads.
    gate()
        .terminate_worker(Duration::from_secs(10))
        .expect("the worker stops on SIGTERM");
    let holder = ForeignHolder::take(env).await;
    let restarted = scraper.len();
    gate().start_worker();
    let pending = scraper
        .wait_round(
            "a running worker that does not lead",
            restarted,
            Duration::from_secs(60),
            |r, i| leader(&r[i]) == Some(0.0),
        )
        .await;
    scraper.wait_len(pending + steps + 2).await;

    // The remedy: the other holder lets go (stopped, its Lease lapses);
    // the worker takes the Lease.
    drop(holder);
    let silenced = scraper
        .wait_round(
            "the worker leading again",
            pending,
            Duration::from_secs(60),
            |r, i| leader(&r[i]) == Some(1.0),
        )
        .await;
    scraper.wait_len(silenced + 1).await;
    let rounds = scraper.finish();
    let series = Series::from_rounds(&rounds, interval, &[CERT_EXPIRY]).unwrap();
    let labels = alert_labels(ALERT, &[]);
    assert_on_promtool(
        "no-leader",
        FIRING_SETS,
        &series,
        &fire_and_silence(ALERT, &labels, pending, steps, silenced),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_worker_fires_worker_down_and_starting_it_silences_it() {
    const ALERT: &str = "VolumeGateWorkerDown";
    let _serial = common::serial();
    let env = env();
    let interval = interval_for(for_secs(ALERT));
    let steps = for_secs(ALERT).div_ceil(interval) as usize;
    let scraper = Scraper::start(env);
    let gate = || env.gate.as_ref().unwrap().lock().unwrap();
    let up = |r: &Round| {
        r.targets
            .iter()
            .any(|(t, s)| t["container"] == "worker" && s.is_ok())
    };
    scraper
        .wait_round("the worker scraped", 0, Duration::from_secs(60), |r, i| {
            up(&r[i])
        })
        .await;

    // The condition: the worker's scrape fails (its process stopped).
    gate()
        .terminate_worker(Duration::from_secs(10))
        .expect("the worker stops on SIGTERM");
    let down = scraper
        .wait_round(
            "the worker's scrape failing",
            scraper.len(),
            Duration::from_secs(30),
            |r, i| !up(&r[i]),
        )
        .await;
    scraper.wait_len(down + steps + 2).await;

    // The remedy: the worker runs again.
    gate().start_worker();
    let silenced = scraper
        .wait_round(
            "the worker scraped again",
            down,
            Duration::from_secs(60),
            |r, i| up(&r[i]),
        )
        .await;
    scraper.wait_len(silenced + 1).await;
    // And leads again, as it did before this test.
    scraper
        .wait_round(
            "the worker leading",
            silenced,
            Duration::from_secs(60),
            |r, i| leader(&r[i]) == Some(1.0),
        )
        .await;
    let rounds = scraper.finish();
    let series = Series::from_rounds(&rounds, interval, &[CERT_EXPIRY]).unwrap();
    // absent() keeps its matchers' labels.
    let labels = alert_labels(ALERT, &[("namespace", NS), ("container", "worker")]);
    let mut checks = fire_and_silence(ALERT, &labels, down, steps, silenced);
    // And NoLeader, whose runbook says worker replicas run, stays silent
    // while none does: WorkerDown is the one that says so.
    checks.extend((down..silenced).map(|i| check(i, "VolumeGateNoLeader", &[])));
    assert_on_promtool("worker-down", FIRING_SETS, &series, &checks);
}
