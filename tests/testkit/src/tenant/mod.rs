//! A Cozystack tenant Kubernetes cluster, built as Cozystack builds it: the
//! namespace, the parent and child HelmReleases with the real labels, the
//! control plane objects, and `R-admin-kubeconfig` pointing at a real tenant
//! API server of the harness; and workloads with claims inside it.
//!
//! [`Tenant`] is made here ([`Tenant::create`], [`Tenant::attach`]); what
//! it does is grouped by where it acts:
//!
//! - `parent`: the parent release and the record on it, read from its history;
//! - `workload`: inside the tenant cluster (claims, Pods, what is bound);
//! - `access`: who may reach and act on it (its admin kubeconfig, overrides);
//! - `driver`: the simulated CSI driver and control plane;
//! - `management`: its disks and namespace on the management cluster.

mod access;
mod driver;
mod management;
mod parent;
mod snapshot;
mod workload;

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};

use super::cluster::{ClusterInfo, ControlPlane, client_from};
use super::cozystack;
use super::flux::{FLUX_FINALIZER, Flux, ready_condition};
use super::gate::helmrelease_resource;
use super::history::ParentHistory;
use super::wait::eventually;

// Re-exported where they were before the split.
pub use access::wait_authorized;
pub use management::{
    InfraObjects, bare_parent, delete_unreleasable_disk, paper_parent, unreleasable_disk,
    wait_namespace_gone,
};
pub use parent::is_csi_release_refusal;
pub use snapshot::{DRIVER, SNAPSHOT_GROUP, Taken, content_resource, snapshot_resource};

pub const STORAGE_CLASS: &str = "sim";

pub const RETAIN_STORAGE_CLASS: &str = "sim-retain";

pub const CLUSTER_ANNOTATION: &str = "harness.volume-gate.test/cluster";

/// The simulated kubelet's node (simNodeName in the harness).
pub const SIM_NODE: &str = "sim-node";

pub fn resource(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

pub fn kcp_resource() -> ApiResource {
    resource(
        "controlplane.cluster.x-k8s.io",
        "v1alpha1",
        "KamajiControlPlane",
        "kamajicontrolplanes",
    )
}

pub fn tcp_resource() -> ApiResource {
    resource(
        "kamaji.clastix.io",
        "v1alpha1",
        "TenantControlPlane",
        "tenantcontrolplanes",
    )
}

/// Cluster API's Machine, at the version Cozystack's chart writes.
pub fn machine_resource() -> ApiResource {
    resource("cluster.x-k8s.io", "v1beta1", "Machine", "machines")
}

pub fn datavolume_resource() -> ApiResource {
    resource("cdi.kubevirt.io", "v1beta1", "DataVolume", "datavolumes")
}

pub struct Tenant {
    /// The tenant namespace in the management cluster.
    pub namespace: String,
    /// R, the parent release's name.
    pub name: String,
    pub cluster: ClusterInfo,
    pub management: kube::Client,
    pub api: kube::Client,
    /// Every version of the parent release since before it was created.
    pub history: ParentHistory,
}

/// What [`Tenant::create`] makes: tenant `app` (parent `kubernetes-<app>`)
/// in namespace `tenant-<app>` unless another is named (a namespace may hold
/// several tenants), on a tenant cluster of its own, with the tenant
/// chart's default values unless some are given (`nodes`,
/// `deleteDataVolumes`; see the chart's values.yaml). A bare name is the
/// default tenant of that name:
///
/// ```ignore
/// Tenant::create(cp, "a").await;
/// Tenant::create(cp, TenantOptions::new("b").in_namespace(&ns).light()).await;
/// ```
#[derive(Clone, Debug)]
pub struct TenantOptions {
    pub app: String,
    /// `None`: `tenant-<app>`.
    pub namespace: Option<String>,
    pub cluster: TenantCluster,
    /// Chart values over `hookTimeout: 10s`.
    pub values: Value,
}

/// The tenant cluster a tenant's admin kubeconfig leads to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TenantCluster {
    /// A full one of its own (API server, controller manager, scheduler):
    /// the one the control plane started with if no tenant has it yet,
    /// else one started now.
    Own,
    /// A light one of its own, started now: no scheduler, Pods are placed
    /// on the simulated node by `spec.nodeName`.
    Light,
    /// A full one of its own whose components run in a Pod on the
    /// management cluster's real node, as Kamaji runs a tenant's control
    /// plane: Deployment `R` in the tenant's namespace, owned by its
    /// TenantControlPlane (`crate::node`), and with it the CSI controller
    /// `R-kcsi-controller` as a Pod there. Deleting those Pods stops them;
    /// a terminating namespace makes no new ones.
    InPods,
}

