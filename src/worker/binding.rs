//! Binding a tenant to its cluster: who the tenant cluster is, binding it
//! at custody ([`bind`]), and whether the admin kubeconfig still leads there
//! at each release pass ([`confirm`]). Every write of a binding is here; the
//! decisions are the pure functions [`check`], [`placed`] and [`conflict`].
//!
//! The kubeconfig Secret lives in the tenant namespace, where anyone who may
//! edit that namespace can rewrite it. Copied from another tenant, it once
//! made the worker delete that other tenant's claims and record this one
//! `Released` while its disks stayed on storage. So the worker binds the
//! tenant to its cluster while nothing is at stake (when custody begins),
//! and every release pass checks that the kubeconfig still reaches that
//! cluster before it deletes, or counts as freed, anything. The binding
//! rests on what a namespace editor cannot forge:
//!
//! - the cluster is known by the UID of its `kube-system` namespace *and* by
//!   the certificate authorities that certified its API server: the UID is
//!   public (it is in the record), so a server an editor runs could answer
//!   with it, but it cannot prove a key the tenant's CA certified;
//! - it is bound only to the API server the management side says runs this
//!   tenant (Kamaji's TenantControlPlane `R`: its endpoint, or its Service
//!   in the tenant's own namespace), not to wherever the Secret points;
//! - one cluster belongs to one parent, the one bound to it first: a
//!   cluster (UID and CA) another parent was bound to earlier is never acted
//!   on through a later one (`conflict`), so a second parent made with a
//!   copy of another tenant's kubeconfig can delete nothing, and a server
//!   that only imitates a cluster (its UID under another CA) holds nobody.

use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DynamicObject};
use kube::runtime::controller::Action;
use tracing::{debug, info};

use super::events::Reason;
use super::{Context, ErrorKind, TenantRef, tenant};
use crate::record::{Update, now_rfc3339};

use super::tenant::{TenantAccessError, TenantApi, error_chain};
use crate::record::ClusterIdentity;

/// Binds the tenant to the cluster its admin kubeconfig reaches now,
/// while nothing is at stake, so a release pass can tell when the Secret
/// was later made to point elsewhere. A tenant whose kubeconfig or API is
/// not there yet (Kamaji is still building it) is tried again with backoff.
pub(crate) async fn bind(ctx: &Context, t: &TenantRef) -> Result<Action, kube::Error> {
    let s = &ctx.settings;
    let observed = match tenant::connect(
        &ctx.client,
        &ctx.profile,
        &t.namespace,
        &t.name,
        s.request_timeout,
    )
    .await
    {
        Ok(api) => read_identity(&api, s.probe_timeout, &now_rfc3339()).await,
        Err(e) => Err(e),
    };
    let observed = match observed {
        Ok(id) => match vet(ctx, t, &id, true).await? {
            Vetted::Ours => Ok((id, None)),
            // Bound all the same: the other parent's passes must see this
            // claim too. Neither acts through the cluster.
            Vetted::Conflict(why) => Ok((id, Some(why))),
            Vetted::Misplaced(why) => {
                ctx.count_error(ErrorKind::ClusterConflict);
                ctx.event(
                    t,
                    Reason::ClusterNotBound,
                    format!("the admin kubeconfig does not lead to this tenant's own cluster: {why}; not bound, retried"),
                )
                .await;
                Err(TenantAccessError::NotReady {
                    server: id.server.clone(),
                    message: why,
                })
            }
        },
        Err(e) => Err(e),
    };
    match observed {
        Ok((id, conflict)) => {
            write(ctx, t, &id).await?;
            ctx.bind_succeeded(t);
            match conflict {
                None => {
                    let note = format!(
                        "tenant cluster bound: {}; every release pass checks that the admin kubeconfig still reaches it",
                        id.describe()
                    );
                    ctx.event(t, Reason::ClusterBound, note).await;
                }
                Some(why) => {
                    ctx.count_error(ErrorKind::ClusterConflict);
                    ctx.event(t, Reason::ClusterConflict, why).await;
                }
            }
            Ok(Action::await_change())
        }
        Err(e) => {
            let attempts = ctx.bind_failed(t);
            let delay = s.backoff(attempts);
            debug!(error = %e, attempts, retry_in = ?delay, "tenant cluster not bound yet");
            Ok(Action::requeue(delay))
        }
    }
}

