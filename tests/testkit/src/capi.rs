//! The plain Cluster API world: Cluster API's own core manager (v1.14.2,
//! built by `tests/capi/build.sh`) against the management API server,
//! installed as clusterctl installs it (its CRDs converted by its own
//! conversion webhook, its defaulting and validating webhooks, its
//! ClusterRole, as ServiceAccount `capi-system/capi-manager`), and the
//! simulator's played providers behind Cluster API's contract
//! (`tests/harness/sim_capi.go`; CRDs in `tests/fixtures/crds/capi`).
//!
//! Nothing here reads volume-gate's profile: the world is Cluster API's, and
//! a gated test adds the gate to it. Every fact about Cluster API is read
//! from its module at v1.14.2 (`sigs.k8s.io/cluster-api@v1.14.2`), the file
//! named where it is used.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, PersistentVolumeClaim, Pod, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::ClusterRole;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, PostParams};
use serde_json::{Value, json};

use super::cluster::{ClusterInfo, ControlPlane, client_from, repo_root, run_build_script};
use super::gate::{free_port, http_get, wait_crd_established};
use super::manifests;
use super::process::Process;
use super::wait::eventually;

/// Where clusterctl installs the core provider: `namespace: capi-system`
/// and `namePrefix: capi-` of core/config/default/kustomization.yaml, over
/// core/config/rbac/service_account.yaml's ServiceAccount `manager`.
pub const NAMESPACE: &str = "capi-system";
pub const SERVICE_ACCOUNT: &str = "capi-manager";

/// What Cluster API labels a cluster's objects with (`ClusterNameLabel`,
/// module sigs.k8s.io/cluster-api/api v1.14.2, core/v1beta2/common_types.go).
pub const CLUSTER_NAME_LABEL: &str = "cluster.x-k8s.io/cluster-name";

/// The annotation by which the played providers know the harness cluster
/// that is the tenant's API server (the same as a TenantControlPlane's).
pub const CLUSTER_ANNOTATION: &str = "harness.volume-gate.test/cluster";

/// On a HarnessCluster: the Deployment, in the Cluster's namespace, of the
/// cluster's management-side CSI controller (`tests/harness/sim_capi.go`).
pub const CSI_CONTROLLER_ANNOTATION: &str = "harness.volume-gate.test/csi-controller";

/// A management-side CSI controller as kubevirt-csi-driver's split
/// deployment makes it (github.com/kubevirt/csi-driver, commit 27b52aa:
/// deploy/controller-infra/base/deploy.yaml and
/// deploy/infra-cluster-service-account.yaml), named for one cluster.
#[derive(Clone, Debug)]
pub struct ManagementCsi {
    /// The controller's Deployment.
    pub controller: String,
    /// Its ServiceAccount, Role and RoleBinding.
    pub identity: String,
    /// Its `--infra-cluster-labels`: the labels of its DataVolumes.
    pub labels: BTreeMap<String, String>,
}

impl ManagementCsi {
    /// The names a volume-gate profile guards for `cluster` (its
    /// Deployment entry and ServiceAccount entry by name) and its infra
    /// labels.
    pub fn of_profile(p: &volume_gate::profile::Profile, cluster: &str) -> ManagementCsi {
        let named = |kind: &str| {
            p.guarded
                .iter()
                .find(|g| g.kind == kind && g.name.is_some())
                .and_then(|g| g.name.as_deref())
                .unwrap_or_else(|| panic!("the profile guards no {kind} by name"))
                .replace(volume_gate::profile::TENANT_PLACEHOLDER, cluster)
        };
        ManagementCsi {
            controller: named("Deployment"),
            identity: named("ServiceAccount"),
            labels: p
                .infra
                .as_ref()
                .expect("the profile names an infra layer")
                .labels_of(cluster),
        }
    }

    /// The kinds it is made of, for a [`DeletionWatch`].
    pub fn kinds() -> Vec<(&'static str, ApiResource)> {
        vec![
            (
                "Deployment",
                resource("apps", "v1", "Deployment", "deployments"),
            ),
            (
                "ServiceAccount",
                resource("", "v1", "ServiceAccount", "serviceaccounts"),
            ),
            (
                "Role",
                resource("rbac.authorization.k8s.io", "v1", "Role", "roles"),
            ),
            (
                "RoleBinding",
                resource(
                    "rbac.authorization.k8s.io",
                    "v1",
                    "RoleBinding",
                    "rolebindings",
                ),
            ),
            (
                "DataVolume",
                resource("cdi.kubevirt.io", "v1beta1", "DataVolume", "datavolumes"),
            ),
        ]
    }
}

/// The simulated CSI driver's StorageClass in a Cluster API tenant, made by
/// [`CapiCluster::storage_class`] (the driver's chart makes it in a
/// Cozystack tenant).
pub const STORAGE_CLASS: &str = "sim";
/// The simulator's CSI driver (`harness sim --driver`, its default).
pub const DRIVER: &str = "csi.volume-gate.test";

/// A release of Cluster API's core manager the tests run, and how its
/// platform installs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Core {
    /// What it is, for messages.
    pub what: &'static str,
    /// The script that builds it (`build-go.sh`'s layout: `manager`,
    /// `crds/`, `webhook/manifests.yaml`, `rbac/`).
    pub build_script: &'static str,
    /// The namespace it runs in; its ServiceAccount is
    /// [`SERVICE_ACCOUNT`] there.
    pub namespace: &'static str,
    /// Its `--feature-gates`, as its platform passes them (none: the
    /// manager's defaults).
    pub feature_gates: Option<&'static str>,
    /// The version its CRDs store and serve first: the probe of its
    /// webhooks writes a MachineDeployment of it.
    pub storage_version: &'static str,
}

impl Core {
    /// Cluster API v1.14.2 as clusterctl installs it: the plain Cluster
    /// API world's (`tests/capi`; `namespace: capi-system` of
    /// core/config/default/kustomization.yaml).
    pub const UPSTREAM: Core = Core {
        what: "Cluster API v1.14.2",
        build_script: "tests/capi/build.sh",
        namespace: NAMESPACE,
        feature_gates: None,
        storage_version: "v1beta2",
    };

