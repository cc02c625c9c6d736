//! The Helm chart (`manifests/chart/volume-gate`), rendered by the real
//! `helm` built from the Go module proxy: lint, each option, clear refusals
//! of bad values, no drift from the kustomize base (object by object), and
//! alerts and dashboard panels that name only metrics the binary exports.

use volume_gate_testkit as common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use common::chart::{CHART, Key, helm, kustomize, template, try_template};
use common::gate::binary;
use serde_json::{Value, json};

const CA: &str = "Q0EgcGxhY2Vob2xkZXI="; // base64 "CA placeholder"
const WEBHOOK_CONFIGURATIONS: [&str; 2] = [
    "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration",
];

fn get<'a>(docs: &'a BTreeMap<Key, Value>, kind: &str, ns: &str, name: &str) -> &'a Value {
    docs.get(&(kind.into(), ns.into(), name.into()))
        .unwrap_or_else(|| panic!("{kind} {ns}/{name} not rendered; have {:?}", docs.keys()))
}

fn container<'a>(docs: &'a BTreeMap<Key, Value>, ns: &str, deployment: &str) -> &'a Value {
    &get(docs, "Deployment", ns, deployment)["spec"]["template"]["spec"]["containers"][0]
}

fn args(c: &Value) -> Vec<String> {
    c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

/// The kustomize rendering without its Namespace: the chart leaves the
/// namespace to `helm install --create-namespace` or the platform.
fn without_namespace(mut docs: BTreeMap<Key, Value>) -> BTreeMap<Key, Value> {
    let ns = docs
        .remove(&("Namespace".into(), String::new(), "volume-gate".into()))
        .expect("the base ships its Namespace");
    assert_eq!(
        ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
        "restricted"
    );
    docs
}

/// The chart's Helm hooks, taken out of its rendering: the kustomize files
/// have none (their uninstall runs `volume-gate custody hand-back` by hand).
fn take_hooks(docs: &mut BTreeMap<Key, Value>) -> BTreeMap<Key, Value> {
    let keys: Vec<Key> = docs
        .iter()
        .filter(|(_, d)| !d["metadata"]["annotations"]["helm.sh/hook"].is_null())
        .map(|(k, _)| k.clone())
        .collect();
    keys.into_iter()
        .map(|k| {
            let d = docs.remove(&k).unwrap();
            (k, d)
        })
        .collect()
}

/// Helm's standard labels of a release: on every object the chart renders
/// (and its Pods), not in the kustomize base, which no release installs.
/// The one difference [`assert_same`] forgives.
const RELEASE_LABELS: [&str; 4] = [
    "helm.sh/chart",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
];

/// Where an object carries labels: its own, and its Pod template's.
const LABEL_PATHS: [&str; 2] = ["/metadata/labels", "/spec/template/metadata/labels"];

/// `doc` without [`RELEASE_LABELS`], each of which it must carry.
fn without_release_labels(k: &Key, mut doc: Value) -> Value {
    for path in LABEL_PATHS {
        let Some(labels) = doc.pointer_mut(path).and_then(Value::as_object_mut) else {
            continue;
        };
        for l in RELEASE_LABELS {
            assert!(labels.remove(l).is_some(), "{k:?} {path} has no {l}");
        }
    }
    doc
}

fn assert_same(chart: &BTreeMap<Key, Value>, kustomized: &BTreeMap<Key, Value>, what: &str) {
    let mut chart: BTreeMap<Key, Value> = chart
        .iter()
        .map(|(k, d)| (k.clone(), without_release_labels(k, d.clone())))
        .collect();
    take_hooks(&mut chart);
    assert_eq!(
        chart.keys().collect::<Vec<_>>(),
        kustomized.keys().collect::<Vec<_>>(),
        "{what}: the same objects"
    );
    for (k, doc) in kustomized {
        assert_eq!(
            &chart[k], doc,
            "{what}: {k:?} drifted between the chart and the kustomize files"
        );
    }
}

#[test]
fn helm_lint_passes_for_the_default_values_and_each_option() {
    let variants: [&[&str]; 8] = [
        &[],
        &["platform.profile=cluster-api"],
        &[
            "platform.profile=cluster-api",
            "platform.clusterApi.managementCsi.enabled=true",
        ],
        &[
            "platform.profile=cluster-api",
            "certificates.mode=secret",
            &format!("certificates.caBundle={CA}"),
            "profile=name: acme-capi",
        ],
        &[
            "certificates.mode=secret",
            &format!("certificates.caBundle={CA}"),
        ],
        &[
            "monitoring.prometheusRule.enabled=true",
            "monitoring.dashboard.enabled=true",
            "monitoring.podMonitor.enabled=true",
        ],
        &[
            "profile=name: acme",
            "worker.waitBound=20m",
            "worker.infraAfter=5m",
        ],
        &[
            "image.digest=sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "webhook.replicas=3",
        ],
    ];
    // Each option by --set, and every knob at once from a values file.
    let (_dir, file) = values_file(EVERY_KNOB);
    let runs = variants
        .iter()
        .map(|sets| {
            (
                format!("{sets:?}"),
                sets.iter().flat_map(|s| ["--set", s]).collect(),
            )
        })
        .chain([("every knob".to_string(), vec!["-f", file.as_str()])]);
    for (what, args) in runs {
        let mut a = vec!["lint", CHART, "--strict", "--namespace", "volume-gate"];
        a.extend::<Vec<&str>>(args);
        let out = helm(&a);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "helm lint {what}:\n{text}");
        assert!(text.contains("0 chart(s) failed"), "{text}");
    }
}

#[test]
fn with_an_existing_secret_the_chart_renders_the_kustomize_base_object_by_object() {
    let mut chart = template(
        "volume-gate",
        &[
            "certificates.mode=secret",
            &format!("certificates.caBundle={CA}"),
        ],
    );
    for kind in WEBHOOK_CONFIGURATIONS {
        let doc = chart
            .get_mut(&(kind.into(), String::new(), "volume-gate".into()))
            .unwrap();
        assert!(
            doc["metadata"]["annotations"].is_null(),
            "{kind}: no cert-manager annotation"
        );
        for w in doc["webhooks"].as_array_mut().unwrap() {
            // The base leaves the caBundle to certs-scripts/.
            let cc = w["clientConfig"].as_object_mut().unwrap();
            assert_eq!(
                cc.remove("caBundle"),
                Some(json!(CA)),
                "{kind} {}",
                w["name"]
            );
        }
    }
    assert!(
        !chart
            .keys()
            .any(|k| k.0 == "Certificate" || k.0 == "Issuer"),
        "no cert-manager objects in secret mode"
    );
    assert_same(
        &chart,
        &without_namespace(kustomize("manifests")),
        "secret mode",
    );
}

#[test]
fn with_cert_manager_the_chart_renders_the_overlay_a_ca_chain_and_injects_it() {
    let chart = template("volume-gate", &[]);
    assert_same(
        &chart,
        &without_namespace(kustomize("manifests/overlays/cert-manager")),
        "cert-manager mode",
    );

    // In any namespace: Cozystack's shape, everything named from it.
    let ns = "cozy-volume-gate";
    let docs = template(ns, &[]);
    let issuer = |name: &str| get(&docs, "Issuer", ns, name)["spec"].clone();
    assert_eq!(issuer("volume-gate-selfsigned"), json!({"selfSigned": {}}));
    assert_eq!(
        issuer("volume-gate-ca"),
        json!({"ca": {"secretName": "volume-gate-ca"}})
    );
    let ca = &get(&docs, "Certificate", ns, "volume-gate-ca")["spec"];
    assert_eq!(ca["isCA"], true);
    assert_eq!(ca["issuerRef"]["name"], "volume-gate-selfsigned");
    let serving = &get(&docs, "Certificate", ns, "volume-gate-webhook")["spec"];
    assert_eq!(serving["issuerRef"]["name"], "volume-gate-ca");
    assert_eq!(serving["secretName"], "volume-gate-webhook-tls");
    assert_eq!(serving["renewBefore"], "360h");
    let names: BTreeSet<&str> = serving["dnsNames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    for n in [
        "volume-gate-webhook",
        &format!("volume-gate-webhook.{ns}.svc"),
    ] {
        assert!(
            names.contains(n),
            "serving certificate names {n}: {names:?}"
        );
    }
    for kind in WEBHOOK_CONFIGURATIONS {
        let doc = get(&docs, kind, "", "volume-gate");
        assert_eq!(
            doc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
            format!("{ns}/volume-gate-webhook")
        );
        for w in doc["webhooks"].as_array().unwrap() {
            assert_eq!(w["clientConfig"]["service"]["namespace"], ns);
            assert!(
                w["clientConfig"]["caBundle"].is_null(),
                "cainjector writes it"
            );
        }
    }
    // The worker's identity follows the namespace: the gate lets only it
    // write the record.
    assert!(
        args(container(&docs, ns, "volume-gate-webhook")).contains(&format!(
            "--worker-identity=system:serviceaccount:{ns}:volume-gate-worker"
        ))
    );
    let binding = get(&docs, "ClusterRoleBinding", "", "volume-gate-worker");
    assert_eq!(binding["subjects"][0]["namespace"], ns);
    assert!(
        docs.keys().all(|k| k.1.is_empty() || k.1 == ns),
        "{:?}",
        docs.keys()
    );
}

