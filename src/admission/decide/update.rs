//! The decisions on writes of a parent release (`docs/design.md` §4): who
//! may change the record, the override and its stamps, and the custody
//! finalizer; and the mutating webhook's patch.

use super::*;

/// Who is asking, from the request's userInfo.
#[derive(Clone, Copy, Debug)]
pub struct Requester<'a> {
    pub username: &'a str,
    pub is_worker: bool,
}

/// Metadata of the object before and after a CREATE or UPDATE.
#[derive(Clone, Copy, Debug)]
pub struct Change<'a> {
    pub old: Option<&'a ObjectMetaView>,
    pub new: &'a ObjectMetaView,
}

/// What the validating guards conclude on an UPDATE/CREATE of a release.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpdateVerdict {
    /// Decided without asking anyone.
    Final(Verdict),
    /// Allowed if a SubjectAccessReview for the override verb allows the
    /// requester on this tenant.
    NeedsOverridePermission { namespace: String, tenant: String },
}

/// The object before the write as the parent guards see it: none when it
/// was not a parent yet, as for a CREATE.
fn becoming_parent<'a>(
    profile: &Profile,
    old: Option<&'a ObjectMetaView>,
) -> Option<&'a ObjectMetaView> {
    old.filter(|o| profile.is_parent(&o.labels))
}

fn annotation<'a>(meta: Option<&'a ObjectMetaView>, key: &str) -> Option<&'a str> {
    meta.and_then(|m| m.annotations.get(key))
        .map(String::as_str)
}

/// Validating guards for CREATE/UPDATE of a parent release (`docs/design.md` §4).
pub fn guard_update(
    profile: &Profile,
    keys: &Keys,
    change: Change<'_>,
    who: Requester<'_>,
    now: jiff::Timestamp,
) -> UpdateVerdict {
    let Change { old, new } = change;
    let is_parent =
        profile.is_parent(&new.labels) || old.is_some_and(|o| profile.is_parent(&o.labels));
    if !is_parent {
        return UpdateVerdict::Final(Verdict::allow("not-a-parent"));
    }
    // Becoming a parent is judged like being created one: a record or an
    // override the release carried before it was a tenant was never judged,
    // so it is not let in by being left unchanged.
    let old = becoming_parent(profile, old);
    let tenant = new.name.as_str();
    let changed = |key: &str| annotation(old, key) != annotation(Some(new), key);

    // Custody ends only through the worker, which records why.
    let had_finalizer = old.is_some_and(|o| o.finalizers.contains(&profile.custody_finalizer));
    if had_finalizer && !new.finalizers.contains(&profile.custody_finalizer) && !who.is_worker {
        return UpdateVerdict::Final(forbid(
            "custody-finalizer-removed",
            format!(
                "{} may not remove the custody finalizer {} from tenant {}/{tenant}: only the volume-gate worker ends \
                 custody, after the volume-release phase or a recorded override. To abandon the volumes, record an \
                 override instead: {}",
                who.username,
                profile.custody_finalizer,
                new.namespace,
                profile.override_command(&new.namespace, tenant)
            ),
        ));
    }
    // Custody is a stated intent; hiding a parent behind other labels would
    // end it silently.
    if old.is_some_and(|o| profile.is_parent(&o.labels))
        && !profile.is_parent(&new.labels)
        && !who.is_worker
    {
        return UpdateVerdict::Final(forbid(
            "parent-labels-removed",
            format!(
                "{} may not remove the tenant labels ({}) from {}/{tenant}: the volume gate recognises tenants by them",
                who.username,
                profile.parent_selector(),
                new.namespace
            ),
        ));
    }
    let worker_keys: Vec<&str> = keys
        .worker_owned()
        .into_iter()
        .filter(|k| changed(k))
        .collect();
    if !worker_keys.is_empty() && !who.is_worker {
        return UpdateVerdict::Final(forbid(
            "record-forged",
            format!(
                "{} may not change {}: the release record is written only by the volume-gate worker",
                who.username,
                worker_keys.join(", ")
            ),
        ));
    }
    let override_changed = changed(&keys.override_reason);
    if !override_changed {
        let stamps: Vec<&str> = keys.stamped().into_iter().filter(|k| changed(k)).collect();
        if !stamps.is_empty() {
            return UpdateVerdict::Final(forbid(
                "stamp-forged",
                format!(
                    "{} may not change {}: these are stamped by the volume gate when {} changes, never accepted from a client",
                    who.username,
                    stamps.join(", "),
                    keys.override_reason
                ),
            ));
        }
        return UpdateVerdict::Final(Verdict::allow("guards-passed"));
    }
    match annotation(Some(new), &keys.override_reason) {
        Some(reason) if reason.trim().is_empty() => UpdateVerdict::Final(forbid(
            "override-without-reason",
            format!(
                "the override on {}/{tenant} needs a reason: say why these volumes may be abandoned",
                new.namespace
            ),
        )),
        Some(_) => {
            let by = annotation(Some(new), &keys.override_by);
            let at = annotation(Some(new), &keys.override_at);
            let at_ok = at
                .and_then(|a| a.parse::<jiff::Timestamp>().ok())
                .is_some_and(|t| (now.as_second() - t.as_second()).abs() <= 300);
            if by != Some(who.username) || !at_ok {
                return UpdateVerdict::Final(forbid(
                    "stamp-forged",
                    format!(
                        "the override on {}/{tenant} is not stamped as the volume gate stamps it ({} must be the requester \
                         {}, {} the time of this request): is the mutating webhook installed?",
                        new.namespace, keys.override_by, who.username, keys.override_at
                    ),
                ));
            }
            UpdateVerdict::NeedsOverridePermission {
                namespace: new.namespace.clone(),
                tenant: tenant.to_string(),
            }
        }
        None => {
            // Withdrawing an override is as much a decision as recording one.
            if keys
                .stamped()
                .into_iter()
                .any(|k| annotation(Some(new), k).is_some())
            {
                return UpdateVerdict::Final(forbid(
                    "stamp-forged",
                    format!(
                        "the override on {}/{tenant} was removed but its stamps were not",
                        new.namespace
                    ),
                ));
            }
            UpdateVerdict::NeedsOverridePermission {
                namespace: new.namespace.clone(),
                tenant: tenant.to_string(),
            }
        }
    }
}