impl TenantOptions {
    pub fn new(app: &str) -> TenantOptions {
        TenantOptions {
            app: app.to_string(),
            namespace: None,
            cluster: TenantCluster::Own,
            values: json!({}),
        }
    }

    /// In `namespace`, which may hold other tenants.
    pub fn in_namespace(self, namespace: &str) -> TenantOptions {
        TenantOptions {
            namespace: Some(namespace.to_string()),
            ..self
        }
    }

    /// On a light tenant cluster of its own ([`TenantCluster::Light`]).
    /// Its control plane and CSI controller in Pods on the real node
    /// ([`TenantCluster::InPods`]).
    pub fn in_pods(self) -> TenantOptions {
        TenantOptions {
            cluster: TenantCluster::InPods,
            ..self
        }
    }

    pub fn light(self) -> TenantOptions {
        TenantOptions {
            cluster: TenantCluster::Light,
            ..self
        }
    }

    /// With these chart values.
    pub fn values(self, values: Value) -> TenantOptions {
        TenantOptions { values, ..self }
    }
}

impl From<&str> for TenantOptions {
    fn from(app: &str) -> TenantOptions {
        TenantOptions::new(app)
    }
}

impl From<&String> for TenantOptions {
    fn from(app: &String) -> TenantOptions {
        TenantOptions::new(app)
    }
}

impl TenantCluster {
    fn start(self, cp: &ControlPlane) -> ClusterInfo {
        static FIRST: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);
        match self {
            TenantCluster::Own if FIRST.swap(false, std::sync::atomic::Ordering::SeqCst) => {
                cp.cluster_up(&cp.first_tenant_cluster)
            }
            TenantCluster::Own => cp.cluster_up(&cp.unique("t")),
            TenantCluster::Light => cp.cluster_up_with(&cp.unique("l"), true),
            TenantCluster::InPods => cp.cluster_prepare_pod(&cp.unique("p")),
        }
    }
}

fn obj(ar: &ApiResource, ns: &str, name: &str, labels: Value, body: Value) -> DynamicObject {
    let mut o = DynamicObject::new(name, ar).within(ns);
    o.metadata.labels = serde_json::from_value(labels).unwrap();
    o.data = body;
    o
}

/// The labels Cozystack's API writes on the parent release of Kubernetes
/// application `r` (`pkg/registry/apps/application/rest.go`, v1.6.2): the
/// profile's, its application name, and Flux's shard, `tenants` from the
/// ApplicationDefinition, which the flux-shard-operator's webhook rewrites
/// to `shard<i>` when the release is created
/// (`internal/fluxshardoperator/webhook.go`).
pub fn parent_labels(r: &str) -> BTreeMap<String, String> {
    let profile = super::profile();
    let mut labels = profile.parent.match_labels.clone();
    labels.insert(
        "apps.cozystack.io/application.name".into(),
        r.trim_start_matches(profile.parent.name_prefix.as_str())
            .into(),
    );
    labels.insert("sharding.fluxcd.io/key".into(), "shard1".into());
    labels
}

/// The data of an admin kubeconfig Secret holding `kubeconfig` under each
/// of the profile's keys.
pub fn kubeconfig_data(kubeconfig: &[u8]) -> Value {
    let encoded = base64(kubeconfig);
    Value::Object(
        super::profile()
            .kubeconfig
            .keys
            .into_iter()
            .map(|k| (k, json!(encoded)))
            .collect(),
    )
}