#[test]
fn values_reach_the_objects_and_every_argument_is_a_flag_the_binary_has() {
    let digest = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let ns = "volume-gate";
    let docs = template(
        ns,
        &[
            &format!("image.digest={digest}"),
            "image.tag=0.2.0",
            "webhook.replicas=3",
            "worker.replicas=1",
            "worker.waitBound=20m",
            "worker.infraAfter=5m",
            "worker.maxConcurrentReleases=8",
            "webhook.timeoutSeconds=10",
            "profile=name: acme",
        ],
    );
    let image = format!("ghcr.io/cozystack/volume-gate:0.2.0@{digest}");
    for (deployment, replicas) in [("volume-gate-webhook", 3), ("volume-gate-worker", 1)] {
        let d = get(&docs, "Deployment", ns, deployment);
        assert_eq!(d["spec"]["replicas"], replicas, "{deployment}");
        let c = container(&docs, ns, deployment);
        assert_eq!(c["image"], image, "{deployment}");
        let a = args(c);
        assert!(
            a.contains(&"--profile=/etc/volume-gate/profile/profile.yaml".to_string()),
            "{a:?}"
        );
        let spec = &d["spec"]["template"]["spec"];
        assert!(
            spec["volumes"]
                .as_array()
                .unwrap()
                .iter()
                .any(|v| v["configMap"]["name"] == "volume-gate-profile"),
            "{deployment} mounts the profile"
        );
        assert!(
            !d["spec"]["template"]["metadata"]["annotations"]["checksum/profile"].is_null(),
            "a profile change rolls {deployment}"
        );
        // Every argument is a flag `volume-gate <role> --help` lists.
        let help = Command::new(binary())
            .arg(&a[0])
            .arg("--help")
            .output()
            .unwrap();
        let help = String::from_utf8(help.stdout).unwrap();
        for arg in &a[1..] {
            let flag = arg.split('=').next().unwrap();
            assert!(
                help.contains(flag),
                "{deployment} passes {flag}, unknown to `volume-gate {} --help`",
                a[0]
            );
        }
    }
    let worker = args(container(&docs, ns, "volume-gate-worker"));
    for f in [
        "--wait-bound=20m",
        "--infra-after=5m",
        "--max-concurrent-releases=8",
    ] {
        assert!(worker.contains(&f.to_string()), "{f} in {worker:?}");
    }
    assert_eq!(
        get(&docs, "ConfigMap", ns, "volume-gate-profile")["data"]["profile.yaml"]
            .as_str()
            .map(str::trim_end),
        Some("name: acme")
    );
    for kind in WEBHOOK_CONFIGURATIONS {
        for w in get(&docs, kind, "", "volume-gate")["webhooks"]
            .as_array()
            .unwrap()
        {
            assert_eq!(w["timeoutSeconds"], 10);
        }
    }
    // The profile the chart ships is one the binary accepts.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("profile.yaml");
    std::fs::write(&file, "name: acme\n").unwrap();
    let out = Command::new(binary())
        .args(["profile", "--profile"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_uninstall_is_a_pre_delete_hook_that_hands_custody_back_with_only_what_it_needs() {
    let ns = "cozy-volume-gate";
    let mut docs = template(ns, &["profile=name: acme"]);
    let hooks = take_hooks(&mut docs);
    let names: BTreeSet<(&str, &str)> = hooks
        .keys()
        .map(|(kind, _, name)| (kind.as_str(), name.as_str()))
        .collect();
    assert_eq!(
        names,
        BTreeSet::from([
            ("ClusterRole", "volume-gate-uninstall"),
            ("ClusterRoleBinding", "volume-gate-uninstall"),
            ("Job", "volume-gate-uninstall"),
            ("Role", "volume-gate-uninstall"),
            ("RoleBinding", "volume-gate-uninstall"),
            ("ServiceAccount", "volume-gate-uninstall"),
        ])
    );
    for (k, d) in &hooks {
        let a = &d["metadata"]["annotations"];
        assert_eq!(a["helm.sh/hook"], "pre-delete", "{k:?}");
        // A failed Job is kept for its log; the next attempt replaces it.
        assert_eq!(
            a["helm.sh/hook-delete-policy"], "before-hook-creation,hook-succeeded",
            "{k:?}"
        );
    }
    let job = &hooks[&("Job".into(), ns.into(), "volume-gate-uninstall".into())];
    let pod = &job["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "volume-gate-uninstall");
    assert_eq!(job["spec"]["backoffLimit"], 0);
    let c = &pod["containers"][0];
    assert_eq!(c["image"], "ghcr.io/cozystack/volume-gate:0.1.0");
    let a = args(c);
    assert_eq!(&a[..2], ["custody", "hand-back"]);
    for f in [
        format!("--install-namespace={ns}"),
        "--worker-deployment=volume-gate-worker".into(),
        "--webhook-configuration=volume-gate".into(),
        "--profile=/etc/volume-gate/profile/profile.yaml".into(),
    ] {
        assert!(a.contains(&f), "{f} in {a:?}");
    }
    // Every argument is one `volume-gate custody hand-back` takes.
    let help = Command::new(binary())
        .args(["custody", "hand-back", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    for arg in &a[2..] {
        let flag = arg.split('=').next().unwrap();
        assert!(help.contains(flag), "{flag} unknown to hand-back:\n{help}");
    }
    // The restricted Pod Security level, as the release namespace has.
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["securityContext"]["capabilities"]["drop"], json!(["ALL"]));
    // The webhook configurations and the worker, by name only.
    let cluster = &hooks[&(
        "ClusterRole".into(),
        String::new(),
        "volume-gate-uninstall".into(),
    )];
    let webhooks = cluster["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["apiGroups"][0] == "admissionregistration.k8s.io")
        .expect("a rule for the webhook configurations");
    assert_eq!(webhooks["resourceNames"], json!(["volume-gate"]));
    assert_eq!(webhooks["verbs"], json!(["delete"]));
    let role = &hooks[&("Role".into(), ns.into(), "volume-gate-uninstall".into())];
    let worker = role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["resources"][0] == "deployments")
        .expect("a rule for the worker's Deployment");
    assert_eq!(worker["resourceNames"], json!(["volume-gate-worker"]));
    // Off, nothing of it is rendered.
    let mut off = template(ns, &["uninstallHook.enabled=false"]);
    assert!(take_hooks(&mut off).is_empty());
}

/// The flags a container passes for `flag` (`--flag=value`), in order.
fn flag_values(a: &[String], flag: &str) -> Vec<String> {
    a.iter()
        .filter_map(|x| x.strip_prefix(&format!("{flag}=")))
        .map(str::to_string)
        .collect()
}

/// A webhook's match condition by name.
fn condition<'a>(docs: &'a BTreeMap<Key, Value>, kind: &str, webhook: &str, name: &str) -> &'a str {
    get(docs, kind, "", "volume-gate")["webhooks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["name"] == webhook)
        .unwrap_or_else(|| panic!("{kind} has no webhook {webhook}"))["matchConditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("{webhook} has no condition {name}"))["expression"]
        .as_str()
        .unwrap()
}

#[test]
fn the_charts_platform_identities_are_those_the_fixtures_cozystack_runs_as() {
    use common::cozystack::{COZYSTACK_API, COZYSTACK_CONTROLLER, FLUX};
    // What the test world's Cozystack runs as (tests/testkit/src/cozystack.rs,
    // read from Cozystack's release): Flux as helm-controller, cozystack-
    // controller and cozystack-api as the parents' source writers,
    // cozystack-api as the writer that replaces a parent whole.
    let flux = vec![FLUX.username()];
    let sources = vec![COZYSTACK_CONTROLLER.username(), COZYSTACK_API.username()];
    let replacers = vec![COZYSTACK_API.username()];
    let p = volume_gate::profile::Profile::cozystack().writers;
    assert_eq!(
        (
            &p.release_controllers,
            &p.parent_sources,
            &p.parent_replacers
        ),
        (&flux, &sources, &replacers),
        "the built-in profile"
    );
    let ns = "volume-gate";
    for (docs, what) in [
        (template(ns, &[]), "the chart"),
        (
            without_namespace(kustomize("manifests")),
            "the kustomize base",
        ),
    ] {
        let a = args(container(&docs, ns, "volume-gate-webhook"));
        assert_eq!(flag_values(&a, "--release-controller"), flux, "{what}");
        assert_eq!(flag_values(&a, "--parent-source-writer"), sources, "{what}");
        assert_eq!(flag_values(&a, "--parent-replacer"), replacers, "{what}");
        let status = condition(
            &docs,
            "ValidatingWebhookConfiguration",
            "release-status.volume-gate.cozystack.io",
            "not-the-controller",
        );
        assert!(
            status.contains(&format!("['{}']", flux[0])),
            "{what}: {status}"
        );
        let replaced = condition(
            &docs,
            "MutatingWebhookConfiguration",
            "custody.volume-gate.cozystack.io",
            "custody-missing-override-changed-or-replaced",
        );
        assert!(
            replaced.contains(&format!("['{}']", replacers[0])),
            "{what}: {replaced}"
        );
    }
    // Another platform's identities reach both.
    let docs = template(
        ns,
        &[
            "platform.releaseControllers={system:serviceaccount:flux-system:helm-controller}",
            "platform.parentReplacers={system:serviceaccount:acme:api,alice}",
        ],
    );
    let a = args(container(&docs, ns, "volume-gate-webhook"));
    assert_eq!(
        flag_values(&a, "--release-controller"),
        ["system:serviceaccount:flux-system:helm-controller"]
    );
    assert_eq!(
        flag_values(&a, "--parent-replacer"),
        ["system:serviceaccount:acme:api", "alice"]
    );
    assert!(
        condition(
            &docs,
            "ValidatingWebhookConfiguration",
            "release-status.volume-gate.cozystack.io",
            "not-the-controller"
        )
        .contains("['system:serviceaccount:flux-system:helm-controller']")
    );
    assert!(
        condition(
            &docs,
            "MutatingWebhookConfiguration",
            "custody.volume-gate.cozystack.io",
            "custody-missing-override-changed-or-replaced"
        )
        .contains("['system:serviceaccount:acme:api', 'alice']")
    );
}

#[test]
fn bad_values_are_refused_with_a_message_naming_the_value_and_the_fix() {
    let cases: [(&[&str], &[&str]); 7] = [
        (
            &["certificates.mode=vault"],
            &["certificates.mode \"vault\"", "cert-manager", "secret"],
        ),
        (
            &["certificates.mode=secret"],
            &["certificates.caBundle is empty", "certs-scripts/"],
        ),
        (
            &["image.digest=latest"],
            &["image.digest \"latest\"", "sha256:"],
        ),
        (
            &["webhook.timeoutSeconds=31"],
            &["webhook.timeoutSeconds 31", "1 to 30"],
        ),
        (&["image.tag="], &["image.tag is empty"]),
        (
            &["platform.releaseControllers=null"],
            &["platform.releaseControllers is empty", "cozy-fluxcd:flux"],
        ),
        (
            &["platform.parentReplacers={it's}"],
            &["platform: \"it's\"", "quote"],
        ),
    ];
    for (sets, wanted) in cases {
        let err = try_template("volume-gate", sets).expect_err("refused");
        for w in wanted {
            assert!(err.contains(w), "{sets:?}: {w:?} not in {err}");
        }
    }
}

/// The sample names the binary exports: `# TYPE` lines of its own /metrics
/// text, counters as `_total`, histograms as `_bucket`, `_sum`, `_count`.
fn exported() -> BTreeSet<String> {
    use volume_gate::metrics::*;
    // A family prints nothing until it has a label set: give each one.
    let m = Metrics::new();
    m.decisions
        .get_or_create(&DecisionLabels {
            target: "parent".into(),
            operation: "DELETE".into(),
            verdict: "allowed".into(),
            reason: "in-custody".into(),
        })
        .inc();
    m.decision_seconds
        .get_or_create(&EndpointLabels {
            endpoint: "validate".into(),
        })
        .observe(0.001);
    m.tenants_by_phase
        .get_or_create(&PhaseLabels {
            phase: "Blocked".into(),
        })
        .set(1);
    m.phase_seconds
        .get_or_create(&OutcomeLabels {
            outcome: "Released".into(),
        })
        .observe(1.0);
    m.tenant_teardown_seconds
        .get_or_create(&TeardownLabels {
            tenant_namespace: "tenant-a".into(),
            tenant: "kubernetes-a".into(),
            phase: "Blocked".into(),
        })
        .set(60);
    m.count_error(volume_gate::worker::ErrorKind::ManagementApi.as_str());
    let text = m.encode();
    let mut names = BTreeSet::new();
    for line in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        let (name, kind) = line.split_once(' ').unwrap();
        match kind {
            "counter" => {
                names.insert(format!("{name}_total"));
            }
            "histogram" => {
                for s in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{s}"));
                }
            }
            _ => {
                names.insert(name.to_string());
            }
        }
    }
    assert!(names.len() >= 12, "{names:?}");
    names
}

/// Metric names in a PromQL expression: identifiers followed by `{`, `[`
/// or an operator, that are not functions, keywords or labels.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes: Vec<char> = expr.chars().collect();
    let mut i = 0;
    let mut in_braces = false;
    let mut in_string = false;
    while i < bytes.len() {
        let c = bytes[i];
        if in_string {
            in_string = c != '"';
            i += 1;
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' | '[' => in_braces = true,
            '}' | ']' => in_braces = false,
            _ => {}
        }
        if (c.is_ascii_alphabetic() || c == '_') && !in_braces {
            let start = i;
            while i < bytes.len()
                && (bytes[i].is_ascii_alphanumeric() || bytes[i] == '_' || bytes[i] == ':')
            {
                i += 1;
            }
            let word: String = bytes[start..i].iter().collect();
            let next = bytes[i..].iter().find(|c| !c.is_whitespace()).copied();
            let before = bytes[..start]
                .iter()
                .rev()
                .find(|c| !c.is_whitespace())
                .copied();
            let is_call = next == Some('(');
            let in_grouping = before == Some('(') && {
                let head: String = bytes[..start].iter().collect();
                let t = head.trim_end().trim_end_matches('(').trim_end();
                t.ends_with("by")
                    || t.ends_with("on")
                    || t.ends_with("without")
                    || t.ends_with("ignoring")
            } || before == Some(',') && {
                let head: String = bytes[..start].iter().collect();
                let open = head.rfind('(').unwrap_or(0);
                let t = head[..open].trim_end();
                t.ends_with("by")
                    || t.ends_with("on")
                    || t.ends_with("without")
                    || t.ends_with("ignoring")
            };
            let keyword = matches!(
                word.as_str(),
                // Aggregations, which may be followed by `by (...)`.
                "sum"
                    | "min"
                    | "max"
                    | "avg"
                    | "count"
                    | "group"
                    | "stddev"
                    | "stdvar"
                    | "topk"
                    | "bottomk"
                    | "quantile"
                    | "count_values"
                    | "by"
                    | "on"
                    | "without"
                    | "ignoring"
                    | "or"
                    | "and"
                    | "unless"
                    | "bool"
                    | "group_left"
                    | "group_right"
                    | "offset"
            );
            if !is_call && !keyword && !in_grouping && !word.starts_with("__") {
                out.insert(word);
            }
            continue;
        }
        i += 1;
    }
    out
}

#[test]
fn every_alert_and_panel_names_only_metrics_the_binary_exports() {
    let exported = exported();
    // Outside the binary: kube-state-metrics, for the one thing a dead
    // webhook cannot say about itself.
    let outside = BTreeSet::from(["kube_deployment_status_replicas_available".to_string()]);
    let ns = "volume-gate";
    let docs = template(
        ns,
        &[
            "monitoring.prometheusRule.enabled=true",
            "monitoring.dashboard.enabled=true",
            "monitoring.podMonitor.enabled=true",
        ],
    );
    let mut exprs: Vec<(String, String)> = Vec::new();
    let rule = get(&docs, "PrometheusRule", ns, "volume-gate");
    let alerts: Vec<&str> = rule["spec"]["groups"][0]["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            exprs.push((
                r["alert"].as_str().unwrap().to_string(),
                r["expr"].as_str().unwrap().to_string(),
            ));
            r["alert"].as_str().unwrap()
        })
        .collect();
    assert_eq!(alerts, common::chart::ALERTS);
    // Each alert points at its runbook: a section of docs/operations.md
    // named as the alert (that the section exists is tests/docs_links.rs').
    for r in rule["spec"]["groups"][0]["rules"].as_array().unwrap() {
        let alert = r["alert"].as_str().unwrap();
        assert_eq!(
            r["annotations"]["runbook_url"].as_str(),
            Some(
                format!(
                    "https://github.com/cozystack/volume-gate/blob/main/docs/operations.md#{}",
                    alert.to_lowercase()
                )
                .as_str()
            ),
            "{alert}"
        );
    }
    let dashboard: Value = serde_json::from_str(
        get(&docs, "ConfigMap", ns, "volume-gate-dashboard")["data"]["volume-gate.json"]
            .as_str()
            .unwrap(),
    )
    .expect("the dashboard is JSON");
    let panels = dashboard["panels"].as_array().unwrap();
    for p in panels {
        for t in p["targets"].as_array().unwrap() {
            exprs.push((
                p["title"].as_str().unwrap().to_string(),
                t["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    let titles: Vec<&str> = panels
        .iter()
        .map(|p| p["title"].as_str().unwrap())
        .collect();
    for wanted in [
        "Tenants by phase",
        "Release phase duration",
        "Volumes freed",
        "Admission decisions by verdict",
        "Admission latency",
    ] {
        assert!(
            titles.iter().any(|t| t.starts_with(wanted)),
            "a panel for {wanted}: {titles:?}"
        );
    }
    for (what, expr) in &exprs {
        let names = metric_names(expr);
        assert!(
            names.iter().any(|n| exported.contains(n)),
            "{what}: {expr} names no metric of the binary ({names:?})"
        );
        for n in &names {
            assert!(
                exported.contains(n) || outside.contains(n),
                "{what}: {n} is not a metric volume-gate exports ({exported:?})"
            );
        }
    }
    // The alerts' `container` matcher names the webhook's container, and
    // the PodMonitor scrapes the admin port both roles serve.
    assert_eq!(
        container(&docs, ns, "volume-gate-webhook")["name"],
        "webhook"
    );
    let pm = get(&docs, "PodMonitor", ns, "volume-gate");
    assert_eq!(pm["spec"]["podMetricsEndpoints"][0]["port"], "admin");
    // Without the values, none of it.
    let plain = template(ns, &[]);
    assert!(
        !plain
            .keys()
            .any(|k| matches!(k.0.as_str(), "PrometheusRule" | "PodMonitor")
                || k.2 == "volume-gate-dashboard")
    );
}

/// The alerts' thresholds are the values' (where `absent()` is rendered is
/// `tests/alerts.rs`', on promtool).
#[test]
fn alert_thresholds_are_the_values() {
    let ns = "volume-gate";
    let docs = template(
        ns,
        &[
            "monitoring.prometheusRule.enabled=true",
            "monitoring.prometheusRule.blockedAfterMinutes=45",
            "monitoring.prometheusRule.certificateWarnDays=7",
        ],
    );
    let exprs: BTreeMap<String, String> =
        get(&docs, "PrometheusRule", ns, "volume-gate")["spec"]["groups"][0]["rules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["alert"].as_str().unwrap().to_string(),
                    r["expr"].as_str().unwrap().to_string(),
                )
            })
            .collect();
    assert!(
        exprs["VolumeGateTenantBlocked"].contains("> 2700"),
        "{exprs:#?}"
    );
    assert!(
        exprs["VolumeGateCertificateExpiring"].contains("< 604800"),
        "{exprs:#?}"
    );
}

#[test]
fn the_metric_name_reader_finds_names_and_skips_functions_labels_and_groupings() {
    let n = metric_names(
        r#"histogram_quantile(0.9, sum by (le, outcome) (rate(volume_gate_x_bucket{namespace="a b", phase="Blocked"}[5m]))) or on() (kube_y == 0)"#,
    );
    assert_eq!(
        n,
        BTreeSet::from(["volume_gate_x_bucket".to_string(), "kube_y".to_string()])
    );
}

/// Every placement, label and argument knob of both roles, each role's
/// values distinct so that one cannot reach the other's Pods unseen.
const EVERY_KNOB: &str = r#"
image:
  registry: mirror.example.com:5000/ghcr
imagePullSecrets:
  - name: mirror-pull
webhook:
  replicas: 3
  priorityClassName: gate-critical
  nodeSelector:
    node-role.kubernetes.io/control-plane: ""
  tolerations:
    - key: node-role.kubernetes.io/control-plane
      operator: Exists
      effect: NoSchedule
  affinity:
    nodeAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        nodeSelectorTerms:
          - matchExpressions:
              - key: kubernetes.io/arch
                operator: In
                values: [amd64]
  topologySpreadConstraints:
    - maxSkew: 1
      topologyKey: topology.kubernetes.io/zone
      whenUnsatisfiable: ScheduleAnyway
      labelSelector:
        matchLabels:
          app.kubernetes.io/name: volume-gate
          app.kubernetes.io/component: webhook
  podLabels:
    team: storage
    sidecar.istio.io/inject: "false"
  podAnnotations:
    example.com/owner: storage-team
  extraArgs:
    - --cert-reload-interval=10s
  extraEnv:
    - name: HTTPS_PROXY
      value: http://proxy.example.com:3128
worker:
  replicas: 3
  priorityClassName: worker-high
  nodeSelector:
    pool: system
  tolerations:
    - key: dedicated
      operator: Equal
      value: system
      effect: NoExecute
  affinity:
    podAntiAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        - topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              app.kubernetes.io/name: volume-gate
              app.kubernetes.io/component: worker
  topologySpreadConstraints:
    - maxSkew: 1
      topologyKey: kubernetes.io/hostname
      whenUnsatisfiable: DoNotSchedule
      labelSelector:
        matchLabels:
          app.kubernetes.io/name: volume-gate
          app.kubernetes.io/component: worker
  podLabels:
    team: platform
  podAnnotations:
    example.com/owner: platform-team
  extraArgs:
    - --retry-base=1m
    - --lease-duration=20s
  extraEnv:
    - name: RUST_BACKTRACE
      value: "1"
    - name: NODE_NAME
      valueFrom:
        fieldRef:
          fieldPath: spec.nodeName
"#;

/// `yaml` as a values file: the directory that holds it, and its path.
fn values_file(yaml: &str) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("values.yaml");
    std::fs::write(&file, yaml).unwrap();
    let path = file.to_str().unwrap().to_string();
    (dir, path)
}

/// `helm template` with the values file `yaml`, then `sets`: the documents,
/// or helm's error output.
fn try_render(ns: &str, yaml: &str, sets: &[&str]) -> Result<BTreeMap<Key, Value>, String> {
    let (_dir, file) = values_file(yaml);
    let mut a = vec![
        "template",
        "volume-gate",
        CHART,
        "--namespace",
        ns,
        "-f",
        &file,
    ];
    for s in sets {
        a.extend(["--set", s]);
    }
    let out = helm(&a);
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(&String::from_utf8(out.stdout).unwrap()).expect("YAML");
    Ok(docs
        .into_iter()
        .filter(|d| !d.is_null())
        .map(|d| (common::chart::key(&d), d))
        .collect())
}

fn render(ns: &str, yaml: &str, sets: &[&str]) -> BTreeMap<Key, Value> {
    try_render(ns, yaml, sets).unwrap_or_else(|e| panic!("helm template: {e}"))
}

/// The Pod specs the chart renders: each role's, and the uninstall hook's.
fn pod_specs(docs: &BTreeMap<Key, Value>, ns: &str) -> [(&'static str, Value); 3] {
    let pod = |kind: &str, name: &str| get(docs, kind, ns, name)["spec"]["template"].clone();
    [
        ("webhook", pod("Deployment", "volume-gate-webhook")),
        ("worker", pod("Deployment", "volume-gate-worker")),
        ("uninstall", pod("Job", "volume-gate-uninstall")),
    ]
}

/// The part of the values file `EVERY_KNOB` under `path` (`/worker/affinity`).
fn knob(path: &str) -> Value {
    let values: Value = serde_saphyr::from_str(EVERY_KNOB).unwrap();
    values
        .pointer(path)
        .unwrap_or_else(|| panic!("{path} in EVERY_KNOB"))
        .clone()
}

#[test]
fn the_registry_override_and_pull_secrets_reach_every_pod() {
    let ns = "volume-gate";
    // Default: ghcr.io, no pull secret.
    for (role, pod) in pod_specs(&template(ns, &[]), ns) {
        let spec = &pod["spec"];
        assert_eq!(
            spec["containers"][0]["image"], "ghcr.io/cozystack/volume-gate:0.1.0",
            "{role}"
        );
        assert!(spec["imagePullSecrets"].is_null(), "{role}: {spec}");
    }
    let docs = render(ns, EVERY_KNOB, &[]);
    for (role, pod) in pod_specs(&docs, ns) {
        let spec = &pod["spec"];
        assert_eq!(
            spec["containers"][0]["image"],
            "mirror.example.com:5000/ghcr/cozystack/volume-gate:0.1.0",
            "{role}"
        );
        assert_eq!(
            spec["imagePullSecrets"],
            json!([{"name": "mirror-pull"}]),
            "{role}"
        );
    }
    // An empty registry: the repository alone, pinned as before.
    let digest = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let docs = template(
        ns,
        &[
            "image.registry=",
            "image.repository=volume-gate",
            &format!("image.digest={digest}"),
        ],
    );
    for (role, pod) in pod_specs(&docs, ns) {
        assert_eq!(
            pod["spec"]["containers"][0]["image"],
            format!("volume-gate:0.1.0@{digest}"),
            "{role}"
        );
    }
}

#[test]
fn scheduling_values_reach_each_roles_pods_and_the_uninstall_hook_runs_where_the_worker_does() {
    let ns = "volume-gate";
    // Default: no priority, selector or toleration; replicas spread over
    // nodes by a preferred anti-affinity on the role's own labels.
    for (role, pod) in pod_specs(&template(ns, &[]), ns) {
        let spec = &pod["spec"];
        for k in [
            "priorityClassName",
            "nodeSelector",
            "tolerations",
            "topologySpreadConstraints",
        ] {
            assert!(spec[k].is_null(), "{role}: {k} by default: {}", spec[k]);
        }
        if role == "uninstall" {
            assert!(spec["affinity"].is_null(), "one Pod: nothing to spread");
            continue;
        }
        let term = &spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
            [0]["podAffinityTerm"];
        assert_eq!(term["topologyKey"], "kubernetes.io/hostname", "{role}");
        assert_eq!(
            term["labelSelector"]["matchLabels"],
            json!({"app.kubernetes.io/name": "volume-gate", "app.kubernetes.io/component": role}),
            "{role}"
        );
    }
    // Set: each role's own, the default affinity replaced; the hook as
    // the worker, but for the spread.
    let docs = render(ns, EVERY_KNOB, &[]);
    for (role, pod) in pod_specs(&docs, ns) {
        let spec = &pod["spec"];
        let from = if role == "webhook" {
            "webhook"
        } else {
            "worker"
        };
        for k in [
            "priorityClassName",
            "nodeSelector",
            "tolerations",
            "affinity",
        ] {
            assert_eq!(spec[k], knob(&format!("/{from}/{k}")), "{role}: {k}");
        }
        let spread = &spec["topologySpreadConstraints"];
        if role == "uninstall" {
            assert!(spread.is_null(), "the hook's one Pod is not spread");
        } else {
            assert_eq!(*spread, knob(&format!("/{role}/topologySpreadConstraints")));
        }
    }
    // The worker's affinity alone replaces the worker's default (and is
    // the hook's); the webhook keeps its own.
    let docs = render(
        ns,
        "worker:\n  affinity:\n    nodeAffinity:\n      preferredDuringSchedulingIgnoredDuringExecution:\n        - weight: 1\n          preference:\n            matchExpressions: [{key: pool, operator: In, values: [system]}]\n",
        &[],
    );
    let [(_, webhook), (_, worker), (_, hook)] = pod_specs(&docs, ns);
    assert!(!webhook["spec"]["affinity"]["podAntiAffinity"].is_null());
    for spec in [&worker["spec"], &hook["spec"]] {
        assert!(spec["affinity"]["podAntiAffinity"].is_null(), "{spec}");
        assert_eq!(
            spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
                ["weight"],
            1
        );
    }
}

#[test]
fn pod_labels_and_annotations_reach_the_pods_and_a_selector_label_is_refused() {
    let ns = "volume-gate";
    let docs = render(ns, EVERY_KNOB, &["profile=name: acme"]);
    for role in ["webhook", "worker"] {
        let d = get(&docs, "Deployment", ns, &format!("volume-gate-{role}"));
        let meta = &d["spec"]["template"]["metadata"];
        for (k, v) in knob(&format!("/{role}/podLabels")).as_object().unwrap() {
            assert_eq!(&meta["labels"][k], v, "{role}: podLabels {k}");
        }
        for (k, v) in knob(&format!("/{role}/podAnnotations"))
            .as_object()
            .unwrap()
        {
            assert_eq!(&meta["annotations"][k], v, "{role}: podAnnotations {k}");
        }
        // The chart's own annotation is kept beside them.
        assert!(!meta["annotations"]["checksum/profile"].is_null(), "{role}");
        // The selector is as it was, and still selects the Pods.
        let selector = &d["spec"]["selector"]["matchLabels"];
        assert_eq!(
            *selector,
            json!({"app.kubernetes.io/name": "volume-gate", "app.kubernetes.io/component": role})
        );
        for (k, v) in selector.as_object().unwrap() {
            assert_eq!(
                &meta["labels"][k], v,
                "{role}: the selector selects its Pods"
            );
        }
        // The Deployment's own labels are not the Pods'.
        assert!(d["metadata"]["labels"]["team"].is_null(), "{role}");
    }
    // None by default.
    let plain = template(ns, &[]);
    let meta = &get(&plain, "Deployment", ns, "volume-gate-worker")["spec"]["template"]["metadata"];
    assert!(meta["annotations"].is_null(), "{meta}");
    // A key that would change what the selector matches is refused, naming it.
    for (role, key) in [
        ("webhook", "app.kubernetes.io/component"),
        ("worker", "app.kubernetes.io/name"),
    ] {
        let err = try_render(
            ns,
            &format!("{role}:\n  podLabels:\n    {key}: other\n"),
            &[],
        )
        .expect_err("refused");
        for w in [
            format!("{role}.podLabels"),
            format!("{key:?}"),
            "selector".into(),
            "use another key".into(),
        ] {
            assert!(err.contains(&w), "{role} {key}: {w:?} not in {err}");
        }
    }
}

#[test]
fn extra_args_and_env_are_appended_to_each_roles_container() {
    let ns = "volume-gate";
    let plain = template(ns, &[]);
    let docs = render(ns, EVERY_KNOB, &[]);
    for role in ["webhook", "worker"] {
        let deployment = format!("volume-gate-{role}");
        let before = container(&plain, ns, &deployment);
        let after = container(&docs, ns, &deployment);
        // The chart's arguments, then the extra ones, in order.
        let extra: Vec<String> = knob(&format!("/{role}/extraArgs"))
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .collect();
        let (a, b) = (args(after), args(before));
        assert_eq!(a[..b.len()], b[..], "{role}");
        assert_eq!(a[b.len()..], extra[..], "{role}");
        let env = after["env"].as_array().unwrap();
        let base = before["env"].as_array().unwrap();
        assert_eq!(env[..base.len()], base[..], "{role}");
        assert_eq!(
            Value::Array(env[base.len()..].to_vec()),
            knob(&format!("/{role}/extraEnv")),
            "{role}"
        );
    }
    // The extra arguments are flags the binary has: the chart passes them
    // through, `volume-gate <role> --help` must know them.
    for (role, flag) in [
        ("webhook", "--cert-reload-interval"),
        ("worker", "--retry-base"),
        ("worker", "--lease-duration"),
    ] {
        let help = Command::new(binary())
            .args([role, "--help"])
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&help.stdout).contains(flag),
            "{role} {flag}"
        );
    }
}

#[test]
fn every_object_carries_the_standard_labels_and_the_selectors_are_unchanged() {
    let ns = "volume-gate";
    let chart: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(format!("{CHART}/Chart.yaml")).unwrap())
            .unwrap();
    let version = chart["version"].as_str().unwrap();
    let app_version = chart["appVersion"].as_str().unwrap();
    let release = |component: Option<&str>| {
        let mut l = json!({
            "app.kubernetes.io/name": "volume-gate",
            "helm.sh/chart": format!("volume-gate-{version}"),
            "app.kubernetes.io/instance": "volume-gate",
            "app.kubernetes.io/version": app_version,
            "app.kubernetes.io/managed-by": "Helm",
        });
        if let Some(c) = component {
            l["app.kubernetes.io/component"] = json!(c);
        }
        l
    };
    // Every object of both certificate modes, the profile and the hooks.
    let mut all = template(ns, &["profile=name: acme"]);
    all.extend(template(
        ns,
        &[
            "certificates.mode=secret",
            &format!("certificates.caBundle={CA}"),
        ],
    ));
    assert!(all.len() >= 25, "{:?}", all.keys());
    for (k, d) in &all {
        let labels = d["metadata"]["labels"].as_object().unwrap();
        let component = labels
            .get("app.kubernetes.io/component")
            .map(|c| c.as_str().unwrap());
        assert_eq!(
            d["metadata"]["labels"],
            release(component),
            "{k:?}: the standard labels, and no others"
        );
        if let Some(pod) = d.pointer("/spec/template/metadata/labels") {
            assert_eq!(*pod, release(component), "{k:?}: its Pods' labels");
        }
    }
    // The selectors are what releases before these labels had: a
    // Deployment's selector cannot change on upgrade.
    let selector = |c: &str| json!({"app.kubernetes.io/name": "volume-gate", "app.kubernetes.io/component": c});
    for c in ["webhook", "worker"] {
        let name = format!("volume-gate-{c}");
        assert_eq!(
            get(&all, "Deployment", ns, &name)["spec"]["selector"],
            json!({"matchLabels": selector(c)})
        );
        assert_eq!(
            get(&all, "PodDisruptionBudget", ns, &name)["spec"]["selector"],
            json!({"matchLabels": selector(c)})
        );
    }
    assert_eq!(
        get(&all, "Service", ns, "volume-gate-webhook")["spec"]["selector"],
        selector("webhook")
    );
    // As the kustomize base has them.
    let base = without_namespace(kustomize("manifests"));
    for (kind, name, path) in [
        ("Deployment", "volume-gate-webhook", "/spec/selector"),
        ("Deployment", "volume-gate-worker", "/spec/selector"),
        ("Service", "volume-gate-webhook", "/spec/selector"),
        (
            "PodDisruptionBudget",
            "volume-gate-webhook",
            "/spec/selector",
        ),
        (
            "PodDisruptionBudget",
            "volume-gate-worker",
            "/spec/selector",
        ),
    ] {
        assert_eq!(
            get(&all, kind, ns, name).pointer(path),
            get(&base, kind, ns, name).pointer(path),
            "{kind} {name}"
        );
    }
}

