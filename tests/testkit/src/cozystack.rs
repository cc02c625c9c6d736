//! Cozystack as it ships: the identities its controllers run as, and what
//! the fixture plays of them, each read from Cozystack's release
//! ([`RELEASE`], github.com/cozystack/cozystack) with the file it was read
//! from. Never chosen to fit volume-gate's code: when the two disagree, the
//! code changes (`docs/census.md`, where each is used).

use serde_json::json;

use super::cluster::ControlPlane;
use super::manifests;

/// The Cozystack release every fact here was read from.
pub const RELEASE: &str = "v1.6.2";

/// A platform component's identity: the ServiceAccount its Pods run as,
/// and where in Cozystack's release that is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    /// What it is, for messages.
    pub component: &'static str,
    pub namespace: &'static str,
    pub service_account: &'static str,
    /// The file of Cozystack's release (at [`RELEASE`]) that says so.
    pub source: &'static str,
}

impl Identity {
    /// The username its requests carry.
    pub fn username(&self) -> String {
        format!(
            "system:serviceaccount:{}:{}",
            self.namespace, self.service_account
        )
    }
}

/// Flux: one Deployment `flux` in `cozy-fluxcd` whose every container
/// (helm-controller v1.5.0 among them) runs as ServiceAccount `flux`, bound
/// to cluster-admin by ClusterRoleBinding `flux`; the flux-shard-operator's
/// `helm-controller-shard<i>` Deployments copy that Pod spec, identity
/// included (`internal/fluxshardoperator/provisioner.go`
/// `BuildShardDeployment`).
pub const FLUX: Identity = Identity {
    component: "Flux (helm-controller and its shards)",
    namespace: "cozy-fluxcd",
    service_account: "flux",
    source: "internal/fluxinstall/manifests/fluxcd.yaml (ServiceAccount flux, Deployment flux, ClusterRoleBinding flux)",
};

/// cozystack-controller: its `ApplicationDefinitionHelmReconciler` sets
/// parents' `spec.chartRef` from their ApplicationDefinition.
pub const COZYSTACK_CONTROLLER: Identity = Identity {
    component: "cozystack-controller",
    namespace: "cozy-system",
    service_account: "cozystack-controller",
    source: "packages/system/cozystack-controller/templates/sa.yaml, deployment.yaml; installed into cozy-system by packages/core/platform/sources/cozystack-engine.yaml",
};

/// cozystack-api: the Application API; it creates, replaces (on every
/// Application update) and deletes parents as itself, not as the user.
pub const COZYSTACK_API: Identity = Identity {
    component: "cozystack-api",
    namespace: "cozy-system",
    service_account: "cozystack-api",
    source: "packages/system/cozystack-api/templates/sa.yaml, deployment.yaml",
};

/// cozystack-operator: turns Packages into HelmReleases and namespaces.
pub const COZYSTACK_OPERATOR: Identity = Identity {
    component: "cozystack-operator (Packages)",
    namespace: "cozy-system",
    service_account: "cozystack",
    source: "packages/core/installer/templates/cozystack-operator.yaml",
};

/// flux-shard-operator: patches `sharding.fluxcd.io/key` on tenants'
/// HelmReleases (labels only).
pub const FLUX_SHARD_OPERATOR: Identity = Identity {
    component: "flux-shard-operator",
    namespace: "cozy-fluxcd",
    service_account: "flux-shard-operator",
    source: "packages/system/flux-shard-operator/templates/rbac.yaml; packages/core/platform/sources/flux-shard-operator.yaml",
};

/// flux-plunger: toggles `spec.suspend` of a release stuck with "has no
/// deployed releases" and annotates it.
pub const FLUX_PLUNGER: Identity = Identity {
    component: "flux-plunger",
    namespace: "cozy-fluxcd",
    service_account: "flux-plunger",
    source: "packages/system/flux-plunger/templates/serviceaccount.yaml; packages/core/platform/sources/flux-plunger.yaml",
};

/// The platform chart's migration Job (pre-install, pre-upgrade hook),
/// bound to cluster-admin.
pub const MIGRATION_HOOK: Identity = Identity {
    component: "platform migrations",
    namespace: "cozy-system",
    service_account: "cozystack-migration-hook",
    source: "packages/core/platform/templates/migration-hook.yaml",
};

/// Kamaji's controller: the TenantControlPlane's Deployment, Service and
/// Secrets (the admin kubeconfig among them).
pub const KAMAJI: Identity = Identity {
    component: "Kamaji",
    namespace: "cozy-kamaji",
    service_account: "kamaji-controller-manager",
    source: "packages/system/kamaji/charts/kamaji/values.yaml (serviceAccount); packages/core/platform/sources/kamaji.yaml (namespace)",
};

