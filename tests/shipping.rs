//! What ships is what is tested: the kustomize base renders to the files the
//! control-plane tests install, the Deployments' arguments are flags the
//! binary has, the certificate script works against a real API server, and
//! the custody and status commands do what the README says.

use volume_gate_testkit as common;

use std::collections::BTreeMap;
use std::process::Command;

use common::chart::{key, kustomize};
use common::cluster::{control_plane, repo_root};
use common::gate::{binary, helmrelease_resource};
use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
use serde_json::{Value, json};

#[test]
fn the_kustomize_base_renders_exactly_the_documents_the_tests_install() {
    let rendered = kustomize("manifests");
    let shipped: BTreeMap<_, _> = common::manifests::base_documents()
        .into_iter()
        .map(|d| (key(&d), d))
        .collect();
    assert_eq!(
        rendered.keys().collect::<Vec<_>>(),
        shipped.keys().collect::<Vec<_>>(),
        "same objects"
    );
    for (k, doc) in &shipped {
        let mut expected = doc.clone();
        // The base's only transform: the image name and tag.
        if k.0 == "Deployment" {
            for c in expected["spec"]["template"]["spec"]["containers"]
                .as_array_mut()
                .unwrap()
            {
                assert_eq!(c["image"], "volume-gate");
                c["image"] = json!("ghcr.io/cozystack/volume-gate:0.1.0");
            }
        }
        assert_eq!(&rendered[k], &expected, "{k:?} renders as shipped");
    }
}

#[test]
fn the_cert_manager_overlay_injects_the_ca_into_both_webhook_configurations() {
    let rendered = kustomize("manifests/overlays/cert-manager");
    for kind in [
        "ValidatingWebhookConfiguration",
        "MutatingWebhookConfiguration",
    ] {
        let doc = &rendered[&(kind.to_string(), String::new(), "volume-gate".to_string())];
        assert_eq!(
            doc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
            "volume-gate/volume-gate-webhook",
            "{kind}"
        );
    }
    let cert = &rendered[&(
        "Certificate".to_string(),
        "volume-gate".to_string(),
        "volume-gate-webhook".to_string(),
    )];
    assert_eq!(
        cert["spec"]["secretName"], "volume-gate-webhook-tls",
        "the Secret the webhook Deployment mounts"
    );
}

#[test]
fn every_deployment_argument_is_a_flag_the_binary_has() {
    for doc in common::manifests::base_documents()
        .iter()
        .filter(|d| d["kind"] == "Deployment")
    {
        let c = &doc["spec"]["template"]["spec"]["containers"][0];
        let args: Vec<String> = c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .collect();
        let help = Command::new(binary())
            .arg(&args[0])
            .arg("--help")
            .output()
            .unwrap();
        let help = String::from_utf8(help.stdout).unwrap();
        for a in &args[1..] {
            let flag = a.split('=').next().unwrap();
            assert!(
                help.contains(flag),
                "{} passes {flag}, which `volume-gate {} --help` does not list",
                key(doc).2,
                args[0]
            );
        }
        let sc = &c["securityContext"];
        assert_eq!(sc["readOnlyRootFilesystem"], true);
        assert_eq!(sc["allowPrivilegeEscalation"], false);
        assert_eq!(
            doc["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"],
            true
        );
        for probe in ["livenessProbe", "readinessProbe"] {
            assert_eq!(
                c[probe]["httpGet"]["port"], "admin",
                "{probe} on the admin port"
            );
        }
    }
}

#[test]
fn every_rbac_rule_is_justified_by_a_comment() {
    for file in ["webhook-rbac.yaml", "worker-rbac.yaml"] {
        let text = std::fs::read_to_string(repo_root().join("manifests/base").join(file)).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            if line.trim_start().starts_with("- apiGroups:") && i > 0 {
                let prev = lines[i - 1].trim_start();
                assert!(
                    prev.starts_with('#'),
                    "{file}:{}: rule without a justifying comment above it",
                    i + 1
                );
            }
        }
    }
}

