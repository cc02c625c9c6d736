//! The worker: custody of every tenant and the volume-release phase
//! (`docs/design.md` §2, §3, §5).
//!
//! One reconcile per parent release, over a metadata-only watch (thousands of
//! HelmReleases stay cheap). What to do next is decided by a pure function
//! ([`next`]); [`reconcile`] carries it out; the long-running phase runs in its
//! own task, at most N at once, so custody of new tenants never waits behind
//! a slow driver. [`run()`](run::run) is leader election and the controller's wiring.
//!
//! - [`context`]: the shared state and the worker's writes to the management API
//! - [`release`], [`claims`], [`infra`]: the phase's steps, on both layers
//! - [`custody`], [`identity`], [`tenant`]: the finalizer, the cluster binding,
//!   the tenant API
//! - [`status`]: the `status` command

pub mod claims;
pub mod context;
pub mod custody;
pub mod identity;
pub mod infra;
pub mod next;
pub mod reconcile;
pub mod release;
pub mod run;
pub mod status;
pub mod tenant;

use std::net::SocketAddr;
use std::time::Duration;

pub use context::Context;
pub use run::run;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Profile(#[from] crate::profile::ProfileError),
    #[error("cannot build a Kubernetes client (in-cluster config or KUBECONFIG): {0}")]
    Client(#[source] kube::Error),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("leader election on Lease {namespace}/{name} failed: {message}")]
    Lease {
        namespace: String,
        name: String,
        message: String,
    },
    #[error("lost the leader Lease; exiting so a standby takes over cleanly")]
    LostLeadership,
}

/// A tenant: its parent release's namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TenantRef {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for TenantRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The worker's tuning (from its arguments).
#[derive(Clone, Debug)]
pub struct Settings {
    pub probe_timeout: Duration,
    pub wait_bound: Duration,
    pub request_timeout: Duration,
    pub retry_base: Duration,
    pub retry_max: Duration,
    /// How long the tenant API must stay unreachable before the phase frees
    /// its inventoried Delete volumes from the management side.
    pub infra_after: Duration,
}

impl Settings {
    /// The delay before retry number `attempts` (1-based).
    pub fn backoff(&self, attempts: u32) -> Duration {
        next::backoff(self.retry_base, self.retry_max, attempts)
    }
}
