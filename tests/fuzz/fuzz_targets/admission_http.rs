//! Target 1b: the same AdmissionReview bodies through the real HTTP layer
//! (`admission::server::router`: body limit, decode, `Gate::validate` with
//! its fresh reads, `Gate::mutate`, `respond`), against an in-process
//! stand-in for the API server whose answers the fuzzer chooses (the
//! crate's scripted server, `volume_gate::testing`).
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
//! - /validate's verdict is the one judge's (`Judge::admit`, the crate's
//!   only copy of `docs/design.md` §4's rules) for the stand-in's state, and
//!   the gate reads nothing the judge did not ask for; an allow of a
//!   dependent rests on a parent read made for this request, an allow "not
//!   in teardown" on a namespace read, an override on an access review;
//!   any API error is a denial;
//! - /mutate never denies a decodable parent write that has an object, and
//!   its base64 JSON patch applies to the request's object.

#![no_main]

#[path = "../common/mod.rs"]
mod common;

use std::sync::{Arc, LazyLock};

use arbitrary::{Arbitrary, Unstructured};
use base64::Engine;
use common::{AnnKey, AnnVal, WORKER};
use http_body_util::BodyExt;
use kube::core::admission::{AdmissionRequest, Operation};
use volume_gate::admission::request::Object as DynamicObject;
use libfuzzer_sys::fuzz_target;
use serde_json::{Value, json};
use tower::ServiceExt;
use volume_gate::admission::decide::{Target, Verdict};
use volume_gate::admission::judge::{self, Access, Admission, Judge, Read};
use volume_gate::admission::request::ObjectMetaView;
use volume_gate::admission::{request, review};
use volume_gate::admission::{Gate, router};
use volume_gate::args::DEFAULT_MAX_BODY_BYTES;
use volume_gate::metrics::Metrics;
use volume_gate::profile::Profile;
use volume_gate::record::Keys;
use volume_gate::testing::{FakeApi, partial_metadata, status_body};

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

/// The scripted API server (`volume_gate::testing`), shared with the
/// crate's in-process tests; each input scripts it from its facts.
static API: LazyLock<Arc<FakeApi>> = LazyLock::new(FakeApi::new);

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
        let client = API.client();
        let gate = Arc::new(Gate::new(PROFILE.clone(), WORKER.to_string(), client, Metrics::new()));
        Routers { normal: router(gate.clone(), DEFAULT_MAX_BODY_BYTES), tiny: router(gate, TINY_LIMIT) }
    })
});

const PARENTS: &str = "/apis/helm.toolkit.fluxcd.io/v2/namespaces/";
const NAMESPACES: &str = "/api/v1/namespaces/";
const SAR: &str = "/apis/authorization.k8s.io/v1/subjectaccessreviews";

/// Scripts the API server as the facts say: the parent's metadata, the
/// namespace's, and SubjectAccessReviews. Routes match by prefix: a name the
/// API server would never have admitted (a slash, say) still reaches it as
/// a read of that kind.
fn script_api(facts: &Facts) {
    API.reset();
    let keys = &*KEYS;
    let annotations = common::annotations(&facts.annotations, keys, "", 0);
    let mut meta = json!({"name": "parent", "namespace": "tenant", "annotations": annotations});
    match &facts.parent {
        ParentState::Absent => {}
        ParentState::Error => {
            API.on_prefix("GET", PARENTS, 500, status_body(500));
        }
        ParentState::NotParent | ParentState::Present { .. } => {
            if let ParentState::Present { deleting, in_custody } = &facts.parent {
                meta["labels"] = json!(PROFILE.parent.match_labels);
                if *deleting {
                    meta["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
                }
                if *in_custody {
                    meta["finalizers"] = json!([PROFILE.custody_finalizer]);
                }
            } else {
                meta["labels"] = json!({"apps.cozystack.io/application.kind": "Postgres"});
            }
            API.on_prefix("GET", PARENTS, 200, partial_metadata(meta));
        }
    }
    let mut ns = json!({"name": "tenant"});
    match facts.namespace {
        NsState::Absent => {}
        NsState::Error => {
            API.on_prefix("GET", NAMESPACES, 503, status_body(503));
        }
        NsState::Live | NsState::Deleting => {
            if matches!(facts.namespace, NsState::Deleting) {
                ns["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
            }
            API.on_prefix("GET", NAMESPACES, 200, partial_metadata(ns));
        }
    }
    let (allowed, denied) = match facts.sar {
        SarState::Allowed => (true, false),
        SarState::Denied => (false, false),
        SarState::AllowedAndDenied => (true, true),
        SarState::Error => {
            API.on("POST", SAR, 500, status_body(500));
            return;
        }
    };
    API.on("POST", SAR, 201, json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                                    "spec": {}, "status": {"allowed": allowed, "denied": denied}}));
}