/// Records the binding.
async fn write(ctx: &Context, t: &TenantRef, id: &ClusterIdentity) -> Result<(), kube::Error> {
    ctx.write_record(
        t,
        &Update {
            cluster: Some(id.clone()),
            ..Default::default()
        },
    )
    .await
}

/// What [`vet`] concludes of a cluster for a tenant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Vetted {
    Ours,
    /// Not where the management side says this tenant's API server runs:
    /// never bound.
    Misplaced(String),
    /// Another parent is bound to it too: neither acts through it.
    Conflict(String),
}

/// Whether the cluster `seen` may be bound to (or, `binding` false, still
/// acted on for) tenant `t`: when binding, the management side must record
/// this tenant's control plane where the kubeconfig points ([`placed`]);
/// always, no other parent may be bound to it ([`conflict`]).
pub(crate) async fn vet(
    ctx: &Context,
    t: &TenantRef,
    seen: &ClusterIdentity,
    binding: bool,
) -> Result<Vetted, kube::Error> {
    if binding && let Some(spec) = &ctx.profile.control_plane {
        let name = spec.name_of(&t.name);
        let api: Api<DynamicObject> =
            Api::namespaced_with(ctx.client.clone(), &t.namespace, &spec.resource());
        let cp = api.get_opt(&name).await?.map(|o| ControlPlane {
            object: format!("{} {}/{name}", spec.kind, t.namespace),
            endpoint: serde_json::to_value(&o)
                .ok()
                .and_then(|v| spec.endpoint_in(&v)),
            service_host: spec.service_of(&t.namespace, &t.name),
        });
        if let Err(why) = placed(&seen.server, cp.as_ref()) {
            return Ok(Vetted::Misplaced(why));
        }
    }
    Ok(match conflict(&t.to_string(), seen, &ctx.bindings()) {
        Some(why) => Vetted::Conflict(why),
        None => Vetted::Ours,
    })
}

/// What a release pass may act on: the bound cluster, or why not.
pub(crate) enum Confirmed {
    Cluster(ClusterIdentity),
    /// Nothing may be deleted or counted as freed through this API.
    Refused(ErrorKind, String),
}

/// At a release pass: checks that the tenant's API (`api`, reached through
/// the admin kubeconfig Secret `secret`) is the cluster bound to the
/// tenant, binding it first if none is (a tenant that never answered
/// before its deletion). Recorded even in conflict: the other parent's
/// passes see it too.
pub(crate) async fn confirm(
    ctx: &Context,
    t: &TenantRef,
    api: &tenant::TenantApi,
    secret: &str,
    bound: Option<&ClusterIdentity>,
) -> Result<Confirmed, kube::Error> {
    let seen = match read_identity(api, ctx.settings.probe_timeout, &now_rfc3339()).await {
        Ok(seen) => seen,
        Err(e) => return Ok(Confirmed::Refused(e.kind(), e.to_string())),
    };
    let (id, write_it) = match check(bound, &seen, secret) {
        Check::Same => (bound.cloned().unwrap_or(seen), false),
        Check::Bind(id) | Check::Pin(id) => (id, true),
        Check::Different { message } => {
            return Ok(Confirmed::Refused(ErrorKind::ClusterMismatch, message));
        }
    };
    let binding = bound.is_none();
    let conflict = match vet(ctx, t, &id, binding).await? {
        Vetted::Ours => None,
        Vetted::Misplaced(why) => {
            let message = format!(
                "the admin kubeconfig Secret {secret} does not lead to this tenant's own cluster: {why}. Nothing is \
                 deleted or counted as freed through it. Restore the Secret, or record an override to abandon the \
                 volumes"
            );
            return Ok(Confirmed::Refused(ErrorKind::ClusterConflict, message));
        }
        Vetted::Conflict(why) => Some(why),
    };
    if write_it {
        write(ctx, t, &id).await?;
        info!(server = %id.server, binding, "tenant cluster bound at a release pass");
    }
    Ok(match conflict {
        None => Confirmed::Cluster(id),
        Some(why) => Confirmed::Refused(ErrorKind::ClusterConflict, why),
    })
}

