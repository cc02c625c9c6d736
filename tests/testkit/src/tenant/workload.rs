//! Inside the tenant cluster: namespaces, claims, the Pods and
//! StatefulSets that hold them, and what is bound there.

use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};

use super::{SIM_NODE, STORAGE_CLASS, Tenant};
use crate::sim::Simulator;
use crate::wait::eventually;

impl Tenant {
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
        // A namespace just made has no ServiceAccount `default` until the
        // tenant's controller manager makes it, and the API server refuses
        // a Pod until then: a state the namespace moves into, waited for.
        let api = Api::<Pod>::namespaced(self.api.clone(), ns);
        eventually(
            &format!("Pod {ns}/{name} created"),
            Duration::from_secs(120),
            || async {
                match api.create(&PostParams::default(), &pod).await {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(s))
                        if s.code == 403
                            && s.message.contains("serviceaccount \"default\" not found") =>
                    {
                        Err(s.message)
                    }
                    Err(e) => panic!("create pod {ns}/{name}: {e}"),
                }
            },
        )
        .await;
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

    /// Waits until `n` claims are Bound and every Pod is Running. Its bound
    /// is a failure's, not a target: a machine building 50 tenants while
    /// another test binary runs (`tests/load.rs` in the suite) has taken
    /// more than 90 s to run one Pod.
    pub async fn wait_settled(&self, claims: usize, pods: usize) {
        let api = self.api.clone();
        eventually(
            &format!(
                "{claims} claims bound and {pods} pods running in {}",
                self.name
            ),
            Duration::from_secs(240),
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

    /// Claims in namespace `apps`, all mounted by one running Pod `holder`.
    pub async fn with_held_claims(&self, claims: &[&str]) {
        self.tenant_namespace("apps").await;
        for c in claims {
            self.claim("apps", c, STORAGE_CLASS).await;
        }
        self.pod("apps", "holder", claims).await;
        self.wait_settled(claims.len(), 1).await;
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

    /// Holds the tenant in teardown, not done: a claim held by a Pod, its
    /// driver stopped, its parent deleted, its inventory taken.
    pub async fn hold_in_teardown(&self, sim: &Simulator) {
        self.with_held_claims(&["data"]).await;
        self.set_driver(sim, false).await;
        self.delete_parent().await;
        self.wait_inventory().await;
    }
}