/// Cluster API's core controllers (Cluster, MachineDeployment, MachineSet,
/// Machine).
pub const CAPI: Identity = Identity {
    component: "Cluster API core",
    namespace: "cozy-cluster-api",
    service_account: "capi-manager",
    source: "packages/system/capi-providers-core (components: ServiceAccount capi-manager); namespace from the Provider CR's release namespace (sources/capi-provider-*.yaml)",
};

/// The Kamaji control plane provider for Cluster API (KamajiControlPlane
/// -> TenantControlPlane).
pub const CAPI_KAMAJI: Identity = Identity {
    component: "Cluster API Kamaji control plane provider",
    namespace: "cozy-cluster-api",
    service_account: "capi-kamaji-controller-manager",
    source: "packages/system/capi-providers-cpprovider (components)",
};

/// Cluster API's KubeVirt infrastructure provider (the tenant's VMs).
pub const CAPK: Identity = Identity {
    component: "Cluster API KubeVirt provider",
    namespace: "cozy-cluster-api",
    service_account: "capk-manager",
    source: "packages/system/capi-providers-infraprovider (components)",
};

/// KubeVirt's virt-controller. The ServiceAccount is made by virt-operator
/// at run time, so its name is upstream's (`kubevirt-controller`), not a
/// file of Cozystack's; the namespace is Cozystack's.
pub const KUBEVIRT: Identity = Identity {
    component: "KubeVirt virt-controller",
    namespace: "cozy-kubevirt",
    service_account: "kubevirt-controller",
    source: "packages/system/kubevirt-operator (namespace cozy-kubevirt); ServiceAccount name from KubeVirt's virt-operator, not in Cozystack's files",
};

/// CDI's controller (DataVolumes, their PVCs). As for KubeVirt, the
/// ServiceAccount is the operator's (`cdi-sa`).
pub const CDI: Identity = Identity {
    component: "CDI",
    namespace: "cozy-kubevirt-cdi",
    service_account: "cdi-sa",
    source: "packages/system/kubevirt-cdi-operator (namespace cozy-kubevirt-cdi); ServiceAccount name from CDI's operator, not in Cozystack's files",
};

/// The lineage webhook: labels Pods, Secrets, Services and PVCs with their
/// application, inside their creator's own request.
pub const LINEAGE_WEBHOOK: Identity = Identity {
    component: "lineage-controller-webhook",
    namespace: "cozy-system",
    service_account: "lineage-controller-webhook",
    source: "packages/system/lineage-controller-webhook/templates/sa.yaml",
};

/// The labels of Flux's namespace: flux-aio's own
/// (`internal/fluxinstall/manifests/fluxcd.yaml`, Namespace cozy-fluxcd),
/// and `cozystack.io/system: "true"`, which the Package operator adds to
/// every namespace of a Package component not named `tenant-*`
/// (`internal/operator/package_reconciler.go` `reconcileNamespaces`):
/// flux-plunger and flux-shard-operator install there.
pub const FLUX_NAMESPACE_LABELS: [(&str, &str); 5] = [
    ("app.kubernetes.io/name", "flux"),
    ("app.kubernetes.io/part-of", "flux"),
    ("app.kubernetes.io/version", "v2.8.0"),
    ("pod-security.kubernetes.io/enforce", "privileged"),
    (SYSTEM_NAMESPACE_LABEL, "true"),
];

/// The label the Package operator puts on the namespaces of system
/// packages (`internal/operator/package_reconciler.go`), and which the
/// tenant namespaces' ingress policy admits
/// (`packages/apps/tenant/templates/networkpolicy.yaml`, `<tenant>-ingress`).
pub const SYSTEM_NAMESPACE_LABEL: &str = "cozystack.io/system";

/// helm-controller's arguments in Cozystack's `flux` Deployment
/// (`internal/fluxinstall/manifests/fluxcd.yaml`, container
/// helm-controller, image `ghcr.io/fluxcd/helm-controller:v1.5.0`), in
/// order, but its listening addresses, which the fixture picks on
/// loopback. What the fixture changes, and why, is [`super::flux::FluxConfig`];
/// it builds v1.6.0, the closest version the Go module proxy serves
/// (`tests/flux/go.mod`; v1.5.x answered 403), and `docs/census.md` says
/// what differs.
pub const HELM_CONTROLLER_ARGS: [&str; 8] = [
    "--watch-all-namespaces",
    "--log-level=info",
    "--log-encoding=json",
    "--enable-leader-election=false",
    "--watch-label-selector=!sharding.fluxcd.io/key",
    "--concurrent=5",
    "--requeue-dependency=30s",
    "--feature-gates=ExternalArtifact=true",
];

