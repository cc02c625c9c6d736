//! What every long-running role starts the same way, built once: the
//! profile, a client of the management API, the metrics, the shutdown on
//! SIGTERM and the admin port (health and metrics). The webhook and the
//! worker add what is theirs on top.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::args::CommonArgs;
use crate::metrics::Metrics;
use crate::profile::Profile;

/// Why a role could not start.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error(transparent)]
    Profile(#[from] crate::profile::ProfileError),
    #[error("cannot build a Kubernetes client (in-cluster config or KUBECONFIG): {0}")]
    Client(#[source] kube::Error),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Binds `addr`, naming it in the error.
pub async fn listen(addr: SocketAddr) -> Result<tokio::net::TcpListener, BootError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| BootError::Listen { addr, source })
}

/// A running role's shared parts.
pub struct Runtime {
    pub profile: Profile,
    pub client: kube::Client,
    pub metrics: Arc<Metrics>,
    /// Cancelled on SIGTERM or SIGINT, or by the role when it stops.
    pub shutdown: CancellationToken,
    /// Where the admin port listens.
    pub admin_addr: SocketAddr,
    admin: JoinHandle<std::io::Result<()>>,
}

impl Runtime {
    /// Loads the profile, builds the client, binds and serves the admin
    /// port, and cancels `shutdown` on a signal.
    pub async fn start(common: &CommonArgs) -> Result<Runtime, BootError> {
        let profile = Profile::load_or_default(common.profile.path())?;
        let client = kube::Client::try_default()
            .await
            .map_err(BootError::Client)?;
        let metrics = Metrics::new();
        let shutdown = CancellationToken::new();
        let admin_listener = listen(common.admin_listen).await?;
        let admin_addr = admin_listener
            .local_addr()
            .map_err(|source| BootError::Listen {
                addr: common.admin_listen,
                source,
            })?;
        let readiness = Arc::new(crate::admin::ApiServerReadiness::new(client.clone()));
        let admin = tokio::spawn(crate::admin::serve_admin(
            admin_listener,
            metrics.clone(),
            readiness,
            shutdown.clone(),
        ));
        tokio::spawn(crate::shutdown_on_signal(shutdown.clone()));
        Ok(Runtime {
            profile,
            client,
            metrics,
            shutdown,
            admin_addr,
            admin,
        })
    }

    /// Once the role is done: stops the admin port and waits for it.
    pub async fn finish(self) {
        self.shutdown.cancel();
        if let Ok(Err(e)) = self.admin.await {
            tracing::warn!(error = %e, "the admin port stopped with an error");
        }
    }
}
