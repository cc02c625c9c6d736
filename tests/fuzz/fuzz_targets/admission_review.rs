//! Target 1: an AdmissionReview body, decoded and judged by the one judge
//! (`Judge::admit`, as the gate calls it), with the facts it asks for
//! chosen by the fuzzer.
//!
//! Input layout: byte 0 = length L of the facts region; bytes 1..=L feed
//! `arbitrary` for [`Facts`]; the rest is the HTTP body. A seed that is
//! `\0` followed by JSON is a review judged with default facts.
//!
//! The oracle holds no copy of a rule: the judge is the crate's only one.
//! It checks what must hold whatever the rules say, on every input:
//! - decode error: `respond(uid, cannot_judge(..))` is JSON, `allowed: false`,
//!   and carries the uid decode found (or "");
//! - decode ok: the uid is non-empty and the envelope was v1;
//! - the judge answers within four rounds of reads and never asks for a read
//!   it has; for the fuzzer's facts and for every combination of the parent
//!   (absent, unreadable, present, being deleted), its namespace (live,
//!   being deleted, unreadable) and the access review:
//!   - nothing it could not judge is allowed: a dependent of a parent whose
//!     read failed is refused;
//!   - the CSI driver release is never deleted while its parent is there
//!     and the record is not done (the incident);
//!   - a parent's DELETE is allowed only done or in custody;
//!   - each allow rests on the fact its reason names (`done` on a done
//!     record, `not-in-teardown` on a live namespace and parent,
//!     `parent-absent` on no parent, with a warning, `override-authorized`
//!     on an access review that allowed it);
//! - a relabel that turns the CSI release into a parent is refused before
//!   the record is done (F5);
//! - CREATE/UPDATE of the parent kind: the JSON patch from the judge's
//!   `mutate` applies cleanly to the request's object whenever it has a
//!   metadata map; the patched parent carries the custody finalizer unless
//!   it is being deleted or the finalizer was just removed; and
//!   `guard_update(old, patched)` never answers "stamp-forged" for the same
//!   requester unless the client itself changed a stamp while leaving the
//!   override as it was;
//! - every response's warnings are at most 256 bytes and the response body
//!   is JSON with the right `allowed`.

#![no_main]

#[path = "../common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::sync::LazyLock;

use arbitrary::{Arbitrary, Unstructured};
use common::{AnnKey, AnnVal, WORKER};
use kube::core::admission::Operation;
use volume_gate::admission::request::Object as DynamicObject;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use volume_gate::admission::decide::{self, Change, Requester, Target, UpdateVerdict, Verdict};
use volume_gate::admission::judge::{self, Access, Admission, Judge, Read};
use volume_gate::admission::request::ObjectMetaView;
use volume_gate::admission::{request, review};
use volume_gate::profile::Profile;
use volume_gate::record::{Keys, Record};

static PROFILE: LazyLock<Profile> = LazyLock::new(Profile::cozystack);
static KEYS: LazyLock<Keys> = LazyLock::new(|| Keys::new(&PROFILE.annotation_prefix));
/// The one judge, as the gate holds it.
static JUDGE: LazyLock<Judge> = LazyLock::new(|| Judge::new(PROFILE.clone(), WORKER.to_string()));

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
    /// What an access review for an override answers (`None`: it failed).
    access: Option<bool>,
}

fuzz_target!(|data: &[u8]| {
    let Some((&len, rest)) = data.split_first() else { return };
    let len = usize::from(len).min(rest.len());
    let (facts_bytes, body) = rest.split_at(len);
    let facts = Facts::arbitrary_take_rest(Unstructured::new(facts_bytes)).unwrap_or_default();
    run(&facts, body);
});

