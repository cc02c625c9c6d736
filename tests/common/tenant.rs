//! A Cozystack tenant Kubernetes cluster, built as Cozystack builds it: the
//! namespace, the parent and child HelmReleases with the real labels, the
//! control plane objects, and `R-admin-kubeconfig` pointing at a real tenant
//! API server of the harness; and workloads with claims inside it.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod, Secret};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};

use super::cluster::{ClusterInfo, ControlPlane, client_from, repo_root};
use super::flux::{FLUX_FINALIZER, Flux, ready_condition};
use super::gate::helmrelease_resource;
use super::history::{ParentHistory, Seen};
use super::manifests;
use super::wait::eventually;
use volume_gate::record::{Keys, Record};

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

fn obj(ar: &ApiResource, ns: &str, name: &str, labels: Value, body: Value) -> DynamicObject {
    let mut o = DynamicObject::new(name, ar).within(ns);
    o.metadata.labels = serde_json::from_value(labels).unwrap();
    o.data = body;
    o
}

impl Tenant {
    /// Creates a tenant named `app` (parent `kubernetes-<app>` in namespace
    /// `tenant-<app>`) with a tenant API server of its own.
    pub async fn create(cp: &ControlPlane, app: &str) -> Tenant {
        static FIRST: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);
        let cluster_name = if FIRST.swap(false, std::sync::atomic::Ordering::SeqCst) {
            cp.first_tenant_cluster.clone()
        } else {
            cp.unique("t")
        };
        Self::create_on(
            cp,
            cp.cluster_up(&cluster_name),
            &format!("tenant-{app}"),
            app,
            json!({}),
        )
        .await
    }

    /// [`Tenant::create`] with chart values of its own (`nodes`,
    /// `deleteDataVolumes`; see the chart's values.yaml).
    pub async fn create_with(cp: &ControlPlane, app: &str, values: Value) -> Tenant {
        Self::create_on(
            cp,
            cp.cluster_up(&cp.unique("t")),
            &format!("tenant-{app}"),
            app,
            values,
        )
        .await
    }

    /// Creates a tenant `app` (parent `kubernetes-<app>`) in `namespace`,
    /// which may hold other tenants, with a tenant API server of its own.
    pub async fn create_in(cp: &ControlPlane, namespace: &str, app: &str) -> Tenant {
        Self::create_on(
            cp,
            cp.cluster_up(&cp.unique("t")),
            namespace,
            app,
            json!({}),
        )
        .await
    }

    /// Creates a tenant `app` (parent `kubernetes-<app>`) in `namespace`,
    /// which may hold other tenants, on a light tenant cluster of its own:
    /// Pods are placed on the simulated node by `spec.nodeName`.
    pub async fn create_light(cp: &ControlPlane, namespace: &str, app: &str) -> Tenant {
        Self::create_on(
            cp,
            cp.cluster_up_with(&cp.unique("l"), true),
            namespace,
            app,
            json!({}),
        )
        .await
    }

    /// The tenant `app` (parent `kubernetes-<app>`) in `namespace` on
    /// `cluster`, installed the way Cozystack installs it, by this test
    /// binary's real helm-controller: Kamaji's part (the TenantControlPlane
    /// and its admin kubeconfig) first, then the parent HelmRelease of the
    /// tenant chart (`tests/fixtures/charts/kubernetes`), which installs the
    /// CSI controller and its identity, the KamajiControlPlane, the child
    /// releases and the pre-delete hook; the children install into the
    /// tenant cluster. Returns once the parent and R-csi are Ready.
    async fn create_on(
        cp: &ControlPlane,
        cluster: ClusterInfo,
        namespace: &str,
        app: &str,
        values: Value,
    ) -> Tenant {
        let flux = super::flux::flux(cp).await;
        let management = cp.management_client().await;
        let api = client_from(&cluster.kubeconfig).await;
        let namespace = namespace.to_string();
        let name = format!("kubernetes-{app}");
        cp.namespace(&namespace).await;
        for (artifact, chart) in [
            ("chart-kubernetes", "kubernetes"),
            ("chart-csi", "csi"),
            ("chart-demo", "demo"),
        ] {
            flux.publish_chart(&management, &namespace, artifact, chart)
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
        let mut all_values = json!({"hookTimeout": "10s"});
        if let (Some(all), Some(extra)) = (all_values.as_object_mut(), values.as_object()) {
            all.extend(extra.clone());
        }
        let mut parent = t.parent_object(json!({"spec": {
            "interval": "10m",
            "chartRef": {"kind": "ExternalArtifact", "name": "chart-kubernetes"},
            "values": all_values,
        }}));
        parent.metadata.finalizers = Some(vec![FLUX_FINALIZER.into()]);
        hrs.create(&PostParams::default(), &parent)
            .await
            .expect("create parent HelmRelease");
        for release in [t.name.clone(), format!("{}-csi", t.name)] {
            wait_ready(&hrs, &release, flux).await;
        }
        t
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
            json!({
                "apps.cozystack.io/application.kind": "Kubernetes",
                "apps.cozystack.io/application.group": "apps.cozystack.io",
                "apps.cozystack.io/application.name": self.name.trim_start_matches("kubernetes-"),
                "sharding.fluxcd.io/key": "shard1",
            }),
            body,
        )
    }

    /// What Kamaji makes of the KamajiControlPlane: the TenantControlPlane
    /// (served by this tenant's harness API server) and the admin
    /// kubeconfig Secret it owns.
    async fn create_control_plane(&self) {
        let (ns, r) = (self.namespace.as_str(), self.name.as_str());
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
        // Where Kamaji says the tenant's API server is.
        let endpoint = self
            .cluster
            .server
            .trim_start_matches("https://")
            .trim_end_matches('/')
            .to_string();
        tcps.patch_status(
            r,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"controlPlaneEndpoint": endpoint}})),
        )
        .await
        .expect("TenantControlPlane status");

        let kubeconfig = std::fs::read(&self.cluster.kubeconfig).expect("tenant kubeconfig");
        let secret: Secret = serde_json::from_value(json!({
            "metadata": {
                "name": format!("{r}-admin-kubeconfig"),
                "namespace": ns,
                "labels": {"kamaji.clastix.io/name": r, "kamaji.clastix.io/component": "admin-kubeconfig"},
                "ownerReferences": [{
                    "apiVersion": "kamaji.clastix.io/v1alpha1", "kind": "TenantControlPlane",
                    "name": r, "uid": tcp.metadata.uid.clone().expect("tcp uid"),
                }],
            },
            "data": {
                "super-admin.svc": base64(&kubeconfig),
                "super-admin.conf": base64(&kubeconfig),
            },
        }))
        .unwrap();
        Api::<Secret>::namespaced(self.management.clone(), ns)
            .create(&pp, &secret)
            .await
            .expect("create admin kubeconfig Secret");
    }

    pub fn hr_api(&self) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.management.clone(),
            &self.namespace,
            &helmrelease_resource(),
        )
    }

    pub async fn parent(&self) -> Option<DynamicObject> {
        self.hr_api().get_opt(&self.name).await.expect("get parent")
    }

    pub async fn record(&self) -> Record {
        let p = self.parent().await.expect("parent exists");
        Record::from_annotations(
            &Keys::new("volumes.cozystack.io/"),
            &p.metadata.annotations.unwrap_or_default(),
        )
    }

    /// Deletes the Kubernetes application: the parent release.
    pub async fn delete_parent(&self) {
        self.hr_api()
            .delete(&self.name, &DeleteParams::default())
            .await
            .expect("delete parent HelmRelease");
    }

    /// Waits until the parent release is gone from the management cluster.
    pub async fn wait_parent_gone(&self, timeout: Duration) {
        let what = format!("parent {}/{} gone", self.namespace, self.name);
        self.history
            .next_matching(&what, timeout, |s| matches!(s, Seen::Gone).then_some(()))
            .await
    }

    /// Waits until the worker has bound the tenant to its cluster (the
    /// record's `cluster` key), and returns the bound kube-system UID.
    pub async fn wait_cluster_bound(&self) -> String {
        let record = self
            .history
            .next_record("the tenant cluster bound", Duration::from_secs(60), |r| {
                r.cluster.is_some()
            })
            .await;
        record.cluster.expect("bound").kube_system_uid
    }

    /// Waits until the worker has taken the tenant into custody.
    pub async fn wait_custody(&self) {
        let api = self.hr_api();
        let name = self.name.clone();
        eventually(
            "custody finalizer on the parent",
            Duration::from_secs(30),
            || {
                let (api, name) = (api.clone(), name.clone());
                async move {
                    let p = api.get(&name).await.map_err(|e| e.to_string())?;
                    let f = p.metadata.finalizers.unwrap_or_default();
                    if f.iter().any(|f| f == "volumes.cozystack.io/release") {
                        Ok(())
                    } else {
                        Err(format!("{f:?}"))
                    }
                }
            },
        )
        .await
    }

    // ---- inside the tenant cluster ----

    pub async fn tenant_namespace(&self, ns: &str) {
        let api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(self.api.clone());
        let n = serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap();
        match api.create(&PostParams::default(), &n).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("create tenant namespace {ns}: {e}"),
        }
    }

    pub async fn claim(&self, ns: &str, name: &str, class: &str) {
        let pvc: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": class,
                     "resources": {"requests": {"storage": "1Gi"}}},
        }))
        .unwrap();
        Api::<PersistentVolumeClaim>::namespaced(self.api.clone(), ns)
            .create(&PostParams::default(), &pvc)
            .await
            .expect("create claim");
    }

    /// A Pod mounting each of `claims`.
    pub async fn pod(&self, ns: &str, name: &str, claims: &[&str]) {
        let volumes: Vec<Value> = claims
            .iter()
            .enumerate()
            .map(|(i, c)| json!({"name": format!("v{i}"), "persistentVolumeClaim": {"claimName": c}}))
            .collect();
        let mut pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns},
            "spec": {"terminationGracePeriodSeconds": 1, "containers": [{"name": "app", "image": "busybox"}], "volumes": volumes},
        }))
        .unwrap();
        self.place(&mut pod);
        Api::<Pod>::namespaced(self.api.clone(), ns)
            .create(&PostParams::default(), &pod)
            .await
            .expect("create pod");
    }

    /// A light cluster has no scheduler: its Pods go to the simulated node.
    fn place(&self, pod: &mut Pod) {
        if self.cluster.light {
            pod.spec.as_mut().expect("pod spec").node_name = Some(SIM_NODE.into());
        }
    }

    /// A Pod with a generic ephemeral volume (claim `<pod>-scratch`).
    pub async fn ephemeral_pod(&self, ns: &str, name: &str) {
        let mut pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns},
            "spec": {"terminationGracePeriodSeconds": 1, "containers": [{"name": "app", "image": "busybox"}],
                     "volumes": [{"name": "scratch", "ephemeral": {"volumeClaimTemplate": {"spec": {
                         "accessModes": ["ReadWriteOnce"], "storageClassName": STORAGE_CLASS,
                         "resources": {"requests": {"storage": "1Gi"}}}}}}]},
        }))
        .unwrap();
        self.place(&mut pod);
        Api::<Pod>::namespaced(self.api.clone(), ns)
            .create(&PostParams::default(), &pod)
            .await
            .expect("create ephemeral pod");
    }

    /// A StatefulSet whose Pods each get a claim from a template.
    pub async fn statefulset(&self, ns: &str, name: &str, replicas: i32) {
        let sts: StatefulSet = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "replicas": replicas, "serviceName": name,
                "selector": {"matchLabels": {"app": name}},
                "template": {"metadata": {"labels": {"app": name}}, "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "db", "image": "postgres", "volumeMounts": [{"name": "data", "mountPath": "/data"}]}]}},
                "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
                    "accessModes": ["ReadWriteOnce"], "storageClassName": STORAGE_CLASS,
                    "resources": {"requests": {"storage": "1Gi"}}}}],
            },
        }))
        .unwrap();
        Api::<StatefulSet>::namespaced(self.api.clone(), ns)
            .create(&PostParams::default(), &sts)
            .await
            .expect("create statefulset");
    }

    /// Waits until `n` claims are Bound and every Pod is Running.
    pub async fn wait_settled(&self, claims: usize, pods: usize) {
        let api = self.api.clone();
        eventually(
            &format!(
                "{claims} claims bound and {pods} pods running in {}",
                self.name
            ),
            Duration::from_secs(90),
            || {
                let api = api.clone();
                async move {
                    let pvcs = Api::<PersistentVolumeClaim>::all(api.clone())
                        .list(&ListParams::default())
                        .await
                        .map_err(|e| e.to_string())?;
                    let bound = pvcs
                        .items
                        .iter()
                        .filter(|c| {
                            c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
                        })
                        .count();
                    let podl = Api::<Pod>::all(api)
                        .list(&ListParams::default())
                        .await
                        .map_err(|e| e.to_string())?;
                    let running = podl
                        .items
                        .iter()
                        .filter(|p| {
                            p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                        })
                        .count();
                    if bound >= claims && running >= pods {
                        Ok(())
                    } else {
                        Err(format!("{bound} bound, {running} running"))
                    }
                }
            },
        )
        .await
    }

    pub async fn pv_count(&self) -> usize {
        Api::<PersistentVolume>::all(self.api.clone())
            .list(&ListParams::default())
            .await
            .expect("list PVs")
            .items
            .len()
    }
}