/// Where the platform's chart artifacts are, and what they are named:
/// Cozystack's PackageSource `cozystack.kubernetes-application` (variant
/// `kubevirt`) makes one ExternalArtifact per component in `cozy-system`,
/// named `<source>-<variant>-<component>` with dots as dashes
/// (`internal/operator/packagesource_reconciler.go`,
/// `packages/core/platform/sources/kubernetes-application.yaml`); the
/// ApplicationDefinition `kubernetes` points parents at the first
/// (`packages/system/kubernetes-rd/cozyrds/kubernetes.yaml`), the parent
/// chart its children at the others
/// (`packages/apps/kubernetes/templates/helmreleases/*.yaml`).
pub const ARTIFACT_NAMESPACE: &str = "cozy-system";
pub const PARENT_ARTIFACT: &str = "cozystack-kubernetes-application-kubevirt-kubernetes";

/// The tenant chart's artifacts and the fixture chart
/// (`tests/fixtures/charts/<chart>`) each serves: the parent's, the CSI
/// driver's (`kubevirt-csi-node`), and two addons'.
pub fn tenant_artifacts() -> [(String, &'static str); 4] {
    [
        (PARENT_ARTIFACT.to_string(), "kubernetes"),
        (format!("{PARENT_ARTIFACT}-kubevirt-csi-node"), "csi"),
        (format!("{PARENT_ARTIFACT}-cilium"), "demo"),
        (format!("{PARENT_ARTIFACT}-coredns"), "demo"),
    ]
}

/// The Secret of a tenant namespace's platform values, which every parent
/// release reads (`valuesFrom`).
pub const NAMESPACE_VALUES: &str = "cozystack-values";

/// Writes `namespace`'s `cozystack-values` Secret, as the tenant app does
/// for each tenant namespace (`packages/apps/tenant/templates/namespace.yaml`:
/// `values.yaml` with `_cluster` and `_namespace`, labelled for Flux to
/// watch), the namespace its own etcd's.
pub async fn write_namespace_values(client: &kube::Client, namespace: &str) {
    let values = format!(
        "_cluster: {{}}\n_namespace:\n  etcd: {namespace:?}\n  ingress: \"\"\n  gateway: \"\"\n  monitoring: \"\"\n  seaweedfs: \"\"\n  host: \"\"\n"
    );
    manifests::apply(
        client,
        &json!({"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": NAMESPACE_VALUES, "namespace": namespace,
                             "labels": {"reconcile.fluxcd.io/watch": "Enabled"}},
                "type": "Opaque", "stringData": {"values.yaml": values}}),
    )
    .await;
}

/// Creates `identity`'s namespace (with `labels`) and ServiceAccount and
/// binds it to cluster-admin, as Cozystack binds Flux, the operator and
/// the migration hook; returns a kubeconfig that acts as it. For the
/// others the gate's answer is what is tested, not Cozystack's RBAC, which
/// is Cozystack's own to keep right.
pub async fn act_as(
    cp: &ControlPlane,
    identity: &Identity,
    labels: &[(&str, &str)],
) -> std::path::PathBuf {
    let client = cp.management_client().await;
    cp.namespace(identity.namespace).await;
    if !labels.is_empty() {
        let labels: serde_json::Map<String, serde_json::Value> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        let api: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(client.clone());
        api.patch(
            identity.namespace,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"metadata": {"labels": labels}})),
        )
        .await
        .unwrap_or_else(|e| panic!("label namespace {}: {e}", identity.namespace));
    }
    manifests::apply(
        &client,
        &json!({"apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": identity.service_account, "namespace": identity.namespace}}),
    )
    .await;
    manifests::apply(
        &client,
        &json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": format!("{}-{}", identity.namespace, identity.service_account)},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
                "subjects": [{"kind": "ServiceAccount", "name": identity.service_account,
                              "namespace": identity.namespace}]}),
    )
    .await;
    cp.service_account_kubeconfig(identity.namespace, identity.service_account)
        .await
}

/// The directory `tests/cozystack/build.sh` prints: `cozystack-controller`
/// and the CRDs of what it watches, `crds/`.
pub fn controller_dir() -> std::path::PathBuf {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| super::cluster::run_build_script("tests/cozystack/build.sh"))
        .clone()
}