#[test]
fn the_disruption_budget_evicts_one_pod_at_a_time_and_a_single_replica_has_none() {
    let ns = "volume-gate";
    let pdb = |docs: &BTreeMap<Key, Value>, role: &str| {
        docs.get(&(
            "PodDisruptionBudget".into(),
            ns.into(),
            format!("volume-gate-{role}"),
        ))
        .map(|d| d["spec"].clone())
    };
    let docs = template(ns, &[]);
    for role in ["webhook", "worker"] {
        assert_eq!(
            pdb(&docs, role),
            Some(json!({
                "maxUnavailable": 1,
                "selector": {"matchLabels": {
                    "app.kubernetes.io/name": "volume-gate",
                    "app.kubernetes.io/component": role,
                }},
            })),
            "{role}: replicas 2"
        );
    }
    let docs = template(ns, &["webhook.replicas=1"]);
    assert_eq!(pdb(&docs, "webhook"), None, "one webhook replica");
    assert!(pdb(&docs, "worker").is_some(), "the worker keeps its");
    let docs = template(ns, &["worker.replicas=1"]);
    assert_eq!(pdb(&docs, "worker"), None, "one worker replica");
    assert!(pdb(&docs, "webhook").is_some());
    // The old value names what replaced it.
    let err = try_template(ns, &["webhook.minAvailable=1"]).expect_err("refused");
    for w in [
        "webhook.minAvailable",
        "maxUnavailable: 1",
        "remove the value",
    ] {
        assert!(err.contains(w), "{w:?} not in {err}");
    }
}