/// Reads who the cluster behind `api` is, bounded by `timeout`.
pub async fn read_identity(
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
                ca_sha256: api.ca_sha256.clone(),
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
    /// The bound cluster, in a binding made before its CA was kept: keep
    /// it now.
    Pin(ClusterIdentity),
    /// Another cluster: nothing may be deleted or counted through it.
    Different { message: String },
}

/// Compares the cluster a pass reached with the one bound to the tenant.
/// The UID and the CA decide: a new address or new credentials for the
/// same cluster (Kamaji rotates them) are the same cluster; a server that
/// answers with the bound UID but is certified by another CA is not.
pub fn check(bound: Option<&ClusterIdentity>, seen: &ClusterIdentity, secret: &str) -> Check {
    let Some(bound) = bound else {
        return Check::Bind(seen.clone());
    };
    let same_uid = bound.kube_system_uid == seen.kube_system_uid;
    if same_uid && bound.ca_sha256 == seen.ca_sha256 {
        return Check::Same;
    }
    if same_uid && bound.ca_sha256.is_empty() {
        return Check::Pin(ClusterIdentity {
            bound_at: bound.bound_at.clone(),
            ..seen.clone()
        });
    }
    let which = if same_uid {
        "a server certified by another CA, answering with this cluster's kube-system UID (which anyone can read \
         in the record),"
    } else {
        "a different cluster"
    };
    Check::Different {
        message: format!(
            "the admin kubeconfig Secret {secret} now points at {which}: {} answers, but this tenant's cluster, \
             bound at {}, is {}. Nothing is deleted or counted as freed through it. Restore the Secret to the \
             tenant's own kubeconfig, or record an override to abandon the volumes",
            seen.describe(),
            bound.bound_at,
            bound.describe()
        ),
    }
}

/// Whether another parent is bound to the cluster `seen`: `(namespace/name,
/// its binding)` of each other parent. One cluster belongs to one parent;
/// when two claim it, one reached it through a copy of the other's
/// kubeconfig. The cluster is the whole identity: the `kube-system` UID
/// *and* the CA that certified it (a binding made before the CA was kept
/// matches by UID alone). A server that answers with another cluster's UID
/// under its own CA is another cluster, however it names itself: the UID is
/// public, the CA's key is not. Of two parents bound to one cluster, the
/// one bound first keeps it (it was bound while nothing was at stake, at
/// custody; a copy of its kubeconfig came later): only the later one, and
/// both when neither is earlier, is refused.
pub fn conflict(
    me: &str,
    seen: &ClusterIdentity,
    others: &[(String, ClusterIdentity)],
) -> Option<String> {
    let same_cluster = |id: &ClusterIdentity| {
        id.kube_system_uid == seen.kube_system_uid
            && (id.ca_sha256 == seen.ca_sha256
                || id.ca_sha256.is_empty()
                || seen.ca_sha256.is_empty())
    };
    let claimants: Vec<&(String, ClusterIdentity)> = others
        .iter()
        .filter(|(who, id)| who != me && same_cluster(id))
        .collect();
    if claimants.is_empty()
        || claimants
            .iter()
            .all(|(_, id)| bound_before(&seen.bound_at, &id.bound_at))
    {
        return None;
    }
    let named: Vec<String> = claimants
        .iter()
        .map(|(who, id)| format!("{who} (bound at {})", id.bound_at))
        .collect();
    Some(format!(
        "the tenant cluster {} (bound at {}) is bound to another parent too, no later than this one: {}. One \
         cluster belongs to one parent, the one bound to it first; one of them reached it through a copy of the \
         other's admin kubeconfig. Nothing is deleted or counted as freed through it here: record an override on \
         the parent whose cluster it is not, and once that parent is gone the other proceeds",
        seen.describe(),
        seen.bound_at,
        named.join(", ")
    ))
}

/// Whether binding time `a` is strictly before `b` (RFC 3339; an unreadable
/// time is never before anything).
fn bound_before(a: &str, b: &str) -> bool {
    let at = |s: &str| s.parse::<jiff::Timestamp>().ok();
    matches!((at(a), at(b)), (Some(a), Some(b)) if a < b)
}

