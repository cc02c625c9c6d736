//! The webhook as the API server meets it: the real router behind the real
//! TLS stack, a client that trusts only the generated CA, and AdmissionReview
//! bodies on the wire. The Kubernetes client points at a closed loopback
//! port, so every decision that needs an API read must be refused.

use std::net::SocketAddr;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::client::Resumption;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;
use volume_gate::admission::{Gate, router};
use volume_gate::args::{DEFAULT_MAX_BODY_BYTES, DEFAULT_WORKER_IDENTITY};
use volume_gate::certs::{self, ServingSpec};
use volume_gate::metrics::Metrics;
use volume_gate::profile::Profile;
use volume_gate::record::Keys;
use volume_gate::tls::{self, CertReloader};

const DEADLINE: Duration = Duration::from_secs(20);
/// Nothing listens here (binding it needs root), so every API read fails at once.
const UNREACHABLE_API: &str = "http://127.0.0.1:1";
const WORKER: &str = DEFAULT_WORKER_IDENTITY;
const NAMESPACE: &str = "tenant-x";
const TENANT: &str = "kubernetes-x";

/// The profile the gate runs with: its names are what the tests expect.
fn profile() -> &'static Profile {
    static PROFILE: LazyLock<Profile> = LazyLock::new(Profile::cozystack);
    &PROFILE
}

/// The custody finalizer.
fn finalizer() -> &'static str {
    &profile().custody_finalizer
}

/// The record's annotation keys.
fn keys() -> &'static Keys {
    static KEYS: LazyLock<Keys> = LazyLock::new(|| Keys::new(&profile().annotation_prefix));
    &KEYS
}

// ---------------------------------------------------------------------------
// The server under test
// ---------------------------------------------------------------------------

struct Webhook {
    addr: SocketAddr,
    ca_pem: String,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    task: JoinHandle<std::io::Result<()>>,
    _dir: tempfile::TempDir,
}

impl Webhook {
    /// The production router (`Gate` + `router`) behind `tls::serve`, with a
    /// certificate for 127.0.0.1 minted by `certs::generate` into a tempdir.
    async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut spec = ServingSpec::new("volume-gate-webhook", "volume-gate");
        spec.extra_sans = vec!["127.0.0.1".into()];
        let bundle = certs::generate(&spec, None).unwrap();
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        std::fs::write(&cert, &bundle.tls_cert).unwrap();
        std::fs::write(&key, &bundle.tls_key).unwrap();
        let reloader = CertReloader::load(&cert, &key).unwrap();

        assert!(
            TcpStream::connect("127.0.0.1:1").await.is_err(),
            "something listens on 127.0.0.1:1; these tests need an unreachable API server"
        );
        let config = kube::Config::new(UNREACHABLE_API.parse().unwrap());
        let client = kube::Client::try_from(config).unwrap();
        let metrics = Metrics::new();
        let gate = Arc::new(Gate::new(
            profile().clone(),
            WORKER.to_string(),
            client,
            metrics.clone(),
        ));

        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(tls::serve(
            listener,
            tls::server_config(reloader),
            router(gate, DEFAULT_MAX_BODY_BYTES),
            shutdown.clone(),
        ));
        Self {
            addr,
            ca_pem: bundle.ca.cert,
            metrics,
            shutdown,
            task,
            _dir: dir,
        }
    }

    async fn h2(&self) -> Client {
        Client::connect(self, b"h2").await
    }

    async fn h1(&self) -> Client {
        Client::connect(self, b"http/1.1").await
    }

    fn api_reads(&self) -> u64 {
        self.metrics.api_reads.get()
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(25), self.task)
            .await
            .expect("serve did not return after shutdown")
            .unwrap()
            .unwrap();
    }
}

// ---------------------------------------------------------------------------
// A verifying HTTPS client (tokio-rustls + hyper)
// ---------------------------------------------------------------------------

/// Trusts only `ca_pem`; offers exactly `alpn`.
fn connector(ca_pem: &str, alpn: &[u8]) -> TlsConnector {
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap())
        .unwrap();
    let mut config =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    config.alpn_protocols = vec![alpn.to_vec()];
    config.resumption = Resumption::disabled();
    TlsConnector::from(Arc::new(config))
}

enum Sender {
    H1(http1::SendRequest<Full<Bytes>>),
    H2(http2::SendRequest<Full<Bytes>>),
}

/// One TLS connection; HTTP/2 senders are cloned to multiplex streams.
struct Client {
    sender: Sender,
}

/// An answer as received: HTTP status, Content-Type and the raw body.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    content_type: String,
    body: Bytes,
}

impl Answer {
    /// The body as JSON, checked to be a well-formed AdmissionReview v1 response.
    fn review(&self) -> Value {
        assert_eq!(self.content_type, "application/json", "{self:?}");
        let v: Value = serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "the answer is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        });
        assert_eq!(v["apiVersion"], "admission.k8s.io/v1", "{v}");
        assert_eq!(v["kind"], "AdmissionReview", "{v}");
        assert!(v["response"].is_object(), "{v}");
        assert!(
            v["response"]["uid"].is_string(),
            "response.uid must be a string: {v}"
        );
        assert!(
            v["response"]["allowed"].is_boolean(),
            "response.allowed must be a boolean: {v}"
        );
        v
    }