pub fn base64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

impl Tenant {
    /// Events recorded on the parent release (events.k8s.io), as
    /// `(type, reason, note)`.
    pub async fn events(&self) -> Vec<(String, String, String)> {
        let api: Api<k8s_openapi::api::events::v1::Event> =
            Api::namespaced(self.management.clone(), &self.namespace);
        let mut out: Vec<(String, String, String)> = api
            .list(&ListParams::default())
            .await
            .expect("list events")
            .items
            .into_iter()
            .filter(|e| {
                e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(self.name.as_str())
            })
            .map(|e| {
                (
                    e.type_.unwrap_or_default(),
                    e.reason.unwrap_or_default(),
                    e.note.unwrap_or_default(),
                )
            })
            .collect();
        out.sort();
        out
    }

    /// Waits for an Event on the parent of type `ty` and `reason` whose note
    /// satisfies `note`, and returns its note. Events outlive the state they
    /// report, and the worker writes one just after the record: a test that
    /// saw the record first waits here for its Event.
    pub async fn wait_event(&self, ty: &str, reason: &str, note: impl Fn(&str) -> bool) -> String {
        eventually(
            &format!("a {ty} Event {reason} on {}", self.name),
            Duration::from_secs(30),
            || {
                let note = &note;
                async move {
                    let events = self.events().await;
                    events
                        .iter()
                        .find(|(t, r, n)| t == ty && r == reason && note(n))
                        .map(|(_, _, n)| n.clone())
                        .ok_or_else(|| format!("{events:?}"))
                }
            },
        )
        .await
    }

