//! The worker's writes to the management API: the record (and its mirror
//! for the tenant's owner), Events, the custody finalizer, the retry
//! requests to the parent's controller. Methods of [`Context`] for its
//! client, profile and keys; the per-tenant state they count in is
//! `context.rs`'s.

use kube::ResourceExt;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::runtime::events::{Event, EventType};
use tracing::{info, warn};

use super::context::ParentMeta;
use super::events::Reason;
use super::{Context, ErrorKind, TenantRef, custody};
use crate::record::{Phase, Record, Update, now_rfc3339};
use crate::text::{one_line, shorten};

/// Whether the API server refused a write because the object would be
/// too large: its annotations over their 256 KiB (422 "Too long"), or the
/// whole object over etcd's request limit (413, or "request is too large").
pub(crate) fn is_too_large(e: &kube::Error) -> bool {
    let kube::Error::Api(s) = e else {
        return false;
    };
    let m = s.message.to_ascii_lowercase();
    s.code == 413
        || (s.code == 422 && m.contains("annotations") && m.contains("too long"))
        || m.contains("request is too large")
        || m.contains("request entity too large")
}

impl Context {
    fn parent_api(&self, namespace: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), namespace, &self.parent_resource)
    }

    /// Writes worker-owned record keys with a patch that names only them:
    /// other annotations, and anything a person set, stay untouched. An
    /// outcome that ends the phase (`Released`, `Overridden`) also asks the
    /// parent's controller to reconcile now and ends custody, in the same
    /// write (`custody::outcome_patch`).
    pub async fn write_record(&self, t: &TenantRef, update: &Update) -> Result<(), kube::Error> {
        let mut annotations = update.annotations(&self.keys);
        // The tenant's owner sees the phase where the platform shows a
        // parent's annotations (Cozystack's Application API); nothing reads
        // the mirror back.
        for (key, mirror) in self
            .keys
            .mirrored(&self.profile.parent.visible_annotation_prefix)
        {
            if let Some(v) = annotations.get(key).cloned() {
                annotations.insert(mirror, v);
            }
        }
        if matches!(update.phase, Some(Phase::Released | Phase::Overridden)) {
            let request = &self.profile.parent.reconcile_request_annotation;
            if !request.is_empty() {
                annotations.insert(request.clone(), serde_json::Value::String(now_rfc3339()));
            }
            if let Some(done) = self.write_outcome(t, &annotations).await? {
                return Ok(done);
            }
        }
        let patch = serde_json::json!({"metadata": {"annotations": annotations}});
        self.parent_api(&t.namespace)
            .patch_metadata(&t.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    }

    /// Writes an outcome and ends custody in one JSON Patch, built on a
    /// fresh read and retried when the parent changed under it (the patch's
    /// `test` fails). `None` when the parent was not found: the caller's
    /// plain write reports that.
    async fn write_outcome(
        &self,
        t: &TenantRef,
        annotations: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Option<()>, kube::Error> {
        let api = self.parent_api(&t.namespace);
        let mut attempt = 0;
        loop {
            let Some(parent) = api.get_metadata_opt(&t.name).await? else {
                return Ok(None);
            };
            let patch = custody::outcome_patch(
                parent.finalizers(),
                &self.profile.custody_finalizer,
                !parent.annotations().is_empty(),
                annotations,
            );
            match api
                .patch_metadata(&t.name, &PatchParams::default(), &Patch::<()>::Json(patch))
                .await
            {
                Ok(_) => {
                    info!("outcome recorded; custody ended in the same write");
                    return Ok(Some(()));
                }
                Err(kube::Error::Api(s)) if (s.code == 422 || s.code == 409) && attempt < 3 => {
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Asks the parent's controller to retry its uninstall once more
    /// (`reconcile.fluxcd.io/requestedAt`, as `flux reconcile` writes it) and
    /// returns how many such requests this worker has made for it.
    pub(crate) async fn request_retry(&self, t: &TenantRef) -> Result<u32, kube::Error> {
        let key = &self.profile.parent.reconcile_request_annotation;
        let patch = serde_json::json!({"metadata": {"annotations": {key.as_str(): now_rfc3339()}}});
        self.parent_api(&t.namespace)
            .patch_metadata(&t.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        let made = self.request_made(t);
        info!(
            request = made,
            "the parent is still there after its outcome: asked its controller to retry the uninstall"
        );
        Ok(made)
    }

    /// The parent's record, read now, if a release pass should run on it:
    /// `None` when the parent is gone, `Released`, overridden or out of
    /// custody.
    pub(crate) async fn fresh_record(&self, t: &TenantRef) -> Result<Option<Record>, kube::Error> {
        let Some(parent) = self
            .parent_api(&t.namespace)
            .get_metadata_opt(&t.name)
            .await?
        else {
            return Ok(None);
        };
        let record = Record::from_annotations(&self.keys, parent.annotations());
        let in_custody = parent
            .finalizers()
            .contains(&self.profile.custody_finalizer);
        let done = record.phase == Some(Phase::Released) || record.stamped_override().is_some();
        Ok((in_custody && !done).then_some(record))
    }

    /// Makes a record write that failed for the parent's size loud: a
    /// Warning Event `RecordNotWritten` naming what fills the parent and the
    /// command that frees it, and the `record-too-large` error count.
    /// Nothing is deleted before the inventory is written, so nothing is
    /// lost while it waits; the caller retries on its backoff. Other errors
    /// are left to the caller. Returns whether `e` was such a failure.
    pub(crate) async fn record_not_written(&self, t: &TenantRef, e: &kube::Error) -> bool {
        if !is_too_large(e) {
            return false;
        }
        self.count_error(ErrorKind::RecordTooLarge);
        let parent = format!(
            "{}.{} -n {} {}",
            self.profile.parent.plural, self.profile.parent.group, t.namespace, t.name
        );
        let space = match self
            .parent_api(&t.namespace)
            .get_metadata_opt(&t.name)
            .await
        {
            Ok(Some(p)) => crate::record::Space::of(&self.keys, p.annotations()).describe(&parent),
            Ok(None) => "the parent is gone".into(),
            Err(read) => format!("its annotations could not be read ({read})"),
        };
        self.event(
            t,
            Reason::RecordNotWritten,
            format!(
                "cannot write the volume-release record on {}/{}: the API server refused it as too large ({}); \
                 {space}. Nothing of the tenant is deleted until its inventory is written, and the teardown \
                 waits; the worker retries on its backoff",
                t.namespace,
                t.name,
                crate::text::bounded(&e.to_string(), 300)
            ),
        )
        .await;
        true
    }

    /// An Event on the parent; a failure to publish is logged, never fatal.
    pub async fn event(&self, t: &TenantRef, reason: Reason, note: String) {
        let reference = self.parent_reference(t);
        let type_ = reason.event_type();
        let warning = type_ == EventType::Warning;
        let reason = reason.as_str();
        let ev = Event {
            type_,
            reason: reason.to_string(),
            note: Some(shorten(&one_line(&note), 1000, "...")),
            action: "ReleaseVolumes".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &reference).await {
            warn!(reason, error = %e, "cannot publish event");
        }
        if warning {
            warn!(reason, note = %note, "event");
        } else {
            info!(reason, note = %note, "event");
        }
    }

    fn parent_reference(&self, t: &TenantRef) -> k8s_openapi::api::core::v1::ObjectReference {
        let uid = self.parents.get(&self.object_ref(t)).and_then(|p| p.uid());
        k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some(self.parent_resource.api_version.clone()),
            kind: Some(self.parent_resource.kind.clone()),
            namespace: Some(t.namespace.clone()),
            name: Some(t.name.clone()),
            uid,
            ..Default::default()
        }
    }

    /// Ends custody: removes the finalizer, guarded by a `test` of its index.
    pub(crate) async fn end_custody(
        &self,
        t: &TenantRef,
        finalizers: &[String],
    ) -> Result<(), kube::Error> {
        let Some(patch) =
            custody::remove_finalizer_patch(finalizers, &self.profile.custody_finalizer)
        else {
            return Ok(());
        };
        let api = self.parent_api(&t.namespace);
        match api
            .patch_metadata(&t.name, &PatchParams::default(), &Patch::<()>::Json(patch))
            .await
        {
            Ok(_) => {
                info!("custody ended: finalizer removed");
                Ok(())
            }
            // The `test` failed: the finalizers changed since the store saw
            // them, typically because this worker already removed its own
            // (the store lags the write). Done if it is gone now; otherwise
            // the reconcile runs again on the fresh list.
            Err(kube::Error::Api(s)) if s.code == 422 || s.code == 404 => {
                let now = api.get_metadata_opt(&t.name).await?;
                match now {
                    Some(p) if p.finalizers().contains(&self.profile.custody_finalizer) => {
                        Err(kube::Error::Api(s))
                    }
                    _ => Ok(()),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Takes custody of a parent that is not being deleted.
    pub(crate) async fn take_custody(
        &self,
        t: &TenantRef,
        meta: &ParentMeta,
    ) -> Result<(), kube::Error> {
        let rv = meta.resource_version().unwrap_or_default();
        let patch =
            custody::add_finalizer_patch(meta.finalizers(), &rv, &self.profile.custody_finalizer);
        self.parent_api(&t.namespace)
            .patch_metadata(&t.name, &PatchParams::default(), &Patch::<()>::Json(patch))
            .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::is_too_large;

    fn api(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure(message, "Invalid")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn a_write_refused_for_size_is_told_from_other_failures() {
        for (code, message) in [
            (
                422,
                "HelmRelease.helm.toolkit.fluxcd.io \"r\" is invalid: metadata.annotations: Too long: must have at most 262144 bytes",
            ),
            (500, "etcdserver: request is too large"),
            (413, "Request entity too large: limit is 3145728"),
        ] {
            assert!(is_too_large(&api(code, message)), "{code} {message}");
        }
        for (code, message) in [
            (422, "the object has been modified"),
            (409, "conflict"),
            (500, "etcdserver: leader changed"),
            (403, "forbidden"),
        ] {
            assert!(!is_too_large(&api(code, message)), "{code} {message}");
        }
    }
}
