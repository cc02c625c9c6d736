//! The parent release and the record on it: read as they are now, or
//! waited for in the parent's history (every version since the tenant was
//! made), and the Events on it.

use std::time::Duration;

use kube::api::{Api, DeleteParams, DynamicObject, ListParams};
use volume_gate::record::{Phase, Record};

use super::Tenant;
use crate::flux::ready_condition;
use crate::gate::helmrelease_resource;
use crate::history::Seen;
use crate::wait::eventually;

/// Whether `msg` is the gate's refusal of tenant `tenant`'s CSI driver
/// release.
pub fn is_csi_release_refusal(msg: &str, tenant: &str) -> bool {
    msg.contains("volume-gate") && msg.contains("CSI driver release") && msg.contains(tenant)
}

impl Tenant {
    /// Deletes the tenant's CSI driver release and asserts the gate refused
    /// it; returns the message the client got.
    pub async fn assert_csi_release_deletion_refused(&self) -> String {
        let err = self
            .hr_api()
            .delete(
                &crate::profile()
                    .csi_release_name(&self.name)
                    .expect("Cozystack has a CSI release"),
                &DeleteParams::default(),
            )
            .await
            .expect_err("the CSI driver release's deletion is refused");
        let msg = err.to_string();
        assert!(is_csi_release_refusal(&msg, &self.name), "{msg}");
        msg
    }