    /// Points the admin kubeconfig Secret at `server` (e.g. an address where
    /// nothing answers), keeping its credentials.
    pub async fn point_kubeconfig_at(&self, server: &str) {
        let text = std::fs::read_to_string(&self.cluster.kubeconfig).expect("tenant kubeconfig");
        let moved = text.replace(&self.cluster.server, server);
        assert_ne!(moved, text, "kubeconfig server replaced");
        let secrets: Api<Secret> = Api::namespaced(self.management.clone(), &self.namespace);
        let patch = json!({"data": {"super-admin.svc": base64(moved.as_bytes()), "super-admin.conf": base64(moved.as_bytes())}});
        secrets
            .patch(
                &format!("{}-admin-kubeconfig", self.name),
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .expect("patch kubeconfig Secret");
    }

    /// Waits for the next record (after the last one a wait returned) in
    /// `phase`, and returns it. Read from the watch history: a phase the
    /// teardown has already moved past is still found.
    pub async fn wait_phase(&self, phase: volume_gate::record::Phase, timeout: Duration) -> Record {
        self.history
            .next_record(&format!("phase {phase}"), timeout, |r| {
                r.phase == Some(phase)
            })
            .await
    }

    /// Records an override as `client`'s user: `kubectl annotate`.
    pub async fn annotate_override(
        &self,
        client: &kube::Client,
        reason: &str,
    ) -> Result<(), kube::Error> {
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), &self.namespace, &helmrelease_resource());
        let patch = json!({"metadata": {"annotations": {"volumes.cozystack.io/override": reason}}});
        api.patch(
            &self.name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .map(|_| ())
    }

