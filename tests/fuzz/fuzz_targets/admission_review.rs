//! Target 1: an AdmissionReview body, decoded and judged by the pure
//! decisions as the server calls them (src/admission/server.rs), with parent
//! facts chosen by the fuzzer.
//!
//! Input layout: byte 0 = length L of the facts region; bytes 1..=L feed
//! `arbitrary` for [`Facts`]; the rest is the HTTP body. A seed that is
//! `\0` followed by JSON is a review judged with default facts.
//!
//! Invariants, on every input:
//! - decode error: `respond(uid, cannot_judge(..))` is JSON, `allowed: false`,
//!   and carries the uid decode found (or "");
//! - decode ok: the uid is non-empty and the envelope was v1;
//! - DELETE (and a relabelling UPDATE, judged as a delete): the verdict equals
//!   `docs/design.md` §4's table, computed independently here (allow only when the
//!   target is unrelated; the parent is absent, with a warning; the record is
//!   done; the parent is in custody (parent target); or a child/guarded
//!   object outside teardown with the namespace read) — for the fuzzer's facts
//!   and for every combination of the boolean facts;
//! - in particular nothing that could not be judged is allowed: a
//!   child/guarded dependent with `namespace_deleting == None`, parent not
//!   deleting and not done, is denied;
//! - CREATE/UPDATE of the parent kind: the JSON patch from `mutate` applies
//!   cleanly to the request's object whenever it has a metadata map; the
//!   patched parent carries the custody finalizer unless it is being deleted
//!   or the finalizer was just removed; and `guard_update(old, patched)`
//!   never answers "stamp-forged" for the same requester unless the client
//!   itself changed a stamp while leaving the override as it was;
//! - every allowed response's warnings are at most 256 bytes and the
//!   response body is JSON with the right `allowed`.

#![no_main]

#[path = "../common/mod.rs"]
mod common;

use std::sync::LazyLock;

use arbitrary::{Arbitrary, Unstructured};
use common::{AnnKey, AnnVal};
use kube::core::admission::Operation;
use volume_gate::admission::request::Object as DynamicObject;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use volume_gate::admission::decide::{
    self, Change, ObjectMetaView, ParentFacts, Requester, Subject, Target, UpdateVerdict, Verdict,
};
use volume_gate::admission::{request, review};
use volume_gate::profile::Profile;
use volume_gate::record::{Keys, Record};

static PROFILE: LazyLock<Profile> = LazyLock::new(Profile::cozystack);
static KEYS: LazyLock<Keys> = LazyLock::new(|| Keys::new(&PROFILE.annotation_prefix));

#[derive(Debug, Default, Arbitrary)]
struct Facts {
    /// The requester is the worker's identity (when it has a username).
    requester_is_worker: bool,
    now_offset: i16,
    deleting: bool,
    namespace_deleting: Option<bool>,
    in_custody: bool,
    parent_absent: bool,
    /// The parent's annotations (its record), for dependents.
    annotations: Vec<(AnnKey, AnnVal)>,
}

fuzz_target!(|data: &[u8]| {
    let Some((&len, rest)) = data.split_first() else { return };
    let len = usize::from(len).min(rest.len());
    let (facts_bytes, body) = rest.split_at(len);
    let facts = Facts::arbitrary_take_rest(Unstructured::new(facts_bytes)).unwrap_or_default();
    run(&facts, body);
});

