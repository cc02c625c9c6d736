//! The HTTP layer: routes, body limits and timeouts, decoding, the answer,
//! its metrics and log line, and the `webhook` command. What is decided is
//! in [`super::gate`] (the facts) and [`super::decide`] (the judgement).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::{BodyExt, Limited};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::decide::{Verdict, cannot_judge};
use super::gate::Gate;
use super::request;
use super::review::{self, Invalid};
use crate::args::WebhookArgs;
use crate::metrics::{DecisionLabels, EndpointLabels};
use crate::runtime::Runtime;

/// The API server sends a review at once; its own timeout is at most 30s.
const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error(transparent)]
    Boot(#[from] crate::runtime::BootError),
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    #[error("server failed: {0}")]
    Serve(#[source] std::io::Error),
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
    let state = AppState {
        gate,
        max_body_bytes,
    };
    Router::new()
        .route(
            "/validate",
            post(|s: State<AppState>, b: Body| handle(s, b, Endpoint::Validate)),
        )
        .route(
            "/mutate",
            post(|s: State<AppState>, b: Body| handle(s, b, Endpoint::Mutate)),
        )
        .with_state(state)
}

async fn handle(State(state): State<AppState>, body: Body, endpoint: Endpoint) -> Response {
    let started = Instant::now();
    let gate = &state.gate;
    // A body that trickles in must not hold a connection forever.
    let read =
        tokio::time::timeout(BODY_READ_TIMEOUT, read_limited(body, state.max_body_bytes)).await;
    let response = match read.unwrap_or(Err(StatusCode::REQUEST_TIMEOUT)) {
        Ok(bytes) => answer(gate, &bytes, endpoint).await,
        Err(status) => {
            let message = match status {
                StatusCode::PAYLOAD_TOO_LARGE => format!(
                    "AdmissionReview body exceeds {} bytes",
                    state.max_body_bytes
                ),
                StatusCode::REQUEST_TIMEOUT => format!(
                    "request body not received within {}s",
                    BODY_READ_TIMEOUT.as_secs()
                ),
                _ => "cannot read the request body".to_string(),
            };
            reject_invalid(gate, endpoint, status, Invalid { uid: None, message })
        }
    };
    gate.metrics
        .decision_seconds
        .get_or_create(&EndpointLabels {
            endpoint: endpoint.as_str().into(),
        })
        .observe(started.elapsed().as_secs_f64());
    response
}

async fn read_limited(body: Body, limit: usize) -> Result<Bytes, StatusCode> {
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(StatusCode::PAYLOAD_TOO_LARGE)
        }
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
    let op = request::operation_name(&req.operation);
    let kind = request::group_kind(&req);
    let verdict_label = if verdict.allowed() {
        "allowed"
    } else {
        "denied"
    };
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
        name = request::request_name(&req),
        user = req.user_info.username.as_deref().unwrap_or(""),
        dry_run = req.dry_run,
        target = target.label(),
        verdict = verdict_label,
        reason = verdict.reason(),
        patched,
        // Not `message`: that is the event's own key in a JSON line.
        refusal = message,
        micros = started.elapsed().as_micros() as u64,
        "admission decision"
    );
    json_response(
        StatusCode::OK,
        review::respond(&req.uid, &verdict, patch.as_ref()),
    )
}

/// Bad input: a well-formed denial; HTTP 200 when the uid is known.
fn reject_invalid(
    gate: &Gate,
    endpoint: Endpoint,
    status: StatusCode,
    invalid: Invalid,
) -> Response {
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
    let status = if invalid.uid.is_some() {
        StatusCode::OK
    } else {
        status
    };
    json_response(
        status,
        review::respond(invalid.uid.as_deref().unwrap_or(""), &verdict, None),
    )
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// A token cancelled `delay` after `shutdown` is. A Pod being deleted gets
/// SIGTERM while the API server may still pick it for a webhook call, and
/// may write to a kept-alive connection the moment it is closed ("broken
/// pipe", a failed admission, seen in a rolling upgrade on a real node): it
/// goes on serving, new connections too, until its endpoint is gone.
fn delayed(shutdown: CancellationToken, delay: Duration) -> CancellationToken {
    if delay.is_zero() {
        return shutdown;
    }
    let stop = CancellationToken::new();
    let later = stop.clone();
    tokio::spawn(async move {
        shutdown.cancelled().await;
        info!(
            delay_seconds = delay.as_secs_f64(),
            "serving on before draining, while the endpoints drop this Pod"
        );
        tokio::time::sleep(delay).await;
        later.cancel();
    });
    stop
}

/// `volume-gate webhook`: serve until SIGTERM/SIGINT (and `--shutdown-delay`
/// after it), then drain.
pub async fn run(args: WebhookArgs) -> Result<(), WebhookError> {
    let rt = Runtime::start(&args.common).await?;
    let mut profile = rt.profile.clone();
    args.writers.apply(&mut profile.writers);
    profile
        .validate()
        .map_err(|message| crate::profile::ProfileError::Invalid {
            path: "--release-controller, --parent-source-writer, --parent-replacer".into(),
            message,
        })
        .map_err(crate::runtime::BootError::from)?;
    let gate = Arc::new(Gate::new(
        profile,
        args.worker_identity.clone(),
        rt.client.clone(),
        rt.metrics.clone(),
    ));
    let certs = crate::tls::CertReloader::load(&args.tls_cert, &args.tls_key)?;
    certs.spawn_reload(args.cert_reload_interval, rt.shutdown.clone());
    publish_expiry(&certs, &rt.metrics, args.cert_reload_interval, &rt.shutdown);
    let tls_config = crate::tls::server_config(certs);
    let listener = crate::runtime::listen(args.listen).await?;
    info!(
        listen = %listener.local_addr().map_err(WebhookError::Serve)?,
        admin = %rt.admin_addr,
        profile = %gate.profile().name,
        worker_identity = %gate.judge.worker_identity,
        release_controllers = ?gate.profile().writers.release_controllers,
        parent_source_writers = ?gate.profile().writers.parent_sources,
        parent_replacers = ?gate.profile().writers.parent_replacers,
        "volume-gate webhook serving"
    );
    let served = crate::tls::serve(
        listener,
        tls_config,
        router(gate, args.max_body_bytes),
        delayed(rt.shutdown.clone(), args.shutdown_delay),
    )
    .await;
    rt.finish().await;
    served.map_err(WebhookError::Serve)
}

/// Keeps `volume_gate_certificate_expiry_timestamp_seconds` at the expiry of
/// the certificate being served, read again at the reload's own pace so a
/// renewal shows within one interval.
fn publish_expiry(
    certs: &Arc<crate::tls::CertReloader>,
    metrics: &Arc<crate::metrics::Metrics>,
    every: Duration,
    shutdown: &CancellationToken,
) {
    let (certs, metrics, shutdown) = (certs.clone(), metrics.clone(), shutdown.clone());
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every.max(Duration::from_secs(1)));
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            metrics
                .certificate_expiry
                .set(certs.not_after().unwrap_or_default());
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticks.tick() => {}
            }
        }
    });
}
