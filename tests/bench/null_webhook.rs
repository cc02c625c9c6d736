//! The null webhook of the admission benchmarks: it reads the body, finds
//! the uid (serde skims the rest of the document without building it) and
//! allows. The cheapest correct webhook on the gate's own TLS/HTTP stack,
//! the baseline the gate is compared with. Used by `admission_load.rs` and
//! `apiserver.rs` through `#[path]`.

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::{BodyExt, Limited};
use serde::Deserialize;
use volume_gate::args::DEFAULT_MAX_BODY_BYTES;

#[derive(Deserialize)]
pub struct UidOnly<'a> {
    #[serde(borrow)]
    request: UidRequest<'a>,
}

#[derive(Deserialize)]
struct UidRequest<'a> {
    #[serde(borrow)]
    uid: Cow<'a, str>,
}

/// `/validate` and `/mutate`, both allowing; `calls` counts the reviews.
pub fn router(calls: Arc<AtomicU64>) -> Router {
    Router::new()
        .route("/validate", post(null_review))
        .route("/mutate", post(null_review))
        .with_state(calls)
}

async fn null_review(State(calls): State<Arc<AtomicU64>>, body: Body) -> Response {
    calls.fetch_add(1, Ordering::Relaxed);
    let bytes = match Limited::new(body, DEFAULT_MAX_BODY_BYTES).collect().await {
        Ok(c) => c.to_bytes(),
        Err(_) => return StatusCode::BAD_REQUEST.into_response(),
    };
    let uid = match serde_json::from_slice::<UidOnly>(&bytes) {
        Ok(r) => serde_json::to_string(&r.request.uid).unwrap(),
        Err(_) => return StatusCode::BAD_REQUEST.into_response(),
    };
    let out = format!(
        r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{{"uid":{uid},"allowed":true}}}}"#
    );
    ([(header::CONTENT_TYPE, "application/json")], out).into_response()
}