fn run(facts: &Facts, body: &[u8]) {
    let req = match review::decode(body) {
        Ok(req) => req,
        Err(invalid) => {
            let uid = invalid.uid.clone().unwrap_or_default();
            let out = review::respond(&uid, &decide::cannot_judge(format!("invalid AdmissionReview: {}", invalid.message)), None);
            let v: Value = serde_json::from_slice(&out).expect("a refusal is JSON");
            assert_eq!(v["response"]["allowed"], Value::Bool(false), "an undecodable review was allowed: {v}");
            assert_eq!(v["response"]["uid"].as_str(), Some(uid.as_str()));
            assert_eq!(v["apiVersion"], "admission.k8s.io/v1");
            return;
        }
    };
    assert!(!req.uid.is_empty(), "decoded a review without uid");
    // F7 (fixed in 0d2820b): decode's typed fast path once accepted a body
    // that is not JSON (invalid UTF-8 in a value the typed model ignores).
    let raw: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => panic!("F7: decode accepted a body that is not JSON ({e}): uid {:?}, {:?}", req.uid, req.operation),
    };
    assert_eq!(raw["apiVersion"], "admission.k8s.io/v1");

    let username = req.user_info.username.as_deref().unwrap_or("");
    let who = Requester { username, is_worker: facts.requester_is_worker && !username.is_empty() };
    let now = common::now(i32::from(facts.now_offset));
    let kind = request::group_kind(&req);
    let namespace = req.namespace.as_deref().unwrap_or("");

    match req.operation {
        Operation::Delete => {
            let Some(old) = req.old_object.as_ref() else { return };
            let labels = request::labels_of(Some(old));
            let target = decide::classify(&PROFILE, &kind, &req.name, &labels);
            let subject = Subject { kind: &kind, namespace, name: &req.name, action: "delete" };
            match &target {
                Target::Unrelated => {}
                Target::Parent { tenant } => {
                    let view = request::meta_view(old, namespace, &req.name);
                    let pf = ParentFacts {
                        namespace: namespace.to_string(),
                        name: tenant.clone(),
                        deleting: view.deleting,
                        namespace_deleting: None,
                        in_custody: view.finalizers.contains(&PROFILE.custody_finalizer),
                        record: Record::from_annotations(&KEYS, &view.annotations),
                    };
                    let v = decide::decide_parent_delete(&PROFILE, subject, &pf);
                    let expected = pf.record.is_done() || pf.in_custody;
                    assert_eq!(v.allowed(), expected, "parent DELETE: {v:?} for {pf:?}");
                    check_response(&req.uid, &v);
                }
                _ => judge_dependent(facts, &target, subject, username),
            }
        }
        Operation::Update => {
            let old = request::labels_of(req.old_object.as_ref());
            let new = request::labels_of(req.object.as_ref());
            // The oracle follows the first identity a relabel concerns (the
            // gate judges every one and keeps the strictest answer).
            if let Some(target) = decide::relabel_targets(&PROFILE, &kind, &req.name, &old, &new).into_iter().next() {
                assert!(target.tenant().is_some(), "a retargeted object has a tenant: {target:?}");
                // A relabelled CSI release is judged as a child, or, when the
                // relabel makes it look like a parent (F5), as itself.
                assert!(!matches!(target, Target::Parent { .. } | Target::Unrelated));
                let subject = Subject { kind: &kind, namespace, name: &req.name, action: "relabel" };
                judge_dependent(facts, &target, subject, username);
                // (e) A CSI release's DELETE is held until the record is done
                // "by its name"; an UPDATE that gives it the parent's labels
                // turns it into a parent, whose DELETE is allowed once in
                // custody (which the mutating webhook grants on that very
                // UPDATE). Such an UPDATE must not be allowed before done.
                let before = decide::classify(&PROFILE, &kind, &req.name, &old);
                let after = decide::classify(&PROFILE, &kind, &req.name, &new);
                // F5, fixed in 0d2820b: always checked.
                if matches!(before, Target::CsiRelease { .. }) && matches!(after, Target::Parent { .. }) {
                    let pf = ParentFacts {
                        namespace: namespace.to_string(),
                        name: target.tenant().unwrap().to_string(),
                        deleting: false,
                        namespace_deleting: Some(false),
                        in_custody: true,
                        record: Record::default(),
                    };
                    let v = decide::decide_dependent_delete(&PROFILE, &target, subject, Some(&pf));
                    assert!(
                        !v.allowed(),
                        "F5: the CSI release {} may be relabelled as a parent ({after:?}) while its tenant's volumes \
                         are not released: {v:?}",
                        req.name
                    );
                }
            } else if kind == PROFILE.parent_kind() {
                judge_parent_write(&req, &raw, who, now);
            }
        }
        Operation::Create if kind == PROFILE.parent_kind() => judge_parent_write(&req, &raw, who, now),
        _ => {}
    }
}