    fn response(&self) -> Value {
        self.review()["response"].clone()
    }
}

impl Client {
    async fn connect(server: &Webhook, alpn: &[u8]) -> Self {
        let tcp = TcpStream::connect(server.addr).await.unwrap();
        // As Go's net.Dial (the API server's client) does; with Nagle on, a
        // request body written after its headers waits for a delayed ACK.
        tcp.set_nodelay(true).unwrap();
        let tls = connector(&server.ca_pem, alpn)
            .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
            .await
            .expect("a client trusting the generated CA accepts the webhook's certificate");
        assert_eq!(
            tls.get_ref().1.alpn_protocol(),
            Some(alpn),
            "negotiated protocol"
        );
        let io = TokioIo::new(tls);
        let sender = if alpn == b"h2" {
            let (sender, conn) = http2::handshake(TokioExecutor::new(), io).await.unwrap();
            tokio::spawn(conn);
            Sender::H2(sender)
        } else {
            let (sender, conn) = http1::handshake(io).await.unwrap();
            tokio::spawn(conn);
            Sender::H1(sender)
        };
        Self { sender }
    }

    /// Another handle on the same HTTP/2 connection.
    fn stream(&self) -> Self {
        match &self.sender {
            Sender::H2(s) => Self {
                sender: Sender::H2(s.clone()),
            },
            Sender::H1(_) => panic!("HTTP/1.1 connections are not multiplexed"),
        }
    }

    async fn post(&mut self, path: &str, body: impl Into<Bytes>) -> Answer {
        tokio::time::timeout(DEADLINE, self.post_inner(path, body.into()))
            .await
            .unwrap_or_else(|_| panic!("no answer to POST {path} within {DEADLINE:?}"))
    }

    async fn post_inner(&mut self, path: &str, body: Bytes) -> Answer {
        let mut builder = Request::builder()
            .method(Method::POST)
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::CONTENT_LENGTH, body.len());
        builder = match &self.sender {
            Sender::H1(_) => builder.uri(path).header(header::HOST, "127.0.0.1"),
            Sender::H2(_) => builder.uri(format!("https://127.0.0.1{path}")),
        };
        let request = builder.body(Full::new(body)).unwrap();
        let response = match &mut self.sender {
            Sender::H1(s) => {
                s.ready().await.unwrap();
                s.send_request(request).await
            }
            Sender::H2(s) => {
                s.ready().await.unwrap();
                s.send_request(request).await
            }
        }
        .unwrap_or_else(|e| panic!("POST {path}: {e:?}"));
        let status = response.status();
        let content_type = response
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Answer {
            status,
            content_type,
            body,
        }
    }

    /// POSTs a review and returns its `response`, asserting HTTP 200.
    async fn review(&mut self, path: &str, review: &Value) -> Value {
        let answer = self.post(path, serde_json::to_vec(review).unwrap()).await;
        assert_eq!(
            answer.status,
            StatusCode::OK,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
        answer.response()
    }
}

// ---------------------------------------------------------------------------
// AdmissionReviews
// ---------------------------------------------------------------------------

fn helmrelease(name: &str, labels: Value, annotations: Value, finalizers: &[&str]) -> Value {
    let mut metadata =
        json!({"name": name, "namespace": NAMESPACE, "labels": labels, "annotations": annotations});
    if !finalizers.is_empty() {
        metadata["finalizers"] = json!(finalizers);
    }
    json!({
        "apiVersion": "helm.toolkit.fluxcd.io/v2",
        "kind": "HelmRelease",
        "metadata": metadata,
        "spec": {"chart": {"spec": {"chart": "kubernetes"}}, "values": {"storageClass": "replicated"}}
    })
}

fn parent_labels() -> Value {
    json!({
        "apps.cozystack.io/application.kind": "Kubernetes",
        "apps.cozystack.io/application.group": "apps.cozystack.io",
        "apps.cozystack.io/application.name": "x"
    })
}

/// The tenant's parent HelmRelease.
fn parent(annotations: Value, finalizers: &[&str]) -> Value {
    helmrelease(TENANT, parent_labels(), annotations, finalizers)
}

/// A request for `kind` (group, version, kind, plural) as the API server sends it.
#[allow(clippy::too_many_arguments)]
fn request_for(
    uid: &str,
    gvk: (&str, &str, &str, &str),
    operation: &str,
    name: &str,
    user: &str,
    object: Option<Value>,
    old_object: Option<Value>,
    dry_run: bool,
) -> Value {
    let (group, version, kind, plural) = gvk;
    let mut r = json!({
        "uid": uid,
        "kind": {"group": group, "version": version, "kind": kind},
        "resource": {"group": group, "version": version, "resource": plural},
        "requestKind": {"group": group, "version": version, "kind": kind},
        "requestResource": {"group": group, "version": version, "resource": plural},
        "name": name,
        "namespace": NAMESPACE,
        "operation": operation,
        "userInfo": {"username": user, "uid": format!("uid-of-{user}"), "groups": ["system:authenticated"]},
        "object": object,
        "oldObject": old_object,
        "dryRun": dry_run,
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": format!("{}Options", title(operation))}
    });
    if r["object"].is_null() {
        r.as_object_mut().unwrap().remove("object");
    }
    if r["oldObject"].is_null() {
        r.as_object_mut().unwrap().remove("oldObject");
    }
    r
}