    /// Grants `group` the override verb in every namespace, from the shipped
    /// example ClusterRole: what a tenant whose namespace is being deleted
    /// needs (a Role there goes with the namespace).
    pub async fn grant_override_everywhere(&self, group: &str) {
        let path = repo_root().join("manifests/examples/override-clusterrole.yaml");
        let text = std::fs::read_to_string(&path).expect("override-clusterrole.yaml");
        let docs: Vec<Value> =
            serde_saphyr::from_multiple(&text).expect("parse override-clusterrole.yaml");
        for mut d in docs.into_iter().filter(|d| !d.is_null()) {
            if d["kind"] == "ClusterRoleBinding" {
                d["subjects"][0]["name"] = json!(group);
            }
            manifests::apply(&self.management, &d).await;
        }
        wait_authorized(
            &self.management,
            group,
            &self.namespace,
            "volumes.cozystack.io",
            "tenants",
            "override",
        )
        .await;
    }

    /// Grants `group` the override verb on this tenant's namespace, from the
    /// shipped example Role.
    pub async fn grant_override(&self, group: &str) {
        let path = repo_root().join("manifests/examples/override-role.yaml");
        let text = std::fs::read_to_string(&path).expect("override-role.yaml");
        let docs: Vec<Value> =
            serde_saphyr::from_multiple(&text).expect("parse override-role.yaml");
        for mut d in docs.into_iter().filter(|d| !d.is_null()) {
            d["metadata"]["namespace"] = json!(self.namespace);
            if d["kind"] == "RoleBinding" {
                d["subjects"][0]["name"] = json!(group);
            }
            manifests::apply(&self.management, &d).await;
        }
        wait_authorized(
            &self.management,
            group,
            &self.namespace,
            "helm.toolkit.fluxcd.io",
            "helmreleases",
            "patch",
        )
        .await;
        wait_authorized(
            &self.management,
            group,
            &self.namespace,
            "volumes.cozystack.io",
            "tenants",
            "override",
        )
        .await;
    }
}

