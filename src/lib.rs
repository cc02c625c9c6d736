//! volume-gate: an admission gate and a companion controller that free a
//! Cozystack tenant's volumes before its CSI driver is removed.
//!
//! The layout is the architecture:
//! - [`profile`] alone knows the platform's names (Cozystack by default);
//! - [`record`] alone knows the annotation keys of the release record;
//! - [`names`] is Kubernetes' name rules, [`text`] how text is bounded for
//!   people (logs, records, Events);
//! - [`admission`] holds the gate's decisions as pure functions, the fresh
//!   reads they need, and a thin HTTP layer;
//! - [`worker`] takes custody of tenants and runs the volume-release phase;
//! - [`args`] is the command line of both roles;
//! - [`metrics`] is every metric exported;
//! - [`tls`] and [`certs`] serve and mint the webhook's certificates;
//! - [`admin`] is the plain-HTTP health and metrics port, and [`runtime`]
//!   what both roles start the same way (profile, client, metrics, admin
//!   port, shutdown);
//! - `testing` (unit tests, or the `testing` feature) is a scripted API
//!   server for in-process tests.
//!
//! The design: `docs/design.md`.

#![forbid(unsafe_code)]

pub mod admin;
pub mod admission;
pub mod args;
pub mod certs;
pub mod metrics;
pub mod names;
pub mod profile;
pub mod record;
pub mod runtime;
pub mod telemetry;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod text;
pub mod tls;
pub mod worker;

/// Cancels `token` on SIGTERM or SIGINT, so servers drain instead of dying.
pub async fn shutdown_on_signal(token: tokio_util::sync::CancellationToken) {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM; only SIGINT will stop the process gracefully");
            let _ = tokio::signal::ctrl_c().await;
            token.cancel();
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received, shutting down"),
        _ = token.cancelled() => {}
    }
    token.cancel();
}