impl Tenant {
    /// Creates the tenant `options` describe, installed the way Cozystack
    /// installs it, by this test binary's real helm-controller: the
    /// TenantControlPlane and its admin kubeconfig first (on the platform
    /// Kamaji's Cluster API provider makes the TenantControlPlane from the
    /// KamajiControlPlane and Kamaji the kubeconfig; here it is made first,
    /// naming the harness cluster that serves it, and the played provider
    /// takes it as its own), then the parent HelmRelease of the
    /// tenant chart (`tests/fixtures/charts/kubernetes`), which installs the
    /// CSI controller and its identity, the Cluster API objects, the child
    /// releases and the pre-delete hook; the children install into the
    /// tenant cluster, its Cluster API objects run on Cluster API's own
    /// controllers ([`super::capi::Core::COZYSTACK`]). Returns once the
    /// parent and R-csi are Ready and, unless `nodes: 0`, a Machine of its
    /// node group has joined ([`Tenant::wait_node_joined`]).
    pub async fn create(cp: &ControlPlane, options: impl Into<TenantOptions>) -> Tenant {
        let TenantOptions {
            app,
            namespace,
            cluster,
            values,
        } = options.into();
        // The tenant chart's Cluster API objects run on Cluster API's own
        // core manager at Cozystack's version (started once per binary).
        super::capi::core(cp, super::capi::Core::COZYSTACK).await;
        let cluster = cluster.start(cp);
        let flux = super::flux::running(cp).await;
        let management = cp.management_client().await;
        let api = client_from(&cluster.kubeconfig).await;
        let profile = super::profile();
        let namespace = namespace.unwrap_or_else(|| format!("tenant-{app}"));
        let name = format!("{}{app}", profile.parent.name_prefix);
        cp.namespace(&namespace).await;
        cp.namespace(cozystack::ARTIFACT_NAMESPACE).await;
        for (artifact, chart) in cozystack::tenant_artifacts() {
            flux.publish_chart(&management, cozystack::ARTIFACT_NAMESPACE, &artifact, chart)
                .await;
        }
        let hrs = Api::namespaced_with(management.clone(), &namespace, &helmrelease_resource());
        let history = ParentHistory::open(hrs.clone(), &name).await;
        let t = Tenant {
            namespace,
            name,
            cluster,
            management,
            api,
            history,
        };
        t.create_control_plane().await;
        let in_pods = !t.cluster.commands.is_empty();
        if in_pods {
            t.run_control_plane_pod(cp).await;
        }
        cozystack::write_namespace_values(&t.management, &t.namespace).await;
        let mut all_values = json!({"hookTimeout": "10s"});
        if in_pods {
            // The CSI controller runs a Pod on the node (one that holds its
            // place: the simulator's plugin and sidecars work while it runs).
            all_values["kcsiController"] = json!({"replicas": 1,
                "image": crate::node::harness_image(cp), "args": ["pause"]});
        }
        if let (Some(all), Some(extra)) = (all_values.as_object_mut(), values.as_object()) {
            all.extend(extra.clone());
        }
        let has_nodes = all_values["nodes"].as_i64() != Some(0);
        let mut parent = t.parent_object(json!({"spec": {
            "interval": "10m",
            "chartRef": {"kind": "ExternalArtifact", "name": cozystack::PARENT_ARTIFACT,
                         "namespace": cozystack::ARTIFACT_NAMESPACE},
            // As cozystack-api writes every parent, and cozystack-controller
            // keeps it (pkg/registry/apps/application/rest.go,
            // internal/controller/applicationdefinition_helmreconciler.go).
            "valuesFrom": [{"kind": "Secret", "name": cozystack::NAMESPACE_VALUES}],
            "values": all_values,
        }}));
        parent.metadata.finalizers = Some(vec![FLUX_FINALIZER.into()]);
        hrs.create(&PostParams::default(), &parent)
            .await
            .expect("create parent HelmRelease");
        for release in [
            t.name.clone(),
            profile
                .csi_release_name(&t.name)
                .expect("Cozystack has a CSI release"),
        ] {
            wait_ready(&hrs, &release, flux).await;
        }
        if has_nodes {
            t.wait_node_joined().await;
        }
        t
    }

    /// The Machines of the tenant's cluster (Cluster API's, made by its
    /// MachineDeployment): each name, phase and `spec.providerID` (its
    /// infrastructure machine's, once provisioned).
    pub async fn machines(&self) -> Vec<(String, String, String)> {
        let machines: Api<DynamicObject> = Api::namespaced_with(
            self.management.clone(),
            &self.namespace,
            &machine_resource(),
        );
        let selector = format!("{}={}", super::capi::CLUSTER_NAME_LABEL, self.name);
        let text = |v: &Value| v.as_str().unwrap_or("").to_string();
        let mut out: Vec<(String, String, String)> = machines
            .list(&kube::api::ListParams::default().labels(&selector))
            .await
            .expect("list the tenant's Machines")
            .items
            .into_iter()
            .map(|m| {
                (
                    m.metadata.name.clone().unwrap_or_default(),
                    text(&m.data["status"]["phase"]),
                    text(&m.data["spec"]["providerID"]),
                )
            })
            .collect();
        out.sort();
        out
    }

