//! Why a tenant volume is still there when a pass ends: what Kubernetes
//! itself says holds it. A volume the driver has not freed is held by one
//! of three things, each of which the operator acts on differently:
//!
//! - a **VolumeAttachment** naming its PV: the external-provisioner does not
//!   delete a volume still attached to a node; the attach/detach controller
//!   detaches it once no Pod uses it;
//! - a **Pod** mounting its claim that has not terminated: on a node whose
//!   kubelet is gone (NotReady) nothing finishes that Pod, so nothing
//!   detaches the volume, until the node is deleted or tainted
//!   `node.kubernetes.io/out-of-service` (Kubernetes' non-graceful node
//!   shutdown; the attach/detach controller's 6-minute force detach applies
//!   only to Pods already gone);
//! - the **driver's own word**: the last Event on the PV (the
//!   external-provisioner's `VolumeFailedDelete` with the driver's error,
//!   a 403 among them, or `VolumeDelete` "still attached ... waiting for
//!   detach").
//!
//! [`gather`] lists them from the tenant API once per `Blocked` outcome;
//! [`explain`] (per volume) and [`remedy`] (once) are pure.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Event, Node, Pod};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::api::{Api, ListParams};

use crate::record::Volume;
use crate::text::{bounded, one_line};

/// What the tenant API says about the volumes left.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Facts {
    /// VolumeAttachments by the PV they name: (name, node, attached, detach error).
    pub attachments: BTreeMap<String, Vec<Attachment>>,
    /// Pods that have not terminated, by the claim (`namespace/name`) they mount.
    pub pods: BTreeMap<String, Vec<Holder>>,
    /// Nodes that are not Ready: name -> since when (RFC 3339, or "unknown").
    pub not_ready: BTreeMap<String, String>,
    /// The latest Event on each PV: (reason, message).
    pub last_event: BTreeMap<String, (String, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    pub name: String,
    pub node: String,
    pub attached: bool,
    pub detach_error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// `namespace/name`.
    pub pod: String,
    pub node: Option<String>,
    /// RFC 3339 time of its deletion, if it is being deleted.
    pub deleting_since: Option<String>,
}

/// The taint Kubernetes' non-graceful node shutdown acts on.
pub const OUT_OF_SERVICE: &str = "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute";