    /// Cluster API v1.10.1 as Cozystack v1.6.2 installs it
    /// (`packages/system/capi-providers-core/files/core-components.yaml`:
    /// the image `cluster-api-controller:v1.10.1`, its `--feature-gates`
    /// with their defaults, ServiceAccount `capi-manager`), through the
    /// cluster-api-operator into the Provider's namespace,
    /// [`cozystack::CAPI`]'s: the Cozystack world's tenants run on it
    /// (`tests/capi-cozystack`).
    pub const COZYSTACK: Core = Core {
        what: "Cluster API v1.10.1 (Cozystack v1.6.2's)",
        build_script: "tests/capi-cozystack/build.sh",
        namespace: super::cozystack::CAPI.namespace,
        feature_gates: Some(
            "MachinePool=true,ClusterResourceSet=true,ClusterTopology=false,RuntimeSDK=false,\
             MachineSetPreflightChecks=true,MachineWaitForVolumeDetachConsiderVolumeAttachments=true,\
             PriorityQueue=false",
        ),
        storage_version: "v1beta1",
    };

    /// The directory its build script prints.
    pub fn dir(&self) -> PathBuf {
        static DIRS: std::sync::Mutex<BTreeMap<&'static str, PathBuf>> =
            std::sync::Mutex::new(BTreeMap::new());
        let mut dirs = DIRS.lock().unwrap_or_else(|p| p.into_inner());
        dirs.entry(self.build_script)
            .or_insert_with(|| run_build_script(self.build_script))
            .clone()
    }
}

pub fn resource(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

/// A kind of cluster.x-k8s.io at `version` (`v1beta2`, the storage version,
/// or `v1beta1`, served and deprecated).
pub fn core_resource(version: &str, kind: &str) -> ApiResource {
    let plural = format!("{}s", kind.to_lowercase());
    resource("cluster.x-k8s.io", version, kind, &plural)
}

/// A kind of the played providers (`HarnessCluster`, `HarnessMachine`,
/// `HarnessMachineTemplate`, `HarnessControlPlane`).
pub fn harness_resource(kind: &str) -> ApiResource {
    let group = if kind == "HarnessControlPlane" {
        "controlplane.cluster.x-k8s.io"
    } else {
        "infrastructure.cluster.x-k8s.io"
    };
    resource(
        group,
        "v1alpha1",
        kind,
        &format!("{}s", kind.to_lowercase()),
    )
}

/// Cluster API's core manager running against the management cluster.
pub struct Capi {
    pub release: Core,
    pub process: Process,
    /// Its webhook server (conversion, defaulting, validation).
    pub webhook_port: u16,
    pub health_port: u16,
    /// From the start of the install to the API server calling its
    /// webhooks.
    pub started_in: Duration,
}

static CAPI: tokio::sync::OnceCell<Capi> = tokio::sync::OnceCell::const_new();

/// This test binary's Cluster API core manager for the plain Cluster API
/// world ([`Core::UPSTREAM`]), installed and started on first use.
pub async fn capi(cp: &ControlPlane) -> &'static Capi {
    core(cp, Core::UPSTREAM).await
}

/// This test binary's Cluster API core manager, `release`, installed and
/// started on first use; a binary runs one.
pub async fn core(cp: &ControlPlane, release: Core) -> &'static Capi {
    let capi = CAPI.get_or_init(|| Capi::start(cp, release)).await;
    crate::refuse_another("Cluster API core manager", &capi.release, &release);
    capi
}

impl Capi {
    /// Installs Cluster API's CRDs (conversion through the manager's
    /// webhook), the played providers' CRDs, its RBAC and webhook
    /// configurations, and starts the manager as its ServiceAccount;
    /// returns once the API server converts, defaults and validates
    /// through it. Tests use [`capi`].
    pub async fn start(cp: &ControlPlane, release: Core) -> Capi {
        let started = Instant::now();
        let dir = release.dir();
        let client = cp.management_client().await;
        let webhook_port = free_port();
        let certs = cp.state.join(cp.unique("capi-certs"));
        let ca_bundle = serving_certificate(cp, &certs, release.namespace);
        let base = format!("https://127.0.0.1:{webhook_port}");

        let mut crds: Vec<String> = Vec::new();
        for file in yaml_files(&dir.join("crds")) {
            for doc in documents(&file) {
                let doc = with_conversion_webhook(doc, &base, &ca_bundle);
                crds.push(doc["metadata"]["name"].as_str().expect("CRD name").into());
                manifests::apply(&client, &doc).await;
            }
        }
        for file in yaml_files(&repo_root().join("tests/fixtures/crds/capi")) {
            for doc in documents(&file) {
                crds.push(doc["metadata"]["name"].as_str().expect("CRD name").into());
                manifests::apply(&client, &doc).await;
            }
        }
        for name in &crds {
            wait_crd_established(&client, name).await;
        }

        let rbac = rbac_documents(&dir.join("rbac"), release.namespace);
        cp.namespace(release.namespace).await;
        for doc in &rbac {
            manifests::apply(&client, doc).await;
        }
        wait_aggregated(&client, &rbac).await;
        let kubeconfig = cp
            .service_account_kubeconfig(release.namespace, SERVICE_ACCOUNT)
            .await;

        let health_port = free_port();
        let mut cmd = Command::new(dir.join("manager"));
        crate::process::go_program(&mut cmd);
        cmd.arg("--kubeconfig")
            .arg(&kubeconfig)
            .arg(format!("--health-addr=127.0.0.1:{health_port}"))
            .arg(format!("--diagnostics-address=127.0.0.1:{}", free_port()))
            .arg("--insecure-diagnostics")
            .arg(format!("--webhook-port={webhook_port}"))
            .arg("--webhook-cert-dir")
            .arg(&certs);
        if let Some(gates) = release.feature_gates {
            cmd.arg(format!("--feature-gates={gates}"));
        }
        let log = cp
            .state
            .join("logs")
            .join(format!("{}.log", cp.unique("capi-manager")));
        let process = Process::start("capi-manager", cmd, log);
        eventually(
            &format!("{}'s manager /readyz", release.what),
            Duration::from_secs(120),
            || async {
                if !process.alive() {
                    panic!(
                        "Cluster API's manager exited; its log:\n{}",
                        process.log_text()
                    );
                }
                match http_get(health_port, "/readyz").await {
                    Ok((200, _)) => Ok(()),
                    Ok((code, body)) => Err(format!("{code} {body}")),
                    Err(e) => Err(e),
                }
            },
        )
        .await;

        let webhooks = std::fs::read_to_string(dir.join("webhook/manifests.yaml"))
            .expect("webhook/manifests.yaml");
        let prefix = kustomization(&dir.join("rbac")).1;
        for doc in serde_saphyr::from_multiple::<Value>(&webhooks)
            .expect("webhook manifests")
            .into_iter()
            .filter(|d| !d.is_null())
        {
            let mut doc = manifests::point_at_local(&doc, &base, &ca_bundle);
            let name = doc["metadata"]["name"].as_str().expect("name").to_string();
            doc["metadata"]["name"] = json!(format!("{prefix}{name}"));
            manifests::apply(&client, &doc).await;
        }
        wait_webhooks_active(cp, &process, release).await;
        let capi = Capi {
            release,
            process,
            webhook_port,
            health_port,
            started_in: started.elapsed(),
        };
        eprintln!(
            "{}'s core manager installed and serving in {:.1}s (log {})",
            release.what,
            capi.started_in.as_secs_f64(),
            capi.process.log.display()
        );
        capi
    }