fn title(operation: &str) -> String {
    let lower = operation.to_lowercase();
    let mut chars = lower.chars();
    chars
        .next()
        .map(|c| c.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

const HELMRELEASE: (&str, &str, &str, &str) = (
    "helm.toolkit.fluxcd.io",
    "v2",
    "HelmRelease",
    "helmreleases",
);

fn hr_request(
    uid: &str,
    operation: &str,
    name: &str,
    user: &str,
    object: Option<Value>,
    old: Option<Value>,
) -> Value {
    request_for(uid, HELMRELEASE, operation, name, user, object, old, false)
}

fn review(request: Value) -> Value {
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request})
}

/// DELETE of the parent as the API server sends it (oldObject, no object).
fn parent_delete(uid: &str, finalizers: &[&str], dry_run: bool) -> Value {
    let old = parent(json!({}), finalizers);
    review(request_for(
        uid,
        HELMRELEASE,
        "DELETE",
        TENANT,
        "alice",
        None,
        Some(old),
        dry_run,
    ))
}

/// DELETE of the tenant's CSI driver release.
fn csi_delete(uid: &str, dry_run: bool) -> Value {
    let name = profile()
        .csi_release_name(TENANT)
        .expect("Cozystack has a CSI release");
    let old = helmrelease(
        &name,
        json!({"cozystack.io/target-cluster-name": TENANT}),
        json!({}),
        &[],
    );
    review(request_for(
        uid,
        HELMRELEASE,
        "DELETE",
        &name,
        "alice",
        None,
        Some(old),
        dry_run,
    ))
}

/// A forged phase on an UPDATE of the parent, by `user`.
fn forged_phase_update(uid: &str, user: &str) -> Value {
    let old = parent(json!({}), &[finalizer()]);
    let new = parent(json!({&keys().phase: "Released"}), &[finalizer()]);
    review(hr_request(
        uid,
        "UPDATE",
        TENANT,
        user,
        Some(new),
        Some(old),
    ))
}

fn parent_create(uid: &str) -> Value {
    review(hr_request(
        uid,
        "CREATE",
        TENANT,
        "alice",
        Some(parent(json!({}), &[])),
        None,
    ))
}

fn decode_patch(response: &Value) -> json_patch::Patch {
    assert_eq!(response["patchType"], "JSONPatch", "{response}");
    let text = response["patch"]
        .as_str()
        .unwrap_or_else(|| panic!("patch must be a base64 string, got {response}"));
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text)
        .expect("patch is standard base64");
    serde_json::from_slice(&bytes).expect("patch decodes to an RFC 6902 JSON Patch")
}

fn denied(response: &Value) -> &str {
    assert_eq!(response["allowed"], false, "{response}");
    response["status"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("a denial carries a message: {response}"))
}

fn assert_allowed(response: &Value) {
    assert_eq!(response["allowed"], true, "{response}");
    assert!(
        response
            .get("status")
            .is_none_or(|s| s.get("code").is_none_or(|c| c == 200)),
        "{response}"
    );
}

// ---------------------------------------------------------------------------
// Round trips
// ---------------------------------------------------------------------------

#[tokio::test]
async fn validate_refuses_a_forged_record_from_a_person_and_accepts_it_from_the_worker() {
    let server = Webhook::start().await;
    let mut client = server.h2().await;

    let response = client
        .review(
            "/validate",
            &forged_phase_update("uid-forged-by-alice", "alice"),
        )
        .await;
    assert_eq!(response["uid"], "uid-forged-by-alice");
    let message = denied(&response);
    assert_eq!(response["status"]["code"], 403, "{response}");
    assert!(
        message.contains(&keys().phase),
        "the message names the key: {message}"
    );
    assert!(
        message.contains("alice"),
        "the message names the requester: {message}"
    );

    let response = client
        .review("/validate", &forged_phase_update("uid-by-worker", WORKER))
        .await;
    assert_eq!(response["uid"], "uid-by-worker");
    assert_allowed(&response);
    assert_eq!(
        server.api_reads(),
        0,
        "record guards are decided from the request alone"
    );
    server.stop().await;
}

#[tokio::test]
async fn delete_of_a_parent_in_custody_is_allowed_without_an_api_read() {
    let server = Webhook::start().await;
    let mut client = server.h2().await;

    let response = client
        .review(
            "/validate",
            &parent_delete("uid-in-custody", &[finalizer()], false),
        )
        .await;
    assert_eq!(response["uid"], "uid-in-custody");
    assert_allowed(&response);
    assert_eq!(
        server.api_reads(),
        0,
        "custody is judged from oldObject, with no read"
    );

    let response = client
        .review(
            "/validate",
            &parent_delete("uid-no-custody", &["other.example.com/keep"], false),
        )
        .await;
    assert_eq!(response["uid"], "uid-no-custody");
    let message = denied(&response);
    assert_eq!(response["status"]["code"], 403, "{response}");
    assert!(message.contains("not yet in custody"), "{message}");
    assert!(message.contains(finalizer()), "{message}");

    let response = client
        .review("/validate", &parent_delete("uid-no-finalizers", &[], false))
        .await;
    assert!(
        denied(&response).contains("not yet in custody"),
        "{response}"
    );
    assert_eq!(server.api_reads(), 0);
    server.stop().await;
}

