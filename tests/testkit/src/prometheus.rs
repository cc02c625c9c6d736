//! Prometheus' side of the alert tests (`tests/alerts.rs`): Prometheus' own
//! `promtool` (built by `tests/prometheus/build.sh`), and a pure converter
//! from what a scrape of the real processes returned to a `promtool test
//! rules` file, writing the series as Prometheus' scrape loop would have
//! stored them.
//!
//! What Prometheus stores, and so what the converter writes (Prometheus
//! 3.16.0, `scrape/scrape.go`; prometheus-operator v0.93.0's
//! `pkg/prometheus/promcfg.go`, `generatePodMonitorConfig`: the namespace,
//! container, pod, job and endpoint relabelings):
//! - each scraped sample under its target's labels: a PodMonitor target has
//!   `namespace`, `container`, `pod`, `job` (`<namespace>/<PodMonitor name>`),
//!   `endpoint` (the port's name) and `instance` (the address scraped); a
//!   scraped label that clashes with one of them is kept as `exported_<name>`
//!   (`honor_labels: false`, the PodMonitor's default);
//! - `up{<target labels>}`, 1 after a scrape that succeeded, 0 after one that
//!   failed;
//! - a stale marker (`stale` in promtool's series notation) for every series
//!   of the target's previous scrape that the current one lacks; a failed
//!   scrape counts as one that returned nothing, and a target that is gone
//!   (its pod deleted) marks all of its series stale once.
//!
//! One scrape round is one rule evaluation step: sample `i` is written at
//! `start + i * interval`, where `start` is the first round's wall time (whole
//! seconds, promtool's `start_timestamp`). The gauges keep their scraped
//! values (a duration stays the real duration it measured) except those named
//! as absolute Unix timestamps, which are re-anchored to the compressed
//! clock: `value - scrape wall time + start + i * interval`, so that
//! `value - time()` in a rule is the real remaining time at that scrape (a
//! 0, such a gauge's "none yet", is no time and is kept).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use serde_json::{Value, json};

use super::cluster::run_build_script;
pub use super::exposition::{Sample, parse_exposition, series_key};

/// Prometheus' `promtool`, built on first use into the harness cache.
pub fn promtool_binary() -> PathBuf {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY
        .get_or_init(|| run_build_script("tests/prometheus/build.sh"))
        .clone()
}

/// Runs `promtool ARGS` in `dir` (rule files are found relative to it).
pub fn promtool(dir: &Path, args: &[&str]) -> Output {
    Command::new(promtool_binary())
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run promtool")
}

/// A series: its metric name and labels.
pub type SeriesId = (String, BTreeMap<String, String>);

/// A scrape target: the labels Prometheus gives its samples.
pub type Target = BTreeMap<String, String>;