/// Where the management side says the tenant's API server runs: Kamaji's
/// TenantControlPlane endpoint (`host:port`), and the Service that fronts
/// it in the tenant's own namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControlPlane {
    pub object: String,
    pub endpoint: Option<String>,
    pub service_host: Option<String>,
}

/// Whether the kubeconfig's `server` is the control plane the management
/// side records for this tenant: its endpoint, or its Service (any port;
/// the server's certificate must then be valid for that name, which needs
/// the tenant's CA). `Err` says what is wrong, for a refusal to bind.
pub fn placed(server: &str, cp: Option<&ControlPlane>) -> Result<(), String> {
    let Some(cp) = cp else {
        return Err(
            "the management cluster records no control plane for this tenant, so nothing says which API \
             server is its own"
                .into(),
        );
    };
    let Ok(url) = server.parse::<http::Uri>() else {
        return Err(format!("the kubeconfig's server {server:?} is not a URL"));
    };
    let host = url.host().unwrap_or("").trim_end_matches('.');
    let port = url.port_u16().unwrap_or(443);
    if let Some(service) = cp.service_host.as_deref()
        && (host == service || host == format!("{service}.cluster.local"))
    {
        return Ok(());
    }
    let or_service = cp
        .service_host
        .as_deref()
        .map(|s| format!(" (or its Service {s})"))
        .unwrap_or_default();
    match &cp.endpoint {
        Some(endpoint) if endpoint_is(endpoint, host, port) => Ok(()),
        Some(endpoint) => Err(format!(
            "the admin kubeconfig points at {server}, but {} says this tenant's API server is at {endpoint}{or_service}",
            cp.object
        )),
        None => Err(format!(
            "{} has no endpoint yet, so nothing says which API server is this tenant's",
            cp.object
        )),
    }
}

