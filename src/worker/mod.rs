//! The worker: custody of every tenant and the volume-release phase
//! (`docs/design.md` §2, §3, §5).
//!
//! One reconcile per parent release, over a metadata-only watch (thousands of
//! HelmReleases stay cheap). What to do next is decided by a pure function
//! ([`next`]); [`reconcile`] carries it out; the long-running phase runs in its
//! own task, at most N at once, so custody of new tenants never waits behind
//! a slow driver. [`run()`](run::run) is leader election and the controller's wiring.
//!
//! - [`context`]: the shared state (one entry per tenant) and the worker's
//!   writes to the management API
//! - [`release`]: the phase's steps, on both layers
//! - [`custody`], [`identity`], [`tenant`]: the finalizer, the cluster binding,
//!   the tenant API
//! - [`events`], [`errors`]: the Event reasons and the error kinds, each once
//! - [`status`]: the `status` command; [`orphans`]: the `orphans` command
//!   (what tenants gone before the gate left on the management cluster)

pub mod binding;
pub mod context;
pub mod custody;
pub mod errors;
pub mod events;
pub mod next;
pub mod orphans;
pub mod reconcile;
pub mod release;
pub mod run;
pub mod status;
pub mod tenant;
pub mod writes;

use std::time::Duration;

pub use context::Context;
pub use errors::{ErrorKind, WorkerError};
pub use run::run;

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
    /// How long a pass may hold its release slot while another tenant waits
    /// for one (`release::Turn`).
    pub release_turn: Duration,
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