    /// Waits until a Machine of the tenant's cluster has joined: its
    /// infrastructure provisioned (`spec.providerID`) and the tenant's API
    /// holding a Node of that providerID, Ready. Cluster API marks such a
    /// Machine `Running` once its cluster cache reaches the tenant
    /// (`machine_controller_noderef.go`); that connection is retried every
    /// 30 s (`ConnectionCreationRetryInterval`, v1.10.1) after a first try
    /// made before Kamaji's provider wrote the kubeconfig, so that is not
    /// waited for.
    pub async fn wait_node_joined(&self) {
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(self.api.clone());
        eventually(
            &format!("a Machine of Cluster {}/{} joined as a Ready Node", self.namespace, self.name),
            Duration::from_secs(120),
            || async {
                let machines = self.machines().await;
                let ready: Vec<String> = nodes
                    .list(&kube::api::ListParams::default())
                    .await
                    .map_err(|e| format!("list the tenant's Nodes: {e}"))?
                    .items
                    .into_iter()
                    .filter(|n| {
                        n.status.as_ref().and_then(|s| s.conditions.as_ref()).is_some_and(|c| {
                            c.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                        })
                    })
                    .filter_map(|n| n.spec.and_then(|s| s.provider_id))
                    .collect();
                if machines.iter().any(|(_, _, id)| !id.is_empty() && ready.contains(id)) {
                    Ok(())
                } else {
                    Err(format!("machines (name, phase, providerID): {machines:?}; Ready nodes' providerIDs: {ready:?}"))
                }
            },
        )
        .await;
    }

    /// A handle on a parent `name` in `namespace` that a test makes itself,
    /// not through the chart, and whose admin kubeconfig leads to `cluster`
    /// (its own, or one it borrows). Call it before creating the parent:
    /// its history starts here.
    pub async fn attach(
        cp: &ControlPlane,
        namespace: &str,
        name: &str,
        cluster: &ClusterInfo,
    ) -> Tenant {
        let management = cp.management_client().await;
        let hrs = Api::namespaced_with(management.clone(), namespace, &helmrelease_resource());
        Tenant {
            namespace: namespace.to_string(),
            name: name.to_string(),
            api: client_from(&cluster.kubeconfig).await,
            cluster: cluster.clone(),
            management,
            history: ParentHistory::open(hrs, name).await,
        }
    }

    /// The parent release with Cozystack's labels (what its API writes for
    /// a Kubernetes application) and `body`.
    fn parent_object(&self, body: Value) -> DynamicObject {
        obj(
            &helmrelease_resource(),
            &self.namespace,
            &self.name,
            json!(parent_labels(&self.name)),
            body,
        )
    }

    /// What Kamaji and its Cluster API provider make of the
    /// KamajiControlPlane: the TenantControlPlane (made here first, served
    /// by this tenant's harness API server, and taken by the played
    /// provider as its own) and the admin kubeconfig Secret it owns,
    /// `R-admin-kubeconfig`, with the two of
    /// Kamaji's four keys the profile reads (`super-admin.svc`,
    /// `super-admin.conf`), Kamaji's labels and its owner reference
    /// (clastix/kamaji 26.3.6-edge, the version Cozystack v1.6.2 builds:
    /// `internal/resources/kubeconfig.go`, `controllers/resources.go`).
    async fn create_control_plane(&self) {
        let (ns, r) = (self.namespace.as_str(), self.name.as_str());
        let kubeconfig_secret = super::profile().kubeconfig_secret_name(r);
        let pp = PostParams::default();
        let tcps: Api<DynamicObject> =
            Api::namespaced_with(self.management.clone(), ns, &tcp_resource());
        let mut tcp = obj(&tcp_resource(), ns, r, json!({}), json!({"spec": {}}));
        tcp.metadata.annotations = Some(BTreeMap::from([(
            CLUSTER_ANNOTATION.to_string(),
            self.cluster.name.clone(),
        )]));
        let tcp = tcps
            .create(&pp, &tcp)
            .await
            .expect("create TenantControlPlane");
        // Where Kamaji says the tenant's API server is: with a real node,
        // by the node's IP, which Pods and this machine's processes reach it
        // by (the harness forwards it to loopback).
        let rehost = |s: &str| match crate::node::address() {
            Some(ip) => s.replace("https://127.0.0.1:", &format!("https://{ip}:")),
            None => s.to_string(),
        };
        let endpoint = rehost(&self.cluster.server)
            .trim_start_matches("https://")
            .trim_end_matches('/')
            .to_string();
        // And the admin kubeconfig Kamaji made for it, which Kamaji's
        // Cluster API provider copies into `R-kubeconfig`
        // (`status.kubeconfig.admin.secretName`,
        // api/v1alpha1/tenantcontrolplane_status.go).
        tcps.patch_status(
            r,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"controlPlaneEndpoint": endpoint,
                "kubeconfig": {"admin": {"secretName": kubeconfig_secret}}}})),
        )
        .await
        .expect("TenantControlPlane status");

        let kubeconfig =
            std::fs::read_to_string(&self.cluster.kubeconfig).expect("tenant kubeconfig");
        let kubeconfig = rehost(&kubeconfig).into_bytes();
        let secret: Secret = serde_json::from_value(json!({
            "metadata": {
                "name": kubeconfig_secret,
                "namespace": ns,
                "labels": {"kamaji.clastix.io/name": r, "kamaji.clastix.io/component": "admin-kubeconfig"},
                "ownerReferences": [{
                    "apiVersion": "kamaji.clastix.io/v1alpha1", "kind": "TenantControlPlane",
                    "name": r, "uid": tcp.metadata.uid.clone().expect("tcp uid"),
                }],
            },
            "data": kubeconfig_data(&kubeconfig),
        }))
        .unwrap();
        Api::<Secret>::namespaced(self.management.clone(), ns)
            .create(&pp, &secret)
            .await
            .expect("create admin kubeconfig Secret");
    }
}