/// RBAC reaches the API server's authorizer through an informer: waits until
/// a SubjectAccessReview for a member of `group` is allowed.
pub async fn wait_authorized(
    client: &kube::Client,
    group: &str,
    namespace: &str,
    api_group: &str,
    resource: &str,
    verb: &str,
) {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
    };
    let api: Api<SubjectAccessReview> = Api::all(client.clone());
    let sar = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some("rbac-probe".into()),
            groups: Some(vec![group.to_string(), "system:authenticated".into()]),
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(namespace.into()),
                group: Some(api_group.into()),
                resource: Some(resource.into()),
                verb: Some(verb.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    eventually(
        &format!("group {group} may {verb} {resource}.{api_group} in {namespace}"),
        Duration::from_secs(30),
        || {
            let (api, sar) = (api.clone(), sar.clone());
            async move {
                let r = api
                    .create(&PostParams::default(), &sar)
                    .await
                    .map_err(|e| e.to_string())?;
                if r.status.is_some_and(|s| s.allowed) {
                    Ok(())
                } else {
                    Err("not yet".into())
                }
            }
        },
    )
    .await
}

impl Tenant {
    /// Stops (or restarts) this tenant's simulated CSI driver while its
    /// release stays installed: a stuck or crashed driver. Returns once the
    /// simulator has acted on it.
    pub async fn set_driver(&self, sim: &super::sim::Simulator, running: bool) {
        let action = if running { "activated" } else { "deactivated" };
        let value = if running {
            serde_json::Value::Null
        } else {
            json!("stopped")
        };
        self.annotate_csi_release(sim, "harness.volume-gate.test/driver", value, action)
            .await
    }

    /// Makes this tenant's simulated driver slow: it frees a released
    /// volume `delay` (a Go duration, "20s") after it sees it released.
    /// Returns once the simulator has seen it.
    pub async fn set_free_after(&self, sim: &super::sim::Simulator, delay: &str) {
        self.annotate_csi_release(
            sim,
            "harness.volume-gate.test/free-after",
            json!(delay),
            "free-after",
        )
        .await
    }

    /// Sets annotation `key` on R-csi to `value` (null removes it) and waits
    /// for the simulator's next log line `N/R <action>` about this tenant.
    async fn annotate_csi_release(
        &self,
        sim: &super::sim::Simulator,
        key: &str,
        value: Value,
        action: &str,
    ) {
        let needle = format!("{}/{} {action}", self.namespace, self.name);
        let before = sim.log().matches(&needle).count();
        let patch = json!({"metadata": {"annotations": {key: value}}});
        self.hr_api()
            .patch(
                &format!("{}-csi", self.name),
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .expect("annotate the CSI release");
        eventually(
            &format!("simulator saw: {needle}"),
            Duration::from_secs(20),
            || {
                let n = sim.log().matches(&needle).count();
                async move {
                    if n > before {
                        Ok(())
                    } else {
                        Err(format!("{n} times"))
                    }
                }
            },
        )
        .await;
    }

    /// The parent's raw record annotations.
    pub async fn volumes_annotation(&self) -> Option<String> {
        self.parent()
            .await
            .and_then(|p| p.metadata.annotations)
            .and_then(|a| a.get("volumes.cozystack.io/volumes").cloned())
    }
}

impl Tenant {
    /// Claims in namespace `apps`, all mounted by one running Pod `holder`.
    /// The management PVs the worker keeps for this tenant: found as an
    /// operator finds them (README), by the `kept-namespace` label.
    pub async fn kept_disks(&self) -> Vec<k8s_openapi::api::core::v1::PersistentVolume> {
        let keys = volume_gate::record::Keys::new(
            &volume_gate::profile::Profile::cozystack().annotation_prefix,
        );
        Api::<k8s_openapi::api::core::v1::PersistentVolume>::all(self.management.clone())
            .list(
                &ListParams::default()
                    .labels(&format!("{}={}", keys.kept_namespace, self.namespace)),
            )
            .await
            .expect("list kept PVs")
            .items
    }