#[test]
fn the_values_schema_refuses_a_misspelled_or_mistyped_value_naming_it() {
    let ns = "volume-gate";
    for (sets, wanted) in [
        (&["webhook.replica=3"][..], &["replica", "webhook"][..]),
        (
            &["worker.nodeSelecter.pool=system"],
            &["nodeSelecter", "worker"],
        ),
        (
            &["image.registery=mirror.example.com"],
            &["registery", "image"],
        ),
        (&["imagePullSecret[0].name=x"], &["imagePullSecret"]),
        (
            &["monitoring.prometheusRule.blockedFor=30m"],
            &["blockedFor"],
        ),
        (&["webhook.replicas=two"], &["replicas", "integer"]),
        (&["worker.tolerations=none"], &["tolerations", "array"]),
        (
            &["monitoring.prometheusRule.certificateWarnDays=0"],
            &["certificateWarnDays"],
        ),
    ] {
        let err = try_template(ns, sets).expect_err("refused");
        assert!(err.contains("schema"), "{sets:?}: not the schema: {err}");
        for w in wanted {
            assert!(err.contains(w), "{sets:?}: {w:?} not in {err}");
        }
    }
    // Free-form maps take any key.
    let docs = template(
        ns,
        &[
            "worker.nodeSelector.any\\.key/x=y",
            "webhook.podAnnotations.anything=z",
            "webhook.resources.limits.cpu=1",
        ],
    );
    assert_eq!(
        get(&docs, "Deployment", ns, "volume-gate-worker")["spec"]["template"]["spec"]["nodeSelector"],
        json!({"any.key/x": "y"})
    );
}

