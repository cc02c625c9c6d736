//! Prometheus metrics, in seconds as f64, served on the admin port.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// `Target::label`: parent, csi-release, child, guarded, release-object,
    /// infra-disk, unrelated; or invalid (an undecodable review)
    pub target: String,
    pub operation: String,
    /// allowed, denied
    pub verdict: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabels {
    pub endpoint: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub phase: String,
}

/// One tenant in teardown: bounded by the tenants being deleted, never
/// every tenant.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TeardownLabels {
    pub tenant_namespace: String,
    pub tenant: String,
    /// NotStarted, Releasing, Blocked
    pub phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub error: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

/// Every metric volume-gate exports. Both roles register all of them; each
/// moves only its own (the webhook the admission ones, the worker the rest).
pub struct Metrics {
    registry: Registry,
    pub decisions: Family<DecisionLabels, Counter>,
    pub decision_seconds: Family<EndpointLabels, Histogram>,
    pub api_reads: Counter,
    pub tenants_by_phase: Family<PhaseLabels, Gauge>,
    pub phase_seconds: Family<OutcomeLabels, Histogram>,
    pub volumes_freed: Counter,
    pub residue_volumes: Gauge,
    pub residue_acknowledged_volumes: Gauge,
    pub tenant_teardown_seconds: Family<TeardownLabels, Gauge>,
    pub worker_leader: Gauge,
    pub certificate_expiry: Gauge,
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    pub slot_wait_seconds: Histogram,
    pub turns_yielded: Counter,
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::with_prefix("volume_gate");
        // 50µs to ~3.3s: sub-millisecond buckets for decisions without reads.
        let decision_seconds = Family::<EndpointLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.00005, 2.0, 17))
        });
        let phase_seconds = Family::<OutcomeLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.5, 2.0, 14))
        });
        let m = Self {
            decisions: Family::default(),
            decision_seconds,
            api_reads: Counter::default(),
            tenants_by_phase: Family::default(),
            phase_seconds,
            volumes_freed: Counter::default(),
            residue_volumes: Gauge::default(),
            residue_acknowledged_volumes: Gauge::default(),
            tenant_teardown_seconds: Family::default(),
            worker_leader: Gauge::default(),
            certificate_expiry: Gauge::default(),
            reconcile_errors: Family::default(),
            // 0.1s to ~1.8h.
            slot_wait_seconds: Histogram::new(exponential_buckets(0.1, 2.0, 17)),
            turns_yielded: Counter::default(),
            registry: Registry::default(),
        };
        registry.register(
            "admission_decisions",
            "Admission decisions by target, operation, verdict and reason",
            m.decisions.clone(),
        );
        registry.register(
            "admission_duration_seconds",
            "Time to answer an admission review",
            m.decision_seconds.clone(),
        );
        registry.register(
            "admission_api_reads",
            "API server reads made to decide admissions",
            m.api_reads.clone(),
        );
        registry.register(
            "tenants",
            "Tenants by release phase (NotStarted for those in custody without a phase)",
            m.tenants_by_phase.clone(),
        );
        registry.register(
            "release_phase_duration_seconds",
            "Time from a tenant's deletion to the phase's outcome",
            m.phase_seconds.clone(),
        );
        registry.register(
            "volumes_freed",
            "Tenant volumes observed gone by the release phase",
            m.volumes_freed.clone(),
        );
        registry.register(
            "residue_volumes",
            "Volumes left on storage that nobody acknowledged: those of Blocked or Overridden \
             tenants, and the management side's kept PVs without kept-acknowledged",
            m.residue_volumes.clone(),
        );
        registry.register(
            "residue_acknowledged_volumes",
            "Kept PVs on the management side an operator acknowledged (kept-acknowledged, stamped)",
            m.residue_acknowledged_volumes.clone(),
        );
        registry.register(
            "tenant_teardown_seconds",
            "Seconds since each tenant in teardown was deleted, by its phase (only tenants being torn down)",
            m.tenant_teardown_seconds.clone(),
        );
        registry.register(
            "worker_leader",
            "1 while this worker replica holds the Lease and runs the controller, else 0",
            m.worker_leader.clone(),
        );
        registry.register(
            "certificate_expiry_timestamp_seconds",
            "When the webhook's serving certificate expires (notAfter, Unix seconds); 0 before one is loaded",
            m.certificate_expiry.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Worker reconcile errors by kind",
            m.reconcile_errors.clone(),
        );
        registry.register(
            "release_slot_wait_seconds",
            "Time a release pass waited for one of the worker's release slots",
            m.slot_wait_seconds.clone(),
        );
        registry.register(
            "release_turns_yielded",
            "Release passes that gave their slot to a waiting tenant at the end of their turn",
            m.turns_yielded.clone(),
        );
        Arc::new(Self { registry, ..m })
    }

    /// Counts one worker error, by its kind's label
    /// (`worker::ErrorKind::as_str`).
    pub fn count_error(&self, kind: &str) {
        self.reconcile_errors
            .get_or_create(&ErrorLabels { error: kind.into() })
            .inc();
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}