    /// Claims `names` of StorageClass `class` each, held by one Pod, in
    /// the tenant's namespace `apps`; returns once bound and running.
    pub async fn with_claims_of(&self, claims: &[(&str, &str)]) {
        self.tenant_namespace("apps").await;
        for (c, class) in claims {
            self.claim("apps", c, class).await;
        }
        let names: Vec<&str> = claims.iter().map(|(c, _)| *c).collect();
        self.pod("apps", "holder", &names).await;
        self.wait_settled(claims.len(), 1).await;
    }

    /// Holds the tenant in teardown, not done: a claim held by a Pod, its
    /// driver stopped, its parent deleted, its inventory taken.
    pub async fn hold_in_teardown(&self, sim: &super::sim::Simulator) {
        self.with_held_claims(&["data"]).await;
        self.set_driver(sim, false).await;
        self.delete_parent().await;
        self.wait_inventory().await;
    }

    pub async fn with_held_claims(&self, claims: &[&str]) {
        self.tenant_namespace("apps").await;
        for c in claims {
            self.claim("apps", c, STORAGE_CLASS).await;
        }
        self.pod("apps", "holder", claims).await;
        self.wait_settled(claims.len(), 1).await;
    }

    /// The seed's workload in namespace `apps`: a Pod mounting two claims, a
    /// Pod mounting one, a StatefulSet with a claim template. Returns once
    /// all 4 claims are bound and the 3 Pods run.
    pub async fn incident_workload(&self) {
        self.tenant_namespace("apps").await;
        for c in ["data-a", "data-b", "logs"] {
            self.claim("apps", c, STORAGE_CLASS).await;
        }
        self.pod("apps", "two-claims", &["data-a", "data-b"]).await;
        self.pod("apps", "one-claim", &["logs"]).await;
        self.statefulset("apps", "db", 1).await;
        self.wait_settled(4, 3).await;
    }

    /// Waits until the worker has written the inventory into the record
    /// (the next version, after the last one a wait returned, that has it).
    pub async fn wait_inventory(&self) -> String {
        self.history
            .next_matching(
                "inventory in the record",
                Duration::from_secs(30),
                |s| match s {
                    Seen::Parent(p) => p
                        .metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get("volumes.cozystack.io/volumes").cloned()),
                    Seen::Gone => None,
                },
            )
            .await
    }
}

