//! What the worker rests a tenant's cluster and its record on, tried as
//! someone who may edit a tenant's namespace (`mallory`), on the real
//! control plane with the shipped manifests:
//!
//! - a second parent made with a copy of another tenant's admin kubeconfig
//!   (one cluster, one parent; the management side's record of where each
//!   tenant's API server runs);
//! - an API server of mallory's own answering with a tenant's `kube-system`
//!   UID, which the record publishes (the CA that certified it decides);
//! - a parent filled so that its record cannot be written.

use volume_gate_testkit as common;

use std::sync::Arc;
use std::time::Duration;

use common::tenant::{Tenant, base64, kubeconfig_data, tcp_resource};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Secret};
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use volume_gate::record::Phase;

fn env() -> &'static common::Env {
    common::gated_short()
}

fn hrs_in(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &common::gate::helmrelease_resource())
}

fn merge(v: Value) -> Patch<Value> {
    Patch::Merge(v)
}

/// The claim `data` of `t`'s namespace `apps`: still there, not deleted.
async fn claim_untouched(t: &Tenant) {
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(t.api.clone(), "apps");
    let claim = claims.get("data").await.expect("the claim is still there");
    assert!(
        claim.metadata.deletion_timestamp.is_none(),
        "{}'s claim was not deleted",
        t.name
    );
}

/// `r`'s admin kubeconfig Secret in `ns`, holding `kubeconfig`.
async fn kubeconfig_secret(client: &kube::Client, ns: &str, r: &str, kubeconfig: &[u8]) {
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": common::profile().kubeconfig_secret_name(r)},
        "data": kubeconfig_data(kubeconfig)}))
    .unwrap();
    Api::<Secret>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await
        .expect("create the admin kubeconfig Secret");
}

/// A TenantControlPlane `r` in `ns` whose endpoint says `endpoint`.
async fn control_plane(client: &kube::Client, ns: &str, r: &str, endpoint: &str) {
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &tcp_resource());
    let mut tcp = DynamicObject::new(r, &tcp_resource()).within(ns);
    tcp.data = json!({"spec": {}});
    api.create(&PostParams::default(), &tcp)
        .await
        .expect("create a TenantControlPlane");
    api.patch_status(
        r,
        &PatchParams::default(),
        &merge(json!({"status": {"controlPlaneEndpoint": endpoint}})),
    )
    .await
    .expect("its endpoint");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_parent_with_a_copy_of_a_bound_tenants_kubeconfig_can_delete_nothing_of_it() {
    let env = env();
    let cp = env.cp;
    let victim = Tenant::create(cp, &cp.unique("owner")).await;
    victim.wait_custody().await;
    victim.with_held_claims(&["data"]).await;
    victim.wait_cluster_bound().await;
    let volumes = env.sim.volumes_of(&victim.namespace, &victim.name);
    assert_eq!(volumes.len(), 1);

    // Mallory edits another namespace, and has a copy of the victim's
    // kubeconfig. Her parent claims the victim's cluster, with a
    // TenantControlPlane whose endpoint she wrote to match.
    let ns = cp.unique("tenant-borrower");
    cp.namespace(&ns).await;
    let m = common::editor::mallory(cp, &[&ns]).await;
    let copy = std::fs::read(&victim.cluster.kubeconfig).expect("the victim's kubeconfig");
    let endpoint = victim
        .cluster
        .server
        .trim_start_matches("https://")
        .to_string();
    let (borrower, stranger) = ("kubernetes-borrower", "kubernetes-stranger");
    let b = Tenant::attach(cp, &ns, borrower, &victim.cluster).await;
    kubeconfig_secret(&m, &ns, borrower, &copy).await;
    control_plane(&m, &ns, borrower, &endpoint).await;
    common::tenant::bare_parent(&hrs_in(&m, &ns), borrower).await;
    // It is bound all the same (the victim's passes must see the claim),
    // and said to be in conflict at once, long before any teardown.
    let note = b
        .wait_event("Warning", "ClusterConflict", |n| {
            n.contains("bound to another parent too")
        })
        .await;
    assert!(
        note.contains(&format!("{}/{}", victim.namespace, victim.name)),
        "the conflict names the parent it collides with: {note}"
    );
    // A second one, with no TenantControlPlane of its own: nothing says
    // which API server is its, so nothing is bound.
    let s = Tenant::attach(cp, &ns, stranger, &victim.cluster).await;
    kubeconfig_secret(&m, &ns, stranger, &copy).await;
    common::tenant::bare_parent(&hrs_in(&m, &ns), stranger).await;
    s.wait_event("Warning", "ClusterNotBound", |n| {
        n.contains("records no control plane")
    })
    .await;

    // Deleting either frees nothing of the victim's.
    for t in [&b, &s] {
        t.delete_parent().await;
        let record = t.wait_phase(Phase::Blocked, Duration::from_secs(60)).await;
        let message = record.message.unwrap_or_default();
        assert!(
            message.contains("bound to another parent too")
                || message.contains("does not lead to this tenant's own cluster"),
            "{}: {message}",
            t.name
        );
        assert!(record.inventory.is_none(), "nothing inventoried through it");
    }
    claim_untouched(&victim).await;
    assert_eq!(env.sim.volumes_of(&victim.namespace, &victim.name), volumes);

    // The victim was bound to its cluster first (at custody, long before
    // the copies): its own teardown goes on, and frees its volume.
    victim.delete_parent().await;
    victim.wait_parent_gone(Duration::from_secs(180)).await;
    assert!(
        env.sim
            .volumes_of(&victim.namespace, &victim.name)
            .is_empty(),
        "the victim's own teardown freed its volume"
    );
    // With the victim gone, so is its cluster (its TenantControlPlane went
    // with it): the copies reach nothing, hold no disk on the management
    // side, and go (the unreachable road, `docs/design.md` §5b).
    for t in [&b, &s] {
        t.wait_parent_gone(Duration::from_secs(120)).await;
    }
}