fn run(facts: &Facts, body: &[u8]) {
    let mut req = match review::decode(body) {
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

    // The judge knows the worker by its username.
    if facts.requester_is_worker && req.user_info.username.as_deref().is_some_and(|u| !u.is_empty()) {
        req.user_info.username = Some(WORKER.to_string());
    }
    let now = common::now(i32::from(facts.now_offset));
    let annotations = common::annotations(&facts.annotations, &KEYS, req.user_info.username.as_deref().unwrap_or(""), i32::from(facts.now_offset));
    let mut worlds = vec![World {
        parent: if facts.parent_absent { ParentWorld::Absent } else { ParentWorld::Present { deleting: facts.deleting, in_custody: facts.in_custody } },
        namespace: facts.namespace_deleting,
        access: facts.access,
    }];
    for parent in [
        ParentWorld::Absent,
        ParentWorld::Unreadable,
        ParentWorld::Present { deleting: false, in_custody: facts.in_custody },
        ParentWorld::Present { deleting: true, in_custody: facts.in_custody },
    ] {
        for namespace in [None, Some(false), Some(true)] {
            worlds.push(World { parent, namespace, access: facts.access });
        }
    }
    for world in &worlds {
        let (target, verdict) = judged(&req, world, &annotations, now);
        check_response(&req.uid, &verdict);
        check_allow(&req, world, &annotations, &target, &verdict);
    }

    let kind = request::group_kind(&req);
    let namespace = req.namespace.as_deref().unwrap_or("");
    if req.operation == Operation::Update {
        // F5, fixed in 0d2820b: a CSI release relabelled as a parent is still
        // the CSI release until the record is done.
        let old = request::labels_of(req.old_object.as_ref());
        let new = request::labels_of(req.object.as_ref());
        let before = decide::classify(&PROFILE, &kind, &req.name, &old);
        let after = decide::classify(&PROFILE, &kind, &req.name, &new);
        if matches!(before, Target::CsiRelease { .. }) && matches!(after, Target::Parent { .. }) {
            let live = World { parent: ParentWorld::Present { deleting: false, in_custody: true }, namespace: Some(false), access: Some(false) };
            let (_, v) = judged(&req, &live, &BTreeMap::new(), now);
            assert!(
                !v.allowed(),
                "F5: the CSI release {} may be relabelled as a parent ({after:?}) while its tenant's volumes are not released: {v:?}",
                req.name
            );
        }
    }
    if matches!(req.operation, Operation::Create | Operation::Update) && kind == PROFILE.parent_kind() {
        let username = req.user_info.username.as_deref().unwrap_or("");
        let who = Requester { username, is_worker: !username.is_empty() && username == WORKER };
        judge_parent_write(&req, &raw, namespace, who, now);
    }
}

/// The parent as the world the judge reads has it.
#[derive(Clone, Copy, Debug)]
enum ParentWorld {
    Absent,
    Unreadable,
    Present { deleting: bool, in_custody: bool },
}

/// What every read the judge may ask for finds: `None` is a failed read.
#[derive(Clone, Copy, Debug)]
struct World {
    parent: ParentWorld,
    namespace: Option<bool>,
    access: Option<bool>,
}

/// The judge's answer in `world` (the parent's record is `annotations`).
fn judged(req: &request::Request, world: &World, annotations: &BTreeMap<String, String>, now: jiff::Timestamp) -> (Target, Verdict) {
    let mut known = judge::Facts::default();
    for _ in 0..4 {
        match JUDGE.admit(req, &known, now) {
            Admission::Judged(target, verdict) => return (target, verdict),
            Admission::Need(reads) => {
                assert!(!reads.is_empty(), "the judge asked for nothing");
                for r in reads {
                    assert!(!known.has(&r), "the judge asked twice for {r:?}");
                    match r {
                        Read::Parent { namespace, name } => {
                            let got = match world.parent {
                                ParentWorld::Absent => Ok(None),
                                ParentWorld::Unreadable => Err("the parent could not be read (fuzzed)".to_string()),
                                ParentWorld::Present { deleting, in_custody } => Ok(Some(ObjectMetaView {
                                    namespace: namespace.clone(),
                                    name: name.clone(),
                                    labels: PROFILE.parent.match_labels.clone(),
                                    annotations: annotations.clone(),
                                    finalizers: if in_custody { vec![PROFILE.custody_finalizer.clone()] } else { Vec::new() },
                                    deleting,
                                })),
                            };
                            known.parent(&namespace, &name, got);
                        }
                        Read::Namespace { name } => {
                            known.namespace(&name, world.namespace.ok_or_else(|| "the namespace could not be read (fuzzed)".to_string()));
                        }
                        Read::OverrideAccess { namespace, tenant } => {
                            let got = world
                                .access
                                .map(|allowed| Access { allowed, reason: String::new() })
                                .ok_or_else(|| "the access review failed (fuzzed)".to_string());
                            known.access(&namespace, &tenant, got);
                        }
                        // No guarded entry of the Cozystack profile follows a reference.
                        Read::Referrers { namespace } => {
                            known.referrers(&namespace, Err("no reference is followed (fuzzed)".to_string()));
                        }
                    }
                }
            }
        }
    }
    panic!("the judge asked for reads in more than 4 rounds");
}

/// What must hold of an answer whatever the rules are.
fn check_allow(req: &request::Request, world: &World, annotations: &BTreeMap<String, String>, target: &Target, verdict: &Verdict) {
    let record = Record::from_annotations(&KEYS, annotations);
    let present = matches!(world.parent, ParentWorld::Present { .. });
    if req.operation == Operation::Delete
        && matches!(target, Target::CsiRelease { .. })
        && present
        && !record.is_done()
    {
        assert!(!verdict.allowed(), "the CSI release {} deleted before its tenant's volumes are released: {verdict:?} in {world:?}", req.name);
    }
    let Verdict::Allow { reason, warnings } = verdict else { return };
    let dependent = !matches!(target, Target::Parent { .. } | Target::Unrelated);
    if dependent && matches!(world.parent, ParentWorld::Unreadable) {
        // The rules that judge an object from itself alone (a platform
        // controller's source move) need no parent.
        assert_eq!(*reason, "platform-source-move", "{target:?} allowed ({reason}) though its parent could not be read");
    }
    if req.operation == Operation::Delete && matches!(target, Target::Parent { .. }) {
        let own = req.old_object.as_ref().map(|o| request::meta_view(o, req.namespace.as_deref().unwrap_or(""), &req.name));
        let ok = own.as_ref().is_some_and(|v| {
            Record::from_annotations(&KEYS, &v.annotations).is_done() || v.finalizers.contains(&PROFILE.custody_finalizer)
        });
        assert!(ok, "a parent DELETE allowed ({reason}) neither done nor in custody");
    }
    match *reason {
        "not-in-teardown" => {
            assert!(matches!(world.parent, ParentWorld::Present { deleting: false, .. }), "not-in-teardown with {world:?}");
            assert_eq!(world.namespace, Some(false), "not-in-teardown without a live namespace read: {world:?}");
        }
        "parent-absent" => {
            assert!(matches!(world.parent, ParentWorld::Absent), "parent-absent with {world:?}");
            assert!(!warnings.is_empty(), "an allow without a parent carries a warning");
        }
        "done" if dependent => assert!(record.is_done() && present, "done, with a record not done: {world:?}"),
        "override-authorized" => assert_eq!(world.access, Some(true), "an override allowed without an access review that allowed it"),
        _ => {}
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

fn judge_parent_write(req: &request::Request, raw: &Value, namespace: &str, who: Requester<'_>, now: jiff::Timestamp) {
    let Some(new) = req.object.as_ref() else { return };
    let new_view = request::meta_view(new, namespace, &req.name);
    let old_view = req.old_object.as_ref().map(|o| request::meta_view(o, namespace, &req.name));
    let change = Change { old: old_view.as_ref(), new: &new_view };

    // The validating guard on the request as sent: must not panic.
    let _ = decide::guard_update(&PROFILE, &KEYS, change, who, now);

    let (_, verdict, patch) = JUDGE.mutate(req, now);
    assert!(verdict.allowed(), "the mutating answer refused a parent write with an object: {verdict:?}");
    let patch = patch.unwrap_or_default();
    let out = review::respond(&req.uid, &verdict, Some(&patch));
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