/// Waits until namespace `namespace` is gone, saying what the namespace
/// controller reports left if it does not go.
pub async fn wait_namespace_gone(management: &kube::Client, namespace: &str, timeout: Duration) {
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(management.clone());
    eventually(&format!("namespace {namespace} gone"), timeout, || {
        let namespaces = namespaces.clone();
        async move {
            match namespaces
                .get_opt(namespace)
                .await
                .map_err(|e| e.to_string())?
            {
                None => Ok(()),
                Some(n) => Err(format!(
                    "terminating: {:?}",
                    n.status
                        .and_then(|s| s.conditions)
                        .unwrap_or_default()
                        .iter()
                        .map(|c| c.message.clone().unwrap_or_default())
                        .collect::<Vec<_>>()
                )),
            }
        }
    })
    .await
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

impl Tenant {
    /// Waits for the next version of the parent on which helm-controller
    /// records a failed uninstall (`Ready=False`, `UninstallFailed`, what an
    /// operator sees in `kubectl get hr`) whose message `accept`s; returns
    /// the message.
    pub async fn next_uninstall_failed(
        &self,
        timeout: Duration,
        accept: impl Fn(&str) -> bool,
    ) -> String {
        let (_, _, message) = self
            .history
            .next_matching("the parent UninstallFailed", timeout, |s| match s {
                Seen::Parent(p) => ready_condition(p).filter(|(status, reason, message)| {
                    status == "False" && reason == "UninstallFailed" && accept(message)
                }),
                Seen::Gone => None,
            })
            .await;
        message
    }
}

impl Tenant {
    /// Asserts what resumed the teardown: the write that recorded
    /// `Released` asked the parent's controller to retry
    /// (`reconcile.fluxcd.io/requestedAt`, what `flux reconcile` writes) and
    /// nothing before it did. Returns that version's finalizers.
    pub fn assert_released_write_requests_a_retry(&self) -> Vec<String> {
        let versions: Vec<_> = self
            .history
            .all()
            .into_iter()
            .filter_map(|s| match s {
                Seen::Parent(p) => Some(p),
                Seen::Gone => None,
            })
            .collect();
        let request = |p: &DynamicObject| {
            p.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get("reconcile.fluxcd.io/requestedAt").cloned())
        };
        let released = versions
            .iter()
            .position(|p| {
                Seen::Parent(p.clone()).record().and_then(|r| r.phase)
                    == Some(volume_gate::record::Phase::Released)
            })
            .expect("a Released version");
        assert!(
            request(&versions[released]).is_some(),
            "the Released write carries reconcile.fluxcd.io/requestedAt"
        );
        assert!(
            versions[..released].iter().all(|p| request(p).is_none()),
            "no retry request before Released"
        );
        versions[released]
            .metadata
            .finalizers
            .clone()
            .unwrap_or_default()
    }
}

impl Tenant {
    /// Deletes the tenant's namespace in the management cluster.
    pub async fn delete_namespace(&self) {
        let namespaces: Api<k8s_openapi::api::core::v1::Namespace> =
            Api::all(self.management.clone());
        namespaces
            .delete(&self.namespace, &DeleteParams::default())
            .await
            .expect("delete the tenant namespace");
    }

    /// Waits until the tenant's namespace is gone (see [`wait_namespace_gone`]).
    pub async fn wait_namespace_gone(&self, timeout: Duration) {
        wait_namespace_gone(&self.management, &self.namespace, timeout).await
    }

    /// Waits until the simulator has stopped this tenant's API server (its
    /// TenantControlPlane deleted): from then on nothing can free a volume.
    pub async fn wait_api_stopped(&self, sim: &super::sim::Simulator, timeout: Duration) {
        let needle = format!("{}/{} stopped tenant API server", self.namespace, self.name);
        eventually(&format!("simulator: {needle}"), timeout, || {
            let seen = sim.log().contains(&needle);
            async move {
                if seen {
                    Ok(())
                } else {
                    Err("not yet".to_string())
                }
            }
        })
        .await
    }
}

/// The tenant's objects on the management side of its volumes (the infra
/// layer): DataVolumes and PVCs labelled for it in its namespace, and the
/// management PVs bound to those PVCs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InfraObjects {
    pub datavolumes: Vec<String>,
    pub claims: Vec<String>,
    pub volumes: Vec<String>,
}

impl InfraObjects {
    pub fn is_empty(&self) -> bool {
        self.datavolumes.is_empty() && self.claims.is_empty() && self.volumes.is_empty()
    }
}

pub fn datavolume_resource() -> ApiResource {
    resource("cdi.kubevirt.io", "v1beta1", "DataVolume", "datavolumes")
}

impl Tenant {
    /// The volumeHandles of the tenant's PVs (its API's view), sorted: what
    /// the record names. On the KubeVirt path each is a DataVolume's name;
    /// the ledger holds the management disks behind them.
    pub async fn volume_handles(&self) -> Vec<String> {
        let pvs: Api<PersistentVolume> = Api::all(self.api.clone());
        let mut out: Vec<String> = pvs
            .list(&ListParams::default())
            .await
            .expect("list tenant PVs")
            .items
            .into_iter()
            .filter_map(|pv| Some(pv.spec?.csi?.volume_handle))
            .collect();
        out.sort();
        out
    }