/// A parent in custody whose reference the profile follows (`guarded[].ref`,
/// Cluster API's `spec.controlPlaneRef`, `spec.infrastructureRef`) pointed
/// elsewhere: the object it named would lose its identity and could be
/// deleted under the tenant, and Cluster API, which follows the reference
/// to delete it with the Cluster, would delete another. Its own webhook
/// forbids only removing a reference, not changing it
/// (`core/webhooks/admission/cluster.go`, v1.14.2). Held until the volumes
/// are released or an override is recorded; setting one not set before is
/// not a move. `None`: no reference moved.
pub fn decide_reference_move(
    profile: &Profile,
    keys: &Keys,
    old: &ObjectMetaView,
    (old_spec, new_spec): (&SpecView, &SpecView),
    who: Requester<'_>,
) -> Option<Verdict> {
    if !profile.is_parent(&old.labels)
        || !old.finalizers.contains(&profile.custody_finalizer)
        || who.is_worker
    {
        return None;
    }
    let (before, after) = (old_spec.as_object(), new_spec.as_object());
    let moved: Vec<&str> = profile
        .guarded
        .iter()
        .filter_map(|g| g.reference.as_deref())
        .filter(|p| {
            let was = crate::profile::reference_at(&before, p);
            was.is_some() && was != crate::profile::reference_at(&after, p)
        })
        .collect();
    let first = moved.first()?;
    let facts = ParentFacts::of(profile, keys, &old.namespace, &old.name, old);
    if facts.record.is_done() {
        return None;
    }
    Some(forbid(
        "reference-moved",
        format!(
            "{} may not change {} of tenant {}/{} while it is in custody: the object it names is held until the \
             tenant's volumes are released, and moving the reference would release it unreleased. To abandon the \
             volumes, record an override: {}",
            who.username,
            first.trim_start_matches('/').replace('/', "."),
            old.namespace,
            old.name,
            profile.override_command(&old.namespace, &old.name)
        ),
    ))
}

