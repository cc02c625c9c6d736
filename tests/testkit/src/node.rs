//! The management cluster's real node (`harness up --node`,
//! `tests/harness/node.go`): the kubelet, containerd with runc, a CNI
//! bridge. volume-gate's image is assembled here from the binary the tests
//! run, as the Dockerfile describes it (the binary, the glibc it links, user
//! 65532 and no shell), without a daemon or a registry, and imported into the
//! node's runtime under the name the chart's values give, so the chart is
//! installed with no test-only value.

use std::path::{Path, PathBuf};
use std::process::Command;

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, LogParams};
use serde_json::Value;

use super::certmanager::CertManager;
use super::cluster::{ControlPlane, repo_root};

/// The node's name (node.go's `nodeName`).
pub const NODE: &str = "vg-node";

/// The node's IP (node.go's `nodeIP`), by which Pods reach the harness's
/// API servers.
pub const NODE_IP: &str = "10.244.0.1";

/// The node's IP when this binary's control plane runs the real node.
pub fn address() -> Option<&'static str> {
    super::cluster::running()
        .filter(|cp| cp.node)
        .map(|_| NODE_IP)
}

fn chart_image_values() -> Value {
    let path = repo_root().join("manifests/chart/volume-gate/values.yaml");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let values: Value =
        serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()));
    values["image"].clone()
}

/// The image repository the chart's values name: `registry/repository`
/// (the repository alone when the registry is empty).
pub fn chart_image_repository() -> String {
    let image = chart_image_values();
    let repository = image["repository"].as_str().expect("image.repository");
    match image["registry"].as_str().unwrap_or("") {
        "" => repository.to_string(),
        registry => format!("{}/{repository}", registry.trim_end_matches('/')),
    }
}

/// The image the chart's values name: `registry/repository:tag`.
pub fn chart_image() -> String {
    format!(
        "{}:{}",
        chart_image_repository(),
        chart_image_values()["tag"].as_str().expect("image.tag")
    )
}