/// Every webhook of a rendering's configuration `kind`, by name.
fn webhooks<'a>(docs: &'a BTreeMap<Key, Value>, kind: &str) -> BTreeMap<&'a str, &'a Value> {
    get(docs, kind, "", "volume-gate")["webhooks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["name"].as_str().unwrap(), w))
        .collect()
}

/// Every CEL expression of a rendering's webhook conditions.
fn expressions(docs: &BTreeMap<Key, Value>) -> Vec<String> {
    WEBHOOK_CONFIGURATIONS
        .iter()
        .flat_map(|kind| webhooks(docs, kind).into_values())
        .flat_map(|w| w["matchConditions"].as_array().cloned().unwrap_or_default())
        .map(|c| c["expression"].as_str().unwrap().to_string())
        .collect()
}

/// What can go wrong when a template writes CEL, checked without an API
/// server: a template action left in, unbalanced brackets or quotes, an
/// operator with no operand, or a bare name that is none of the variables
/// an admission condition has (`object`, `oldObject`, `request`), a macro's
/// own variable, or CEL's (`has`, `in`, `null`, `true`, `false`). A name
/// after `.` or `.?` is a field or a method, any name.
fn cel_shape(expr: &str) -> Result<(), String> {
    if expr.contains("{{") || expr.contains("}}") {
        return Err("a template action was left in".into());
    }
    let mut bound: BTreeSet<String> = ["object", "oldObject", "request", "has", "in", "null"]
        .into_iter()
        .chain(["true", "false"])
        .map(str::to_string)
        .collect();
    for macro_ in [".exists(", ".all(", ".map(", ".filter("] {
        for (i, _) in expr.match_indices(macro_) {
            let var: String = expr[i + macro_.len()..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            bound.insert(var);
        }
    }
    let mut open = Vec::new();
    let chars: Vec<char> = expr.chars().collect();
    let mut i = 0;
    let mut last = ' ';
    while i < chars.len() {
        let c = chars[i];
        match c {
            '\'' => {
                let end = chars[i + 1..]
                    .iter()
                    .position(|&c| c == '\'')
                    .ok_or("an unterminated string")?;
                i += end + 2;
                last = '\'';
                continue;
            }
            '(' | '[' | '{' => open.push(c),
            ')' | ']' | '}' => {
                let want = match c {
                    ')' => '(',
                    ']' => '[',
                    _ => '{',
                };
                if open.pop() != Some(want) {
                    return Err(format!("an unbalanced {c:?} at {i}"));
                }
            }
            c if c.is_alphabetic() || c == '_' => {
                let word: String = chars[i..]
                    .iter()
                    .take_while(|c| c.is_alphanumeric() || **c == '_')
                    .collect();
                let selected = last == '.' || (last == '?' && i >= 2 && chars[i - 2] == '.');
                if !selected && !bound.contains(&word) {
                    return Err(format!("{word:?} is no variable of an admission condition"));
                }
                i += word.chars().count();
                last = 'a';
                continue;
            }
            _ => {}
        }
        if !c.is_whitespace() {
            last = c;
        }
        i += 1;
    }
    if !open.is_empty() {
        return Err(format!("{open:?} never closed"));
    }
    let squeezed: String = expr.split_whitespace().collect::<Vec<_>>().join(" ");
    for bad in [
        "|| ||", "&& &&", "|| &&", "&& ||", "( ||", "( &&", "|| )", "&& )",
    ] {
        if squeezed.contains(bad) {
            return Err(format!("an operator without an operand: {bad:?}"));
        }
    }
    if ["||", "&&", "!"].iter().any(|o| squeezed.ends_with(o))
        || ["||", "&&"].iter().any(|o| squeezed.starts_with(o))
    {
        return Err("an operator without an operand at an end".into());
    }
    Ok(())
}

#[test]
fn the_cel_shape_check_finds_what_a_template_can_break() {
    // Every condition of both platforms' renderings passes it ...
    for sets in [&[][..], &["platform.profile=cluster-api"][..]] {
        for e in expressions(&template("volume-gate", sets)) {
            cel_shape(&e).unwrap_or_else(|why| panic!("{sets:?}: {why}: {e}"));
        }
    }
    // ... and it refuses what a broken template writes.
    for broken in [
        "oldObject.metadata.name.endsWith('-kubeconfig'",
        "oldObject.metadata.name.endsWith('-kubeconfig)",
        "request.operation == 'DELETE' ||",
        "request.operation == 'DELETE' || || true",
        "obj.metadata.name == ''",
        "object.metadata.name == '{{ .name }}'",
        "[object, oldObject].exists(o, x != null)",
    ] {
        assert!(cel_shape(broken).is_err(), "{broken}");
    }
    cel_shape("[object, oldObject].exists(o, o != null && o.spec.?x.orValue('') != '')").unwrap();
}

/// The webhook shape every webhook of the gate has, whatever the platform:
/// the Service, the CA, the failure policy, the timeout.
fn assert_same_care(w: &Value, policy: &str, path: &str, ns: &str, ca: Option<&str>) {
    let name = &w["name"];
    assert_eq!(w["failurePolicy"], policy, "{name}");
    assert_eq!(w["sideEffects"], "None", "{name}");
    assert_eq!(w["matchPolicy"], "Equivalent", "{name}");
    assert_eq!(w["admissionReviewVersions"], json!(["v1"]), "{name}");
    assert_eq!(w["timeoutSeconds"], 7, "{name}");
    let mut client = json!({"service": {"name": "volume-gate-webhook", "namespace": ns,
        "path": path, "port": 443}});
    if let Some(ca) = ca {
        client["caBundle"] = json!(ca);
    }
    assert_eq!(w["clientConfig"], client, "{name}");
}

#[test]
fn for_cluster_api_the_chart_sends_the_gate_what_the_profile_judges_and_nothing_of_flux() {
    use volume_gate::profile::{CLUSTER_API_OPT_IN, Profile};
    let p = Profile::cluster_api();
    let ns = "capi-volume-gate";
    let capi = ["platform.profile=cluster-api", "webhook.timeoutSeconds=7"];
    let cozy = template(ns, &["webhook.timeoutSeconds=7"]);
    let ca_bundle = format!("certificates.caBundle={CA}");
    let secret = [&capi[..], &["certificates.mode=secret", &ca_bundle]].concat();
    for (sets, ca) in [(&capi[..], None), (&secret[..], Some(CA))] {
        let docs = template(ns, sets);
        let validating = webhooks(&docs, "ValidatingWebhookConfiguration");
        let mutating = webhooks(&docs, "MutatingWebhookConfiguration");
        assert_eq!(
            validating.keys().copied().collect::<Vec<_>>(),
            [
                "kubeconfigs.volume-gate.cozystack.io",
                "machines.volume-gate.cozystack.io",
                "parents.volume-gate.cozystack.io",
                "references.volume-gate.cozystack.io",
            ],
        );
        assert_eq!(
            mutating.keys().copied().collect::<Vec<_>>(),
            [
                "custody.volume-gate.cozystack.io",
                "kept-disks.volume-gate.cozystack.io"
            ],
        );
        for w in validating.values() {
            assert_same_care(w, "Fail", "/validate", ns, ca);
        }
        assert_same_care(
            mutating["custody.volume-gate.cozystack.io"],
            "Ignore",
            "/mutate",
            ns,
            ca,
        );
        assert_same_care(
            mutating["kept-disks.volume-gate.cozystack.io"],
            "Fail",
            "/mutate",
            ns,
            ca,
        );
        for kind in WEBHOOK_CONFIGURATIONS {
            let doc = get(&docs, kind, "", "volume-gate");
            let injected = &doc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"];
            match ca {
                None => assert_eq!(injected, &json!(format!("{ns}/volume-gate-webhook"))),
                Some(_) => assert!(injected.is_null(), "{kind}"),
            }
        }
        // Nothing of Flux, Kamaji, the infra layer or a name prefix.
        let text = serde_json::to_string(&[
            &get(&docs, "ValidatingWebhookConfiguration", "", "volume-gate")["webhooks"],
            &get(&docs, "MutatingWebhookConfiguration", "", "volume-gate")["webhooks"],
        ])
        .unwrap();
        for foreign in [
            "helm.toolkit.fluxcd.io",
            "helmreleases",
            "kamaji",
            "cdi.kubevirt.io",
            "kubernetes-",
            "apps.cozystack.io",
            "namespace-controller",
            "-kcsi",
            "meta.helm.sh",
        ] {
            assert!(
                !text.contains(foreign),
                "{foreign} in the cluster-api webhooks"
            );
        }
    }

    let docs = template(ns, &capi);
    let validating = webhooks(&docs, "ValidatingWebhookConfiguration");
    let mutating = webhooks(&docs, "MutatingWebhookConfiguration");
    let rule = |w: &Value| -> Vec<(Vec<String>, Vec<String>, Vec<String>)> {
        let strings = |v: &Value| -> Vec<String> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_string())
                .collect()
        };
        w["rules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    strings(&r["apiGroups"]),
                    strings(&r["resources"]),
                    strings(&r["operations"]),
                )
            })
            .collect()
    };
    let strings = |xs: &[&str]| xs.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let opted_in = json!({"matchLabels": p.parent.match_labels});
    assert_eq!(
        opted_in,
        json!({"matchLabels": {CLUSTER_API_OPT_IN: "true"}})
    );

    // The parents: the profile's parent kind, opted in by its label.
    let parents = validating["parents.volume-gate.cozystack.io"];
    assert_eq!(
        rule(parents),
        [(
            vec![p.parent.group.clone()],
            vec![p.parent.plural.clone()],
            strings(&["CREATE", "UPDATE", "DELETE"])
        )]
    );
    assert_eq!(parents["objectSelector"], opted_in);
    // DELETE and CREATE as Cozystack's parents; the UPDATE names the
    // reference fields the profile follows and the opt-in label.
    for c in ["delete-without-custody", "create-with-record"] {
        assert_eq!(
            condition(
                &docs,
                "ValidatingWebhookConfiguration",
                "parents.volume-gate.cozystack.io",
                c
            ),
            condition(
                &cozy,
                "ValidatingWebhookConfiguration",
                "parents.volume-gate.cozystack.io",
                c
            ),
        );
    }
    let update = condition(
        &docs,
        "ValidatingWebhookConfiguration",
        "parents.volume-gate.cozystack.io",
        "update-of-record-custody-opt-in-or-reference",
    );
    for field in volume_gate::profile::REFERENCE_FIELDS {
        let name = field.rsplit('/').next().unwrap();
        assert!(update.contains(&format!("'{name}'")), "{field} in {update}");
    }
    assert!(
        update.contains(&format!("'{CLUSTER_API_OPT_IN}'")),
        "{update}"
    );

    // The machines: every kind the profile guards by spec.clusterName and
    // by the cluster-name label, with Cozystack's conditions.
    let machines = validating["machines.volume-gate.cozystack.io"];
    let guarded = |f: &dyn Fn(&volume_gate::profile::GuardedSpec) -> bool| -> BTreeSet<String> {
        p.guarded
            .iter()
            .filter(|g| f(g))
            .map(|g| format!("{}s", g.kind.to_lowercase()))
            .collect()
    };
    let by_field = guarded(&|g| g.field.is_some());
    assert_eq!(by_field, guarded(&|g| g.label.is_some()));
    let machine_rules = rule(machines);
    let [(groups, resources, operations)] = &machine_rules[..] else {
        panic!("one rule: {machines}")
    };
    assert_eq!(groups, &strings(&["cluster.x-k8s.io"]));
    assert_eq!(resources.iter().cloned().collect::<BTreeSet<_>>(), by_field);
    assert_eq!(operations, &strings(&["UPDATE", "DELETE"]));
    assert_eq!(
        machines["matchConditions"],
        webhooks(&cozy, "ValidatingWebhookConfiguration")["machines.volume-gate.cozystack.io"]["matchConditions"]
    );

    // Whatever a reference names: every DELETE of the groups the profile
    // follows references into, any kind.
    let referenced: BTreeSet<String> = p
        .guarded
        .iter()
        .filter(|g| g.reference.is_some())
        .map(|g| g.group.clone())
        .collect();
    let references = validating["references.volume-gate.cozystack.io"];
    let reference_rules = rule(references);
    let [(groups, resources, operations)] = &reference_rules[..] else {
        panic!("one rule: {references}")
    };
    assert_eq!(groups.iter().cloned().collect::<BTreeSet<_>>(), referenced);
    assert_eq!(resources, &strings(&["*"]));
    assert_eq!(operations, &strings(&["DELETE"]));
    assert!(references["matchConditions"].is_null());
    assert!(references["objectSelector"].is_null());

    // The kubeconfig Secret, by the name the profile gives it.
    let suffix = p.kubeconfig.secret_name.replace("{tenant}", "");
    assert_eq!(
        rule(validating["kubeconfigs.volume-gate.cozystack.io"]),
        [(strings(&[""]), strings(&["secrets"]), strings(&["DELETE"]))]
    );
    assert_eq!(
        condition(
            &docs,
            "ValidatingWebhookConfiguration",
            "kubeconfigs.volume-gate.cozystack.io",
            "cluster-kubeconfig"
        ),
        format!("oldObject.metadata.name.endsWith('{suffix}')")
    );

    // Custody on the Clusters opted in; the kept disks as for Cozystack.
    let custody = mutating["custody.volume-gate.cozystack.io"];
    assert_eq!(
        rule(custody),
        [(
            vec![p.parent.group.clone()],
            vec![p.parent.plural.clone()],
            strings(&["CREATE", "UPDATE"])
        )]
    );
    assert_eq!(custody["objectSelector"], opted_in);
    assert!(
        condition(
            &docs,
            "MutatingWebhookConfiguration",
            "custody.volume-gate.cozystack.io",
            "custody-missing-override-changed-or-replaced"
        )
        .contains("request.userInfo.username in []"),
        "no one replaces a Cluster unless the profile says so"
    );
    assert_eq!(
        mutating["kept-disks.volume-gate.cozystack.io"],
        webhooks(&cozy, "MutatingWebhookConfiguration")["kept-disks.volume-gate.cozystack.io"]
    );

    // Every quoted name in the conditions is the profile's (or an
    // operation's), and every name they must send by is there.
    let keys = volume_gate::record::Keys::new(&p.annotation_prefix);
    let mut names: BTreeSet<String> = [
        p.custody_finalizer.clone(),
        p.annotation_prefix.clone(),
        format!("{}override", p.annotation_prefix),
        suffix.clone(),
        keys.kept_acknowledged.clone(),
        keys.kept_acknowledged_by.clone(),
        keys.kept_acknowledged_at.clone(),
    ]
    .into();
    names.extend(p.parent.match_labels.keys().cloned());
    names.extend(p.guarded.iter().filter_map(|g| g.label.clone()));
    names.extend(
        volume_gate::profile::REFERENCE_FIELDS.map(|f| f.rsplit('/').next().unwrap().to_string()),
    );
    let quoted: BTreeSet<String> = expressions(&docs)
        .iter()
        .flat_map(|e| {
            e.split('\'')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .filter(|q| !["CREATE", "UPDATE", "DELETE", ""].contains(&q.as_str()))
        .collect();
    assert_eq!(quoted, names, "the names the cluster-api conditions use");
}

#[test]
fn for_cluster_api_the_profile_configmap_is_the_cluster_api_profile_and_every_role_reads_it() {
    use volume_gate::profile::Profile;
    let ns = "volume-gate";
    let shipped = |docs: &BTreeMap<Key, Value>| {
        let text = get(docs, "ConfigMap", ns, "volume-gate-profile")["data"]["profile.yaml"]
            .as_str()
            .unwrap()
            .to_string();
        Profile::from_yaml(&text).unwrap_or_else(|e| panic!("{e}:\n{text}"))
    };
    let docs = template(ns, &["platform.profile=cluster-api"]);
    assert_eq!(shipped(&docs), Profile::cluster_api());
    let profile_arg = "--profile=/etc/volume-gate/profile/profile.yaml".to_string();
    for (role, pod) in pod_specs(&docs, ns) {
        let c = &pod["spec"]["containers"][0];
        assert!(args(c).contains(&profile_arg), "{role}: {:?}", args(c));
        assert!(
            pod["spec"]["volumes"]
                .as_array()
                .unwrap()
                .iter()
                .any(|v| v["configMap"]["name"] == "volume-gate-profile"),
            "{role} mounts the profile"
        );
    }
    // Cozystack's identities are not passed: the profile's writers say.
    let a = args(container(&docs, ns, "volume-gate-webhook"));
    for flag in [
        "--release-controller",
        "--parent-source-writer",
        "--parent-replacer",
    ] {
        assert!(flag_values(&a, flag).is_empty(), "{flag} in {a:?}");
    }
    // The profile value's fields go over the Cluster API profile, as a
    // string or as a mapping; its writers reach the custody condition.
    let replacer = "system:serviceaccount:gitops:applier";
    // One list named: the others are the Cluster API profile's (none),
    // never Cozystack's identities.
    let writers = format!("{{parentReplacers: ['{replacer}']}}");
    let mut want = Profile::cluster_api();
    want.name = "acme-capi".into();
    want.writers.parent_replacers = vec![replacer.into()];
    for docs in [
        render(
            ns,
            &format!(
                "platform: {{profile: cluster-api}}\nprofile: \"name: acme-capi\\nwriters: {writers}\"\n"
            ),
            &[],
        ),
        render(
            ns,
            &format!(
                "platform: {{profile: cluster-api}}\nprofile:\n  name: acme-capi\n  writers: {writers}\n"
            ),
            &[],
        ),
    ] {
        assert_eq!(shipped(&docs), want);
        assert!(
            condition(
                &docs,
                "MutatingWebhookConfiguration",
                "custody.volume-gate.cozystack.io",
                "custody-missing-override-changed-or-replaced"
            )
            .contains(&format!("in ['{replacer}']"))
        );
    }
    // A profile value whose base is the other platform is refused, naming
    // the fix; as is a platform the chart does not know.
    for (sets, wanted) in [
        (
            &["platform.profile=cluster-api", "profile=base: cozystack"][..],
            &["base: cozystack", "platform.profile=cozystack"][..],
        ),
        (
            &["profile=base: cluster-api"][..],
            &["base: cluster-api", "platform.profile=cluster-api"][..],
        ),
        (&["platform.profile=capi"][..], &["platform", "profile"][..]),
    ] {
        let err = try_template(ns, sets).expect_err("refused");
        for w in wanted {
            assert!(err.contains(w), "{sets:?}: {w:?} not in {err}");
        }
    }
    for (writers, wanted) in [(
        "{releaseControllers: [], parentSources: [], parentReplacers: [\"it's\"]}",
        &["parentReplacers", "quote"][..],
    )] {
        let yaml = format!("platform: {{profile: cluster-api}}\nprofile:\n  writers: {writers}\n");
        let err = try_render(ns, &yaml, &[]).expect_err("refused");
        for w in wanted {
            assert!(err.contains(w), "{writers}: {w:?} not in {err}");
        }
    }
}

/// A ClusterRole's rules as (group, resource) -> verbs.
fn grants(docs: &BTreeMap<Key, Value>, name: &str) -> BTreeMap<(String, String), BTreeSet<String>> {
    let mut out: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    for r in get(docs, "ClusterRole", "", name)["rules"]
        .as_array()
        .unwrap()
    {
        for g in r["apiGroups"].as_array().unwrap() {
            for res in r["resources"].as_array().unwrap() {
                out.entry((g.as_str().unwrap().into(), res.as_str().unwrap().into()))
                    .or_default()
                    .extend(
                        r["verbs"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|v| v.as_str().unwrap().to_string()),
                    );
            }
        }
    }
    out
}

#[test]
fn for_cluster_api_each_role_may_do_only_what_it_does_there() {
    let ns = "volume-gate";
    let mut docs = template(ns, &["platform.profile=cluster-api"]);
    let hooks = take_hooks(&mut docs);
    let verbs = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    let key = |g: &str, r: &str| (g.to_string(), r.to_string());
    let clusters = key("cluster.x-k8s.io", "clusters");
    let webhook = grants(&docs, "volume-gate-webhook");
    assert_eq!(
        webhook,
        BTreeMap::from([
            (clusters.clone(), verbs(&["get", "list"])),
            (key("", "namespaces"), verbs(&["get"])),
            (
                key("authorization.k8s.io", "subjectaccessreviews"),
                verbs(&["create"])
            ),
        ])
    );
    let worker = grants(&docs, "volume-gate-worker");
    assert_eq!(
        worker,
        BTreeMap::from([
            (clusters.clone(), verbs(&["get", "list", "watch", "patch"])),
            (key("", "namespaces"), verbs(&["list", "watch"])),
            (key("", "secrets"), verbs(&["get"])),
            (key("", "persistentvolumes"), verbs(&["list", "watch"])),
            (
                key("snapshot.storage.k8s.io", "volumesnapshotcontents"),
                verbs(&["list"])
            ),
            (key("events.k8s.io", "events"), verbs(&["create", "patch"])),
        ])
    );
    let uninstall = grants(&hooks, "volume-gate-uninstall");
    assert_eq!(uninstall[&clusters], verbs(&["list", "patch"]));
    assert!(
        !uninstall.keys().any(|(g, _)| g == "helm.toolkit.fluxcd.io"),
        "{uninstall:?}"
    );
    // An infra layer the profile names brings its rules (and the worker's
    // management-side disk, claim, snapshot and Pod rules) back.
    let with_infra = render(
        ns,
        "platform: {profile: cluster-api}\nprofile:\n  infra: {group: cdi.kubevirt.io, version: v1beta1, kind: DataVolume,\n    plural: datavolumes, labels: {cluster.x-k8s.io/cluster-name: \"{tenant}\"}}\n",
        &[],
    );
    let worker = grants(&with_infra, "volume-gate-worker");
    assert_eq!(
        worker[&key("cdi.kubevirt.io", "datavolumes")],
        verbs(&["list", "delete"])
    );
    assert_eq!(worker[&key("", "pods")], verbs(&["list", "delete"]));
    assert_eq!(
        worker[&key("", "persistentvolumes")],
        verbs(&["list", "watch", "patch"])
    );
    // Cozystack's roles are unchanged: parents are HelmReleases.
    let cozy = template(ns, &[]);
    assert!(
        grants(&cozy, "volume-gate-webhook")
            .contains_key(&key("helm.toolkit.fluxcd.io", "helmreleases"))
    );
    assert!(!grants(&cozy, "volume-gate-worker").contains_key(&clusters));
}

#[test]
fn for_cluster_api_the_management_side_csi_controller_knob_guards_it_its_identity_and_its_disks() {
    use volume_gate::profile::{GuardedSpec, InfraSpec, Profile};
    let ns = "volume-gate";
    let on = [
        "platform.profile=cluster-api",
        "platform.clusterApi.managementCsi.enabled=true",
        // assert_same_care's timeout.
        "webhook.timeoutSeconds=7",
    ];
    let docs = template(ns, &on);

    // The profile: Cluster API's, with the controller and its identity
    // guarded by name and the DataVolumes of kubevirt-csi-driver's
    // --infra-cluster-labels as the infra layer.
    let text = get(&docs, "ConfigMap", ns, "volume-gate-profile")["data"]["profile.yaml"]
        .as_str()
        .unwrap()
        .to_string();
    let shipped = Profile::from_yaml(&text).unwrap_or_else(|e| panic!("{e}:\n{text}"));
    let mut want = Profile::cluster_api();
    let entry = |role: &str, group: &str, kind: &str, name: &str| GuardedSpec {
        role: role.into(),
        group: group.into(),
        kind: kind.into(),
        name: Some(name.into()),
        label: None,
        field: None,
        reference: None,
    };
    let identity = "the identity the cluster's CSI controller frees disks with";
    want.guarded.extend([
        entry(
            "the cluster's CSI controller, which frees its volumes from the management cluster",
            "apps",
            "Deployment",
            "{tenant}-kubevirt-csi-controller",
        ),
        entry(identity, "", "ServiceAccount", "{tenant}-kubevirt-csi"),
        entry(
            identity,
            "rbac.authorization.k8s.io",
            "Role",
            "{tenant}-kubevirt-csi",
        ),
        entry(
            identity,
            "rbac.authorization.k8s.io",
            "RoleBinding",
            "{tenant}-kubevirt-csi",
        ),
    ]);
    want.infra = Some(InfraSpec {
        labels: BTreeMap::from([("csi-driver/cluster".into(), "{tenant}".into())]),
        ..InfraSpec::cozystack()
    });
    assert_eq!(shipped, want);

    // The webhooks: Cluster API's, and the two that send the gate the
    // controller's and its identity's DELETEs and its disks'.
    let validating = webhooks(&docs, "ValidatingWebhookConfiguration");
    assert_eq!(
        validating.keys().copied().collect::<Vec<_>>(),
        [
            "infra-disks.volume-gate.cozystack.io",
            "kubeconfigs.volume-gate.cozystack.io",
            "machines.volume-gate.cozystack.io",
            "management-csi.volume-gate.cozystack.io",
            "parents.volume-gate.cozystack.io",
            "references.volume-gate.cozystack.io",
        ],
    );
    for w in validating.values() {
        assert_same_care(w, "Fail", "/validate", ns, None);
    }
    let csi = condition(
        &docs,
        "ValidatingWebhookConfiguration",
        "management-csi.volume-gate.cozystack.io",
        "csi-controller-or-its-identity",
    );
    assert!(
        csi.contains("request.kind.kind == 'Deployment' && (oldObject.metadata.name.endsWith('-kubevirt-csi-controller'))")
            && csi.contains("request.kind.kind != 'Deployment' && (oldObject.metadata.name.endsWith('-kubevirt-csi'))"),
        "{csi}"
    );
    let resources: BTreeSet<String> =
        validating["management-csi.volume-gate.cozystack.io"]["rules"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| r["resources"].as_array().unwrap().clone())
            .map(|r| r.as_str().unwrap().to_string())
            .collect();
    assert_eq!(
        resources,
        ["deployments", "rolebindings", "roles", "serviceaccounts"]
            .map(String::from)
            .into()
    );
    let disks = validating["infra-disks.volume-gate.cozystack.io"];
    assert_eq!(
        disks["objectSelector"],
        json!({"matchExpressions": [{"key": "csi-driver/cluster", "operator": "Exists"}]})
    );
    let cond = condition(
        &docs,
        "ValidatingWebhookConfiguration",
        "infra-disks.volume-gate.cozystack.io",
        "namespace-deletion-or-infra-label-change",
    );
    assert!(
        cond.contains("system:serviceaccount:kube-system:namespace-controller")
            && cond.contains("['csi-driver/cluster'].exists(k"),
        "{cond}"
    );
    for e in expressions(&docs) {
        cel_shape(&e).unwrap_or_else(|err| panic!("{err}: {e}"));
    }

    // The worker may read and free the disks as with any infra layer.
    let worker = grants(&docs, "volume-gate-worker");
    let key = |g: &str, r: &str| (g.to_string(), r.to_string());
    let verbs = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(
        worker[&key("cdi.kubevirt.io", "datavolumes")],
        verbs(&["list", "delete"])
    );
    assert_eq!(worker[&key("", "persistentvolumeclaims")], verbs(&["list"]));
    assert_eq!(worker[&key("", "pods")], verbs(&["list", "delete"]));
    // A change of the knob rolls both roles (the profile they read changed).
    let with = |knob: &str| {
        format!(
            "webhook: {{timeoutSeconds: 7}}\nplatform:\n  profile: cluster-api\n  clusterApi:\n    managementCsi:\n      enabled: true\n{knob}"
        )
    };
    let other = render(ns, &with("      identity: \"{tenant}-csi\"\n"), &[]);
    for (role, pod) in pod_specs(&docs, ns).into_iter().take(2) {
        let sum = &pod["metadata"]["annotations"]["checksum/profile"];
        assert!(sum.is_string(), "{role}");
        let (_, changed) = pod_specs(&other, ns)
            .into_iter()
            .find(|(r, _)| *r == role)
            .unwrap();
        assert_ne!(
            sum, &changed["metadata"]["annotations"]["checksum/profile"],
            "{role}"
        );
    }
    // Other names reach the profile and the conditions.
    let custom = render(
        ns,
        "platform:\n  profile: cluster-api\n  clusterApi:\n    managementCsi:\n      enabled: true\n      controller: csi-{tenant}\n      identity: \"{tenant}-csi\"\n      infraClusterLabels: {acme.io/cluster: \"{tenant}\", acme.io/tier: disks}\n",
        &[],
    );
    let csi = condition(
        &custom,
        "ValidatingWebhookConfiguration",
        "management-csi.volume-gate.cozystack.io",
        "csi-controller-or-its-identity",
    );
    assert!(
        csi.contains("(oldObject.metadata.name.startsWith('csi-'))"),
        "{csi}"
    );
    assert!(
        csi.contains("(oldObject.metadata.name.endsWith('-csi'))"),
        "{csi}"
    );
    let cond = condition(
        &custom,
        "ValidatingWebhookConfiguration",
        "infra-disks.volume-gate.cozystack.io",
        "namespace-deletion-or-infra-label-change",
    );
    assert!(
        cond.contains("['acme.io/cluster', 'acme.io/tier'].exists(k"),
        "{cond}"
    );

    // Off by default; refused on Cozystack, with names that cannot be
    // written into a condition, with labels that name no Cluster, and with
    // a profile value that names infra too.
    let off = webhooks(
        &template(ns, &["platform.profile=cluster-api"]),
        "ValidatingWebhookConfiguration",
    )
    .keys()
    .map(|k| k.to_string())
    .collect::<Vec<_>>();
    assert!(
        !off.iter()
            .any(|k| k.starts_with("management-csi") || k.starts_with("infra-disks")),
        "{off:?}"
    );
    for (sets, wanted) in [
        (
            &["platform.clusterApi.managementCsi.enabled=true"][..],
            &["managementCsi", "platform.profile=cluster-api"][..],
        ),
        (
            &[
                &on[..],
                &["platform.clusterApi.managementCsi.controller=csi-controller"],
            ]
            .concat()[..],
            &["managementCsi.controller", "{tenant}"][..],
        ),
        (
            &[
                &on[..],
                &["platform.clusterApi.managementCsi.infraClusterLabels.acme\\.io/cluster=fixed"],
            ]
            .concat()[..],
            &["infraClusterLabels", "{tenant}"][..],
        ),
        (
            &[&on[..], &["profile=infra: null"]].concat()[..],
            &["profile names infra", "infraClusterLabels"][..],
        ),
    ] {
        let err = try_template(ns, sets).expect_err("refused");
        for w in wanted {
            assert!(err.contains(w), "{sets:?}: {w:?} not in {err}");
        }
    }
    // A name that would break out of its condition's string literal.
    let err = try_render(ns, &with("      identity: \"{tenant}')||true||('\"\n"), &[])
        .expect_err("refused");
    assert!(err.contains("managementCsi.identity"), "{err}");
}