/// The message when the SubjectAccessReview refuses an override.
pub fn override_refused(
    profile: &Profile,
    username: &str,
    namespace: &str,
    tenant: &str,
    why: &str,
) -> Verdict {
    let p = &profile.override_permission;
    let why = if why.is_empty() {
        String::new()
    } else {
        format!(" ({why})")
    };
    forbid(
        "override-unauthorized",
        format!(
            "{username} may not record an override for tenant {namespace}/{tenant}: it needs verb {verb:?} on resource \
             {res:?} of group {group:?}{why}. An administrator grants it with a Role rule {{apiGroups: [{group}], \
             resources: [{res}], verbs: [{verb}]}} in namespace {namespace}",
            verb = p.verb,
            res = p.resource,
            group = p.group
        ),
    )
}

/// One JSON Patch operation, as the mutating webhook returns it.
#[derive(Clone, Debug, PartialEq)]
pub enum Mutation {
    /// Add the custody finalizer (creating the list when absent).
    AddFinalizer { create_list: bool },
    /// Stamp who recorded the override and when.
    Stamp { by: String, at: String },
    /// Stamp who acknowledged a kept disk and when (`acknowledge`).
    StampAcknowledged { by: String, at: String },
    /// Remove the stamps of a withdrawn override or acknowledgement.
    Unstamp { keys: Vec<String> },
    /// Put back annotations of the gate's (the record, the override and its
    /// stamps) that a writer replacing the object whole dropped, creating
    /// the map when the write has none.
    Carry {
        annotations: Vec<(String, String)>,
        create_map: bool,
    },
}