/// The shared libraries `binary` loads, as `ldd` resolves them on this
/// machine (the distroless `cc` base the Dockerfile uses carries the same
/// glibc of Debian 12).
fn shared_libraries(binary: &Path) -> Vec<PathBuf> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .unwrap_or_else(|e| panic!("ldd {}: {e}", binary.display()));
    assert!(
        out.status.success(),
        "ldd {}: {}",
        binary.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or
            // "/lib64/ld-linux-x86-64.so.2 (0x...)"; the vdso has no file.
            let path = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

/// Writes volume-gate's image archive (from `binary`) under the state
/// directory and imports it into the node under the name the chart's values
/// give; returns that name.
pub fn import_volume_gate_image(cp: &ControlPlane, binary: &Path) -> String {
    import_volume_gate_image_as(cp, binary, &chart_image())
}

/// The same image imported under `name` (another tag, for an upgrade).
pub fn import_volume_gate_image_as(cp: &ControlPlane, binary: &Path, name: &str) -> String {
    let name = name.to_string();
    let dir = cp.state.join("images");
    std::fs::create_dir_all(&dir).expect("images dir");
    // distroless/cc's nonroot user and group.
    let passwd = dir.join("passwd");
    std::fs::write(
        &passwd,
        "root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n",
    )
    .unwrap();
    let group = dir.join("group");
    std::fs::write(&group, "root:x:0:\nnonroot:x:65532:\n").unwrap();
    let archive = dir.join(format!(
        "volume-gate-{}.tar",
        name.rsplit(':').next().unwrap_or("image")
    ));
    let mut cmd = Command::new(&cp.harness);
    cmd.arg("image")
        .arg("--out")
        .arg(&archive)
        .args(["--name", &name])
        .args(["--entrypoint", r#"["/usr/local/bin/volume-gate"]"#])
        .args(["--cmd", r#"["--help"]"#])
        .args(["--user", "65532:65532"])
        .arg("--file")
        .arg(format!("/usr/local/bin/volume-gate={}", binary.display()))
        .arg("--file")
        .arg(format!("/etc/passwd={}", passwd.display()))
        .arg("--file")
        .arg(format!("/etc/group={}", group.display()))
        .arg("--file")
        .arg("/etc/ssl/certs/ca-certificates.crt=/etc/ssl/certs/ca-certificates.crt");
    for lib in shared_libraries(binary) {
        cmd.arg("--file")
            .arg(format!("{}={}", lib.display(), lib.display()));
    }
    run(&mut cmd, "harness image");
    run(
        Command::new(&cp.harness)
            .args(["node", "import", "--state"])
            .arg(&cp.state)
            .arg(&archive),
        "harness node import",
    );
    name
}

fn run(cmd: &mut Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The chart installed on the node; cert-manager runs while it is held.
pub struct Installed {
    pub image: String,
    pub chart: PathBuf,
    pub cert_manager: CertManager,
}

/// Installs the chart as a user does (`helm install` with its default
/// values, cert-manager issuing the serving certificate) into `namespace`,
/// volume-gate's image imported under the name the values give; returns once
/// both Deployments' Pods are Running and Ready on the node, in that image.
pub async fn install_chart(cp: &ControlPlane, namespace: &str) -> Installed {
    let client = cp.management_client().await;
    // The namespace as the README's install makes it: `kubectl create
    // namespace`, then `kubectl label namespace` with its labels (the
    // restricted Pod Security level, and the label Cozystack's tenant
    // network policy admits: tests/network.rs).
    cp.namespace(namespace).await;
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    let label = readme
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("kubectl label namespace volume-gate ")
        })
        .expect("the README labels the namespace");
    let mut labels = serde_json::Map::new();
    for kv in label.split_whitespace() {
        let (k, v) = kv.split_once('=').expect("K=V");
        labels.insert(k.into(), serde_json::json!(v));
    }
    Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .patch(
            namespace,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"metadata": {"labels": labels}})),
        )
        .await
        .expect("label the namespace as the README does");
    let image = import_volume_gate_image(cp, &super::gate::binary());
    let cert_manager = super::certmanager::start(cp, namespace).await;
    let chart = repo_root().join("manifests/chart/volume-gate");
    super::chart::helm_ok(
        "helm install",
        &[
            "install",
            "volume-gate",
            chart.to_str().unwrap(),
            "--namespace",
            namespace,
            "--kubeconfig",
            cp.management.kubeconfig.to_str().unwrap(),
        ],
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    for (component, deployment) in [
        ("webhook", "volume-gate-webhook"),
        ("worker", "volume-gate-worker"),
    ] {
        let replicas = Api::<Deployment>::namespaced(client.clone(), namespace)
            .get(deployment)
            .await
            .unwrap_or_else(|e| panic!("Deployment {deployment}: {e}"))
            .spec
            .replicas
            .unwrap_or(1) as usize;
        for pod in ready_on_the_node(&pods, component, replicas).await {
            let status = pod.status.unwrap_or_default();
            let containers = status.container_statuses.unwrap_or_default();
            assert!(
                containers
                    .iter()
                    .all(|c| c.image.ends_with(&image) || c.image == image),
                "{component} runs {image}: {containers:?}"
            );
        }
    }
    Installed {
        image,
        chart,
        cert_manager,
    }
}

/// A container of `pod` that has stopped with an error (a wrong argument,
/// mount or probe in the chart): its exit and the end of its log.
pub async fn crashed(pods: &Api<Pod>, pod: &Pod) -> Option<String> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    for c in pod.status.as_ref()?.container_statuses.as_ref()? {
        let last = c.last_state.as_ref().and_then(|s| s.terminated.as_ref());
        let now = c.state.as_ref().and_then(|s| s.terminated.as_ref());
        let Some(t) = now.or(last).filter(|t| t.exit_code != 0) else {
            continue;
        };
        let log = pods
            .logs(
                &name,
                &LogParams {
                    container: Some(c.name.clone()),
                    previous: now.is_none(),
                    tail_lines: Some(20),
                    ..Default::default()
                },
            )
            .await
            .unwrap_or_else(|e| format!("(its log could not be read: {e})"));
        return Some(format!(
            "container {} of Pod {name} exited {} ({}), restarts {}; its log:\n{log}",
            c.name,
            t.exit_code,
            t.reason.clone().unwrap_or_default(),
            c.restart_count
        ));
    }
    None
}

/// The Pods of one of the chart's components, all Running and Ready on the
/// node. A container that stops with an error fails at once, with its log.
pub async fn ready_on_the_node(pods: &Api<Pod>, component: &str, replicas: usize) -> Vec<Pod> {
    let selector =
        format!("app.kubernetes.io/name=volume-gate,app.kubernetes.io/component={component}");
    let deadline = std::time::Instant::now() + Duration::from_secs(180);
    loop {
        let list = pods
            .list(&ListParams::default().labels(&selector))
            .await
            .expect("list the chart's Pods");
        for pod in &list.items {
            if let Some(crash) = crashed(pods, pod).await {
                panic!("the chart's {component} does not run as installed: {crash}");
            }
        }
        let ready: Vec<Pod> = list
            .items
            .iter()
            .filter(|p| {
                let on_node = p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(NODE);
                let ready = p
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
                on_node && ready && p.metadata.deletion_timestamp.is_none()
            })
            .cloned()
            .collect();
        if ready.len() == replicas {
            return ready;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{replicas} {component} Pods Running and Ready on {}: {} of {} ready: {:?}",
            NODE,
            ready.len(),
            list.items.len(),
            list.items
                .iter()
                .map(|p| (
                    p.metadata.name.clone(),
                    p.status
                        .as_ref()
                        .map(|s| (s.phase.clone(), s.container_statuses.clone()))
                ))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The harness binary as an image for the node (`harness image`, static:
/// no library needed), imported once per control plane: what a tenant's
/// control plane Pod and the CSI controller's place-holding Pod run.
pub fn harness_image(cp: &ControlPlane) -> String {
    static IMAGE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    IMAGE
        .get_or_init(|| {
            // Not `latest`: the kubelet would try to pull it.
            let name = "volume-gate.test/harness:local".to_string();
            let dir = cp.state.join("images");
            std::fs::create_dir_all(&dir).expect("images dir");
            let archive = dir.join("harness.tar");
            run(
                Command::new(&cp.harness)
                    .arg("image")
                    .arg("--out")
                    .arg(&archive)
                    .args(["--name", &name])
                    .args(["--entrypoint", r#"["/harness"]"#])
                    .arg("--file")
                    .arg(format!("/harness={}", cp.harness.display())),
                "harness image (the harness)",
            );
            run(
                Command::new(&cp.harness)
                    .args(["node", "import", "--state"])
                    .arg(&cp.state)
                    .arg(&archive),
                "harness node import (the harness)",
            );
            name
        })
        .clone()
}