    pub fn log(&self) -> String {
        self.process.log_text()
    }

    /// The manager's resident memory now (VmRSS), in KiB.
    pub fn rss_kib(&self) -> Option<u64> {
        let pid = self.process.pid()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }
}

fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

fn documents(file: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    serde_saphyr::from_multiple::<Value>(&text)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .into_iter()
        .filter(|d| !d.is_null())
        .collect()
}

/// What core/config/crd/kustomization.yaml patches into every CRD
/// (patches/webhook_in_*.yaml): conversion by the manager's webhook at
/// `/convert`, reached here on loopback instead of through the Service.
fn with_conversion_webhook(mut crd: Value, base: &str, ca_bundle: &str) -> Value {
    crd["spec"]["conversion"] = json!({
        "strategy": "Webhook",
        "webhook": {
            "conversionReviewVersions": ["v1"],
            "clientConfig": {"url": format!("{base}/convert"), "caBundle": ca_bundle},
        },
    });
    crd
}

/// The webhook server's certificate, issued by the harness CA (the
/// control plane's `pki/`, which the API server trusts) for the Service
/// clusterctl makes (core/config/webhook/service.yaml `webhook-service`,
/// prefixed) and for 127.0.0.1, into `certs` as `tls.crt`/`tls.key`, the
/// names the manager reads (--webhook-cert-name, --webhook-key-name
/// defaults in core/main.go). Returns the CA bundle, base64.
fn serving_certificate(cp: &ControlPlane, certs: &Path, namespace: &str) -> String {
    std::fs::create_dir_all(certs).expect("certs dir");
    let pki = cp.state.join("pki");
    for f in ["ca.crt", "ca.key"] {
        std::fs::copy(pki.join(f), certs.join(f))
            .unwrap_or_else(|e| panic!("copy the harness CA's {f}: {e}"));
    }
    crate::process::run_ok(
        Command::new(super::gate::binary())
            .args([
                "certs",
                "generate",
                "--reuse-ca",
                "--service",
                "capi-webhook-service",
                "--namespace",
                namespace,
                "--san",
                "127.0.0.1",
                "--out",
            ])
            .arg(certs),
        "volume-gate certs generate (Cluster API's webhook certificate)",
    );
    // The CA key is the harness's: it stays in pki/ only.
    std::fs::remove_file(certs.join("ca.key")).expect("remove the CA key copy");
    std::fs::read_to_string(certs.join("ca-bundle.b64"))
        .expect("ca-bundle.b64")
        .trim()
        .to_string()
}

/// core/config/default/kustomization.yaml's `namespace` and `namePrefix`.
fn kustomization(rbac: &Path) -> (String, String) {
    let k = documents(&rbac.join("default-kustomization.yaml"))
        .pop()
        .expect("kustomization");
    let s = |k: &Value| k.as_str().expect("a string").to_string();
    (s(&k["namespace"]), s(&k["namePrefix"]))
}

/// The manager's identity and permissions as clusterctl installs them
/// (kustomize of core/config/default), in `namespace` (the
/// kustomization's, or the Provider's where the cluster-api-operator
/// installs it): ServiceAccount `manager`,
/// ClusterRole `manager-role` (labelled for aggregation by
/// default/manager_role_aggregation_patch.yaml), ClusterRole
/// `aggregated-manager-role` aggregating it, and ClusterRoleBinding
/// `manager-rolebinding` bound to the aggregated role (the same patch),
/// each named with the prefix in the namespace of the kustomization.
fn rbac_documents(rbac: &Path, namespace: &str) -> Vec<Value> {
    let prefix = kustomization(rbac).1;
    let patches = documents(&rbac.join("manager_role_aggregation_patch.yaml"));
    let patch_of = |kind: &str, name: &str| {
        patches
            .iter()
            .find(|p| p["kind"] == kind && p["metadata"]["name"] == name)
            .cloned()
    };
    let mut out = Vec::new();
    for file in [
        "service_account.yaml",
        "role.yaml",
        "aggregated_role.yaml",
        "role_binding.yaml",
    ] {
        for mut doc in documents(&rbac.join(file)) {
            let kind = doc["kind"].as_str().expect("kind").to_string();
            let name = doc["metadata"]["name"].as_str().expect("name").to_string();
            if let Some(patch) = patch_of(&kind, &name) {
                if let Some(labels) = patch["metadata"]["labels"].as_object() {
                    for (k, v) in labels {
                        doc["metadata"]["labels"][k] = v.clone();
                    }
                }
                if !patch["roleRef"].is_null() {
                    doc["roleRef"] = patch["roleRef"].clone();
                }
            }
            doc["metadata"]["name"] = json!(format!("{prefix}{name}"));
            if !doc["metadata"]["namespace"].is_null() {
                doc["metadata"]["namespace"] = json!(namespace);
            }
            if let Some(role) = doc["roleRef"]["name"].as_str() {
                doc["roleRef"]["name"] = json!(format!("{prefix}{role}"));
            }
            if let Some(subjects) = doc.get_mut("subjects").and_then(Value::as_array_mut) {
                for s in subjects {
                    let n = s["name"].as_str().expect("subject name").to_string();
                    s["name"] = json!(format!("{prefix}{n}"));
                    s["namespace"] = json!(namespace);
                }
            }
            out.push(doc);
        }
    }
    assert!(
        out.iter()
            .any(|d| d["kind"] == "ServiceAccount" && d["metadata"]["name"] == SERVICE_ACCOUNT),
        "Cluster API's ServiceAccount is not {SERVICE_ACCOUNT} in its kustomization"
    );
    out
}