pub fn application_definition_resource() -> kube::core::ApiResource {
    kube::core::ApiResource::from_gvk_with_plural(
        &kube::core::GroupVersionKind::gvk("cozystack.io", "v1alpha1", "ApplicationDefinition"),
        "applicationdefinitions",
    )
}

/// Cozystack's ApplicationDefinition `kubernetes`
/// (`packages/system/kubernetes-rd/cozyrds/kubernetes.yaml`), the parts
/// cozystack-controller reads: the application's kind, and the release's
/// prefix, labels and chart (`chart_ref`: the parent artifact's name in
/// [`ARTIFACT_NAMESPACE`]). Its OpenAPI schema and dashboard are the
/// Application API's, which does not run here: the smallest the CRD
/// accepts.
pub fn kubernetes_application_definition(chart_ref: &str) -> serde_json::Value {
    json!({"apiVersion": "cozystack.io/v1alpha1", "kind": "ApplicationDefinition",
    "metadata": {"name": "kubernetes"},
    "spec": {
        "application": {"kind": "Kubernetes", "singular": "kubernetes", "plural": "kuberneteses",
                        "openAPISchema": "{\"type\":\"object\"}"},
        "release": {"prefix": "kubernetes-", "labels": {"sharding.fluxcd.io/key": "tenants"},
                    "chartRef": {"kind": "ExternalArtifact", "name": chart_ref,
                                 "namespace": ARTIFACT_NAMESPACE}},
        "dashboard": {"category": "IaaS", "singular": "Kubernetes", "plural": "Kubernetes"},
    }})
}

/// The real cozystack-controller (v1.6.1's, the same code as v1.6.2's:
/// `tests/cozystack/go.mod`) against the management cluster, as
/// [`COZYSTACK_CONTROLLER`], with the arguments of Cozystack's Deployment
/// (`packages/system/cozystack-controller/templates/deployment.yaml`:
/// `--zap-log-level=info`), its probe on loopback, and
/// `--disable-telemetry` (the default values send telemetry to
/// telemetry.cozystack.io, which this machine cannot reach).
pub struct CozystackController {
    pub process: super::process::Process,
}

impl CozystackController {
    /// Installs the CRDs of every kind it watches, then starts it; returns
    /// once it answers its readiness probe.
    pub async fn start(cp: &ControlPlane) -> CozystackController {
        let dir = controller_dir();
        let client = cp.management_client().await;
        let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(dir.join("crds"))
            .expect("crds")
            .map(|e| e.expect("entry").path())
            .collect();
        files.sort();
        for f in &files {
            manifests::apply_file(&client, f).await;
        }
        for f in &files {
            let text = std::fs::read_to_string(f).expect("crd");
            let doc: serde_json::Value = serde_saphyr::from_multiple(&text)
                .expect("crd yaml")
                .into_iter()
                .find(|d: &serde_json::Value| !d.is_null())
                .expect("a CRD");
            let name = doc["metadata"]["name"].as_str().expect("crd name");
            super::gate::wait_crd_established(&client, name).await;
        }
        cp.namespace(ARTIFACT_NAMESPACE).await;
        let kubeconfig = act_as(
            cp,
            &COZYSTACK_CONTROLLER,
            &[(SYSTEM_NAMESPACE_LABEL, "true")],
        )
        .await;
        let probe = super::gate::free_port();
        let mut cmd = std::process::Command::new(dir.join("cozystack-controller"));
        crate::process::go_program(&mut cmd);
        cmd.env("KUBECONFIG", &kubeconfig).args([
            "--zap-log-level=info".to_string(),
            "--disable-telemetry".into(),
            format!("--health-probe-bind-address=127.0.0.1:{probe}"),
            "--metrics-bind-address=0".into(),
        ]);
        let log = cp
            .state
            .join("logs")
            .join(format!("{}.log", cp.unique("cozystack-controller")));
        let process = super::process::Process::start("cozystack-controller", cmd, log);
        super::wait::eventually(
            "cozystack-controller /readyz",
            std::time::Duration::from_secs(90),
            || async {
                if !process.alive() {
                    panic!(
                        "cozystack-controller exited; its log:\n{}",
                        process.log_text()
                    );
                }
                match super::gate::http_get(probe, "/readyz").await {
                    Ok((200, _)) => Ok(()),
                    Ok((code, body)) => Err(format!("{code} {body}")),
                    Err(e) => Err(e),
                }
            },
        )
        .await;
        CozystackController { process }
    }

    pub fn log(&self) -> String {
        self.process.log_text()
    }
}
