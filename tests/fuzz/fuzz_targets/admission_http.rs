//! Target 1b: the same AdmissionReview bodies through the real HTTP layer
//! (`admission::server::router`: body limit, decode, `Gate::validate` with
//! its fresh reads, `Gate::mutate`, `respond`), against an in-process
//! stand-in for the API server whose answers the fuzzer chooses.
//!
//! Input layout as in `admission_review`: byte 0 = length L of the facts
//! region, bytes 1..=L feed `arbitrary` for [`Facts`], the rest is the body.
//! The body's `@NOW@` is replaced by the current time (RFC 3339), so seeds
//! can carry a valid `override-at` stamp.
//!
//! Invariants, on every input, for /validate and /mutate:
//! - the answer is a JSON AdmissionReview v1 with the request's uid;
//! - an undecodable, oversized, truncated or non-JSON body (F7) is never
//!   allowed (HTTP 200
//!   when a uid was found, else the error status);
//! - /validate's verdict equals `docs/design.md` §4's table computed here from the
//!   stand-in's state; an allow of a dependent rests on a parent read made
//!   for this request, and an allow "not in teardown" on a namespace read;
//!   any API error is a denial;
//! - /mutate never denies a decodable parent write that has an object, and
//!   its base64 JSON patch applies to the request's object.

#![no_main]

#[path = "../common/mod.rs"]
mod common;

use std::convert::Infallible;
use std::sync::{Arc, LazyLock, Mutex};

use arbitrary::{Arbitrary, Unstructured};
use base64::Engine;
use bytes::Bytes;
use common::{AnnKey, AnnVal, WORKER};
use http_body_util::{BodyExt, Full};
use kube::core::admission::{AdmissionRequest, Operation};
use volume_gate::admission::review::Object as DynamicObject;
use libfuzzer_sys::fuzz_target;
use serde_json::{Value, json};
use tower::ServiceExt;
use volume_gate::admission::decide::{self, Change, Requester, Target, UpdateVerdict};
use volume_gate::admission::review;
use volume_gate::admission::{Gate, router};
use volume_gate::args::DEFAULT_MAX_BODY_BYTES;
use volume_gate::metrics::Metrics;
use volume_gate::profile::Profile;
use volume_gate::record::{Keys, Record};

#[derive(Debug, Clone, Default, Arbitrary)]
enum ParentState {
    #[default]
    Absent,
    Error,
    /// An object of the parent kind with the name, but not a parent's labels.
    NotParent,
    Present { deleting: bool, in_custody: bool },
}

#[derive(Debug, Clone, Default, Arbitrary)]
enum NsState {
    Absent,
    Error,
    #[default]
    Live,
    Deleting,
}

#[derive(Debug, Clone, Default, Arbitrary)]
enum SarState {
    Allowed,
    #[default]
    Denied,
    /// `allowed: true` together with `denied: true`: a denial.
    AllowedAndDenied,
    Error,
}

#[derive(Debug, Clone, Default, Arbitrary)]
struct Facts {
    parent: ParentState,
    annotations: Vec<(AnnKey, AnnVal)>,
    namespace: NsState,
    sar: SarState,
    /// Serve with a 64-byte body limit.
    tiny_limit: bool,
}

#[derive(Debug, Default)]
struct ApiState {
    facts: Facts,
    reads: Vec<&'static str>,
}

static API: LazyLock<Mutex<ApiState>> = LazyLock::new(Default::default);