/// Waits until the controller manager has aggregated the rules into every
/// aggregating ClusterRole of `rbac`.
async fn wait_aggregated(client: &kube::Client, rbac: &[Value]) {
    let roles: Api<ClusterRole> = Api::all(client.clone());
    for doc in rbac
        .iter()
        .filter(|d| d["kind"] == "ClusterRole" && !d["aggregationRule"].is_null())
    {
        let name = doc["metadata"]["name"].as_str().expect("name").to_string();
        eventually(
            &format!("ClusterRole {name} aggregated"),
            Duration::from_secs(60),
            || {
                let (roles, name) = (roles.clone(), name.clone());
                async move {
                    let role = roles.get(&name).await.map_err(|e| e.to_string())?;
                    match role.rules {
                        Some(r) if !r.is_empty() => Ok(()),
                        _ => Err("no rules yet".into()),
                    }
                }
            },
        )
        .await;
    }
}

/// The API server's webhook configuration cache lags the objects: probe
/// with dry-run creates until Cluster API's webhooks answer. A v1beta1
/// MachineDeployment is converted (the conversion webhook) and defaulted
/// (core/webhooks/admission/machinedeployment.go `Default` labels it with
/// its cluster); one whose version lacks its `v` is refused by `validate`
/// ("must start with v").
async fn wait_webhooks_active(cp: &ControlPlane, manager: &Process, release: Core) {
    let client = cp.management_client().await;
    let ns = "capi-probe";
    cp.namespace(ns).await;
    let v1beta1: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        ns,
        &core_resource("v1beta1", "MachineDeployment"),
    );
    let stored: Api<DynamicObject> = Api::namespaced_with(
        client,
        ns,
        &core_resource(release.storage_version, "MachineDeployment"),
    );
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    // What its validation refuses: before v1.14 (v1beta1 stored) a
    // version that is not one (internal/webhooks/machinedeployment.go,
    // v1.10.1); since, a template of another cluster
    // (core/webhooks/admission/machinedeployment.go, v1.14.2).
    let (bad, refusal) = if release.storage_version == "v1beta1" {
        let mut bad = v1beta1_machine_deployment("probe", "probe-cluster");
        bad.data["spec"]["template"]["spec"]["version"] = json!("not-a-version");
        (bad, "must be a valid semantic version")
    } else {
        let mut bad = machine_deployment("probe", "probe-cluster", "probe", 0);
        bad.data["spec"]["template"]["spec"]["clusterName"] = json!("another-cluster");
        (bad, "must be set to the same value")
    };
    eventually(
        &format!("{}'s webhooks active in the API server", release.what),
        Duration::from_secs(60),
        || {
            let (v1beta1, stored, dry, bad) =
                (v1beta1.clone(), stored.clone(), dry.clone(), bad.clone());
            async move {
                if !manager.alive() {
                    panic!(
                        "Cluster API's manager exited; its log:\n{}",
                        manager.log_text()
                    );
                }
                let md = v1beta1
                    .create(&dry, &v1beta1_machine_deployment("probe", "probe-cluster"))
                    .await
                    .map_err(|e| format!("conversion or defaulting: {e}"))?;
                if md.labels().get(CLUSTER_NAME_LABEL).map(String::as_str) != Some("probe-cluster")
                {
                    return Err("the defaulting webhook is not called yet".into());
                }
                match stored.create(&dry, &bad).await {
                    Err(kube::Error::Api(s)) if s.message.contains(refusal) => Ok(()),
                    other => Err(format!(
                        "the validating webhook is not called yet: {other:?}"
                    )),
                }
            }
        },
    )
    .await;
}

/// The `spec` of a v1beta1 Machine of cluster `cluster` in the shape of
/// Cozystack's (bootstrapped by Talos, on KubeVirt), made by hand: its
/// bootstrap data Secret and its KubevirtMachine `name` are named, not made,
/// so Cluster API's Machine controller waits for its infrastructure. Its
/// cluster must exist: Cluster API keeps its finalizer on a Machine of no
/// Cluster for ever (internal/controllers/machine/machine_controller.go
/// `Reconcile`, v1.10.1).
pub fn cozystack_machine_spec(cluster: &str, name: &str) -> Value {
    json!({
        "clusterName": cluster,
        "bootstrap": {"dataSecretName": format!("{name}-bootstrap-data")},
        "infrastructureRef": {
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
            "kind": "KubevirtMachine",
            "name": name,
        },
    })
}

/// The `spec` of a v1beta1 MachineDeployment of cluster `cluster` with no
/// machines, in the shape of Cozystack's tenant chart.
pub fn cozystack_machine_deployment_spec(cluster: &str, name: &str) -> Value {
    json!({
        "clusterName": cluster,
        "replicas": 0,
        "selector": {"matchLabels": {"cluster.x-k8s.io/deployment-name": name}},
        "template": {
            "metadata": {"labels": {"cluster.x-k8s.io/deployment-name": name}},
            "spec": {
                "clusterName": cluster,
                "bootstrap": {"configRef": {
                    "apiVersion": "bootstrap.cluster.x-k8s.io/v1alpha3",
                    "kind": "TalosConfigTemplate",
                    "name": name,
                }},
                "infrastructureRef": {
                    "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
                    "kind": "KubevirtMachineTemplate",
                    "name": name,
                },
            },
        },
    })
}