/// What the gate read, by kind, in order.
fn reads() -> Vec<&'static str> {
    API.calls()
        .iter()
        .map(|c| match (c.method.as_str(), c.path.as_str()) {
            ("GET", p) if p.starts_with(PARENTS) && p.contains("/helmreleases/") => "parent",
            ("GET", p) if p.starts_with(NAMESPACES) => "namespace",
            ("POST", SAR) => "sar",
            _ => "unexpected",
        })
        .collect()
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
    script_api(facts);
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
    let reads = reads();
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

/// The one judge, as the gate holds it: the oracle's copy of every rule
/// is the crate's own (`Judge::admit`), so this target checks that the HTTP
/// layer and the gate's reads answer what the judge answers for the
/// stand-in's state, and that every allow rests on the reads it needs.
static JUDGE: LazyLock<Judge> = LazyLock::new(|| Judge::new(PROFILE.clone(), WORKER.to_string()));

/// What the stand-in answers for `read`, as the gate's facts; a read the
/// gate did not make (`made` is false: no URI could carry its name) failed.
fn fact(facts: &Facts, read: &Read, made: bool, known: &mut judge::Facts) {
    fn failed<T>(what: &str) -> Result<T, String> {
        Err(format!("{what} not read (the fuzzer's stand-in)"))
    }
    match read {
        Read::Parent { namespace, name } => {
            let got = match (&facts.parent, made) {
                (_, false) | (ParentState::Error, _) => failed("parent"),
                (ParentState::Absent, _) => Ok(None),
                (state, _) => {
                    let (labels, deleting, in_custody) = match state {
                        ParentState::Present { deleting, in_custody } => {
                            (PROFILE.parent.match_labels.clone(), *deleting, *in_custody)
                        }
                        _ => (
                            [("apps.cozystack.io/application.kind".to_string(), "Postgres".to_string())].into(),
                            false,
                            false,
                        ),
                    };
                    Ok(Some(ObjectMetaView {
                        namespace: namespace.clone(),
                        name: name.clone(),
                        labels,
                        annotations: common::annotations(&facts.annotations, &KEYS, "", 0),
                        finalizers: if in_custody { vec![PROFILE.custody_finalizer.clone()] } else { Vec::new() },
                        deleting,
                    }))
                }
            };
            known.parent(namespace, name, got);
        }
        Read::Namespace { name } => {
            let got = match (&facts.namespace, made) {
                (_, false) | (NsState::Error, _) => failed("namespace"),
                (NsState::Live, _) => Ok(false),
                // A namespace that is gone counts as being deleted.
                (NsState::Absent | NsState::Deleting, _) => Ok(true),
            };
            known.namespace(name, got);
        }
        Read::OverrideAccess { namespace, tenant } => {
            let got = match (&facts.sar, made) {
                (_, false) | (SarState::Error, _) => failed("access review"),
                (SarState::Allowed, _) => Ok(Access { allowed: true, reason: String::new() }),
                (SarState::Denied | SarState::AllowedAndDenied, _) => Ok(Access { allowed: false, reason: String::new() }),
            };
            known.access(namespace, tenant, got);
        }
        // No guarded entry of the Cozystack profile follows a reference.
        Read::Referrers { namespace } => known.referrers(namespace, failed("referrers")),
    }
}