/// `docs/design.md` §4 for a child/guarded/CSI dependent, computed independently.
fn expected_dependent(target: &Target, action: &str, parent: Option<&ParentFacts>) -> bool {
    let Some(p) = parent else { return true };
    if p.record.is_done() {
        return true;
    }
    let teardown = p.deleting || p.namespace_deleting == Some(true);
    match target {
        Target::CsiRelease { .. } => false,
        // A disk's delete frees it; in teardown only once the inventory says
        // which disks to keep (§5c). Any other change of it is held.
        Target::InfraDisk { .. } if action == "delete" => {
            if teardown {
                p.record.inventory.is_some()
            } else {
                p.namespace_deleting.is_some()
            }
        }
        Target::InfraDisk { .. } => false,
        Target::Child { .. } | Target::Guarded { .. } | Target::ReleaseObject { .. } => !teardown && p.namespace_deleting == Some(false),
        Target::Parent { .. } | Target::Unrelated => true,
    }
}

fn judge_dependent(facts: &Facts, target: &Target, subject: Subject<'_>, username: &str) {
    let tenant = target.tenant().expect("a dependent has a tenant").to_string();
    let annotations = common::annotations(&facts.annotations, &KEYS, username, i32::from(facts.now_offset));
    let record = Record::from_annotations(&KEYS, &annotations);
    let mut cases = vec![(facts.parent_absent, facts.deleting, facts.namespace_deleting, facts.in_custody)];
    for absent in [false, true] {
        for deleting in [false, true] {
            for ns in [None, Some(false), Some(true)] {
                cases.push((absent, deleting, ns, facts.in_custody));
            }
        }
    }
    for (absent, deleting, namespace_deleting, in_custody) in cases {
        let pf = ParentFacts {
            namespace: subject.namespace.to_string(),
            name: tenant.clone(),
            deleting,
            namespace_deleting,
            in_custody,
            record: record.clone(),
        };
        let parent = (!absent).then_some(&pf);
        let v = decide::decide_dependent_delete(&PROFILE, target, subject, parent);
        let expected = expected_dependent(target, subject.action, parent);
        assert_eq!(v.allowed(), expected, "{} of {target:?}: got {v:?}, parent {parent:?}", subject.action);
        if let Verdict::Allow { reason, warnings } = &v
            && parent.is_none()
        {
            assert_eq!(*reason, "parent-absent");
            assert!(!warnings.is_empty(), "an allow without a parent carries a warning");
        }
        // Nothing it cannot judge is allowed.
        if let Some(p) = parent
            && matches!(target, Target::Child { .. } | Target::Guarded { .. })
            && p.namespace_deleting.is_none()
            && !p.deleting
            && !p.record.is_done()
        {
            assert!(!v.allowed(), "allowed without reading the namespace: {v:?}");
        }
        // The server asks for the namespace exactly when an allow could rest on it.
        if let Some(p) = parent {
            let needs = decide::needs_namespace(target, p);
            let could_allow_on_it = matches!(target, Target::Child { .. } | Target::Guarded { .. })
                && !p.deleting
                && !p.record.is_done()
                && p.namespace_deleting.is_none();
            assert_eq!(needs, could_allow_on_it, "needs_namespace for {target:?} {p:?}");
        }
        check_response("u", &v);
    }
}

/// The response body for a verdict is JSON with the right `allowed`, and
/// warnings are kept whole (at most 256 bytes).
fn check_response(uid: &str, v: &Verdict) {
    let out = review::respond(uid, v, None);
    let j: Value = serde_json::from_slice(&out).expect("a response is JSON");
    assert_eq!(j["response"]["allowed"], Value::Bool(v.allowed()));
    assert_eq!(j["response"]["uid"].as_str(), Some(uid));
    if let Some(ws) = j["response"]["warnings"].as_array() {
        for w in ws {
            let w = w.as_str().expect("a warning is a string");
            assert!(w.len() <= 256, "warning of {} bytes", w.len());
        }
    }
    if !v.allowed() {
        let msg = j["response"]["status"]["message"].as_str().unwrap_or("");
        assert!(!msg.is_empty(), "a denial says why");
    }
}

