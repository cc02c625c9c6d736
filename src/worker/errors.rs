//! What goes wrong in the worker: [`WorkerError`] ends the process,
//! [`ErrorKind`] names why a reconcile or a pass failed (a `Blocked`
//! outcome's reason, and the `error` label of
//! `volume_gate_reconcile_errors_total`).

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Boot(#[from] crate::runtime::BootError),
    #[error("leader election on Lease {namespace}/{name} failed: {message}")]
    Lease {
        namespace: String,
        name: String,
        message: String,
    },
    #[error("lost the leader Lease; exiting so a standby takes over cleanly")]
    LostLeadership,
}

/// Why a worker's reconcile or release pass failed: the `error` label of
/// `volume_gate_reconcile_errors_total`, in one place.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A call to the management API server failed.
    ManagementApi,
    KubeconfigNotFound,
    KubeconfigForbidden,
    KubeconfigUnreadable,
    KubeconfigUnparseable,
    /// The tenant API did not answer `/readyz` in time.
    TenantApiSilent,
    TenantApiNotReady,
    /// A call to the tenant API failed during the phase.
    TenantApiError,
    /// The admin kubeconfig reaches another cluster than the one bound.
    ClusterMismatch,
    /// The tenant cluster is bound to another parent too, or is not where
    /// the management side says this tenant's control plane runs.
    ClusterConflict,
    /// The record could not be written: the parent is at the API server's
    /// size limits (its annotations, or the whole object).
    RecordTooLarge,
    /// Volumes not freed within the wait bound.
    VolumesRemain,
    /// Only `Retain` volumes are left.
    RetainResidue,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 13] = [
        ErrorKind::ManagementApi,
        ErrorKind::KubeconfigNotFound,
        ErrorKind::KubeconfigForbidden,
        ErrorKind::KubeconfigUnreadable,
        ErrorKind::KubeconfigUnparseable,
        ErrorKind::TenantApiSilent,
        ErrorKind::TenantApiNotReady,
        ErrorKind::TenantApiError,
        ErrorKind::ClusterMismatch,
        ErrorKind::ClusterConflict,
        ErrorKind::RecordTooLarge,
        ErrorKind::VolumesRemain,
        ErrorKind::RetainResidue,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::ManagementApi => "management-api",
            ErrorKind::KubeconfigNotFound => "kubeconfig-not-found",
            ErrorKind::KubeconfigForbidden => "kubeconfig-forbidden",
            ErrorKind::KubeconfigUnreadable => "kubeconfig-unreadable",
            ErrorKind::KubeconfigUnparseable => "kubeconfig-unparseable",
            ErrorKind::TenantApiSilent => "tenant-api-silent",
            ErrorKind::TenantApiNotReady => "tenant-api-not-ready",
            ErrorKind::TenantApiError => "tenant-api-error",
            ErrorKind::ClusterMismatch => "cluster-mismatch",
            ErrorKind::ClusterConflict => "cluster-conflict",
            ErrorKind::RecordTooLarge => "record-too-large",
            ErrorKind::VolumesRemain => "volumes-remain",
            ErrorKind::RetainResidue => "retain-residue",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;

    #[test]
    fn error_labels_are_distinct_and_exported_once_counted() {
        let labels: std::collections::BTreeSet<_> =
            ErrorKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(labels.len(), ErrorKind::ALL.len());
        let m = Metrics::new();
        m.count_error(ErrorKind::ClusterMismatch.as_str());
        assert!(
            m.encode()
                .contains(r#"volume_gate_reconcile_errors_total{error="cluster-mismatch"} 1"#),
            "{}",
            m.encode()
        );
    }
}
