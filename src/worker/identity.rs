//! Who the tenant cluster is, and whether the admin kubeconfig still leads
//! there.
//!
//! The kubeconfig Secret lives in the tenant namespace, where anyone who may
//! edit that namespace can rewrite it. Copied from another tenant, it once
//! made the worker delete that other tenant's claims and record this one
//! `Released` while its disks stayed on storage. So the worker binds the
//! tenant to its cluster while nothing is at stake (when custody begins),
//! by the UID of the cluster's `kube-system` namespace, and every release
//! pass checks that the kubeconfig still reaches that cluster before it
//! deletes, or counts as freed, anything.

use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::Api;

use super::tenant::{TenantAccessError, TenantApi, error_chain};
use crate::record::ClusterIdentity;

/// Reads who the cluster behind `api` is, bounded by `timeout`.
pub async fn observe(
    api: &TenantApi,
    timeout: Duration,
    now: &str,
) -> Result<ClusterIdentity, TenantAccessError> {
    let namespaces: Api<Namespace> = Api::all(api.client.clone());
    let not_ready = |message: String| TenantAccessError::NotReady {
        server: api.server.clone(),
        message,
    };
    match tokio::time::timeout(timeout, namespaces.get_metadata("kube-system")).await {
        Err(_) => Err(TenantAccessError::NotAnswering {
            server: api.server.clone(),
            timeout,
        }),
        Ok(Err(e)) => Err(not_ready(format!(
            "cannot read namespace kube-system: {}",
            error_chain(&e)
        ))),
        Ok(Ok(ns)) => match ns.metadata.uid.filter(|u| !u.is_empty()) {
            Some(uid) => Ok(ClusterIdentity {
                server: api.server.clone(),
                kube_system_uid: uid,
                bound_at: now.to_string(),
            }),
            None => Err(not_ready("namespace kube-system has no UID".into())),
        },
    }
}

/// What a release pass does with the cluster it reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Check {
    /// The bound cluster: go on.
    Same,
    /// Nothing was bound yet (the tenant never answered before its
    /// deletion): bind this one now, before anything is deleted.
    Bind(ClusterIdentity),
    /// Another cluster: nothing may be deleted or counted through it.
    Different { message: String },
}

/// Compares the cluster a pass reached with the one bound to the tenant.
/// The UID decides: a new address or new credentials for the same cluster
/// (Kamaji rotates them) are the same cluster.
pub fn check(bound: Option<&ClusterIdentity>, seen: &ClusterIdentity, secret: &str) -> Check {
    let Some(bound) = bound else {
        return Check::Bind(seen.clone());
    };
    if bound.kube_system_uid == seen.kube_system_uid {
        return Check::Same;
    }
    Check::Different {
        message: format!(
            "the admin kubeconfig Secret {secret} now points at a different cluster: {} answers, but this tenant's \
             cluster, bound at {}, is {}. Nothing is deleted or counted as freed through it. Restore the Secret to \
             the tenant's own kubeconfig, or record an override to abandon the volumes",
            seen.describe(),
            bound.bound_at,
            bound.describe()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(server: &str, uid: &str) -> ClusterIdentity {
        ClusterIdentity {
            server: server.into(),
            kube_system_uid: uid.into(),
            bound_at: "2026-12-03T08:00:00Z".into(),
        }
    }

    #[test]
    fn an_unbound_tenant_binds_the_cluster_it_reaches() {
        assert_eq!(
            check(None, &id("https://a:6443", "u1"), "ns/s"),
            Check::Bind(id("https://a:6443", "u1"))
        );
    }

    #[test]
    fn the_same_cluster_at_a_new_address_is_the_same_cluster() {
        assert_eq!(
            check(
                Some(&id("https://a:6443", "u1")),
                &id("https://b:6443", "u1"),
                "ns/s"
            ),
            Check::Same
        );
    }

    #[test]
    fn another_cluster_is_refused_naming_both_and_the_remedy() {
        let Check::Different { message } = check(
            Some(&id("https://a:6443", "u1")),
            &id("https://b:6443", "u2"),
            "tenant-x/kubernetes-x-admin-kubeconfig",
        ) else {
            panic!("a different cluster was accepted");
        };
        for needle in [
            "tenant-x/kubernetes-x-admin-kubeconfig",
            "different cluster",
            "https://b:6443",
            "u2",
            "https://a:6443",
            "u1",
            "override",
        ] {
            assert!(message.contains(needle), "{needle:?} missing: {message}");
        }
    }

    #[test]
    fn another_cluster_at_the_same_address_is_another_cluster() {
        assert!(matches!(
            check(
                Some(&id("https://a:6443", "u1")),
                &id("https://a:6443", "u2"),
                "ns/s"
            ),
            Check::Different { .. }
        ));
    }
}
