//! The plain-HTTP admin port: `/healthz`, `/readyz`, `/metrics`.
//!
//! Kept off the TLS port so that probes and Prometheus need no certificates,
//! and so that a broken serving certificate still shows up as unready.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// The OpenMetrics text format that `prometheus-client` writes.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A readiness probe answered within this, even when the API server hangs.
const API_SERVER_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether this process can do its job right now; `Err` says why not.
pub trait Readiness: Send + Sync {
    fn check(&self) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send + '_>>;
}

/// Ready while the Kubernetes API server answers: every admission decision
/// that allows a teardown reads it fresh, so without it the gate can only deny.
pub struct ApiServerReadiness {
    client: kube::Client,
}

impl ApiServerReadiness {
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }
}

impl Readiness for ApiServerReadiness {
    fn check(&self) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send + '_>> {
        Box::pin(async move {
            match tokio::time::timeout(API_SERVER_TIMEOUT, self.client.apiserver_version()).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(format!("Kubernetes API server unreachable: {e}")),
                Err(_) => Err(format!(
                    "Kubernetes API server unreachable: no answer to /version within {API_SERVER_TIMEOUT:?}"
                )),
            }
        })
    }
}

/// Always ready: for tests and for tools that have nothing to wait for.
pub struct AlwaysReady;

impl Readiness for AlwaysReady {
    fn check(&self) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send + '_>> {
        Box::pin(std::future::ready(Ok(())))
    }
}

#[derive(Clone)]
struct Admin {
    metrics: Arc<Metrics>,
    readiness: Arc<dyn Readiness>,
}

/// Serves the admin routes on `listener` until `shutdown`.
pub async fn serve_admin(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    readiness: Arc<dyn Readiness>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(metrics, readiness))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

fn router(metrics: Arc<Metrics>, readiness: Arc<dyn Readiness>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(Admin { metrics, readiness })
}

async fn readyz(State(admin): State<Admin>) -> Response {
    match admin.readiness.check().await {
        Ok(()) => "ok".into_response(),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, reason).into_response(),
    }
}

async fn metrics_text(State(admin): State<Admin>) -> Response {
    (
        [(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)],
        admin.metrics.encode(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    struct Unready;

    impl Readiness for Unready {
        fn check(&self) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send + '_>> {
            Box::pin(async {
                Err("Kubernetes API server unreachable: connection refused".to_string())
            })
        }
    }

    async fn get(
        readiness: Arc<dyn Readiness>,
        path: &str,
    ) -> (StatusCode, Option<String>, String) {
        let response = router(Metrics::new(), readiness)
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let content_type = response
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_string());
        let status = response.status();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (
            status,
            content_type,
            String::from_utf8(body.to_vec()).unwrap(),
        )
    }

    #[tokio::test]
    async fn healthz_is_ok_even_when_not_ready() {
        let (status, _, body) = get(Arc::new(Unready), "/healthz").await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
    }

    #[tokio::test]
    async fn readyz_reports_the_reason_when_not_ready() {
        let (status, _, body) = get(Arc::new(Unready), "/readyz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("API server unreachable"), "{body}");
        let (status, _, body) = get(Arc::new(AlwaysReady), "/readyz").await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
    }

    #[tokio::test]
    async fn metrics_are_openmetrics_text() {
        let (status, content_type, body) = get(Arc::new(AlwaysReady), "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(content_type.as_deref(), Some(OPENMETRICS_CONTENT_TYPE));
        assert!(body.contains("volume_gate_admission_api_reads"), "{body}");
        assert!(body.ends_with("# EOF\n"), "{body}");
    }

    #[tokio::test]
    async fn serve_admin_answers_over_tcp_and_stops_on_shutdown() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve_admin(
            listener,
            Metrics::new(),
            Arc::new(AlwaysReady),
            shutdown.clone(),
        ));

        let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        tcp.write_all(b"GET /healthz HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut response = String::new();
        tcp.read_to_string(&mut response).await.unwrap();
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        assert!(response.ends_with("ok"), "{response}");

        shutdown.cancel();
        server.await.unwrap().unwrap();
    }
}
