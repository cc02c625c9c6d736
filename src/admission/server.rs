//! The thin HTTP layer: decode, gather facts with fresh reads, call the pure
//! decisions, answer. The webhook has no side effects: it only reads.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::{BodyExt, Limited};
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ApiResource, PostParams};
use kube::core::admission::Operation;
use kube::core::{DynamicObject, GroupVersionKind, PartialObjectMeta};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::decide::{
    self, Change, ParentFacts, Requester, Subject, Target, UpdateVerdict, Verdict, cannot_judge, classify,
};
use super::review::{self, Invalid};
use crate::metrics::{DecisionLabels, EndpointLabels, Metrics};
use crate::profile::Profile;
use crate::record::{Keys, Record};

pub const DEFAULT_MAX_BODY_BYTES: usize = 3 * 1024 * 1024;
/// The API server sends a review at once; its own timeout is at most 30s.
const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_WORKER_IDENTITY: &str = "system:serviceaccount:volume-gate:volume-gate-worker";

#[derive(clap::Args, Debug, Clone)]
pub struct WebhookArgs {
    /// HTTPS address for admission reviews.
    #[arg(long, default_value = "0.0.0.0:8443", env = "VOLUME_GATE_LISTEN")]
    pub listen: SocketAddr,
    /// Plain-HTTP address for /healthz, /readyz and /metrics.
    #[arg(long, default_value = "0.0.0.0:8080", env = "VOLUME_GATE_ADMIN_LISTEN")]
    pub admin_listen: SocketAddr,
    /// Serving certificate (PEM); reloaded when it changes.
    #[arg(long, default_value = "/etc/volume-gate/tls/tls.crt")]
    pub tls_cert: PathBuf,
    /// Serving key (PEM); reloaded when it changes.
    #[arg(long, default_value = "/etc/volume-gate/tls/tls.key")]
    pub tls_key: PathBuf,
    /// How often to re-read the certificate and key.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub cert_reload_interval: Duration,
    /// Platform profile (YAML); Cozystack when absent.
    #[arg(long, env = "VOLUME_GATE_PROFILE")]
    pub profile: Option<PathBuf>,
    /// The worker's username: the only identity that writes the record and
    /// removes the custody finalizer.
    #[arg(long, default_value = DEFAULT_WORKER_IDENTITY, env = "VOLUME_GATE_WORKER_IDENTITY")]
    pub worker_identity: String,
    /// AdmissionReview bodies larger than this are refused.
    #[arg(long, default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
}

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(s.len()));
    let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a duration like 500ms, 10s, 5m"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" | "" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (use ms, s, m or h)")),
    };
    Ok(Duration::from_secs_f64(secs))
}