/// The labels a PodMonitor named `podmonitor` in `namespace` gives the
/// target of `container` in `pod`, scraped at `address` on port `endpoint`.
pub fn pod_monitor_target(
    namespace: &str,
    podmonitor: &str,
    pod: &str,
    container: &str,
    endpoint: &str,
    address: &str,
) -> Target {
    [
        ("namespace", namespace.to_string()),
        ("container", container.to_string()),
        ("pod", pod.to_string()),
        ("job", format!("{namespace}/{podmonitor}")),
        ("endpoint", endpoint.to_string()),
        ("instance", address.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// One scrape of every target: when it ran (Unix seconds) and, per target,
/// the exposition it returned or why the scrape failed. A target absent from
/// a round is gone (its pod deleted).
#[derive(Clone, Debug)]
pub struct Round {
    pub wall: f64,
    pub targets: Vec<(Target, Result<String, String>)>,
}

/// A point of a series at one evaluation step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Point {
    /// No sample (promtool `_`).
    Missing,
    Value(f64),
    /// A stale marker (promtool `stale`).
    Stale,
}

/// Series as Prometheus stores them, one point per round.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// promtool's `start_timestamp`: the first round's wall time, in whole seconds.
    pub start: i64,
    /// The evaluation interval one round stands for, in seconds.
    pub interval: u64,
    /// Each series (metric name, labels) to its points.
    pub points: BTreeMap<SeriesId, Vec<Point>>,
}

impl Series {
    /// The rounds' samples as Prometheus' scrape loop stores them (the module
    /// docs say how), one round per `interval` seconds; metrics named in
    /// `timestamps` are absolute Unix times and are re-anchored.
    pub fn from_rounds(
        rounds: &[Round],
        interval: u64,
        timestamps: &[&str],
    ) -> Result<Series, String> {
        let start = rounds.first().map_or(0, |r| r.wall.floor() as i64);
        let n = rounds.len();
        let mut points: BTreeMap<SeriesId, Vec<Point>> = BTreeMap::new();
        let mut last: BTreeMap<Target, BTreeSet<SeriesId>> = BTreeMap::new();
        let mut set = |id: &SeriesId, i: usize, p: Point| {
            points
                .entry(id.clone())
                .or_insert_with(|| vec![Point::Missing; n])[i] = p;
        };
        for (i, round) in rounds.iter().enumerate() {
            let now = start as f64 + (i as u64 * interval) as f64;
            let here: BTreeSet<&Target> = round.targets.iter().map(|(t, _)| t).collect();
            // Targets gone since the last round: their series end.
            let gone: Vec<Target> = last.keys().filter(|t| !here.contains(t)).cloned().collect();
            for t in gone {
                for key in last.remove(&t).unwrap_or_default() {
                    set(&key, i, Point::Stale);
                }
            }
            for (target, scraped) in &round.targets {
                let samples = match scraped {
                    Ok(text) => Some(
                        parse_exposition(text)
                            .map_err(|e| format!("round {i}, target {target:?}: {e}"))?,
                    ),
                    Err(_) => None,
                };
                let mut present = BTreeSet::new();
                let up = ("up".to_string(), target.clone());
                set(&up, i, Point::Value(f64::from(u8::from(samples.is_some()))));
                present.insert(up);
                for s in samples.unwrap_or_default() {
                    let mut labels = BTreeMap::new();
                    for (k, v) in s.labels {
                        let k = if target.contains_key(&k) {
                            format!("exported_{k}")
                        } else {
                            k
                        };
                        labels.insert(k, v);
                    }
                    labels.extend(target.iter().map(|(k, v)| (k.clone(), v.clone())));
                    // 0 is such a gauge's "none yet", not a time: kept.
                    let value = if timestamps.contains(&s.name.as_str()) && s.value != 0.0 {
                        s.value - round.wall + now
                    } else {
                        s.value
                    };
                    let id = (s.name, labels);
                    set(&id, i, Point::Value(value));
                    present.insert(id);
                }
                for key in last.get(target).into_iter().flatten() {
                    if !present.contains(key) {
                        set(key, i, Point::Stale);
                    }
                }
                last.insert(target.clone(), present);
            }
        }
        Ok(Series {
            start,
            interval,
            points,
        })
    }

    /// The series of metric `name` whose labels include all of `labels`.
    pub fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = (&'a BTreeMap<String, String>, &'a [Point])> + 'a {
        self.points
            .iter()
            .filter(move |((n, l), _)| {
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| l.get(*k).is_some_and(|x| x == v))
            })
            .map(|((_, l), p)| (l, p.as_slice()))
    }

    /// Seconds from `start` of evaluation step `i`, as promtool's
    /// `eval_time` names it.
    pub fn eval_time(&self, i: usize) -> String {
        format!("{}s", i as u64 * self.interval)
    }

    /// A `promtool test rules` file evaluating `rule_files` (relative to the
    /// file's directory) over these series, with `checks`: as JSON, which is
    /// YAML.
    pub fn unit_test_file(&self, rule_files: &[&str], checks: &[AlertCheck]) -> String {
        let input_series: Vec<Value> = self
            .points
            .iter()
            .map(|((name, labels), points)| {
                let key = series_key(name, labels);
                let values: Vec<String> = points.iter().map(|p| point_notation(*p)).collect();
                json!({"series": key, "values": values.join(" ")})
            })
            .collect();
        let alert_rule_test: Vec<Value> = checks
            .iter()
            .map(|c| {
                json!({
                    "eval_time": self.eval_time(c.step),
                    "alertname": c.alertname,
                    "exp_alerts": c.firing.iter().map(|labels| json!({"exp_labels": labels})).collect::<Vec<_>>(),
                })
            })
            .collect();
        let file = json!({
            "rule_files": rule_files,
            "evaluation_interval": format!("{}s", self.interval),
            "tests": [{
                "name": "scraped from the running processes",
                "interval": format!("{}s", self.interval),
                "start_timestamp": self.start,
                "input_series": input_series,
                "alert_rule_test": alert_rule_test,
            }],
        });
        serde_json::to_string_pretty(&file).unwrap()
    }
}

/// promtool's series notation of one point.
fn point_notation(p: Point) -> String {
    match p {
        Point::Missing => "_".into(),
        Point::Stale => "stale".into(),
        Point::Value(v) if v.is_nan() => "NaN".into(),
        Point::Value(v) if v == f64::INFINITY => "Inf".into(),
        Point::Value(v) if v == f64::NEG_INFINITY => "-Inf".into(),
        // Rust prints the shortest decimal that reads back as the same f64.
        Point::Value(v) => format!("{v}"),
    }
}

/// At evaluation step `step`, alert `alertname` fires exactly once per label
/// set in `firing` (each without `alertname`, which promtool adds): empty,
/// it does not fire.
#[derive(Clone, Debug, PartialEq)]
pub struct AlertCheck {
    pub step: usize,
    pub alertname: String,
    pub firing: Vec<BTreeMap<String, String>>,
}

/// The `spec.groups` of a rendered PrometheusRule as a Prometheus rule file
/// (JSON, which is YAML); with `annotations` dropped when
/// `without_annotations`: they are informational (Prometheus' alerting rule
/// expands them after it decides whether and with which labels an alert
/// fires) and promtool compares them whole, so a test of the firing leaves
/// them out.
pub fn rule_file(prometheus_rule: &Value, without_annotations: bool) -> String {
    let mut groups = prometheus_rule["spec"]["groups"].clone();
    assert!(
        groups.as_array().is_some_and(|g| !g.is_empty()),
        "the PrometheusRule has no spec.groups: {prometheus_rule}"
    );
    if without_annotations {
        for group in groups.as_array_mut().unwrap() {
            for rule in group["rules"].as_array_mut().into_iter().flatten() {
                if let Some(rule) = rule.as_object_mut() {
                    rule.remove("annotations");
                }
            }
        }
    }
    serde_json::to_string_pretty(&json!({ "groups": groups })).unwrap()
}

/// The alerting rules of a rendered PrometheusRule, by name.
pub fn alerts(prometheus_rule: &Value) -> BTreeMap<String, Value> {
    prometheus_rule["spec"]["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .filter_map(|r| Some((r["alert"].as_str()?.to_string(), r.clone())))
        .collect()
}
