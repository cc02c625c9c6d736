//! A scripted API server in process, for tests that check the worker's and
//! the gate's API calls in milliseconds, without the Go harness (the pattern
//! of kube-rs controller-rs `fixtures.rs`). The real control-plane tests
//! under `tests/` remain the proof; these catch a regression first.
//!
//! Routes answer by method and path (exact, or a prefix); the route added
//! last wins, so a test states its defaults and then what it is about.
//! Every request is recorded with its body. Anything unscripted is a 404
//! `NotFound` Status, as the API server answers for an absent object.
//!
//! Compiled for the crate's unit tests and, with the `testing` feature, for
//! other crates (the fuzz targets).

use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

/// One request the scripted server received.
#[derive(Clone, Debug)]
pub struct Call {
    pub method: String,
    pub path: String,
    pub query: String,
    pub content_type: String,
    /// The body as JSON (`Null` when empty or not JSON).
    pub body: Value,
}

impl Call {
    /// `"GET /api/v1/…"`, for assertion messages.
    pub fn line(&self) -> String {
        format!("{} {}", self.method, self.path)
    }
}

#[derive(Clone)]
struct Route {
    method: String,
    path: String,
    prefix: bool,
    status: u16,
    body: Value,
}

#[derive(Default)]
struct State {
    routes: Vec<Route>,
    calls: Vec<Call>,
}

/// The scripted API server.
#[derive(Default)]
pub struct FakeApi {
    state: Mutex<State>,
}

impl FakeApi {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Answers `method path` with `status` and `body`.
    pub fn on(&self, method: &str, path: &str, status: u16, body: Value) -> &Self {
        self.add(method, path, false, status, body)
    }

    /// Answers every `method` whose path starts with `prefix`.
    pub fn on_prefix(&self, method: &str, prefix: &str, status: u16, body: Value) -> &Self {
        self.add(method, prefix, true, status, body)
    }

    /// Answers `method path` with a failure Status of `code`.
    pub fn fail(&self, method: &str, path: &str, code: u16) -> &Self {
        self.on(method, path, code, status_body(code))
    }

    /// Answers `GET path` with `object`.
    pub fn get(&self, path: &str, object: Value) -> &Self {
        self.on("GET", path, 200, object)
    }

    fn add(&self, method: &str, path: &str, prefix: bool, status: u16, body: Value) -> &Self {
        let route = Route {
            method: method.to_string(),
            path: path.to_string(),
            prefix,
            status,
            body,
        };
        self.state.lock().expect("lock").routes.push(route);
        self
    }

    /// Forgets every route and call.
    pub fn reset(&self) {
        *self.state.lock().expect("lock") = State::default();
    }

    /// Every request received, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.state.lock().expect("lock").calls.clone()
    }

    /// The requests with this method whose path starts with `prefix`.
    pub fn calls_to(&self, method: &str, prefix: &str) -> Vec<Call> {
        self.calls()
            .into_iter()
            .filter(|c| c.method == method && c.path.starts_with(prefix))
            .collect()
    }

    /// A client whose every request this server answers.
    pub fn client(self: &Arc<Self>) -> kube::Client {
        let api = self.clone();
        let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
            let api = api.clone();
            async move { Ok::<_, Infallible>(api.answer(req).await) }
        });
        kube::Client::new(service, "default")
    }

    async fn answer(&self, req: http::Request<kube::client::Body>) -> http::Response<Full<Bytes>> {
        let (parts, body) = req.into_parts();
        let bytes = body
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        let call = Call {
            method: parts.method.as_str().to_string(),
            path: parts.uri.path().to_string(),
            query: parts.uri.query().unwrap_or("").to_string(),
            content_type: parts
                .headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string(),
            body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        };
        let mut state = self.state.lock().expect("lock");
        let route = state
            .routes
            .iter()
            .rev()
            .find(|r| {
                r.method == call.method
                    && if r.prefix {
                        call.path.starts_with(&r.path)
                    } else {
                        call.path == r.path
                    }
            })
            .cloned();
        state.calls.push(call);
        let (status, body) = route.map_or((404, status_body(404)), |r| (r.status, r.body));
        http::Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .expect("a valid response")
    }
}

/// A failure `Status` as the API server writes it.
pub fn status_body(code: u16) -> Value {
    let reason = match code {
        403 => "Forbidden",
        404 => "NotFound",
        409 => "Conflict",
        422 => "Invalid",
        503 => "ServiceUnavailable",
        _ => "InternalError",
    };
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": format!("scripted {reason}"), "reason": reason, "code": code})
}

/// Object metadata as `PartialObjectMetadata` (what metadata reads get).
pub fn partial_metadata(metadata: Value) -> Value {
    json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": metadata})
}