impl Tenant {
    /// What Kamaji makes of the TenantControlPlane for a cluster run in
    /// Pods: Deployment `R` in the tenant's namespace, owned by the
    /// TenantControlPlane (Kamaji's `SetControllerReference`, its labels
    /// `kamaji.clastix.io/name`, `/component: deployment`, `/project`:
    /// clastix/kamaji 26.3.6-edge, the version Cozystack v1.6.2 builds), one
    /// container per component. The Pod shares the node's network (Kamaji's
    /// has its own IP behind Service `R`, which needs a Service proxy this
    /// node has not), so the kubeconfig's address reaches it. Returns once
    /// the API server serves its `kube-system` namespace.
    async fn run_control_plane_pod(&self, cp: &ControlPlane) {
        let (ns, r) = (self.namespace.as_str(), self.name.as_str());
        let tcp =
            Api::<DynamicObject>::namespaced_with(self.management.clone(), ns, &tcp_resource())
                .get(r)
                .await
                .expect("the TenantControlPlane");
        let image = crate::node::harness_image(cp);
        let state = cp.state.display().to_string();
        let containers: Vec<Value> = self
            .cluster
            .commands
            .iter()
            .map(|(component, args)| {
                json!({"name": component, "image": image, "imagePullPolicy": "IfNotPresent", "args": args,
                       "volumeMounts": [{"name": "state", "mountPath": state}]})
            })
            .collect();
        let labels = json!({"kamaji.clastix.io/project": "kamaji", "kamaji.clastix.io/name": r,
                            "kamaji.clastix.io/component": "deployment"});
        let deployment = json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": r, "namespace": ns, "labels": labels,
                "ownerReferences": [{"apiVersion": "kamaji.clastix.io/v1alpha1", "kind": "TenantControlPlane",
                    "name": r, "uid": tcp.metadata.uid.clone().expect("tcp uid"),
                    "controller": true, "blockOwnerDeletion": true}]},
            "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": {"kamaji.clastix.io/name": r}},
                "template": {"metadata": {"labels": labels},
                    "spec": {"hostNetwork": true, "terminationGracePeriodSeconds": 5,
                        "nodeSelector": {"kubernetes.io/hostname": crate::node::NODE},
                        "containers": containers,
                        "volumes": [{"name": "state", "hostPath": {"path": state, "type": "Directory"}}]}}}});
        crate::manifests::apply(&self.management, &deployment).await;
        let api = self.api.clone();
        eventually(
            &format!("{r}'s API server, in its Pod, answering /readyz"),
            Duration::from_secs(180),
            || {
                let api = api.clone();
                async move {
                    Api::<k8s_openapi::api::core::v1::Namespace>::all(api)
                        .get("kube-system")
                        .await
                        .map(drop)
                        .map_err(|e| e.to_string())
                }
            },
        )
        .await;
    }
}

pub fn base64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Waits until helm-controller reports HelmRelease `name` Ready=True.
pub async fn wait_ready(hrs: &Api<DynamicObject>, name: &str, flux: &Flux) {
    eventually(
        &format!("HelmRelease {name} Ready=True"),
        Duration::from_secs(120),
        || {
            assert!(
                flux.process.alive(),
                "helm-controller exited; its log:\n{}",
                flux.log()
            );
            let hrs = hrs.clone();
            async move {
                let hr = hrs.get(name).await.map_err(|e| e.to_string())?;
                match ready_condition(&hr) {
                    Some((s, _, _)) if s == "True" => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            }
        },
    )
    .await
}