#[test]
fn the_dockerfile_is_multi_stage_locked_and_non_root() {
    let text = std::fs::read_to_string(repo_root().join("Dockerfile")).unwrap();
    let froms: Vec<&str> = text.lines().filter(|l| l.starts_with("FROM ")).collect();
    assert_eq!(froms.len(), 2, "a build stage and a runtime stage");
    for f in &froms {
        assert!(
            !f.contains(":latest") && f.split_whitespace().nth(1).unwrap().contains(':'),
            "pinned base: {f}"
        );
    }
    assert!(
        text.contains("cargo build --release --locked"),
        "locked release build"
    );
    let user = text
        .lines()
        .rfind(|l| l.starts_with("USER "))
        .expect("a USER line");
    assert!(
        !user.contains("root") && !user.contains(" 0"),
        "runs as non-root: {user}"
    );
    assert!(text.contains("ENTRYPOINT [\"/usr/local/bin/volume-gate\"]"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_certificate_script_installs_then_rotates_without_changing_the_ca_bundle() {
    // Its webhook configurations point at no webhook: nothing else may run meanwhile.
    let _serial = common::serial();
    let cp = control_plane();
    let client = cp.management_client().await;
    for doc in common::manifests::base_documents()
        .iter()
        .filter(|d| !common::manifests::is_workload(d))
    {
        common::manifests::apply(&client, doc).await;
    }
    let dir = cp.state.join("script-certs");
    let kubectl = format!(
        "{} --kubeconfig {}",
        common::cluster::kubectl_binary().display(),
        cp.management.kubeconfig.display()
    );
    let run = || {
        let out = Command::new("bash")
            .arg(repo_root().join("certs-scripts/install-certs.sh"))
            .env("KUBECTL", &kubectl)
            .env("VOLUME_GATE", binary())
            .env("CERT_DIR", &dir)
            .output()
            .expect("run install-certs.sh");
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "install-certs.sh failed: {stderr}");
        stderr
    };
    let first = run();
    assert!(first.contains("generating a new CA"), "{first}");
    let ca = std::fs::read_to_string(dir.join("ca-bundle.b64"))
        .unwrap()
        .trim()
        .to_string();
    let leaf1 = std::fs::read(dir.join("tls.crt")).unwrap();
    let hooks = |kind: &'static str| {
        let client = client.clone();
        async move {
            let ar = kube::discovery::pinned_kind(
                &client,
                &kube::core::GroupVersionKind::gvk("admissionregistration.k8s.io", "v1", kind),
            )
            .await
            .unwrap()
            .0;
            let cfg = Api::<DynamicObject>::all_with(client, &ar)
                .get("volume-gate")
                .await
                .unwrap();
            cfg.data["webhooks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|w| {
                    w["clientConfig"]["caBundle"]
                        .as_str()
                        .unwrap_or("")
                        .to_string()
                })
                .collect::<Vec<_>>()
        }
    };
    for kind in [
        "ValidatingWebhookConfiguration",
        "MutatingWebhookConfiguration",
    ] {
        let bundles = hooks(kind).await;
        assert!(
            !bundles.is_empty() && bundles.iter().all(|b| *b == ca),
            "{kind}: every webhook trusts the CA"
        );
    }
    let secret =
        Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), "volume-gate")
            .get("volume-gate-webhook-tls")
            .await
            .unwrap();
    assert_eq!(
        secret.data.unwrap()["tls.crt"].0,
        leaf1,
        "the Secret holds the serving certificate"
    );

    let second = run();
    assert!(
        second.contains("rotating the serving certificate"),
        "{second}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("ca-bundle.b64"))
            .unwrap()
            .trim(),
        ca,
        "rotation keeps the CA"
    );
    let leaf2 = std::fs::read(dir.join("tls.crt")).unwrap();
    assert_ne!(leaf1, leaf2, "a new serving certificate");
    let secret =
        Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), "volume-gate")
            .get("volume-gate-webhook-tls")
            .await
            .unwrap();
    assert_eq!(secret.data.unwrap()["tls.crt"].0, leaf2);
    // Leave no gate configuration behind that points at nothing.
    for kind in [
        "validatingwebhookconfiguration",
        "mutatingwebhookconfiguration",
    ] {
        let s = cp
            .kubectl(&cp.management.kubeconfig)
            .args(["delete", kind, "volume-gate"])
            .output()
            .unwrap();
        assert!(s.status.success());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custody_adopt_and_release_change_only_tenants_not_being_deleted() {
    let _serial = common::serial();
    let cp = control_plane();
    common::gate::apply_crds(cp).await;
    let ns = cp.unique("custody");
    cp.namespace(&ns).await;
    let client = cp.management_client().await;
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns, &helmrelease_resource());
    for name in ["kubernetes-a", "kubernetes-b"] {
        let mut hr = DynamicObject::new(name, &helmrelease_resource()).within(&ns);
        hr.metadata.labels = Some(
            [
                ("apps.cozystack.io/application.kind", "Kubernetes"),
                ("apps.cozystack.io/application.group", "apps.cozystack.io"),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .into(),
        );
        hr.metadata.finalizers = Some(vec!["finalizers.fluxcd.io".into()]);
        hr.data = json!({"spec": {}});
        api.create(&PostParams::default(), &hr).await.unwrap();
    }
    // b is being deleted: custody commands leave it to the worker.
    api.delete("kubernetes-b", &DeleteParams::default())
        .await
        .unwrap();
    let cli = |args: &[&str]| {
        let out = Command::new(binary())
            .args(args)
            .env("KUBECONFIG", &cp.management.kubeconfig)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let finalizers = |name: &'static str| {
        let api = api.clone();
        async move {
            api.get(name)
                .await
                .unwrap()
                .metadata
                .finalizers
                .unwrap_or_default()
        }
    };
    let out = cli(&["custody", "adopt", "-n", &ns]);
    assert!(
        out.contains(&format!("{ns}/kubernetes-a: custody taken"))
            && out.contains("kubernetes-b: being deleted"),
        "{out}"
    );
    assert!(
        finalizers("kubernetes-a")
            .await
            .contains(&common::profile().custody_finalizer)
    );
    assert!(
        !finalizers("kubernetes-b")
            .await
            .contains(&common::profile().custody_finalizer)
    );

    let status: Value = serde_json::from_str(&cli(&["status", "-n", &ns, "-o", "json"])).unwrap();
    let rows = status.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["name"], "kubernetes-a");
    assert_eq!(
        (rows[0]["inCustody"].clone(), rows[0]["phase"].clone()),
        (json!(true), json!("NotStarted"))
    );
    assert_eq!(rows[1]["deleting"], true);
    let table = cli(&["status", "-n", &ns]);
    assert!(
        table.starts_with("NAMESPACE")
            && table.contains("kubernetes-a")
            && table.contains("Deleting"),
        "{table}"
    );

    let out = cli(&["custody", "release", "-n", &ns]);
    assert!(out.contains("custody released"), "{out}");
    assert_eq!(
        finalizers("kubernetes-a").await,
        vec!["finalizers.fluxcd.io".to_string()],
        "only the custody finalizer went"
    );
}