/// A MachineDeployment as `cluster.x-k8s.io/v1beta1` writes it (Cozystack's
/// tenant chart writes this version): references with `apiVersion`, of
/// cluster `cluster`, its machines of HarnessMachineTemplate `name`.
pub fn v1beta1_machine_deployment(name: &str, cluster: &str) -> DynamicObject {
    let mut md = DynamicObject::new(name, &core_resource("v1beta1", "MachineDeployment"));
    md.data = json!({"spec": {
        "clusterName": cluster,
        "replicas": 1,
        "selector": {"matchLabels": {"harness.volume-gate.test/md": name}},
        "template": {
            "metadata": {"labels": {"harness.volume-gate.test/md": name}},
            "spec": {
                "clusterName": cluster,
                "version": "v1.34.0",
                "bootstrap": {"dataSecretName": format!("{cluster}-bootstrap")},
                "infrastructureRef": {
                    "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
                    "kind": "HarnessMachineTemplate",
                    "name": name,
                },
            },
        },
    }});
    md
}

/// A v1beta2 MachineDeployment `name` of cluster `cluster` with `replicas`
/// machines of HarnessMachineTemplate `template`, bootstrapped by the data
/// Secret `<cluster>-bootstrap` (no bootstrap provider: Machine
/// `spec.bootstrap.dataSecretName`).
pub fn machine_deployment(
    name: &str,
    cluster: &str,
    template: &str,
    replicas: i32,
) -> DynamicObject {
    let mut md = DynamicObject::new(name, &core_resource("v1beta2", "MachineDeployment"));
    md.data = json!({"spec": {
        "clusterName": cluster,
        "replicas": replicas,
        "selector": {"matchLabels": {"harness.volume-gate.test/md": name}},
        "template": {
            "metadata": {"labels": {"harness.volume-gate.test/md": name}},
            "spec": {
                "clusterName": cluster,
                "version": "v1.34.0",
                "bootstrap": {"dataSecretName": format!("{cluster}-bootstrap")},
                "infrastructureRef": {
                    "apiGroup": "infrastructure.cluster.x-k8s.io",
                    "kind": "HarnessMachineTemplate",
                    "name": template,
                },
            },
        },
    }});
    md
}

/// A plain Cluster API cluster in the management cluster: Cluster
/// (v1beta2) `name` in `namespace`, its HarnessCluster and
/// HarnessControlPlane (`name`), and MachineDeployment `name-md` of one
/// Machine; its API server is harness cluster `cluster`.
pub struct CapiCluster {
    pub namespace: String,
    pub name: String,
    /// The harness cluster that is its API server.
    pub cluster: ClusterInfo,
    pub management: kube::Client,
    /// Its API, as its admin (the kubeconfig Secret's).
    pub api: kube::Client,
}

impl CapiCluster {
    /// The MachineDeployment's name.
    pub fn machine_deployment(&self) -> String {
        format!("{}-md", self.name)
    }

    /// Creates cluster `name` in `namespace` (created if needed), the
    /// Cluster labelled with `labels`, on a harness cluster of its own;
    /// returns once its Machine is Running with a Node. Its CSI driver runs
    /// inside it.
    pub async fn create(
        cp: &ControlPlane,
        namespace: &str,
        name: &str,
        labels: BTreeMap<String, String>,
    ) -> CapiCluster {
        Self::create_with(cp, namespace, name, labels, None).await
    }