/// What a writer that replaces a parent whole (the profile's
/// `writers.parentReplacers`: cozystack-api rebuilding it from the
/// Application on every update) dropped of the gate's: the custody
/// finalizer and every annotation under the record's prefix (and the
/// worker's mirror of it for the tenant's owner), put back from
/// the stored object, with `new` as it is once they are. Anyone else who
/// drops them is refused by the validating guards, loudly; a replacer does
/// not mean to, and refusing it would refuse every Application update of a
/// tenant in custody.
fn carry_over(
    profile: &Profile,
    old: Option<&ObjectMetaView>,
    new: &ObjectMetaView,
    who: Requester<'_>,
) -> (Vec<Mutation>, Option<ObjectMetaView>) {
    let Some(old) = old.filter(|o| profile.is_parent(&o.labels)) else {
        return (Vec::new(), None);
    };
    if !profile.writers.replaces_parents(who.username) {
        return (Vec::new(), None);
    }
    let mut out = Vec::new();
    let mut kept = new.clone();
    if old.finalizers.contains(&profile.custody_finalizer)
        && !new.finalizers.contains(&profile.custody_finalizer)
    {
        out.push(Mutation::AddFinalizer {
            create_list: new.finalizers.is_empty(),
        });
        kept.finalizers.push(profile.custody_finalizer.clone());
    }
    let prefix = &profile.annotation_prefix;
    let mirror = format!("{}{prefix}", profile.parent.visible_annotation_prefix);
    let ours = |k: &str| k.starts_with(prefix.as_str()) || k.starts_with(&mirror);
    let dropped: Vec<(String, String)> = old
        .annotations
        .iter()
        .filter(|(k, _)| ours(k) && !new.annotations.contains_key(*k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if !dropped.is_empty() {
        kept.annotations.extend(dropped.iter().cloned());
        out.push(Mutation::Carry {
            annotations: dropped,
            create_map: new.annotations.is_empty(),
        });
    }
    if out.is_empty() {
        return (out, None);
    }
    (out, Some(kept))
}

/// Mutations for CREATE/UPDATE of a release (`docs/design.md` §2, §3).
pub fn mutate(
    profile: &Profile,
    keys: &Keys,
    change: Change<'_>,
    who: Requester<'_>,
    now: jiff::Timestamp,
) -> Vec<Mutation> {
    let Change { old, new } = change;
    // The same test as `guard_update`: a write that removes the parent
    // labels is still judged (and stamped) as a write to a parent, or the
    // guard would refuse the webhook's own missing stamps (fuzz finding F1).
    let parent_now = profile.is_parent(&new.labels);
    if !parent_now && !old.is_some_and(|o| profile.is_parent(&o.labels)) {
        return Vec::new();
    }
    let (mut out, kept) = carry_over(profile, old, new, who);
    let new = kept.as_ref().unwrap_or(new);
    let old = becoming_parent(profile, old);
    // Custody starts before deletion, never during it, and only on what is
    // a parent after the write. A removal is not quietly undone here: the
    // validating guard refuses it, loudly.
    let removal = old.is_some_and(|o| o.finalizers.contains(&profile.custody_finalizer));
    if parent_now
        && !new.deleting
        && !removal
        && !new.finalizers.contains(&profile.custody_finalizer)
    {
        out.push(Mutation::AddFinalizer {
            create_list: new.finalizers.is_empty(),
        });
    }
    if annotation(old, &keys.override_reason) != annotation(Some(new), &keys.override_reason) {
        if annotation(Some(new), &keys.override_reason).is_some() {
            out.push(Mutation::Stamp {
                by: who.username.to_string(),
                at: crate::record::rfc3339(now),
            });
        } else {
            let present: Vec<String> = keys
                .stamped()
                .into_iter()
                .filter(|k| new.annotations.contains_key(*k))
                .map(str::to_string)
                .collect();
            if !present.is_empty() {
                out.push(Mutation::Unstamp { keys: present });
            }
        }
    }
    out
}

/// The two `add` operations of a stamp: who, and when.
fn stamps(by_key: &str, by: &str, at_key: &str, at: &str) -> [json_patch::PatchOperation; 2] {
    use json_patch::jsonptr::PointerBuf;
    use json_patch::{AddOperation, PatchOperation};
    [(by_key, by), (at_key, at)].map(|(key, value)| {
        PatchOperation::Add(AddOperation {
            path: PointerBuf::from_tokens(["metadata", "annotations", key]),
            value: serde_json::Value::String(value.to_string()),
        })
    })
}

/// Renders mutations as RFC 6902 operations.
pub fn to_json_patch(profile: &Profile, keys: &Keys, mutations: &[Mutation]) -> json_patch::Patch {
    use json_patch::jsonptr::PointerBuf;
    use json_patch::{AddOperation, PatchOperation, RemoveOperation};
    use serde_json::{Value, json};
    let annotation_path = |key: &str| PointerBuf::from_tokens(["metadata", "annotations", key]);
    let mut ops = Vec::new();
    for m in mutations {
        match m {
            Mutation::AddFinalizer { create_list: true } => {
                ops.push(PatchOperation::Add(AddOperation {
                    path: PointerBuf::from_tokens(["metadata", "finalizers"]),
                    value: json!([profile.custody_finalizer]),
                }))
            }
            Mutation::AddFinalizer { create_list: false } => {
                ops.push(PatchOperation::Add(AddOperation {
                    path: PointerBuf::from_tokens(["metadata", "finalizers", "-"]),
                    value: Value::String(profile.custody_finalizer.clone()),
                }))
            }
            // The stamped annotation exists, so the map does too; `add`
            // replaces a stamp written by hand.
            Mutation::Stamp { by, at } => {
                ops.extend(stamps(&keys.override_by, by, &keys.override_at, at))
            }
            Mutation::StampAcknowledged { by, at } => ops.extend(stamps(
                &keys.kept_acknowledged_by,
                by,
                &keys.kept_acknowledged_at,
                at,
            )),
            Mutation::Unstamp { keys } => {
                for k in keys {
                    ops.push(PatchOperation::Remove(RemoveOperation {
                        path: annotation_path(k),
                    }));
                }
            }
            Mutation::Carry {
                annotations,
                create_map,
            } => {
                if *create_map {
                    ops.push(PatchOperation::Add(AddOperation {
                        path: PointerBuf::from_tokens(["metadata", "annotations"]),
                        value: json!({}),
                    }));
                }
                for (k, v) in annotations {
                    ops.push(PatchOperation::Add(AddOperation {
                        path: annotation_path(k),
                        value: json!(v),
                    }));
                }
            }
        }
    }
    json_patch::Patch(ops)
}