#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error(transparent)]
    Profile(#[from] crate::profile::ProfileError),
    #[error("cannot build a Kubernetes client (in-cluster config or KUBECONFIG): {0}")]
    Client(#[source] kube::Error),
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
    #[error("server failed: {0}")]
    Serve(#[source] std::io::Error),
}

/// Everything a decision needs besides the request.
pub struct Gate {
    pub profile: Profile,
    pub keys: Keys,
    pub worker_identity: String,
    pub client: kube::Client,
    pub metrics: Arc<Metrics>,
    parent_resource: ApiResource,
}

impl Gate {
    pub fn new(profile: Profile, worker_identity: String, client: kube::Client, metrics: Arc<Metrics>) -> Self {
        let p = &profile.parent;
        let parent_resource =
            ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(&p.group, &p.version, &p.kind), &p.plural);
        Self { keys: Keys::new(&profile.annotation_prefix), profile, worker_identity, client, metrics, parent_resource }
    }

    fn requester<'a>(&self, req: &'a review::Request) -> Requester<'a> {
        let username = req.user_info.username.as_deref().unwrap_or("");
        Requester { username, is_worker: !username.is_empty() && username == self.worker_identity }
    }

    /// The parent as it is now in the API server: a GET, never a cache, so an
    /// allow never rests on a view that has not seen a deletion yet.
    async fn read_parent(&self, namespace: &str, tenant: &str) -> Result<Option<ParentFacts>, kube::Error> {
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), namespace, &self.parent_resource);
        self.metrics.api_reads.inc();
        let Some(meta) = api.get_metadata_opt(tenant).await? else {
            return Ok(None);
        };
        Ok(self.parent_facts(namespace, tenant, &meta))
    }

    fn parent_facts(&self, namespace: &str, tenant: &str, meta: &PartialObjectMeta<DynamicObject>) -> Option<ParentFacts> {
        let m = &meta.metadata;
        let labels = m.labels.clone().unwrap_or_default();
        if !self.profile.is_parent(&labels) {
            return None;
        }
        Some(ParentFacts {
            namespace: namespace.to_string(),
            name: tenant.to_string(),
            deleting: m.deletion_timestamp.is_some(),
            namespace_deleting: None,
            in_custody: m.finalizers.as_ref().is_some_and(|f| f.contains(&self.profile.custody_finalizer)),
            record: Record::from_annotations(&self.keys, &m.annotations.clone().unwrap_or_default()),
        })
    }

    async fn namespace_deleting(&self, namespace: &str) -> Result<bool, kube::Error> {
        let api: Api<Namespace> = Api::all(self.client.clone());
        self.metrics.api_reads.inc();
        Ok(api.get_metadata_opt(namespace).await?.is_none_or(|ns| ns.metadata.deletion_timestamp.is_some()))
    }

    /// The validating decision for one request.
    pub async fn validate(&self, req: &review::Request) -> (Target, Verdict) {
        let kind = review::group_kind(req);
        let namespace = req.namespace.as_deref().unwrap_or("");
        let name = review::request_name(req);
        match req.operation {
            Operation::Delete => {
                if name.is_empty() {
                    return (Target::Unrelated, cannot_judge(format!("DELETE of {kind} in namespace {namespace:?} names no object")));
                }
                let Some(old) = req.old_object.as_ref() else {
                    // Without the object its labels are unknown: never guess.
                    let target = classify(&self.profile, &kind, name, &Default::default());
                    return (target, cannot_judge(format!("DELETE of {kind} {namespace}/{name} carries no oldObject")));
                };
                let labels = review::labels_of(Some(old));
                let subject = Subject { kind: &kind, namespace, name, action: "delete" };
                let mut judged = Vec::new();
                let ids = decide::identities(&self.profile, &kind, name, &labels);
                for target in decide::with_release_identity(ids, namespace, self.release_of(namespace, Some(old))) {
                    let verdict = match &target {
                        Target::Parent { tenant } => {
                            let view = review::meta_view(old, namespace, name);
                            let facts = ParentFacts {
                                namespace: namespace.to_string(),
                                name: tenant.clone(),
                                deleting: view.deleting,
                                namespace_deleting: None,
                                in_custody: view.finalizers.contains(&self.profile.custody_finalizer),
                                record: Record::from_annotations(&self.keys, &view.annotations),
                            };
                            decide::decide_parent_delete(&self.profile, subject, &facts)
                        }
                        Target::CsiRelease { tenant } | Target::Child { tenant } | Target::Guarded { tenant, .. } => {
                            let tenant = tenant.clone();
                            self.decide_dependent(&target, subject, namespace, &tenant).await
                        }
                        Target::ReleaseObject { tenant, namespace: parent_namespace } => {
                            let (tenant, parent_namespace) = (tenant.clone(), parent_namespace.clone());
                            self.decide_dependent(&target, subject, &parent_namespace, &tenant).await
                        }
                        Target::Unrelated => Verdict::allow("unrelated"),
                    };
                    judged.push((target, verdict));
                }
                strictest_of(judged)
            }
            Operation::Create | Operation::Update => {
                let mut judged = Vec::new();
                // A change of what the object is: judged like the delete it enables.
                if req.operation == Operation::Update {
                    let old = review::labels_of(req.old_object.as_ref());
                    let new = review::labels_of(req.object.as_ref());
                    let subject = Subject { kind: &kind, namespace, name, action: "relabel" };
                    for target in decide::relabel_targets(&self.profile, &kind, name, &old, &new) {
                        let tenant = target.tenant().expect("a dependent has a tenant").to_string();
                        let verdict = self.decide_dependent(&target, subject, namespace, &tenant).await;
                        judged.push((target, verdict));
                    }
                    // Taken out of (or put into) a parent release: judged as
                    // the delete of an object of each release concerned.
                    let (before, after) = (self.release_of(namespace, req.old_object.as_ref()), self.release_of(namespace, req.object.as_ref()));
                    if before != after {
                        for (parent_namespace, tenant) in before.into_iter().chain(after) {
                            let target = Target::ReleaseObject { tenant: tenant.clone(), namespace: parent_namespace.clone() };
                            let verdict = self.decide_dependent(&target, subject, &parent_namespace, &tenant).await;
                            judged.push((target, verdict));
                        }
                    }
                }
                if kind == self.profile.parent_kind() {
                    judged.push(self.guard_release(req, &kind, namespace, name).await);
                }
                strictest_of(judged)
            }
            _ => (Target::Unrelated, Verdict::allow("unrelated")),
        }
    }

    /// The parent release `obj` belongs to, `(namespace, release)`.
    fn release_of(&self, namespace: &str, obj: Option<&review::Object>) -> Option<(String, String)> {
        let view = review::meta_view(obj?, namespace, "");
        decide::release_of(&self.profile, namespace, &view.labels, &view.annotations)
    }

    /// The guards on CREATE/UPDATE of a release: record, override, custody.
    async fn guard_release(&self, req: &review::Request, kind: &crate::profile::GroupKind, namespace: &str, name: &str) -> (Target, Verdict) {
        let Some(new) = req.object.as_ref() else {
            return (Target::Unrelated, cannot_judge(format!("{kind} {namespace}/{name} carries no object")));
        };
        let new_view = review::meta_view(new, namespace, name);
        let old_view = req.old_object.as_ref().map(|o| review::meta_view(o, namespace, name));
        let target = classify(&self.profile, kind, &new_view.name, &new_view.labels);
        let who = self.requester(req);
        let change = Change { old: old_view.as_ref(), new: &new_view };
        let verdict = match decide::guard_update(&self.profile, &self.keys, change, who, jiff::Timestamp::now()) {
            UpdateVerdict::Final(v) => v,
            UpdateVerdict::NeedsOverridePermission { namespace, tenant } => self.check_override_permission(req, &namespace, &tenant).await,
        };
        (target, verdict)
    }

    async fn decide_dependent(&self, target: &Target, subject: Subject<'_>, namespace: &str, tenant: &str) -> Verdict {
        // Both go into URL paths: a '/' would read some other object (and a
        // 404 there reads as "no parent"). The API server never sends such
        // names; a forged review gets a refusal (found by fuzzing).
        if !is_object_name(namespace) || !is_object_name(tenant) {
            return cannot_judge(format!(
                "refusing to {} {subject}: {namespace:?}/{tenant:?} is not a namespace and name the API server would send",
                subject.action
            ));
        }
        let mut parent = match self.read_parent(namespace, tenant).await {
            Ok(p) => p,
            Err(e) => {
                return cannot_judge(format!("refusing to {} {subject}: cannot read tenant {namespace}/{tenant}: {e}", subject.action));
            }
        };
        if let Some(p) = parent.as_mut().filter(|p| decide::needs_namespace(target, p)) {
            match self.namespace_deleting(namespace).await {
                Ok(deleting) => p.namespace_deleting = Some(deleting),
                Err(e) => {
                    return cannot_judge(format!("refusing to {} {subject}: cannot read namespace {namespace}: {e}", subject.action));
                }
            }
        }
        decide::decide_dependent_delete(&self.profile, target, subject, parent.as_ref())
    }

    async fn check_override_permission(&self, req: &review::Request, namespace: &str, tenant: &str) -> Verdict {
        let u = &req.user_info;
        let username = u.username.clone().unwrap_or_default();
        let p = &self.profile.override_permission;
        let sar = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: u.username.clone(),
                groups: u.groups.clone(),
                uid: u.uid.clone(),
                extra: u.extra.clone(),
                resource_attributes: Some(ResourceAttributes {
                    namespace: Some(namespace.to_string()),
                    name: Some(tenant.to_string()),
                    group: Some(p.group.clone()),
                    resource: Some(p.resource.clone()),
                    verb: Some(p.verb.clone()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let api: Api<SubjectAccessReview> = Api::all(self.client.clone());
        self.metrics.api_reads.inc();
        match api.create(&PostParams::default(), &sar).await {
            Ok(done) => {
                let status = done.status.unwrap_or_default();
                if status.allowed && !status.denied.unwrap_or(false) {
                    Verdict::allow("override-authorized")
                } else {
                    decide::override_refused(&self.profile, &username, namespace, tenant, status.reason.as_deref().unwrap_or(""))
                }
            }
            Err(e) => cannot_judge(format!(
                "cannot check whether {username} may record an override on {namespace}/{tenant} (SubjectAccessReview failed: {e})"
            )),
        }
    }

    /// The mutating answer for one request: a verdict and its patch.
    pub fn mutate(&self, req: &review::Request) -> (Target, Verdict, Option<json_patch::Patch>) {
        let kind = review::group_kind(req);
        let namespace = req.namespace.as_deref().unwrap_or("");
        if !matches!(req.operation, Operation::Create | Operation::Update) || kind != self.profile.parent_kind() {
            return (Target::Unrelated, Verdict::allow("unrelated"), None);
        }
        let Some(new) = req.object.as_ref() else {
            return (Target::Unrelated, cannot_judge(format!("{kind} {namespace}/{} carries no object", review::request_name(req))), None);
        };
        let name = review::request_name(req);
        let new_view = review::meta_view(new, namespace, name);
        let old_view = req.old_object.as_ref().map(|o| review::meta_view(o, namespace, name));
        let target = classify(&self.profile, &kind, &new_view.name, &new_view.labels);
        let change = Change { old: old_view.as_ref(), new: &new_view };
        let mutations = decide::mutate(&self.profile, &self.keys, change, self.requester(req), jiff::Timestamp::now());
        let reason = if mutations.is_empty() { "unchanged" } else { "mutated" };
        let patch = decide::to_json_patch(&self.profile, &self.keys, &mutations);
        (target, Verdict::allow(reason), Some(patch))
    }
}

/// The strictest verdict of those an object's identities got, with the
/// identity that earned it (the first one when all allow).
fn strictest_of(judged: Vec<(Target, Verdict)>) -> (Target, Verdict) {
    let target = judged
        .iter()
        .find(|(_, v)| !v.allowed())
        .or(judged.first())
        .map_or(Target::Unrelated, |(t, _)| t.clone());
    (target, decide::strictest(judged.into_iter().map(|(_, v)| v).collect()))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Endpoint {
    Validate,
    Mutate,
}

impl Endpoint {
    fn as_str(self) -> &'static str {
        match self {
            Endpoint::Validate => "validate",
            Endpoint::Mutate => "mutate",
        }
    }
}

#[derive(Clone)]
struct AppState {
    gate: Arc<Gate>,
    max_body_bytes: usize,
}

/// The webhook's routes: `POST /validate` and `POST /mutate`.
pub fn router(gate: Arc<Gate>, max_body_bytes: usize) -> Router {
    let state = AppState { gate, max_body_bytes };
    Router::new()
        .route("/validate", post(|s: State<AppState>, b: Body| handle(s, b, Endpoint::Validate)))
        .route("/mutate", post(|s: State<AppState>, b: Body| handle(s, b, Endpoint::Mutate)))
        .with_state(state)
}

async fn handle(State(state): State<AppState>, body: Body, endpoint: Endpoint) -> Response {
    let started = Instant::now();
    let gate = &state.gate;
    // A body that trickles in must not hold a connection forever.
    let read = tokio::time::timeout(BODY_READ_TIMEOUT, read_limited(body, state.max_body_bytes)).await;
    let response = match read.unwrap_or(Err(StatusCode::REQUEST_TIMEOUT)) {
        Ok(bytes) => answer(gate, &bytes, endpoint).await,
        Err(status) => {
            let message = match status {
                StatusCode::PAYLOAD_TOO_LARGE => format!("AdmissionReview body exceeds {} bytes", state.max_body_bytes),
                StatusCode::REQUEST_TIMEOUT => format!("request body not received within {}s", BODY_READ_TIMEOUT.as_secs()),
                _ => "cannot read the request body".to_string(),
            };
            reject_invalid(gate, endpoint, status, Invalid { uid: None, message })
        }
    };
    gate.metrics
        .decision_seconds
        .get_or_create(&EndpointLabels { endpoint: endpoint.as_str().into() })
        .observe(started.elapsed().as_secs_f64());
    response
}

async fn read_limited(body: Body, limit: usize) -> Result<Bytes, StatusCode> {
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => Err(StatusCode::PAYLOAD_TOO_LARGE),
        Err(_) => Err(StatusCode::BAD_REQUEST),
    }
}

async fn answer(gate: &Gate, body: &[u8], endpoint: Endpoint) -> Response {
    let req = match review::decode(body) {
        Ok(req) => req,
        Err(invalid) => return reject_invalid(gate, endpoint, StatusCode::BAD_REQUEST, invalid),
    };
    let started = Instant::now();
    let (target, verdict, patch) = match endpoint {
        Endpoint::Validate => {
            let (t, v) = gate.validate(&req).await;
            (t, v, None)
        }
        Endpoint::Mutate => gate.mutate(&req),
    };
    let op = review::operation_name(&req.operation);
    let kind = review::group_kind(&req);
    let verdict_label = if verdict.allowed() { "allowed" } else { "denied" };
    gate.metrics
        .decisions
        .get_or_create(&DecisionLabels {
            target: target.label().into(),
            operation: op.into(),
            verdict: verdict_label.into(),
            reason: verdict.reason().into(),
        })
        .inc();
    let patched = patch.as_ref().is_some_and(|p| !p.0.is_empty());
    let message = match &verdict {
        Verdict::Deny { message, .. } => message.as_str(),
        Verdict::Allow { .. } => "",
    };
    info!(
        endpoint = endpoint.as_str(),
        uid = %req.uid,
        operation = op,
        kind = %kind,
        namespace = req.namespace.as_deref().unwrap_or(""),
        name = review::request_name(&req),
        user = req.user_info.username.as_deref().unwrap_or(""),
        dry_run = req.dry_run,
        target = target.label(),
        verdict = verdict_label,
        reason = verdict.reason(),
        patched,
        message,
        micros = started.elapsed().as_micros() as u64,
        "admission decision"
    );
    json_response(StatusCode::OK, review::respond(&req.uid, &verdict, patch.as_ref()))
}

/// Bad input: a well-formed denial; HTTP 200 when the uid is known.
fn reject_invalid(gate: &Gate, endpoint: Endpoint, status: StatusCode, invalid: Invalid) -> Response {
    warn!(endpoint = endpoint.as_str(), uid = invalid.uid.as_deref().unwrap_or(""), problem = %invalid.message, "invalid admission review");
    gate.metrics
        .decisions
        .get_or_create(&DecisionLabels {
            target: "invalid".into(),
            operation: "UNKNOWN".into(),
            verdict: "denied".into(),
            reason: "invalid-review".into(),
        })
        .inc();
    let verdict = cannot_judge(format!("invalid AdmissionReview: {}", invalid.message));
    let status = if invalid.uid.is_some() { StatusCode::OK } else { status };
    json_response(status, review::respond(invalid.uid.as_deref().unwrap_or(""), &verdict, None))
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// `volume-gate webhook`: serve until SIGTERM/SIGINT, then drain.
pub async fn run(args: WebhookArgs) -> Result<(), WebhookError> {
    let profile = match &args.profile {
        Some(path) => Profile::load(path)?,
        None => Profile::cozystack(),
    };
    let client = kube::Client::try_default().await.map_err(WebhookError::Client)?;
    let metrics = Metrics::new();
    let gate = Arc::new(Gate::new(profile, args.worker_identity.clone(), client.clone(), metrics.clone()));
    let shutdown = CancellationToken::new();

    let certs = crate::tls::CertReloader::load(&args.tls_cert, &args.tls_key)?;
    certs.spawn_reload(args.cert_reload_interval, shutdown.clone());
    let tls_config = crate::tls::server_config(certs);

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|source| WebhookError::Listen { addr: args.listen, source })?;
    let admin_listener = tokio::net::TcpListener::bind(args.admin_listen)
        .await
        .map_err(|source| WebhookError::Listen { addr: args.admin_listen, source })?;
    info!(
        listen = %listener.local_addr().map_err(WebhookError::Serve)?,
        admin = %admin_listener.local_addr().map_err(WebhookError::Serve)?,
        profile = %gate.profile.name,
        worker_identity = %gate.worker_identity,
        "volume-gate webhook serving"
    );
    let readiness = Arc::new(crate::admin::ApiServerReadiness::new(client));
    let admin = tokio::spawn(crate::admin::serve_admin(admin_listener, metrics, readiness, shutdown.clone()));
    tokio::spawn(crate::shutdown_on_signal(shutdown.clone()));
    let served = crate::tls::serve(listener, tls_config, router(gate, args.max_body_bytes), shutdown.clone()).await;
    shutdown.cancel();
    let _ = admin.await;
    served.map_err(WebhookError::Serve)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("3").unwrap(), Duration::from_secs(3));
        assert!(parse_duration("ten").unwrap_err().contains("ten"));
        assert!(parse_duration("5d").unwrap_err().contains("unknown unit"));
    }
}

/// A DNS-1123 subdomain, what Kubernetes allows as a namespace or object
/// name (and so safe in a URL path).
fn is_object_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}