    /// As [`CapiCluster::create`]; with `csi_controller`, the cluster's CSI
    /// controller runs management-side as that Deployment (its
    /// HarnessCluster says so: [`CSI_CONTROLLER_ANNOTATION`]), which
    /// [`CapiCluster::management_csi`] makes.
    pub async fn create_with(
        cp: &ControlPlane,
        namespace: &str,
        name: &str,
        labels: BTreeMap<String, String>,
        csi_controller: Option<&str>,
    ) -> CapiCluster {
        capi(cp).await;
        cp.namespace(namespace).await;
        let cluster = cp.cluster_up(&format!("capi-{namespace}-{name}"));
        let management = cp.management_client().await;
        let pp = PostParams::default();
        let create = |kind: &'static str, obj: DynamicObject| {
            let api: Api<DynamicObject> = Api::namespaced_with(
                management.clone(),
                namespace,
                &if kind.starts_with("Harness") {
                    harness_resource(kind)
                } else {
                    core_resource("v1beta2", kind)
                },
            );
            let pp = pp.clone();
            async move {
                api.create(&pp, &obj)
                    .await
                    .unwrap_or_else(|e| panic!("create {kind}: {e}"))
            }
        };
        let annotated = |kind: &'static str, spec: Value| {
            let mut o = DynamicObject::new(name, &harness_resource(kind));
            o.metadata.annotations = Some(BTreeMap::from([(
                CLUSTER_ANNOTATION.to_string(),
                cluster.name.clone(),
            )]));
            o.data = json!({ "spec": spec });
            o
        };
        let mut infra = annotated("HarnessCluster", json!({}));
        if let Some(d) = csi_controller {
            infra
                .metadata
                .annotations
                .get_or_insert_default()
                .insert(CSI_CONTROLLER_ANNOTATION.into(), d.into());
        }
        create("HarnessCluster", infra).await;
        create(
            "HarnessControlPlane",
            annotated("HarnessControlPlane", json!({})),
        )
        .await;
        let mut template = DynamicObject::new(name, &harness_resource("HarnessMachineTemplate"));
        template.data = json!({"spec": {"template": {"spec": {}}}});
        create("HarnessMachineTemplate", template).await;
        // The bootstrap data a bootstrap provider would write; the played
        // machine needs none of it.
        let bootstrap: Secret = serde_json::from_value(json!({
            "metadata": {"name": format!("{name}-bootstrap"), "namespace": namespace,
                         "labels": {CLUSTER_NAME_LABEL: name}},
            "type": "cluster.x-k8s.io/secret",
            "stringData": {"value": "#!/bin/sh\n", "format": "cloud-config"},
        }))
        .unwrap();
        Api::<Secret>::namespaced(management.clone(), namespace)
            .create(&pp, &bootstrap)
            .await
            .expect("create the bootstrap data Secret");
        let mut cl = DynamicObject::new(name, &core_resource("v1beta2", "Cluster"));
        cl.metadata.labels = Some(labels);
        cl.data = json!({"spec": {
            "controlPlaneRef": {"apiGroup": "controlplane.cluster.x-k8s.io", "kind": "HarnessControlPlane", "name": name},
            "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "HarnessCluster", "name": name},
        }});
        create("Cluster", cl).await;
        let md = format!("{name}-md");
        create("MachineDeployment", machine_deployment(&md, name, name, 1)).await;

        let api = client_from(&cluster.kubeconfig).await;
        let c = CapiCluster {
            namespace: namespace.into(),
            name: name.into(),
            cluster,
            management,
            api,
        };
        c.wait_machine_running().await;
        c
    }

    /// Makes the cluster's management-side CSI controller `m` in its
    /// namespace, as kubevirt-csi-driver's split deployment does: the
    /// ServiceAccount, the Role that may free disks (DataVolumes) and hot-plug
    /// them, its RoleBinding, the ClusterRole to read PVs and its binding,
    /// and the controller Deployment, with `--infra-cluster-labels` and as
    /// that ServiceAccount. The simulator plays the controller's work; no
    /// Pod runs (replicas 0). Each namespaced object is owned by the
    /// Cluster (blocking its deletion), as an operator's manifests would
    /// make it go with the Cluster.
    pub async fn management_csi(&self, m: &ManagementCsi) {
        let cluster = self
            .api(&core_resource("v1beta2", "Cluster"))
            .get(&self.name)
            .await
            .expect("get the Cluster");
        let owner = json!([{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
            "name": self.name, "uid": cluster.metadata.uid, "blockOwnerDeletion": true}]);
        let ns = &self.namespace;
        let meta = |name: &str| json!({"name": name, "namespace": ns, "ownerReferences": owner});
        let flag = m
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        let cluster_role = format!("{ns}-{}-cluster", m.identity);
        let docs = [
            json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(&m.identity)}),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta(&m.identity),
            "rules": [
                {"apiGroups": ["cdi.kubevirt.io"], "resources": ["datavolumes"], "verbs": ["get", "create", "delete"]},
                {"apiGroups": ["kubevirt.io"], "resources": ["virtualmachineinstances", "virtualmachines"], "verbs": ["list", "get"]},
                {"apiGroups": ["subresources.kubevirt.io"], "resources": ["virtualmachines/addvolume", "virtualmachines/removevolume", "virtualmachineinstances/removevolume"], "verbs": ["update"]},
                {"apiGroups": ["snapshot.storage.k8s.io"], "resources": ["volumesnapshots"], "verbs": ["get", "create", "delete"]},
                {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get", "patch"]},
            ]}),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta(&m.identity),
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": m.identity},
                "subjects": [{"kind": "ServiceAccount", "name": m.identity, "namespace": ns}]}),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": {"name": cluster_role},
                "rules": [{"apiGroups": [""], "resources": ["persistentvolumes"], "verbs": ["get"]}]}),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": cluster_role},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
                "subjects": [{"kind": "ServiceAccount", "name": m.identity, "namespace": ns}]}),
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(&m.controller),
                "spec": {"replicas": 0,
                    "selector": {"matchLabels": {"app": m.controller}},
                    "template": {"metadata": {"labels": {"app": m.controller}},
                        "spec": {"serviceAccountName": m.identity, "containers": [{
                            "name": "csi-driver", "image": "quay.io/kubevirt/kubevirt-csi-driver:latest",
                            "args": [format!("--infra-cluster-namespace={ns}"),
                                     format!("--infra-cluster-labels={flag}"),
                                     "--run-node-service=false", "--run-controller-service=true"]}]}}}}),
        ];
        for d in &docs {
            manifests::apply(&self.management, d).await;
        }
    }

    /// The cluster's DataVolumes in its namespace (a management-side
    /// controller's disks), by `labels`.
    pub async fn data_volumes(&self, labels: &BTreeMap<String, String>) -> Vec<String> {
        let selector = labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut v: Vec<String> = self
            .api(&resource(
                "cdi.kubevirt.io",
                "v1beta1",
                "DataVolume",
                "datavolumes",
            ))
            .list(&ListParams::default().labels(&selector))
            .await
            .expect("list DataVolumes")
            .items
            .iter()
            .map(|d| d.name_any())
            .collect();
        v.sort();
        v
    }

    fn api(&self, ar: &ApiResource) -> Api<DynamicObject> {
        Api::namespaced_with(self.management.clone(), &self.namespace, ar)
    }

    /// `kubectl delete cluster` of this cluster as a user runs it (the
    /// harness's kubectl, with `flags` besides), while `watch` collects
    /// events until the Cluster is gone, within `within`; returns what
    /// kubectl said once it has said it deleted it.
    pub async fn kubectl_delete(
        &self,
        cp: &ControlPlane,
        flags: &[&str],
        watch: &mut DeletionWatch,
        within: Duration,
    ) -> String {
        let mut kubectl = cp.kubectl(&cp.management.kubeconfig);
        let timeout = format!("--timeout={}s", within.as_secs().saturating_sub(5).max(1));
        kubectl
            .args(["delete", "cluster", &self.name, "-n", &self.namespace])
            .args(flags)
            .arg(timeout);
        let kubectl = tokio::task::spawn_blocking(move || {
            super::process::run_ok(&mut kubectl, "kubectl delete cluster")
        });
        watch.until_deleted("Cluster", &self.name, within).await;
        let said = kubectl.await.expect("kubectl thread");
        assert!(said.contains("deleted"), "kubectl said: {said}");
        said
    }

    /// The cluster's Machines, as Cluster API labels them.
    pub async fn machines(&self) -> Vec<DynamicObject> {
        self.api(&core_resource("v1beta2", "Machine"))
            .list(&ListParams::default().labels(&format!("{CLUSTER_NAME_LABEL}={}", self.name)))
            .await
            .expect("list Machines")
            .items
    }

    /// Waits until the cluster has one Machine, Running, with a nodeRef.
    pub async fn wait_machine_running(&self) {
        eventually(
            &format!(
                "the Machine of Cluster {}/{} Running with a Node",
                self.namespace, self.name
            ),
            Duration::from_secs(180),
            || async {
                let ms = self.machines().await;
                let m = match ms.as_slice() {
                    [m] => m,
                    other => return Err(format!("{} Machines", other.len())),
                };
                let phase = m.data["status"]["phase"].as_str().unwrap_or("");
                let node = m.data["status"]["nodeRef"]["name"].as_str().unwrap_or("");
                if phase == "Running" && !node.is_empty() {
                    Ok(())
                } else {
                    Err(format!("phase {phase:?}, nodeRef {node:?}"))
                }
            },
        )
        .await;
    }

    /// The simulated driver's StorageClass in the cluster, as its chart
    /// makes it (tests/fixtures/charts/csi): freed with the claim.
    pub async fn storage_class(&self) {
        let sc: StorageClass = serde_json::from_value(json!({
            "metadata": {"name": STORAGE_CLASS},
            "provisioner": DRIVER, "reclaimPolicy": "Delete", "volumeBindingMode": "Immediate",
        }))
        .unwrap();
        match Api::<StorageClass>::all(self.api.clone())
            .create(&PostParams::default(), &sc)
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("create StorageClass {STORAGE_CLASS}: {e}"),
        }
    }

    /// In namespace `ns` of the cluster: for each of `pods`, claims of the
    /// driver's StorageClass, mounted by a Pod of that name. Returns once
    /// every claim is Bound and every Pod Running.
    pub async fn workload(&self, ns: &str, pods: &[(&str, &[&str])]) {
        self.storage_class().await;
        let namespaces: Api<Namespace> = Api::all(self.api.clone());
        let n: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap();
        match namespaces.create(&PostParams::default(), &n).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("create namespace {ns} in the cluster: {e}"),
        }
        // The API server refuses Pods of a namespace until its controller
        // manager has made its ServiceAccount `default`.
        let sas: Api<ServiceAccount> = Api::namespaced(self.api.clone(), ns);
        eventually(
            &format!("ServiceAccount {ns}/default in the cluster"),
            Duration::from_secs(60),
            || async {
                sas.get("default")
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            },
        )
        .await;
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.api.clone(), ns);
        let pods_api: Api<Pod> = Api::namespaced(self.api.clone(), ns);
        let mut total = 0;
        for (pod, names) in pods {
            for c in *names {
                let pvc: PersistentVolumeClaim = serde_json::from_value(json!({
                    "metadata": {"name": c, "namespace": ns},
                    "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": STORAGE_CLASS,
                             "resources": {"requests": {"storage": "1Gi"}}},
                }))
                .unwrap();
                claims
                    .create(&PostParams::default(), &pvc)
                    .await
                    .unwrap_or_else(|e| panic!("create claim {ns}/{c}: {e}"));
                total += 1;
            }
            let volumes: Vec<Value> = names
                .iter()
                .enumerate()
                .map(|(i, c)| json!({"name": format!("v{i}"), "persistentVolumeClaim": {"claimName": c}}))
                .collect();
            let p: Pod = serde_json::from_value(json!({
                "metadata": {"name": pod, "namespace": ns},
                "spec": {"terminationGracePeriodSeconds": 1,
                         "containers": [{"name": "app", "image": "busybox"}], "volumes": volumes},
            }))
            .unwrap();
            pods_api
                .create(&PostParams::default(), &p)
                .await
                .unwrap_or_else(|e| panic!("create Pod {ns}/{pod}: {e}"));
        }
        eventually(
            &format!(
                "{total} claims bound and {} Pods running in {}",
                pods.len(),
                self.name
            ),
            Duration::from_secs(180),
            || async {
                let bound = claims
                    .list(&ListParams::default())
                    .await
                    .map_err(|e| e.to_string())?
                    .items
                    .iter()
                    .filter(|c| c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound"))
                    .count();
                let running = pods_api
                    .list(&ListParams::default())
                    .await
                    .map_err(|e| e.to_string())?
                    .items
                    .iter()
                    .filter(|p| {
                        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                    })
                    .count();
                if bound == total && running == pods.len() {
                    Ok(())
                } else {
                    Err(format!("{bound} bound, {running} running"))
                }
            },
        )
        .await;
    }
}