#[tokio::test]
async fn an_allow_that_needs_a_read_is_refused_when_the_api_server_is_unreachable() {
    let server = Webhook::start().await;
    let mut client = server.h2().await;

    let response = client
        .review("/validate", &csi_delete("uid-csi", false))
        .await;
    assert_eq!(response["uid"], "uid-csi");
    let message = denied(&response);
    assert!(
        message.contains(&format!("cannot read tenant {NAMESPACE}/{TENANT}")),
        "{message}"
    );
    assert!(
        message.contains(
            &profile()
                .csi_release_name(TENANT)
                .expect("Cozystack has a CSI release")
        ),
        "the message names the object: {message}"
    );
    assert!(server.api_reads() >= 1, "the decision tried a read");

    // A child release (addons are toggled by deleting them: allowed only when
    // not in teardown, which takes a fresh read) and guarded dependencies.
    let child = helmrelease(
        &format!("{TENANT}-monitoring-agents"),
        json!({"cozystack.io/target-cluster-name": TENANT}),
        json!({}),
        &[],
    );
    let secret = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": profile().kubeconfig_secret_name(TENANT), "namespace": NAMESPACE}});
    let machine = json!({"apiVersion": "cluster.x-k8s.io/v1beta1", "kind": "Machine",
        "metadata": {"name": "kubernetes-x-md0-abcde", "namespace": NAMESPACE, "labels": {"cluster.x-k8s.io/cluster-name": TENANT}}});
    let cases = [
        (
            "uid-child",
            HELMRELEASE,
            format!("{TENANT}-monitoring-agents"),
            child,
        ),
        (
            "uid-secret",
            ("", "v1", "Secret", "secrets"),
            profile().kubeconfig_secret_name(TENANT),
            secret,
        ),
        (
            "uid-machine",
            ("cluster.x-k8s.io", "v1beta1", "Machine", "machines"),
            "kubernetes-x-md0-abcde".to_string(),
            machine,
        ),
    ];
    for (uid, gvk, name, old) in cases {
        let reads_before = server.api_reads();
        let request = review(request_for(
            uid,
            gvk,
            "DELETE",
            &name,
            "alice",
            None,
            Some(old),
            false,
        ));
        let response = client.review("/validate", &request).await;
        assert_eq!(response["uid"], uid);
        let message = denied(&response);
        assert!(message.contains("cannot read tenant"), "{uid}: {message}");
        assert!(
            server.api_reads() > reads_before,
            "{uid}: the decision tried a read"
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn mutate_adds_the_custody_finalizer_as_a_base64_json_patch() {
    let server = Webhook::start().await;
    let mut client = server.h2().await;

    let request = parent_create("uid-create");
    let response = client.review("/mutate", &request).await;
    assert_eq!(response["uid"], "uid-create");
    assert_allowed(&response);
    assert!(
        response["patch"].is_string(),
        "the patch is a base64 string, not a number array: {response}"
    );
    let patch = decode_patch(&response);
    assert_eq!(
        serde_json::to_value(&patch).unwrap(),
        json!([{"op": "add", "path": "/metadata/finalizers", "value": [finalizer()]}])
    );
    let mut object = request["request"]["object"].clone();
    json_patch::patch(&mut object, &patch).expect("the patch applies to the object");
    assert_eq!(object["metadata"]["finalizers"], json!([finalizer()]));
    assert_eq!(object["metadata"]["name"], TENANT, "nothing else changed");

    // Already in custody: nothing to add, no patch at all.
    let with = review(hr_request(
        "uid-create-2",
        "CREATE",
        TENANT,
        "alice",
        Some(parent(json!({}), &[finalizer()])),
        None,
    ));
    let response = client.review("/mutate", &with).await;
    assert_allowed(&response);
    assert!(
        response.get("patch").is_none() && response.get("patchType").is_none(),
        "{response}"
    );

    // Another finalizer present: the custody finalizer is appended.
    let other = review(hr_request(
        "uid-create-3",
        "CREATE",
        TENANT,
        "alice",
        Some(parent(json!({}), &["a.example.com/x"])),
        None,
    ));
    let response = client.review("/mutate", &other).await;
    let patch = decode_patch(&response);
    let mut object = other["request"]["object"].clone();
    json_patch::patch(&mut object, &patch).unwrap();
    assert_eq!(
        object["metadata"]["finalizers"],
        json!(["a.example.com/x", finalizer()])
    );
    assert_eq!(server.api_reads(), 0, "mutation never reads");
    server.stop().await;
}

#[tokio::test]
async fn mutate_stamps_an_override_with_the_requester_and_the_time() {
    let server = Webhook::start().await;
    let mut client = server.h2().await;

    let old = parent(json!({}), &[finalizer()]);
    let new = parent(
        json!({&keys().override_reason: "customer gone, volumes abandoned"}),
        &[finalizer()],
    );
    let request = review(hr_request(
        "uid-override",
        "UPDATE",
        TENANT,
        "bob",
        Some(new.clone()),
        Some(old),
    ));
    let before = jiff::Timestamp::now();
    let response = client.review("/mutate", &request).await;
    let after = jiff::Timestamp::now();
    assert_eq!(response["uid"], "uid-override");
    assert_allowed(&response);
    let patch = decode_patch(&response);

    let mut object = new.clone();
    json_patch::patch(&mut object, &patch).expect("the stamp patch applies");
    let annotations = &object["metadata"]["annotations"];
    assert_eq!(annotations[&keys().override_by], "bob", "{object}");
    assert_eq!(
        annotations[&keys().override_reason],
        "customer gone, volumes abandoned"
    );
    let at = annotations[&keys().override_at]
        .as_str()
        .expect("override-at is stamped");
    let stamped: jiff::Timestamp = at
        .parse()
        .unwrap_or_else(|e| panic!("override-at {at:?} is not RFC 3339: {e}"));
    assert!(
        at.ends_with('Z') && at.as_bytes()[10] == b'T',
        "override-at {at:?} is RFC 3339 UTC"
    );
    assert!(
        stamped.as_second() >= before.as_second() - 1
            && stamped.as_second() <= after.as_second() + 1,
        "override-at {at} is the time of the request ({before}..{after})"
    );
    assert_eq!(
        object["metadata"]["finalizers"],
        json!([finalizer()]),
        "no other change"
    );

    // A client-supplied stamp is overwritten, never accepted.
    let forged = parent(
        json!({&keys().override_reason: "gone", &keys().override_by: "someone-else",
               &keys().override_at: "2001-01-01T00:00:00Z"}),
        &[finalizer()],
    );
    let request = review(hr_request(
        "uid-override-forged",
        "UPDATE",
        TENANT,
        "bob",
        Some(forged.clone()),
        Some(parent(json!({}), &[finalizer()])),
    ));
    let response = client.review("/mutate", &request).await;
    let mut object = forged;
    json_patch::patch(&mut object, &decode_patch(&response)).unwrap();
    assert_eq!(
        object["metadata"]["annotations"][&keys().override_by],
        "bob"
    );
    assert_ne!(
        object["metadata"]["annotations"][&keys().override_at],
        "2001-01-01T00:00:00Z"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_stamped_override_is_refused_when_the_access_review_cannot_be_made() {
    let server = Webhook::start().await;
    let mut client = server.h2().await;

    // What the API server does: mutate first, then validate the patched object.
    let old = parent(json!({}), &[finalizer()]);
    let new = parent(
        json!({&keys().override_reason: "customer gone"}),
        &[finalizer()],
    );
    let request = review(hr_request(
        "uid-sar",
        "UPDATE",
        TENANT,
        "bob",
        Some(new.clone()),
        Some(old.clone()),
    ));
    let response = client.review("/mutate", &request).await;
    let mut patched = new;
    json_patch::patch(&mut patched, &decode_patch(&response)).unwrap();

    let request = review(hr_request(
        "uid-sar",
        "UPDATE",
        TENANT,
        "bob",
        Some(patched),
        Some(old),
    ));
    let response = client.review("/validate", &request).await;
    assert_eq!(response["uid"], "uid-sar");
    let message = denied(&response);
    assert!(message.contains("SubjectAccessReview failed"), "{message}");
    assert!(message.contains("bob"), "{message}");
    assert_eq!(
        server.api_reads(),
        1,
        "exactly one SubjectAccessReview was attempted"
    );
    server.stop().await;
}

#[tokio::test]
async fn dry_run_gets_exactly_the_answer_of_a_real_request() {
    let server = Webhook::start().await;
    let mut client = server.h2().await;

    for finalizers in [&[finalizer()][..], &[][..]] {
        let real = client
            .post(
                "/validate",
                serde_json::to_vec(&parent_delete("uid-dry", finalizers, false)).unwrap(),
            )
            .await;
        let dry = client
            .post(
                "/validate",
                serde_json::to_vec(&parent_delete("uid-dry", finalizers, true)).unwrap(),
            )
            .await;
        assert_eq!(real.status, StatusCode::OK);
        assert_eq!(dry.status, real.status);
        assert_eq!(dry.review(), real.review(), "finalizers {finalizers:?}");
        assert_eq!(
            dry.body, real.body,
            "byte for byte, finalizers {finalizers:?}"
        );
    }
    let real = client
        .review("/validate", &csi_delete("uid-dry-csi", false))
        .await;
    let dry = client
        .review("/validate", &csi_delete("uid-dry-csi", true))
        .await;
    assert_eq!(real["allowed"], false);
    assert_eq!(dry, real);
    server.stop().await;
}

#[tokio::test]
async fn only_gated_operations_are_refused_an_unknown_kind_is_allowed() {
    let server = Webhook::start().await;
    let mut client = server.h2().await;

    let configmap = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings", "namespace": NAMESPACE}});
    let request = review(request_for(
        "uid-cm",
        ("", "v1", "ConfigMap", "configmaps"),
        "DELETE",
        "settings",
        "alice",
        None,
        Some(configmap),
        false,
    ));
    for endpoint in ["/validate", "/mutate"] {
        let response = client.review(endpoint, &request).await;
        assert_eq!(response["uid"], "uid-cm");
        assert_allowed(&response);
        assert!(response.get("patch").is_none(), "{response}");
    }
    // A HelmRelease that is no tenant's: not gated either.
    let unrelated = helmrelease("ingress-nginx", json!({"app": "ingress"}), json!({}), &[]);
    let request = review(hr_request(
        "uid-unrelated",
        "DELETE",
        "ingress-nginx",
        "alice",
        None,
        Some(unrelated),
    ));
    assert_allowed(&client.review("/validate", &request).await);
    assert_eq!(server.api_reads(), 0, "nothing unrelated is read");
    server.stop().await;
}

#[tokio::test]
async fn http1_clients_get_the_same_answers() {
    let server = Webhook::start().await;
    let mut client = server.h1().await;
    let response = client
        .review("/validate", &forged_phase_update("uid-h1", "alice"))
        .await;
    assert_eq!(response["uid"], "uid-h1");
    assert!(denied(&response).contains("alice"));
    let response = client
        .review("/mutate", &parent_create("uid-h1-mutate"))
        .await;
    assert_eq!(response["uid"], "uid-h1-mutate");
    decode_patch(&response);
    server.stop().await;
}

// ---------------------------------------------------------------------------
// Malformed input
// ---------------------------------------------------------------------------

struct Malformed {
    what: &'static str,
    body: Vec<u8>,
    status: StatusCode,
    uid: &'static str,
    /// Part of response.status.message.
    says: &'static str,
}

fn malformed_cases() -> Vec<Malformed> {
    let valid = serde_json::to_vec(&parent_delete("uid-valid", &[finalizer()], false)).unwrap();

    let mut v1beta1 = parent_delete("uid-v1beta1", &[finalizer()], false);
    v1beta1["apiVersion"] = json!("admission.k8s.io/v1beta1");

    let mut no_uid = parent_delete("ignored", &[finalizer()], false);
    no_uid["request"].as_object_mut().unwrap().remove("uid");

    let mut empty_uid = parent_delete("ignored", &[finalizer()], false);
    empty_uid["request"]["uid"] = json!("");

    let no_request = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"});
    let null_request =
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": null});

    let mut unknown_op = parent_delete("uid-unknown-op", &[finalizer()], false);
    unknown_op["request"]["operation"] = json!("EXPLODE");

    let mut wrong_kind = parent_delete("uid-wrong-kind", &[finalizer()], false);
    wrong_kind["kind"] = json!("AdmissionResponse");

    // An otherwise valid review whose object is padded past the limit.
    let mut huge = parent_delete("uid-huge", &[finalizer()], false);
    huge["request"]["oldObject"]["spec"]["values"]["padding"] =
        json!("x".repeat(DEFAULT_MAX_BODY_BYTES));
    let huge = serde_json::to_vec(&huge).unwrap();
    assert!(huge.len() > DEFAULT_MAX_BODY_BYTES);

    let body = |v: &Value| serde_json::to_vec(v).unwrap();
    let bad = StatusCode::BAD_REQUEST;
    let ok = StatusCode::OK;
    vec![
        Malformed {
            what: "not JSON",
            body: b"this is not an AdmissionReview".to_vec(),
            status: bad,
            uid: "",
            says: "not JSON",
        },
        Malformed {
            what: "truncated JSON",
            body: valid[..valid.len() / 2].to_vec(),
            status: bad,
            uid: "",
            says: "not JSON",
        },
        Malformed {
            what: "truncated by one byte",
            body: valid[..valid.len() - 1].to_vec(),
            status: bad,
            uid: "",
            says: "not JSON",
        },
        Malformed {
            what: "v1beta1",
            body: body(&v1beta1),
            status: ok,
            uid: "uid-v1beta1",
            says: "admissionReviewVersions",
        },
        Malformed {
            what: "wrong kind",
            body: body(&wrong_kind),
            status: ok,
            uid: "uid-wrong-kind",
            says: "AdmissionResponse",
        },
        Malformed {
            what: "missing uid",
            body: body(&no_uid),
            status: bad,
            uid: "",
            says: "no uid",
        },
        Malformed {
            what: "empty uid",
            body: body(&empty_uid),
            status: bad,
            uid: "",
            says: "no uid",
        },
        Malformed {
            what: "missing request",
            body: body(&no_request),
            status: bad,
            uid: "",
            says: "no request",
        },
        Malformed {
            what: "null request",
            body: body(&null_request),
            status: bad,
            uid: "",
            says: "no request",
        },
        Malformed {
            what: "unknown operation",
            body: body(&unknown_op),
            status: ok,
            uid: "uid-unknown-op",
            says: "malformed",
        },
        Malformed {
            what: "a JSON array",
            body: b"[1,2,3]".to_vec(),
            status: bad,
            uid: "",
            says: "expected apiVersion",
        },
        Malformed {
            what: "JSON null",
            body: b"null".to_vec(),
            status: bad,
            uid: "",
            says: "expected apiVersion",
        },
        Malformed {
            what: "a body over the limit",
            body: huge,
            status: StatusCode::PAYLOAD_TOO_LARGE,
            uid: "",
            says: "exceeds",
        },
        Malformed {
            what: "empty body",
            body: Vec::new(),
            status: bad,
            uid: "",
            says: "not JSON",
        },
    ]
}

async fn check_malformed(client: &mut Client, endpoint: &str, case: Malformed) {
    let what = format!("{endpoint}, {}", case.what);
    let answer = client.post(endpoint, case.body).await;
    assert_eq!(
        answer.status,
        case.status,
        "{what}: {}",
        String::from_utf8_lossy(&answer.body)
    );
    let text = String::from_utf8_lossy(&answer.body);
    assert!(!text.contains("\"allowed\":true"), "{what}: {text}");
    let response = answer.response();
    assert_eq!(response["uid"], case.uid, "{what}: {response}");
    assert_eq!(response["allowed"], false, "{what}: {response}");
    assert_eq!(response["status"]["code"], 400, "{what}: {response}");
    let message = response["status"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("invalid AdmissionReview"),
        "{what}: {message}"
    );
    assert!(
        message.contains(case.says),
        "{what}: expected {:?} in {message}",
        case.says
    );
    assert!(response.get("patch").is_none(), "{what}: {response}");
}

#[tokio::test]
async fn malformed_reviews_are_refused_with_a_well_formed_answer_on_both_endpoints() {
    let server = Webhook::start().await;
    let mut client = server.h2().await;
    for endpoint in ["/validate", "/mutate"] {
        for case in malformed_cases() {
            check_malformed(&mut client, endpoint, case).await;
        }
    }
    // The connection survived all of it.
    let response = client
        .review(
            "/validate",
            &parent_delete("uid-after", &[finalizer()], false),
        )
        .await;
    assert_allowed(&response);
    assert_eq!(server.api_reads(), 0);
    server.stop().await;
}

#[tokio::test]
async fn an_oversized_review_over_http1_is_refused_with_a_well_formed_answer() {
    let server = Webhook::start().await;
    for endpoint in ["/validate", "/mutate"] {
        let case = malformed_cases()
            .into_iter()
            .find(|c| c.what == "a body over the limit")
            .unwrap();
        let mut client = server.h1().await;
        check_malformed(&mut client, endpoint, case).await;
    }
    server.stop().await;
}

/// The largest review the API server can send: an UPDATE of an object at
/// etcd's 1.5 MiB whose JSON the encoder grew sixfold (`<` written as
/// `\u003c`), carried twice. It is judged, not refused for its size.
#[tokio::test]
async fn a_review_of_the_largest_object_the_api_server_can_send_is_judged() {
    let server = Webhook::start().await;
    let mut review = forged_phase_update("uid-largest", "alice");
    let padding = "<".repeat(1536 * 1024);
    for side in ["object", "oldObject"] {
        review["request"][side]["spec"]["values"]["padding"] = json!(padding);
    }
    // serde_json leaves '<' alone; write it as Go's encoder does.
    let body = serde_json::to_string(&review)
        .unwrap()
        .replace('<', "\\u003c");
    assert!(body.len() > 18 * 1024 * 1024, "{} bytes", body.len());
    let mut client = server.h1().await;
    let answer = client.post("/validate", body.into_bytes()).await;
    assert_eq!(
        answer.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    let response = answer.response();
    assert_eq!(response["uid"], "uid-largest");
    assert_eq!(response["allowed"], false);
    assert!(
        response["status"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("release record is written only by the volume-gate worker")),
        "judged by the guards, not refused for its size: {response}"
    );
    server.stop().await;
}

// ---------------------------------------------------------------------------
// Metrics and concurrency
// ---------------------------------------------------------------------------

/// `(labels, value)` of each sample line of `name` in an exposition.
fn samples<'a>(exposition: &'a str, name: &str) -> Vec<(&'a str, f64)> {
    exposition
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            let (labels, value) = match rest.strip_prefix('{') {
                Some(r) => r.split_once("} ")?,
                None => ("", rest.strip_prefix(' ')?),
            };
            Some((labels, value.split(' ').next()?.parse().ok()?))
        })
        .collect()
}

fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let start = labels.find(&format!("{name}=\""))? + name.len() + 2;
    labels[start..].split('"').next()
}

#[tokio::test]
async fn decisions_and_their_durations_are_counted() {
    let server = Webhook::start().await;
    let mut client = server.h2().await;
    for i in 0..5 {
        client
            .review(
                "/validate",
                &forged_phase_update(&format!("uid-m-deny-{i}"), "alice"),
            )
            .await;
        client
            .review(
                "/validate",
                &parent_delete(&format!("uid-m-allow-{i}"), &[finalizer()], false),
            )
            .await;
        client
            .review("/mutate", &parent_create(&format!("uid-m-mutate-{i}")))
            .await;
    }
    client.post("/validate", &b"garbage"[..]).await;

    let text = server.metrics.encode();
    let decisions = samples(&text, "volume_gate_admission_decisions_total");
    let count = |verdict: &str, reason: &str| -> f64 {
        decisions
            .iter()
            .filter(|(l, _)| {
                label(l, "verdict") == Some(verdict) && label(l, "reason") == Some(reason)
            })
            .map(|(_, v)| v)
            .sum()
    };
    assert_eq!(count("denied", "record-forged"), 5.0, "{text}");
    assert_eq!(count("allowed", "in-custody"), 5.0, "{text}");
    assert_eq!(count("allowed", "mutated"), 5.0, "{text}");
    assert_eq!(count("denied", "invalid-review"), 1.0, "{text}");
    assert!(
        decisions
            .iter()
            .any(|(l, _)| label(l, "target") == Some("parent")
                && label(l, "operation") == Some("UPDATE")),
        "{text}"
    );

    let buckets = samples(&text, "volume_gate_admission_duration_seconds_bucket");
    for endpoint in ["validate", "mutate"] {
        let mine: Vec<(f64, f64)> = buckets
            .iter()
            .filter(|(l, _)| label(l, "endpoint") == Some(endpoint))
            .map(|(l, v)| (label(l, "le").unwrap().parse::<f64>().unwrap(), *v))
            .collect();
        assert!(
            mine.iter().any(|(le, _)| *le <= 0.0001),
            "{endpoint}: a bucket at or below 100µs: {text}"
        );
        // Decisions without reads take a few hundred µs even in a debug build.
        let sub_ms = mine
            .iter()
            .filter(|(le, _)| *le < 0.001)
            .map(|(_, v)| *v)
            .fold(0.0, f64::max);
        assert!(
            sub_ms >= 1.0,
            "{endpoint}: no answer took under a millisecond: {text}"
        );
        let total = mine
            .iter()
            .find(|(le, _)| le.is_infinite())
            .map(|(_, v)| *v)
            .unwrap_or_else(|| panic!("{endpoint}: +Inf bucket: {text}"));
        let expected = if endpoint == "validate" { 11.0 } else { 5.0 };
        assert_eq!(
            total, expected,
            "{endpoint}: every answer is observed once: {text}"
        );
        let counts = samples(&text, "volume_gate_admission_duration_seconds_count");
        let count = counts
            .iter()
            .find(|(l, _)| label(l, "endpoint") == Some(endpoint))
            .map(|(_, v)| *v);
        assert_eq!(count, Some(expected), "{text}");
    }
    assert_eq!(server.api_reads(), 0);
    assert_eq!(
        samples(&text, "volume_gate_admission_api_reads_total"),
        [("", 0.0)],
        "{text}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_requests_over_twenty_streams_of_one_connection_are_all_answered() {
    const REQUESTS: usize = 200;
    const STREAMS: usize = 20;
    let server = Webhook::start().await;
    let client = server.h2().await;

    // Each request knows the answer it must get.
    let expected = |i: usize| -> (&'static str, Value, bool) {
        let uid = format!("uid-concurrent-{i:03}");
        match i % 5 {
            0 => (
                "/validate",
                parent_delete(&uid, &[finalizer()], false),
                true,
            ),
            1 => ("/validate", parent_delete(&uid, &[], false), false),
            2 => ("/validate", forged_phase_update(&uid, "alice"), false),
            3 => ("/mutate", parent_create(&uid), true),
            _ => ("/validate", csi_delete(&uid, false), false),
        }
    };
    let mut tasks = Vec::new();
    for stream in 0..STREAMS {
        let mut client = client.stream();
        tasks.push(tokio::spawn(async move {
            let mut failures = Vec::new();
            for i in (stream..REQUESTS).step_by(STREAMS) {
                let (endpoint, request, allowed) = expected(i);
                let answer = client
                    .post(endpoint, serde_json::to_vec(&request).unwrap())
                    .await;
                let response = answer.response();
                let uid = format!("uid-concurrent-{i:03}");
                if answer.status != StatusCode::OK
                    || response["uid"] != uid.as_str()
                    || response["allowed"] != allowed
                {
                    failures.push(format!("request {i}: HTTP {} {response}", answer.status));
                }
                if i % 5 == 3 {
                    let patch = decode_patch(&response);
                    if serde_json::to_value(&patch).unwrap()[0]["path"] != "/metadata/finalizers" {
                        failures.push(format!("request {i}: wrong patch {patch:?}"));
                    }
                }
            }
            failures
        }));
    }
    let mut failures = Vec::new();
    for task in tasks {
        failures.extend(task.await.unwrap());
    }
    assert!(
        failures.is_empty(),
        "{} of {REQUESTS} answered wrongly: {failures:#?}",
        failures.len()
    );
    let text = server.metrics.encode();
    let total: f64 = samples(&text, "volume_gate_admission_decisions_total")
        .iter()
        .map(|(_, v)| v)
        .sum();
    assert_eq!(total, REQUESTS as f64, "{text}");
    server.stop().await;
}