fn stamps_of(m: Option<&ObjectMetaView>) -> [Option<String>; 2] {
    [&KEYS.override_by, &KEYS.override_at].map(|k| m.and_then(|m| m.annotations.get(k.as_str()).cloned()))
}

fn override_of(m: Option<&ObjectMetaView>) -> Option<String> {
    m.and_then(|m| m.annotations.get(&KEYS.override_reason).cloned())
}

fn judge_parent_write(
    req: &kube::core::admission::AdmissionRequest<DynamicObject>,
    raw: &Value,
    who: Requester<'_>,
    now: jiff::Timestamp,
) {
    let namespace = req.namespace.as_deref().unwrap_or("");
    let Some(new) = req.object.as_ref() else { return };
    let new_view = request::meta_view(new, namespace, &req.name);
    let old_view = req.old_object.as_ref().map(|o| request::meta_view(o, namespace, &req.name));
    let change = Change { old: old_view.as_ref(), new: &new_view };

    // The validating guard on the request as sent: must not panic; its
    // message names the requester when it refuses.
    let _ = decide::guard_update(&PROFILE, &KEYS, change, who, now);

    let mutations = decide::mutate(&PROFILE, &KEYS, change, who, now);
    let patch = decide::to_json_patch(&PROFILE, &KEYS, &mutations);
    let out = review::respond(&req.uid, &Verdict::allow("mutated"), Some(&patch));
    let j: Value = serde_json::from_slice(&out).expect("a mutating response is JSON");
    assert_eq!(j["response"]["allowed"], true);
    assert_eq!(j["response"]["patchType"].is_string(), !patch.0.is_empty());

    let mut object = raw["request"]["object"].clone();
    if !object.get("metadata").is_some_and(Value::is_object) {
        return;
    }
    if let Err(e) = json_patch::patch(&mut object, &patch) {
        panic!("the mutating patch does not apply: {e}\npatch: {}\nobject: {object}", serde_json::to_string(&patch).unwrap());
    }
    let patched: DynamicObject = match serde_json::from_value(object.clone()) {
        Ok(o) => o,
        Err(e) => panic!("the patched object no longer parses: {e}\nobject: {object}"),
    };
    let patched_view = request::meta_view(&patched, namespace, &req.name);

    if PROFILE.is_parent(&new_view.labels) {
        let removal = old_view.as_ref().is_some_and(|o| o.finalizers.contains(&PROFILE.custody_finalizer));
        if !new_view.deleting && !removal {
            assert!(
                patched_view.finalizers.contains(&PROFILE.custody_finalizer),
                "a parent written without the custody finalizer leaves the mutating webhook without it"
            );
        }
    }

    let verdict = decide::guard_update(&PROFILE, &KEYS, Change { old: old_view.as_ref(), new: &patched_view }, who, now);
    if let UpdateVerdict::Final(Verdict::Deny { reason: "stamp-forged", message, .. }) = &verdict {
        // Becoming a parent is judged as a creation (docs/design.md §4): what
        // the object carried before it was one counts as written now.
        let becoming = old_view.as_ref().is_some_and(|o| !PROFILE.is_parent(&o.labels)) && PROFILE.is_parent(&new_view.labels);
        let before = if becoming { None } else { old_view.as_ref() };
        let client_forged = override_of(before) == override_of(Some(&new_view)) && stamps_of(before) != stamps_of(Some(&new_view));
        // A known finding (`docs/fuzzing.md` F1): mutate looks only at the
        // new labels, the guard at old or new, so a worker write that drops
        // the parent labels and changes the override is never stamped.
        let known_f1 = !PROFILE.is_parent(&new_view.labels) && who.is_worker && !common::check_known("F1");
        assert!(
            client_forged || known_f1,
            "stamp-forged after the webhook's own stamps: {message}\nold: {old_view:?}\nnew: {new_view:?}\npatched: {patched_view:?}\nwho: {who:?}"
        );
    }
}