    /// The DataVolumes in the tenant's namespace of the management cluster.
    pub fn datavolumes(&self) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.management.clone(),
            &self.namespace,
            &datavolume_resource(),
        )
    }

    /// What the management cluster holds of the tenant's disks now; with
    /// `also`, the objects of that earlier look too (labels can be removed,
    /// a PV outlives its claim).
    pub async fn infra_objects(&self, also: Option<&InfraObjects>) -> InfraObjects {
        let dvs = self
            .datavolumes()
            .list_metadata(&ListParams::default())
            .await
            .expect("list DataVolumes")
            .items;
        let labelled = |labels: &Option<BTreeMap<String, String>>| {
            labels
                .as_ref()
                .and_then(|l| l.get("cluster.x-k8s.io/cluster-name"))
                .is_some_and(|v| v == &self.name)
        };
        let earlier = also.cloned().unwrap_or_default();
        let mut out = InfraObjects::default();
        for d in dvs {
            let name = d.metadata.name.clone().unwrap_or_default();
            if labelled(&d.metadata.labels) || earlier.datavolumes.contains(&name) {
                out.datavolumes.push(name);
            }
        }
        let pvcs: Api<PersistentVolumeClaim> =
            Api::namespaced(self.management.clone(), &self.namespace);
        for c in pvcs
            .list(&ListParams::default())
            .await
            .expect("list PVCs")
            .items
        {
            let name = c.metadata.name.clone().unwrap_or_default();
            if labelled(&c.metadata.labels) || earlier.claims.contains(&name) {
                out.claims.push(name);
            }
        }
        let pvs: Api<PersistentVolume> = Api::all(self.management.clone());
        for pv in pvs
            .list(&ListParams::default())
            .await
            .expect("list PVs")
            .items
        {
            let name = pv.metadata.name.clone().unwrap_or_default();
            let claim = pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref());
            let ours = claim.is_some_and(|r| {
                r.namespace.as_deref() == Some(self.namespace.as_str())
                    && r.name.as_ref().is_some_and(|n| out.claims.contains(n))
            });
            if ours || earlier.volumes.contains(&name) {
                out.volumes.push(name);
            }
        }
        out
    }
}

/// A disk of tenant `r` that no inventory names: a DataVolume labelled for it
/// in namespace `ns` of the management cluster. A tenant with no API behind
/// it and such a disk is never released by the worker (with no inventory,
/// the disk's reclaim policy is unknown; docs/design.md §5b): tests use it
/// to hold a parent with nothing else behind it in teardown. (With no disk
/// at all, the worker would release it at once.)
pub async fn unreleasable_disk(client: &kube::Client, ns: &str, r: &str) {
    let dvs: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &datavolume_resource());
    let disk = json!({"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
        "metadata": {"name": format!("{r}-disk"), "labels": {"cluster.x-k8s.io/cluster-name": r}},
        "spec": {"source": {"blank": {}}, "storage": {"resources": {"requests": {"storage": "1Gi"}}}}});
    dvs.create(
        &PostParams::default(),
        &serde_json::from_value(disk).unwrap(),
    )
    .await
    .expect("create the tenant's unreleasable DataVolume");
}

/// A parent release `r` with Cozystack's labels and nothing behind it (its
/// spec suspended: no chart runs), taken into custody at creation by the
/// mutating webhook.
pub async fn bare_parent(hrs: &Api<DynamicObject>, r: &str) {
    let parent = json!({"apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
        "metadata": {"name": r, "labels": {
            "apps.cozystack.io/application.kind": "Kubernetes",
            "apps.cozystack.io/application.group": "apps.cozystack.io"}},
        "spec": super::flux::inert_spec("kubernetes")});
    let created = hrs
        .create(
            &PostParams::default(),
            &serde_json::from_value(parent).unwrap(),
        )
        .await
        .expect("create parent");
    assert!(
        created
            .metadata
            .finalizers
            .unwrap_or_default()
            .iter()
            .any(|f| f == "volumes.cozystack.io/release"),
        "the mutating webhook put {r} in custody at creation"
    );
}

/// A parent release in custody with no tenant API behind it, only a disk
/// no inventory names ([`unreleasable_disk`]): the worker never releases
/// it, so once deleted it stays in teardown, not done.
pub async fn paper_parent(hrs: &Api<DynamicObject>, r: &str) {
    let ns = hrs.namespace().expect("namespaced").to_string();
    unreleasable_disk(&hrs.clone().into_client(), &ns, r).await;
    bare_parent(hrs, r).await;
}

/// Deletes the disk [`unreleasable_disk`] made, so the tenant can be released.
pub async fn delete_unreleasable_disk(client: &kube::Client, ns: &str, r: &str) {
    let dvs: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &datavolume_resource());
    dvs.delete(&format!("{r}-disk"), &DeleteParams::default())
        .await
        .expect("delete the tenant's unreleasable DataVolume");
}