/// Whether `endpoint` (`host:port`, `[v6]:port`, or a bare host meaning
/// port 443) names `host` and `port`.
fn endpoint_is(endpoint: &str, host: &str, port: u16) -> bool {
    let (h, p) = match endpoint.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => {
            (h, p.parse::<u16>().ok())
        }
        _ => (endpoint, Some(443)),
    };
    let h = h.trim_start_matches('[').trim_end_matches(']');
    let host = host.trim_start_matches('[').trim_end_matches(']');
    h.eq_ignore_ascii_case(host) && p == Some(port)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(server: &str, uid: &str) -> ClusterIdentity {
        ClusterIdentity {
            server: server.into(),
            kube_system_uid: uid.into(),
            bound_at: "2026-12-03T08:00:00Z".into(),
            ca_sha256: "ca-1".into(),
        }
    }

    #[test]
    fn the_bound_uid_behind_another_ca_is_another_cluster() {
        let mut fake = id("https://a:6443", "u1");
        fake.ca_sha256 = "ca-evil".into();
        let Check::Different { message } = check(Some(&id("https://a:6443", "u1")), &fake, "ns/s")
        else {
            panic!("a server certified by another CA was accepted");
        };
        assert!(message.contains("certified by another CA"), "{message}");
        // A binding made before the CA was kept is pinned at the next pass.
        let mut legacy = id("https://a:6443", "u1");
        legacy.ca_sha256.clear();
        assert_eq!(
            check(Some(&legacy), &id("https://b:6443", "u1"), "ns/s"),
            Check::Pin(id("https://b:6443", "u1"))
        );
    }

    #[test]
    fn a_cluster_bound_to_another_parent_is_a_conflict_naming_it() {
        let others = vec![
            ("tenant-x/kubernetes-a".to_string(), id("https://a", "u1")),
            ("tenant-y/kubernetes-b".to_string(), id("https://b", "u2")),
        ];
        assert_eq!(
            conflict("tenant-x/kubernetes-a", &id("https://a", "u1"), &others),
            None
        );
        let m = conflict("tenant-z/kubernetes-evil", &id("https://a", "u1"), &others)
            .expect("a second claimant");
        assert!(
            m.contains("tenant-x/kubernetes-a")
                && !m.contains("kubernetes-b")
                && m.contains("override"),
            "{m}"
        );
        assert_eq!(
            conflict("tenant-z/kubernetes-evil", &id("https://c", "u3"), &others),
            None
        );
    }

    #[test]
    fn the_parent_bound_first_keeps_its_cluster_and_an_imitator_under_another_ca_is_no_claimant() {
        let at = |uid: &str, ca: &str, when: &str| ClusterIdentity {
            server: "https://a".into(),
            kube_system_uid: uid.into(),
            bound_at: when.into(),
            ca_sha256: ca.into(),
        };
        let victim = at("u1", "ca-1", "2026-12-03T08:00:00Z");
        // A server of an editor's, under her own CA, answering the victim's
        // (public) UID: bound later or earlier, it is another cluster.
        for when in ["2026-12-03T09:00:00Z", "2026-12-03T07:00:00Z"] {
            let imitator = (
                "tenant-e/kubernetes-decoy".to_string(),
                at("u1", "ca-evil", when),
            );
            assert_eq!(
                conflict("tenant-x/kubernetes-a", &victim, &[imitator]),
                None
            );
        }
        // A real copy of the victim's kubeconfig, bound later: the victim
        // goes on, the copy is refused.
        let copy = (
            "tenant-e/kubernetes-copy".to_string(),
            at("u1", "ca-1", "2026-12-03T09:00:00Z"),
        );
        assert_eq!(
            conflict(
                "tenant-x/kubernetes-a",
                &victim,
                std::slice::from_ref(&copy)
            ),
            None
        );
        let refused = conflict(
            "tenant-e/kubernetes-copy",
            &copy.1,
            &[("tenant-x/kubernetes-a".to_string(), victim.clone())],
        )
        .expect("the later binding is refused");
        assert!(
            refused.contains("tenant-x/kubernetes-a") && refused.contains("bound to it first"),
            "{refused}"
        );
        // Bound in the same second: neither is first, both are refused; a
        // binding made before the CA was kept matches by UID.
        let twin = (
            "tenant-e/kubernetes-twin".to_string(),
            at("u1", "", "2026-12-03T08:00:00Z"),
        );
        assert!(conflict("tenant-x/kubernetes-a", &victim, &[twin]).is_some());
    }

    #[test]
    fn a_tenant_binds_only_the_api_server_the_management_side_records_for_it() {
        let cp = |endpoint: Option<&str>| ControlPlane {
            object: "TenantControlPlane tenant-x/kubernetes-a".into(),
            endpoint: endpoint.map(str::to_string),
            service_host: Some("kubernetes-a.tenant-x.svc".into()),
        };
        for (server, endpoint) in [
            ("https://10.0.0.5:6443", Some("10.0.0.5:6443")),
            ("https://10.0.0.5", Some("10.0.0.5")),
            ("https://[fd00::5]:6443", Some("[fd00::5]:6443")),
            (
                "https://kubernetes-a.tenant-x.svc:6443",
                Some("10.0.0.5:6443"),
            ),
            ("https://kubernetes-a.tenant-x.svc.cluster.local", None),
            ("https://API.example.com:443/", Some("api.example.com:443")),
        ] {
            assert_eq!(
                placed(server, Some(&cp(endpoint))),
                Ok(()),
                "{server} vs {endpoint:?}"
            );
        }
        for (server, endpoint, says) in [
            (
                "https://10.0.0.6:6443",
                Some("10.0.0.5:6443"),
                "says this tenant's API server is at 10.0.0.5:6443",
            ),
            (
                "https://10.0.0.5:6444",
                Some("10.0.0.5:6443"),
                "10.0.0.5:6443",
            ),
            (
                "https://kubernetes-b.tenant-x.svc:6443",
                Some("10.0.0.5:6443"),
                "kubernetes-a.tenant-x.svc",
            ),
            (
                "https://kubernetes-a.tenant-y.svc:6443",
                None,
                "has no endpoint yet",
            ),
        ] {
            let err = placed(server, Some(&cp(endpoint))).expect_err(server);
            assert!(err.contains(says), "{server}: {err}");
        }
        assert!(
            placed("https://x", None)
                .unwrap_err()
                .contains("records no control plane")
        );
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