fn read_kind(read: &Read) -> &'static str {
    match read {
        Read::Parent { .. } => "parent",
        Read::Namespace { .. } => "namespace",
        Read::OverrideAccess { .. } => "sar",
        Read::Referrers { .. } => "referrers",
    }
}

/// The judge's answer for the stand-in's state at `now`, and the reads it
/// asked for, by kind.
fn judged(facts: &Facts, req: &request::Request, reads: &[&str], now: jiff::Timestamp) -> (Target, Verdict, Vec<&'static str>) {
    let mut known = judge::Facts::default();
    let mut asked = Vec::new();
    for _ in 0..4 {
        match JUDGE.admit(req, &known, now) {
            Admission::Judged(target, verdict) => return (target, verdict, asked),
            Admission::Need(need) => {
                assert!(!need.is_empty(), "the judge asked for nothing");
                for r in need {
                    assert!(!known.has(&r), "the judge asked twice for {r:?}");
                    let kind = read_kind(&r);
                    let made = reads.iter().filter(|k| **k == kind).count() > asked.iter().filter(|k| **k == kind).count();
                    asked.push(kind);
                    fact(facts, &r, made, &mut known);
                }
            }
        }
    }
    panic!("the judge asked for reads in more than 4 rounds: {asked:?}");
}

/// `/validate` answers what the judge answers for the stand-in's state,
/// having read no more than the judge asked for; an allow rests on its
/// reads.
fn check_validate(
    facts: &Facts,
    req: &request::Request,
    allowed: bool,
    warnings: &[&str],
    reads: &[&str],
    now: jiff::Timestamp,
    out: &Value,
) {
    let (target, verdict, asked) = judged(facts, req, reads, now);
    if verdict.allowed() != allowed {
        // The server's clock may have crossed an override stamp's 300 s
        // window after `now`: only then may the two answers differ.
        let (_, later, _) = judged(facts, req, reads, jiff::Timestamp::now());
        assert_eq!(
            later.allowed(),
            allowed,
            "the gate answered allowed={allowed}, the judge {verdict:?} for {target:?} with {facts:?}: reads {reads:?}: {out}"
        );
    }
    let mut made = reads.to_vec();
    let mut wanted = asked.clone();
    made.sort_unstable();
    wanted.sort_unstable();
    for kind in &made {
        let (m, w) = (made.iter().filter(|k| *k == kind).count(), wanted.iter().filter(|k| *k == kind).count());
        assert!(m <= w, "the gate read {kind} {m} times, the judge asked {w}: reads {reads:?}, asked {asked:?}");
    }
    if !allowed {
        return;
    }
    if let Verdict::Allow { reason, .. } = &verdict {
        // What any allow must rest on.
        if !matches!(target, Target::Parent { .. } | Target::Unrelated) && !matches!(*reason, "platform-source-move") {
            assert!(reads.contains(&"parent"), "{target:?} allowed ({reason}) without reading its parent: {reads:?}");
        }
        if *reason == "parent-absent" {
            assert!(!warnings.is_empty(), "an allow without a parent carries a warning: {out}");
        }
        if *reason == "not-in-teardown" {
            assert!(reads.contains(&"namespace"), "allowed 'not in teardown' without reading the namespace: {reads:?}");
        }
        if *reason == "override-authorized" {
            assert!(reads.contains(&"sar"), "an override judged without a SubjectAccessReview: {reads:?}");
        }
    }
}

fn check_mutate(req: &AdmissionRequest<DynamicObject>, body: &[u8], allowed: bool, out: &Value) {
    let kind = request::group_kind(req);
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