/// An API server of mallory's own: TLS with a CA of hers, answering
/// `/readyz`, the `kube-system` namespace with `uid`, and an empty list for
/// anything else.
struct FakeApiServer {
    port: u16,
    ca_pem: String,
    task: tokio::task::JoinHandle<()>,
}

impl FakeApiServer {
    /// A kubeconfig that leads to it, trusting its CA.
    fn kubeconfig(&self) -> String {
        json!({"apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "t", "cluster": {"server": format!("https://127.0.0.1:{}", self.port),
                "certificate-authority-data": base64(self.ca_pem.as_bytes())}}],
            "users": [{"name": "u", "user": {"token": "anything"}}],
            "contexts": [{"name": "t", "context": {"cluster": "t", "user": "u"}}],
            "current-context": "t"})
        .to_string()
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn fake_api_server(uid: &str) -> FakeApiServer {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = rcgen::CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&leaf_key, &ca)
        .unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![leaf.der().clone()],
        rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into()),
    )
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let uid = uid.to_string();
    let task = tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (acceptor, uid) = (acceptor.clone(), uid.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper::service::service_fn(
                    move |req: http::Request<hyper::body::Incoming>| {
                        let path = req.uri().path().to_string();
                        let uid = uid.clone();
                        async move {
                            let body = match path.as_str() {
                            "/readyz" => "ok".to_string(),
                            "/api/v1/namespaces/kube-system" => json!({"apiVersion": "v1", "kind": "Namespace",
                                "metadata": {"name": "kube-system", "uid": uid}})
                            .to_string(),
                            _ => json!({"apiVersion": "v1", "kind": "List", "metadata": {}, "items": []})
                                .to_string(),
                        };
                            Ok::<_, std::convert::Infallible>(
                                http::Response::builder()
                                    .header("content-type", "application/json")
                                    .body(http_body_util::Full::new(bytes::Bytes::from(body)))
                                    .unwrap(),
                            )
                        }
                    },
                );
                let _ = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                )
                .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                .await;
            });
        }
    });
    FakeApiServer {
        port,
        ca_pem: ca.pem(),
        task,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_answering_with_a_tenants_uid_but_certified_by_another_ca_is_another_cluster() {
    let env = env();
    let cp = env.cp;
    let t = Tenant::create(cp, &cp.unique("imitated")).await;
    t.wait_custody().await;
    t.with_held_claims(&["data"]).await;
    // The UID is public: it is in the record.
    let uid = t.wait_cluster_bound().await;
    let fake = fake_api_server(&uid).await;
    let kubeconfig = fake.kubeconfig();
    let m = common::editor::mallory(cp, &[&t.namespace]).await;
    let secret = common::profile().kubeconfig_secret_name(&t.name);
    Api::<Secret>::namespaced(m.clone(), &t.namespace)
        .patch(
            &secret,
            &PatchParams::default(),
            &merge(json!({"data": kubeconfig_data(kubeconfig.as_bytes())})),
        )
        .await
        .expect("the Secret's data may change (Kamaji rotates it)");

    t.delete_parent().await;
    let record = t.wait_phase(Phase::Blocked, Duration::from_secs(60)).await;
    let message = record.message.unwrap_or_default();
    assert!(
        message.contains("certified by another CA") && message.contains(&uid),
        "{message}"
    );
    assert!(
        record.inventory.is_none(),
        "nothing was inventoried through the imitation: {:?}",
        record.inventory
    );
    claim_untouched(&t).await;
    // Restored, the tenant's own cluster is released.
    let own = std::fs::read(&t.cluster.kubeconfig).unwrap();
    Api::<Secret>::namespaced(t.management.clone(), &t.namespace)
        .patch(
            &secret,
            &PatchParams::default(),
            &merge(json!({"data": kubeconfig_data(&own)})),
        )
        .await
        .expect("restore the Secret");
    t.wait_parent_gone(Duration::from_secs(180)).await;
    assert!(env.sim.volumes_of(&t.namespace, &t.name).is_empty());
    drop(fake);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_with_no_room_for_its_record_says_so_and_deletes_nothing_until_it_has() {
    let env = env();
    let cp = env.cp;
    let t = Tenant::create(cp, &cp.unique("filled")).await;
    t.wait_custody().await;
    t.with_held_claims(&["data"]).await;
    t.wait_cluster_bound().await;
    let m = common::editor::mallory(cp, &[&t.namespace]).await;
    let hrs: Api<DynamicObject> = Api::namespaced_with(
        m.clone(),
        &t.namespace,
        &common::gate::helmrelease_resource(),
    );

    // Fill the parent's annotations to 16 bytes short of Kubernetes' limit:
    // no record key fits any more.
    let parent = hrs.get(&t.name).await.unwrap();
    let used: usize = parent
        .metadata
        .annotations
        .unwrap_or_default()
        .iter()
        .map(|(k, v)| k.len() + v.len())
        .sum();
    let mut room = volume_gate::record::ANNOTATIONS_LIMIT - 16 - used;
    let mut filler = serde_json::Map::new();
    for i in 0.. {
        let key = format!("filler-{i:02}");
        let take = room.min(16 * 1024);
        if take <= key.len() {
            break;
        }
        filler.insert(key.clone(), json!("x".repeat(take - key.len())));
        room -= take;
    }
    let keys: Vec<String> = filler.keys().cloned().collect();
    hrs.patch(
        &t.name,
        &PatchParams::default(),
        &merge(json!({"metadata": {"annotations": filler}})),
    )
    .await
    .expect("fill the parent's annotations");

    t.delete_parent().await;
    let note = t
        .wait_event("Warning", "RecordNotWritten", |n| n.contains("too large"))
        .await;
    for needle in [
        "kubectl annotate",
        "filler-",
        "Nothing of the tenant is deleted",
    ] {
        assert!(note.contains(needle), "{needle:?}: {note}");
    }
    let record = t.record().await;
    assert_eq!(record.phase, None, "no phase could be written");
    assert!(record.inventory.is_none());
    claim_untouched(&t).await;
    let metrics = env.gate.as_ref().unwrap().lock().unwrap().worker_admin;
    let (_, text) = common::gate::http_get(metrics, "/metrics").await.unwrap();
    assert!(
        text.contains(r#"volume_gate_reconcile_errors_total{error="record-too-large"}"#),
        "counted"
    );

    // Room made, the phase resumes on its backoff and finishes.
    let removal: serde_json::Map<String, Value> =
        keys.iter().map(|k| (k.clone(), Value::Null)).collect();
    hrs.patch(
        &t.name,
        &PatchParams::default(),
        &merge(json!({"metadata": {"annotations": removal}})),
    )
    .await
    .expect("free the parent's annotations");
    t.wait_parent_gone(Duration::from_secs(180)).await;
    assert!(env.sim.volumes_of(&t.namespace, &t.name).is_empty());
}

/// Issue 41, case 5: a parent of mallory's own, in her namespace, whose
/// TenantControlPlane (hers to write) points at a server of hers answering
/// the victim's `kube-system` UID (public: it is in the victim's record),
/// under her own CA. It imitates the victim's cluster but is not it: the
/// victim's teardown is not held by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_imitators_parent_in_another_namespace_does_not_hold_the_tenant_it_imitates() {
    let env = env();
    let cp = env.cp;
    let victim = Tenant::create(cp, &cp.unique("imitatee")).await;
    victim.wait_custody().await;
    victim.with_held_claims(&["data"]).await;
    let uid = victim.wait_cluster_bound().await;
    assert_eq!(env.sim.volumes_of(&victim.namespace, &victim.name).len(), 1);

    let ns = cp.unique("tenant-imitator");
    cp.namespace(&ns).await;
    let m = common::editor::mallory(cp, &[&ns]).await;
    let fake = fake_api_server(&uid).await;
    let kubeconfig = fake.kubeconfig();
    let decoy = "kubernetes-decoy";
    let d = Tenant::attach(cp, &ns, decoy, &victim.cluster).await;
    kubeconfig_secret(&m, &ns, decoy, kubeconfig.as_bytes()).await;
    control_plane(&m, &ns, decoy, &format!("127.0.0.1:{}", fake.port)).await;
    common::tenant::bare_parent(&hrs_in(&m, &ns), decoy).await;
    // Bound to what it reached: the victim's UID under mallory's CA, which
    // is not the victim's cluster, so no conflict with anyone.
    let note = d
        .wait_event("Normal", "ClusterBound", |n| n.contains(&uid))
        .await;
    assert!(!note.contains("another parent"), "{note}");

    victim.delete_parent().await;
    victim.wait_parent_gone(Duration::from_secs(180)).await;
    assert!(
        env.sim
            .volumes_of(&victim.namespace, &victim.name)
            .is_empty(),
        "the victim's teardown was not held by the imitation, and freed its volume"
    );
    drop(fake);
}