static RT: LazyLock<tokio::runtime::Runtime> =
    LazyLock::new(|| tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime"));

static PROFILE: LazyLock<Profile> = LazyLock::new(Profile::cozystack);
static KEYS: LazyLock<Keys> = LazyLock::new(|| Keys::new(&PROFILE.annotation_prefix));

const TINY_LIMIT: usize = 64;

struct Routers {
    normal: axum::Router,
    tiny: axum::Router,
}

static ROUTERS: LazyLock<Routers> = LazyLock::new(|| {
    // Client::new spawns its buffer task: inside the runtime.
    RT.block_on(async {
        let service = tower::service_fn(|req: http::Request<kube::client::Body>| async move {
            Ok::<_, Infallible>(answer_api(&req))
        });
        let client = kube::Client::new(service, "default");
        let gate = Arc::new(Gate::new(PROFILE.clone(), WORKER.to_string(), client, Metrics::new()));
        Routers { normal: router(gate.clone(), DEFAULT_MAX_BODY_BYTES), tiny: router(gate, TINY_LIMIT) }
    })
});

fn status(code: u16, reason: &str) -> http::Response<Full<Bytes>> {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": reason, "reason": reason, "code": code});
    http::Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

fn ok(body: Value) -> http::Response<Full<Bytes>> {
    http::Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

/// The API server stand-in: the parent's metadata, the namespace's, and
/// SubjectAccessReviews, as the facts say.
fn answer_api(req: &http::Request<kube::client::Body>) -> http::Response<Full<Bytes>> {
    let path = req.uri().path().to_string();
    let mut api = API.lock().unwrap();
    // Matched by prefix: a name the API server would never have admitted
    // (a slash, say) still reaches the stand-in as a read of that kind.
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match segments.as_slice() {
        ["apis", "helm.toolkit.fluxcd.io", "v2", "namespaces", ns, "helmreleases", name, ..] => {
            api.reads.push("parent");
            let keys = &*KEYS;
            let annotations = common::annotations(&api.facts.annotations, keys, "", 0);
            let mut meta = json!({"name": name, "namespace": ns, "annotations": annotations});
            match &api.facts.parent {
                ParentState::Absent => return status(404, "NotFound"),
                ParentState::Error => return status(500, "InternalError"),
                ParentState::NotParent => meta["labels"] = json!({"apps.cozystack.io/application.kind": "Postgres"}),
                ParentState::Present { deleting, in_custody } => {
                    meta["labels"] = json!(PROFILE.parent.match_labels);
                    if *deleting {
                        meta["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
                    }
                    if *in_custody {
                        meta["finalizers"] = json!([PROFILE.custody_finalizer]);
                    }
                }
            }
            ok(json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": meta}))
        }
        ["api", "v1", "namespaces", ns, ..] => {
            api.reads.push("namespace");
            let mut meta = json!({"name": ns});
            match api.facts.namespace {
                NsState::Absent => return status(404, "NotFound"),
                NsState::Error => return status(503, "ServiceUnavailable"),
                NsState::Live => {}
                NsState::Deleting => meta["deletionTimestamp"] = json!("2026-01-01T00:00:00Z"),
            }
            ok(json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": meta}))
        }
        ["apis", "authorization.k8s.io", "v1", "subjectaccessreviews"] => {
            api.reads.push("sar");
            let (allowed, denied) = match api.facts.sar {
                SarState::Allowed => (true, false),
                SarState::Denied => (false, false),
                SarState::AllowedAndDenied => (true, true),
                SarState::Error => return status(500, "InternalError"),
            };
            ok(json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                      "spec": {}, "status": {"allowed": allowed, "denied": denied}}))
        }
        _ => {
            api.reads.push("unexpected");
            status(404, "NotFound")
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&len, rest)) = data.split_first() else { return };
    let len = usize::from(len).min(rest.len());
    let (facts_bytes, body) = rest.split_at(len);
    let facts = Facts::arbitrary_take_rest(Unstructured::new(facts_bytes)).unwrap_or_default();
    let now = jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
    let body = replace_all(body, b"@NOW@", now.as_bytes());
    for endpoint in ["/validate", "/mutate"] {
        run(&facts, &body, endpoint);
    }
});

fn replace_all(hay: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(hay.len());
    let mut i = 0;
    while i < hay.len() {
        if hay[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
        } else {
            out.push(hay[i]);
            i += 1;
        }
    }
    out
}

fn run(facts: &Facts, body: &[u8], endpoint: &str) {
    {
        let mut api = API.lock().unwrap();
        api.facts = facts.clone();
        api.reads.clear();
    }
    let routers = &*ROUTERS;
    let router = if facts.tiny_limit { routers.tiny.clone() } else { routers.normal.clone() };
    let request = http::Request::post(endpoint)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body.to_vec()))
        .unwrap();
    let now = jiff::Timestamp::now();
    let (code, answer) = RT.block_on(async move {
        let response = router.oneshot(request).await.expect("the router is infallible");
        let code = response.status().as_u16();
        let bytes = response.into_body().collect().await.expect("body").to_bytes();
        (code, bytes)
    });
    let reads = std::mem::take(&mut API.lock().unwrap().reads);
    if std::env::var_os("VG_FUZZ_DEBUG").is_some() {
        eprintln!("{endpoint} with {facts:?}: HTTP {code}, reads {reads:?}: {}", String::from_utf8_lossy(&answer));
    }
    let out: Value = match serde_json::from_slice(&answer) {
        Ok(v) => v,
        Err(e) => panic!("{endpoint} answered non-JSON ({e}): {}", String::from_utf8_lossy(&answer)),
    };
    assert_eq!(out["apiVersion"], "admission.k8s.io/v1", "{out}");
    assert_eq!(out["kind"], "AdmissionReview", "{out}");
    let allowed = out["response"]["allowed"].as_bool().expect("response.allowed is a bool");
    let warnings: Vec<&str> =
        out["response"]["warnings"].as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    for w in &warnings {
        assert!(w.len() <= 256, "warning of {} bytes", w.len());
    }
    assert!(!reads.contains(&"unexpected"), "the gate made an unexpected API call: {reads:?}");

    let over_limit = facts.tiny_limit && body.len() > TINY_LIMIT;
    let decoded = if over_limit { None } else { review::decode(body).ok() };
    let Some(req) = decoded else {
        assert!(!allowed, "{endpoint}: an undecodable or oversized review was allowed: {out}");
        assert!(reads.is_empty(), "the gate read the API for an undecodable review: {reads:?}");
        let uid = if over_limit { None } else { review::decode(body).err().and_then(|e| e.uid) };
        match &uid {
            Some(u) => {
                assert_eq!(code, 200, "{out}");
                assert_eq!(out["response"]["uid"].as_str(), Some(u.as_str()));
            }
            None => assert!(code == 400 || code == 413, "status {code} for a review without uid"),
        }
        return;
    };
    // F7 (fixed in 0d2820b): a body that is not JSON must be refused even
    // when decode's typed fast path could read it.
    if serde_json::from_slice::<Value>(body).is_err() {
        assert!(!allowed, "F7: {endpoint} allowed a body that is not JSON: {out}");
        return;
    }
    assert_eq!(code, 200);
    assert_eq!(out["response"]["uid"].as_str(), Some(req.uid.as_str()), "{out}");
    let message = out["response"]["status"]["message"].as_str().unwrap_or("");
    if !allowed {
        assert!(!message.is_empty(), "a denial without a message: {out}");
    }
    match endpoint {
        "/validate" => check_validate(facts, &req, allowed, &warnings, &reads, now, &out),
        _ => check_mutate(&req, body, allowed, &out),
    }
}

/// `docs/design.md` §4, from the stand-in's state.
fn check_validate(
    facts: &Facts,
    req: &AdmissionRequest<DynamicObject>,
    allowed: bool,
    warnings: &[&str],
    reads: &[&str],
    now: jiff::Timestamp,
    out: &Value,
) {
    let kind = review::group_kind(req);
    let namespace = req.namespace.as_deref().unwrap_or("");
    let dependent = |target: &Target| {
        let record = Record::from_annotations(&KEYS, &common::annotations(&facts.annotations, &KEYS, "", 0));
        if !reads.contains(&"parent") {
            // The read could not even be sent (a name no URI can carry):
            // refused, which is the safe answer.
            assert!(!allowed, "a dependent allowed without reading its parent: {reads:?}: {out}");
            return;
        }
        let expected = match &facts.parent {
            ParentState::Error => false,
            ParentState::Absent | ParentState::NotParent => true,
            ParentState::Present { .. } if record.is_done() => true,
            ParentState::Present { deleting, .. } => match target {
                Target::CsiRelease { .. } => false,
                _ if *deleting => false,
                _ => matches!(facts.namespace, NsState::Live) && reads.contains(&"namespace"),
            },
        };
        assert_eq!(allowed, expected, "{target:?} with {facts:?}: reads {reads:?}: {out}");
        assert_eq!(reads.first(), Some(&"parent"), "a dependent judged without reading its parent: {reads:?}");
        if allowed && matches!(facts.parent, ParentState::Absent | ParentState::NotParent) {
            assert!(!warnings.is_empty(), "an allow without a parent carries a warning: {out}");
        }
        if allowed && matches!(facts.parent, ParentState::Present { .. }) && !record.is_done() {
            assert!(reads.contains(&"namespace"), "allowed 'not in teardown' without reading the namespace: {reads:?}");
        }
    };
    // A DELETECOLLECTION item has an empty request name: the object's own counts.
    let name = review::request_name(req);
    match req.operation {
        Operation::Delete => {
            if name.is_empty() {
                assert!(!allowed, "a DELETE that names no object was allowed: {out}");
                return;
            }
            let Some(old) = req.old_object.as_ref() else {
                assert!(!allowed, "a DELETE without oldObject was allowed: {out}");
                return;
            };
            let target = decide::classify(&PROFILE, &kind, name, &review::labels_of(Some(old)));
            match &target {
                Target::Unrelated => assert!(allowed, "an unrelated DELETE was denied: {out}"),
                Target::Parent { .. } => {
                    let view = review::meta_view(old, namespace, name);
                    let done = Record::from_annotations(&KEYS, &view.annotations).is_done();
                    let custody = view.finalizers.contains(&PROFILE.custody_finalizer);
                    assert_eq!(allowed, done || custody, "parent DELETE: {out}");
                    assert!(reads.is_empty(), "a parent DELETE is judged from its own object: {reads:?}");
                }
                _ => dependent(&target),
            }
        }
        Operation::Update
            if !decide::relabel_targets(
                &PROFILE,
                &kind,
                name,
                &review::labels_of(req.old_object.as_ref()),
                &review::labels_of(req.object.as_ref()),
            )
            .is_empty() =>
        {
            // The oracle follows the first identity a relabel concerns (the
            // gate judges every one and keeps the strictest answer).
            let target = decide::relabel_targets(
                &PROFILE,
                &kind,
                name,
                &review::labels_of(req.old_object.as_ref()),
                &review::labels_of(req.object.as_ref()),
            )
            .remove(0);
            dependent(&target);
        }
        Operation::Create | Operation::Update if kind == PROFILE.parent_kind() => {
            let Some(new) = req.object.as_ref() else {
                assert!(!allowed, "a parent write without object was allowed: {out}");
                return;
            };
            let new_view = review::meta_view(new, namespace, &req.name);
            let old_view = req.old_object.as_ref().map(|o| review::meta_view(o, namespace, &req.name));
            let username = req.user_info.username.as_deref().unwrap_or("");
            let who = Requester { username, is_worker: !username.is_empty() && username == WORKER };
            let change = Change { old: old_view.as_ref(), new: &new_view };
            match decide::guard_update(&PROFILE, &KEYS, change, who, now) {
                UpdateVerdict::Final(v) => {
                    // The server's clock may have crossed a stamp's 300 s
                    // window between the two calls: only then may they differ.
                    if v.allowed() != allowed {
                        let later = decide::guard_update(&PROFILE, &KEYS, change, who, jiff::Timestamp::now());
                        assert!(later != UpdateVerdict::Final(v.clone()), "guard {v:?} but the server said allowed={allowed}: {out}");
                    }
                }
                UpdateVerdict::NeedsOverridePermission { .. } => {
                    let expected = matches!(facts.sar, SarState::Allowed);
                    assert_eq!(allowed, expected, "override permission with {:?}: {out}", facts.sar);
                    assert!(reads.contains(&"sar"), "an override judged without a SubjectAccessReview: {reads:?}");
                }
            }
        }
        _ => assert!(allowed, "{:?} of {kind} is not the gate's business: {out}", req.operation),
    }
}

fn check_mutate(req: &AdmissionRequest<DynamicObject>, body: &[u8], allowed: bool, out: &Value) {
    let kind = review::group_kind(req);
    let parent_write = matches!(req.operation, Operation::Create | Operation::Update) && kind == PROFILE.parent_kind();
    if !parent_write {
        assert!(allowed, "the mutating webhook denied {:?} of {kind}: {out}", req.operation);
        assert!(out["response"]["patch"].is_null(), "a patch for something not a parent write: {out}");
        return;
    }
    if req.object.is_none() {
        assert!(!allowed, "a parent write without object was allowed by the mutating webhook: {out}");
        return;
    }
    assert!(allowed, "the mutating webhook denied a parent write: {out}");
    let Some(patch_b64) = out["response"]["patch"].as_str() else { return };
    assert_eq!(out["response"]["patchType"], "JSONPatch");
    let patch_bytes = base64::engine::general_purpose::STANDARD.decode(patch_b64).expect("patch is base64");
    let patch: json_patch::Patch = serde_json::from_slice(&patch_bytes).expect("patch is a JSON Patch");
    let raw: Value = serde_json::from_slice(body).expect("decoded, so JSON");
    let mut object = raw["request"]["object"].clone();
    if object.get("metadata").is_some_and(Value::is_object) {
        if let Err(e) = json_patch::patch(&mut object, &patch) {
            panic!("the served patch does not apply: {e}\npatch: {}\nobject: {object}", String::from_utf8_lossy(&patch_bytes));
        }
    }
}