/// One watch event of a [`DeletionWatch`].
#[derive(Clone, Debug)]
pub struct Seen {
    pub kind: &'static str,
    /// `ADDED`, `MODIFIED` or `DELETED`.
    pub event: &'static str,
    pub name: String,
    /// The object's resourceVersion in the event: on one etcd, its
    /// revision, which orders writes across kinds (a DELETED event carries
    /// the revision of the deletion).
    pub revision: u64,
    /// Whether the object carries a deletionTimestamp.
    pub deleting: bool,
    /// Its annotations in the event (the record, on a Cluster).
    pub annotations: BTreeMap<String, String>,
}

/// Watches on a cluster's namespace opened before a deletion, one per kind
/// of the cascade: what Cluster API deleted and in which order, observed
/// durably (every event from the moment the watch opened).
pub struct DeletionWatch {
    rx: tokio::sync::mpsc::UnboundedReceiver<Result<Seen, String>>,
    pub seen: Vec<Seen>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// The kinds a Cluster's deletion goes through, in Cluster API's order
/// (core/reconcilers/cluster/cluster_controller.go `reconcileDelete`):
/// descendants, the control plane, the infrastructure cluster, the Cluster.
pub const CASCADE: [&str; 7] = [
    "MachineDeployment",
    "MachineSet",
    "Machine",
    "HarnessMachine",
    "HarnessControlPlane",
    "HarnessCluster",
    "Cluster",
];

impl DeletionWatch {
    /// Opens the watches of [`CASCADE`] in `namespace`, each from a list's
    /// resourceVersion: nothing after this call is missed.
    pub async fn open(client: &kube::Client, namespace: &str) -> DeletionWatch {
        Self::open_with(client, namespace, Vec::new()).await
    }