/// Why volume `v` is still there, or `None` when the tenant API says
/// nothing holds it (the driver is then the one to ask: not running, or
/// slow). A node named here that is NotReady is for [`remedy`].
pub fn explain(v: &Volume, facts: &Facts) -> Option<String> {
    let mut parts = Vec::new();
    if let Some(claim) = &v.claim {
        for h in facts.pods.get(claim).into_iter().flatten() {
            let state = match &h.deleting_since {
                Some(t) => format!("Terminating since {t}"),
                None => "running".to_string(),
            };
            parts.push(format!(
                "mounted by Pod {} on {} {state}",
                h.pod,
                h.node.as_deref().unwrap_or("<unscheduled>")
            ));
        }
    }
    for a in facts.attachments.get(&v.pv).into_iter().flatten() {
        let mut s = format!(
            "VolumeAttachment {} on {} {}",
            a.name,
            a.node,
            if a.attached { "attached" } else { "attaching" }
        );
        if let Some(e) = &a.detach_error {
            s.push_str(&format!(", detach failed: {}", bounded(&one_line(e), 200)));
        }
        parts.push(s);
    }
    if let Some((reason, message)) = facts.last_event.get(&v.pv) {
        parts.push(format!(
            "last event {}: {}",
            bounded(&one_line(reason), 64),
            bounded(&one_line(message), 300)
        ));
    }
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// The NotReady nodes that hold any of `left` (by a Pod or an attachment),
/// and what to do about them, once for the whole message; `None` when no
/// such node holds them.
pub fn remedy(left: &[&Volume], facts: &Facts) -> Option<String> {
    let mut nodes: Vec<&str> = Vec::new();
    for v in left {
        let pods = v
            .claim
            .as_ref()
            .and_then(|c| facts.pods.get(c))
            .into_iter()
            .flatten()
            .filter_map(|h| h.node.as_deref());
        let attached = facts
            .attachments
            .get(&v.pv)
            .into_iter()
            .flatten()
            .map(|a| a.node.as_str());
        for n in pods.chain(attached) {
            if facts.not_ready.contains_key(n) && !nodes.contains(&n) {
                nodes.push(n);
            }
        }
    }
    if nodes.is_empty() {
        return None;
    }
    let since: Vec<String> = nodes
        .iter()
        .map(|n| format!("{n} since {}", facts.not_ready[*n]))
        .collect();
    Some(format!(
        "NotReady: {}; a node whose kubelet is gone has its Pods never finished and their volumes \
         never detached, until the node is deleted or, once it is known to be off, tainted in the \
         tenant: kubectl taint node {} {OUT_OF_SERVICE}",
        since.join(", "),
        nodes.join(" ")
    ))
}

/// Lists what [`explain`] needs for `left` from the tenant API. A list
/// that fails leaves its part empty: the explanation is a help, the
/// outcome does not depend on it.
pub async fn gather(tc: &kube::Client, left: &[&Volume]) -> Facts {
    let mut facts = Facts::default();
    if left.is_empty() {
        return facts;
    }
    let pvs: BTreeMap<&str, ()> = left.iter().map(|v| (v.pv.as_str(), ())).collect();
    let claims: BTreeMap<&str, ()> = left
        .iter()
        .filter_map(|v| v.claim.as_deref())
        .map(|c| (c, ()))
        .collect();
    let lp = ListParams::default();
    if let Ok(list) = Api::<VolumeAttachment>::all(tc.clone()).list(&lp).await {
        for va in list.items {
            let Some(pv) = va.spec.source.persistent_volume_name.clone() else {
                continue;
            };
            if !pvs.contains_key(pv.as_str()) {
                continue;
            }
            let status = va.status.as_ref();
            facts.attachments.entry(pv).or_default().push(Attachment {
                name: va.metadata.name.clone().unwrap_or_default(),
                node: va.spec.node_name.clone(),
                attached: status.is_some_and(|s| s.attached),
                detach_error: status
                    .and_then(|s| s.detach_error.as_ref())
                    .and_then(|e| e.message.clone()),
            });
        }
    }
    if let Ok(list) = Api::<Pod>::all(tc.clone()).list(&lp).await {
        for p in list.items {
            let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
            if matches!(phase, Some("Succeeded" | "Failed")) {
                continue;
            }
            let ns = p.metadata.namespace.clone().unwrap_or_default();
            let name = p.metadata.name.clone().unwrap_or_default();
            let spec = p.spec.as_ref();
            for vol in spec.and_then(|s| s.volumes.as_ref()).into_iter().flatten() {
                let claim = match (&vol.persistent_volume_claim, &vol.ephemeral) {
                    (Some(c), _) => format!("{ns}/{}", c.claim_name),
                    (None, Some(_)) => format!("{ns}/{name}-{}", vol.name),
                    _ => continue,
                };
                if claims.contains_key(claim.as_str()) {
                    facts.pods.entry(claim).or_default().push(Holder {
                        pod: format!("{ns}/{name}"),
                        node: spec.and_then(|s| s.node_name.clone()),
                        deleting_since: p
                            .metadata
                            .deletion_timestamp
                            .as_ref()
                            .map(|t| t.0.to_string()),
                    });
                }
            }
        }
    }
    if let Ok(list) = Api::<Node>::all(tc.clone()).list(&lp).await {
        for n in list.items {
            let ready = n
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
            if ready.is_some_and(|c| c.status == "True") {
                continue;
            }
            let since = ready
                .and_then(|c| c.last_transition_time.as_ref())
                .map(|t| t.0.to_string())
                .unwrap_or_else(|| "unknown".to_string());
            facts
                .not_ready
                .insert(n.metadata.name.unwrap_or_default(), since);
        }
    }
    let events = ListParams::default().fields("involvedObject.kind=PersistentVolume");
    if let Ok(list) = Api::<Event>::all(tc.clone()).list(&events).await {
        let mut latest: BTreeMap<String, (String, String, String)> = BTreeMap::new();
        for e in list.items {
            let pv = e.involved_object.name.clone().unwrap_or_default();
            if !pvs.contains_key(pv.as_str()) {
                continue;
            }
            let at = e
                .last_timestamp
                .as_ref()
                .map(|t| t.0.to_string())
                .or_else(|| e.event_time.as_ref().map(|t| t.0.to_string()))
                .unwrap_or_default();
            let entry = (
                at,
                e.reason.clone().unwrap_or_default(),
                e.message.clone().unwrap_or_default(),
            );
            match latest.get(&pv) {
                Some(old) if old.0 >= entry.0 => {}
                _ => {
                    latest.insert(pv, entry);
                }
            }
        }
        facts.last_event = latest
            .into_iter()
            .map(|(pv, (_, reason, message))| (pv, (reason, message)))
            .collect();
    }
    facts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vol(pv: &str, claim: &str) -> Volume {
        Volume {
            pv: pv.into(),
            driver: Some("csi.example".into()),
            handle: Some("h".into()),
            capacity: None,
            reclaim: "Delete".into(),
            claim: Some(claim.into()),
            gone: false,
            infra: None,
        }
    }

    #[test]
    fn nothing_known_explains_nothing() {
        assert_eq!(explain(&vol("pv1", "a/c"), &Facts::default()), None);
    }

    #[test]
    fn a_pod_on_a_dead_node_and_its_attachment_are_named_and_the_remedy_given_once() {
        let mut f = Facts::default();
        f.pods.insert(
            "a/c".into(),
            vec![Holder {
                pod: "a/p".into(),
                node: Some("n1".into()),
                deleting_since: Some("2026-12-05T03:00:00Z".into()),
            }],
        );
        f.attachments.insert(
            "pv1".into(),
            vec![Attachment {
                name: "csi-1".into(),
                node: "n1".into(),
                attached: true,
                detach_error: None,
            }],
        );
        f.not_ready
            .insert("n1".into(), "2026-12-05T02:59:00Z".into());
        let v = vol("pv1", "a/c");
        assert_eq!(
            explain(&v, &f).unwrap(),
            "mounted by Pod a/p on n1 Terminating since 2026-12-05T03:00:00Z; \
             VolumeAttachment csi-1 on n1 attached"
        );
        let w = vol("pv2", "a/d");
        let r = remedy(&[&v, &w], &f).unwrap();
        assert!(
            r.starts_with("NotReady: n1 since 2026-12-05T02:59:00Z;"),
            "{r}"
        );
        assert!(
            r.ends_with(&format!("kubectl taint node n1 {OUT_OF_SERVICE}")),
            "{r}"
        );
        assert_eq!(
            remedy(&[&w], &f),
            None,
            "a node holding none of them is not named"
        );
        f.not_ready.clear();
        assert_eq!(remedy(&[&v], &f), None, "a Ready node needs no remedy");
    }

    #[test]
    fn the_drivers_last_word_is_quoted() {
        let mut f = Facts::default();
        f.last_event.insert(
            "pv1".into(),
            (
                "VolumeFailedDelete".into(),
                "rpc error: code = Unknown desc = forbidden".into(),
            ),
        );
        assert_eq!(
            explain(&vol("pv1", "a/c"), &f).unwrap(),
            "last event VolumeFailedDelete: rpc error: code = Unknown desc = forbidden"
        );
    }
}