/// Every quoted name in the webhooks' CEL conditions and objectSelectors, and
/// the Cozystack profile's names they stand for, agree both ways: a name
/// renamed in `src/profile.rs` and not in the manifests (or the reverse)
/// would send the gate too little, or too much.
#[test]
fn the_webhook_conditions_use_the_profiles_names_and_only_them() {
    use volume_gate::profile::Profile;
    let p = Profile::cozystack();
    let suffix = |pattern: &str| {
        pattern
            .split_once("{tenant}")
            .map(|(_, s)| s.to_string())
            .expect("pattern with {tenant}")
    };
    let kcsi = p
        .guarded
        .iter()
        .filter_map(|g| g.name.as_deref())
        .find(|n| n.ends_with("-kcsi-controller"))
        .expect("kcsi entry");
    let kcsi_identity = p
        .guarded
        .iter()
        .find(|g| g.kind == "ServiceAccount")
        .and_then(|g| g.name.as_deref())
        .expect("the kcsi identity entry");
    let mut profile_names: Vec<String> = vec![
        suffix(kcsi_identity),
        p.custody_finalizer.clone(),
        p.annotation_prefix.clone(),
        format!("{}override", p.annotation_prefix),
        p.child_label
            .clone()
            .expect("Cozystack labels child releases"),
        suffix(
            p.csi_release
                .as_deref()
                .expect("Cozystack has a CSI release"),
        ),
        suffix(&p.kubeconfig.secret_name),
        suffix(kcsi),
    ];
    profile_names.extend(p.parent.match_labels.keys().cloned());
    profile_names.push(p.parent.name_prefix.clone());
    // The writers the conditions name: who alone writes a status, who
    // replaces parents whole. The source writers are judged by the webhook
    // (its flags, tests/chart.rs), not by a condition.
    profile_names.extend(p.writers.release_controllers.iter().cloned());
    profile_names.extend(p.writers.parent_replacers.iter().cloned());
    // The worker's mirror of the record for the tenant's owner, which a
    // replacer's write may drop too.
    profile_names.push(format!(
        "{}{}",
        p.parent.visible_annotation_prefix, p.annotation_prefix
    ));
    // A kept disk's label and its acknowledgement, which the mutating
    // webhook stamps (the record's keys under the profile's prefix).
    let keys = volume_gate::record::Keys::new(&p.annotation_prefix);
    profile_names.extend(
        [
            &keys.kept,
            &keys.kept_acknowledged,
            &keys.kept_acknowledged_by,
            &keys.kept_acknowledged_at,
        ]
        .map(String::clone),
    );
    // Kubernetes' own: whose DELETEs of a tenant's disks wait for the phase.
    profile_names.push(volume_gate::admission::gate::NAMESPACE_CONTROLLER.to_string());
    // Flux's own field names, which the gate judges (decide::flux).
    profile_names
        .extend(volume_gate::admission::decide::flux::TOP_LEVEL_FIELDS.map(str::to_string));
    profile_names.extend(
        volume_gate::admission::decide::release_keys(&p)
            .into_iter()
            .map(str::to_string),
    );
    profile_names.extend(p.guarded.iter().filter_map(|g| g.label.clone()));
    profile_names.extend(p.infra.iter().flat_map(|i| i.labels.keys().cloned()));
    profile_names.sort();
    profile_names.dedup();
    // The operations, '' (the default of an absent label in `orValue('')`),
    // and Kubernetes' kind the namespace road leaves out (`decide::named_for`).
    let operations = ["CREATE", "UPDATE", "DELETE", "", "Event"];

    let mut quoted: Vec<String> = Vec::new();
    let mut selector_keys: Vec<String> = Vec::new();
    for doc in common::manifests::base_documents()
        .iter()
        .filter(|d| common::manifests::is_webhook_configuration(d))
    {
        for w in doc["webhooks"].as_array().unwrap() {
            for c in w["matchConditions"].as_array().into_iter().flatten() {
                let expr = c["expression"].as_str().unwrap();
                quoted.extend(expr.split('\'').skip(1).step_by(2).map(str::to_string));
            }
            let sel = &w["objectSelector"];
            selector_keys.extend(
                sel["matchLabels"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, _)| k.clone()),
            );
            selector_keys.extend(
                sel["matchExpressions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|e| e["key"].as_str().unwrap().to_string()),
            );
        }
    }
    let unknown: Vec<&String> = quoted
        .iter()
        .chain(&selector_keys)
        .filter(|q| !profile_names.contains(q) && !operations.contains(&q.as_str()))
        .collect();
    assert!(
        unknown.is_empty(),
        "names in the webhook configurations that the profile does not have: {unknown:?}"
    );
    let unused: Vec<&String> = profile_names
        .iter()
        .filter(|n| !quoted.contains(n) && !selector_keys.contains(n))
        .collect();
    assert!(
        unused.is_empty(),
        "profile names no webhook condition or selector uses: {unused:?}"
    );
}