    /// As [`DeletionWatch::open`], with the watches of `extra` kinds too.
    pub async fn open_with(
        client: &kube::Client,
        namespace: &str,
        extra: Vec<(&'static str, ApiResource)>,
    ) -> DeletionWatch {
        use futures::StreamExt;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        let cascade = CASCADE.iter().map(|&kind| {
            let ar = if kind.starts_with("Harness") {
                harness_resource(kind)
            } else {
                core_resource("v1beta2", kind)
            };
            (kind, ar)
        });
        for (kind, ar) in cascade.chain(extra) {
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &ar);
            let list = api
                .list(&ListParams::default())
                .await
                .unwrap_or_else(|e| panic!("list {kind}: {e}"));
            let rv = list
                .metadata
                .resource_version
                .expect("list resourceVersion");
            let stream = api
                .watch(&kube::api::WatchParams::default().timeout(290), &rv)
                .await
                .unwrap_or_else(|e| panic!("watch {kind}: {e}"));
            let tx = tx.clone();
            tasks.push(tokio::spawn(async move {
                let mut stream = stream.boxed();
                while let Some(ev) = stream.next().await {
                    let (event, obj) = match ev {
                        Ok(kube::api::WatchEvent::Added(o)) => ("ADDED", o),
                        Ok(kube::api::WatchEvent::Modified(o)) => ("MODIFIED", o),
                        Ok(kube::api::WatchEvent::Deleted(o)) => ("DELETED", o),
                        Ok(kube::api::WatchEvent::Bookmark(_)) => continue,
                        Ok(kube::api::WatchEvent::Error(e)) => {
                            let _ = tx.send(Err(format!("watch {kind}: {e:?}")));
                            return;
                        }
                        Err(e) => {
                            let _ = tx.send(Err(format!("watch {kind}: {e}")));
                            return;
                        }
                    };
                    let seen = Seen {
                        kind,
                        event,
                        name: obj.metadata.name.clone().unwrap_or_default(),
                        revision: obj
                            .metadata
                            .resource_version
                            .as_deref()
                            .and_then(|v| v.parse().ok())
                            .expect("a numeric resourceVersion"),
                        deleting: obj.metadata.deletion_timestamp.is_some(),
                        annotations: obj.metadata.annotations.clone().unwrap_or_default(),
                    };
                    if tx.send(Ok(seen)).is_err() {
                        return;
                    }
                }
                let _ = tx.send(Err(format!("watch {kind} ended")));
            }));
        }
        DeletionWatch {
            rx,
            seen: Vec::new(),
            tasks,
        }
    }

    /// Collects events until `kind` `name` is DELETED; panics after
    /// `timeout`, or if a watch fails, with what was seen.
    pub async fn until_deleted(&mut self, kind: &str, name: &str, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        while !self
            .seen
            .iter()
            .any(|s| s.kind == kind && s.name == name && s.event == "DELETED")
        {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(Ok(s))) => self.seen.push(s),
                Ok(Some(Err(e))) => panic!("{e}; seen:\n{}", self.render()),
                Ok(None) => panic!("every watch ended; seen:\n{}", self.render()),
                Err(_) => panic!(
                    "{kind} {name} not deleted within {timeout:?}; seen:\n{}",
                    self.render()
                ),
            }
        }
    }

    /// The revision at which `kind` `name` was DELETED.
    pub fn deleted_at(&self, kind: &str, name: &str) -> Option<u64> {
        self.seen
            .iter()
            .find(|s| s.kind == kind && s.name == name && s.event == "DELETED")
            .map(|s| s.revision)
    }

    /// The revision at which `kind` `name` was first seen being deleted
    /// (its deletionTimestamp set): when someone deleted it.
    pub fn deletion_requested_at(&self, kind: &str, name: &str) -> Option<u64> {
        self.seen
            .iter()
            .filter(|s| s.kind == kind && s.name == name && s.deleting)
            .map(|s| s.revision)
            .min()
    }

    /// The first revision at which `kind` `name` carried annotation `key`
    /// with `value` (the record's phase on a Cluster).
    pub fn annotated_at(&self, kind: &str, name: &str, key: &str, value: &str) -> Option<u64> {
        self.seen
            .iter()
            .filter(|s| s.kind == kind && s.name == name)
            .filter(|s| s.annotations.get(key).map(String::as_str) == Some(value))
            .map(|s| s.revision)
            .min()
    }

    /// The revision at which Cluster `name` was first recorded with
    /// `phase` under the record's phase key `key`; panics with what was seen
    /// and `log` (the worker's) if it never was.
    pub fn recorded(&self, name: &str, key: &str, phase: &str, log: &str) -> u64 {
        self.annotated_at("Cluster", name, key, phase)
            .unwrap_or_else(|| {
                panic!(
                    "the Cluster was never recorded {phase}:\n{}\nworker log:\n{log}",
                    self.render()
                )
            })
    }

    /// The names of `kind` seen at all.
    pub fn names(&self, kind: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .seen
            .iter()
            .filter(|s| s.kind == kind)
            .map(|s| s.name.clone())
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// Every event seen, in revision order.
    pub fn render(&self) -> String {
        let mut seen = self.seen.clone();
        seen.sort_by_key(|s| s.revision);
        seen.iter()
            .map(|s| {
                format!(
                    "  {:>8} {:<8} {} {}{}",
                    s.revision,
                    s.event,
                    s.kind,
                    s.name,
                    if s.deleting { " (deleting)" } else { "" }
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for DeletionWatch {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}