    pub fn hr_api(&self) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.management.clone(),
            &self.namespace,
            &helmrelease_resource(),
        )
    }

    pub async fn parent(&self) -> Option<DynamicObject> {
        self.hr_api().get_opt(&self.name).await.expect("get parent")
    }

    pub async fn record(&self) -> Record {
        let p = self.parent().await.expect("parent exists");
        Record::from_annotations(&crate::keys(), &p.metadata.annotations.unwrap_or_default())
    }

    /// Deletes the Kubernetes application: the parent release.
    pub async fn delete_parent(&self) {
        self.hr_api()
            .delete(&self.name, &DeleteParams::default())
            .await
            .expect("delete parent HelmRelease");
    }

    /// Waits until the parent release is gone from the management cluster.
    pub async fn wait_parent_gone(&self, timeout: Duration) {
        let what = format!("parent {}/{} gone", self.namespace, self.name);
        self.history
            .next_matching(&what, timeout, |s| matches!(s, Seen::Gone).then_some(()))
            .await
    }

    /// Asserts the parent is there and carries the custody finalizer.
    pub async fn assert_in_custody(&self) {
        self.assert_custody(true).await;
    }

    /// Asserts the parent is there and carries no custody finalizer (custody
    /// handed back).
    pub async fn assert_out_of_custody(&self) {
        self.assert_custody(false).await;
    }

    async fn assert_custody(&self, held: bool) {
        let finalizers = self
            .parent()
            .await
            .expect("the parent is there")
            .metadata
            .finalizers
            .unwrap_or_default();
        assert_eq!(
            finalizers.contains(&crate::profile().custody_finalizer),
            held,
            "custody held: {finalizers:?}"
        );
    }

    /// Waits until the worker has taken the tenant into custody.
    pub async fn wait_custody(&self) {
        let api = self.hr_api();
        let name = self.name.clone();
        let finalizer = crate::profile().custody_finalizer;
        eventually(
            "custody finalizer on the parent",
            Duration::from_secs(30),
            || {
                let (api, name, finalizer) = (api.clone(), name.clone(), finalizer.clone());
                async move {
                    let p = api.get(&name).await.map_err(|e| e.to_string())?;
                    let f = p.metadata.finalizers.unwrap_or_default();
                    if f.contains(&finalizer) {
                        Ok(())
                    } else {
                        Err(format!("{f:?}"))
                    }
                }
            },
        )
        .await
    }

    /// Waits until the worker has bound the tenant to its cluster (the
    /// record's `cluster` key), and returns the bound kube-system UID.
    pub async fn wait_cluster_bound(&self) -> String {
        let record = self
            .history
            .next_record("the tenant cluster bound", Duration::from_secs(60), |r| {
                r.cluster.is_some()
            })
            .await;
        record.cluster.expect("bound").kube_system_uid
    }

    /// Waits for the next record (after the last one a wait returned) in
    /// `phase`, and returns it. Read from the watch history: a phase the
    /// teardown has already moved past is still found.
    pub async fn wait_phase(&self, phase: Phase, timeout: Duration) -> Record {
        self.history
            .next_record(&format!("phase {phase}"), timeout, |r| {
                r.phase == Some(phase)
            })
            .await
    }

    /// Waits for the next record in `Blocked` whose inventory has `left`
    /// volumes not yet freed. A teardown can first record a `Blocked` with
    /// more left (on a loaded machine a volume can still be detaching when
    /// the worker's stall bound passes) and move on to this one.
    pub async fn wait_blocked_with_left(&self, left: usize, timeout: Duration) -> Record {
        self.history
            .next_record(
                &format!("phase Blocked with {left} volume(s) left"),
                timeout,
                |r| {
                    r.phase == Some(Phase::Blocked)
                        && r.inventory.as_ref().is_some_and(|i| i.left() == left)
                },
            )
            .await
    }

    /// Waits until the worker has written the inventory into the record
    /// (the next version, after the last one a wait returned, that has it).
    pub async fn wait_inventory(&self) -> String {
        let volumes = crate::keys().volumes;
        self.history
            .next_matching(
                "inventory in the record",
                Duration::from_secs(30),
                |s| match s {
                    Seen::Parent(p) => p
                        .metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(&volumes).cloned()),
                    Seen::Gone => None,
                },
            )
            .await
    }

    /// Waits for the next version of the parent on which helm-controller
    /// records a failed uninstall (`Ready=False`, `UninstallFailed`, what an
    /// operator sees in `kubectl get hr`) whose message `accept`s; returns
    /// the message.
    pub async fn next_uninstall_failed(
        &self,
        timeout: Duration,
        accept: impl Fn(&str) -> bool,
    ) -> String {
        let (_, _, message) = self
            .history
            .next_matching("the parent UninstallFailed", timeout, |s| match s {
                Seen::Parent(p) => ready_condition(p).filter(|(status, reason, message)| {
                    status == "False" && reason == "UninstallFailed" && accept(message)
                }),
                Seen::Gone => None,
            })
            .await;
        message
    }

    /// Asserts what resumed the teardown: the write that recorded
    /// `Released` asked the parent's controller to retry
    /// (`reconcile.fluxcd.io/requestedAt`, what `flux reconcile` writes) and
    /// nothing before it did. Returns that version's finalizers.
    pub fn assert_released_write_requests_a_retry(&self) -> Vec<String> {
        let versions: Vec<_> = self
            .history
            .all()
            .into_iter()
            .filter_map(|s| match s {
                Seen::Parent(p) => Some(p),
                Seen::Gone => None,
            })
            .collect();
        let request_key = crate::profile().parent.reconcile_request_annotation;
        let request = |p: &DynamicObject| {
            p.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(&request_key).cloned())
        };
        let released = versions
            .iter()
            .position(|p| {
                Seen::Parent(p.clone()).record().and_then(|r| r.phase) == Some(Phase::Released)
            })
            .expect("a Released version");
        assert!(
            request(&versions[released]).is_some(),
            "the Released write carries reconcile.fluxcd.io/requestedAt"
        );
        assert!(
            versions[..released].iter().all(|p| request(p).is_none()),
            "no retry request before Released"
        );
        versions[released]
            .metadata
            .finalizers
            .clone()
            .unwrap_or_default()
    }

    /// Events recorded on the parent release (events.k8s.io), as
    /// `(type, reason, note)`.
    pub async fn events(&self) -> Vec<(String, String, String)> {
        let api: Api<k8s_openapi::api::events::v1::Event> =
            Api::namespaced(self.management.clone(), &self.namespace);
        let mut out: Vec<(String, String, String)> = api
            .list(&ListParams::default())
            .await
            .expect("list events")
            .items
            .into_iter()
            .filter(|e| {
                e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(self.name.as_str())
            })
            .map(|e| {
                (
                    e.type_.unwrap_or_default(),
                    e.reason.unwrap_or_default(),
                    e.note.unwrap_or_default(),
                )
            })
            .collect();
        out.sort();
        out
    }

    /// Waits for an Event on the parent of type `ty` and `reason` whose note
    /// satisfies `note`, and returns its note. Events outlive the state they
    /// report, and the worker writes one just after the record: a test that
    /// saw the record first waits here for its Event.
    pub async fn wait_event(&self, ty: &str, reason: &str, note: impl Fn(&str) -> bool) -> String {
        eventually(
            &format!("a {ty} Event {reason} on {}", self.name),
            Duration::from_secs(30),
            || {
                let note = &note;
                async move {
                    let events = self.events().await;
                    events
                        .iter()
                        .find(|(t, r, n)| t == ty && r == reason && note(n))
                        .map(|(_, _, n)| n.clone())
                        .ok_or_else(|| format!("{events:?}"))
                }
            },
        )
        .await
    }
}
