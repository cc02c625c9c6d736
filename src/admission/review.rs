//! AdmissionReview v1 on the wire: strict decoding, and responses that are
//! always well-formed (a patch as base64, as the API requires).

use base64::Engine;
use kube::core::admission::AdmissionReview;
use serde::Serialize;
use serde_json::Value;

use super::decide::Verdict;
use super::request::{Object, Request};

pub const API_VERSION: &str = "admission.k8s.io/v1";
pub const KIND: &str = "AdmissionReview";

/// A review that could not be judged, with the uid when one was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    pub uid: Option<String>,
    pub message: String,
}

/// Decodes an AdmissionReview v1 body into its request.
pub fn decode(body: &[u8]) -> Result<Request, Invalid> {
    // One typed pass for a good review; building a generic tree first costs
    // as much again (`docs/benchmarks.md`), so it is kept for explaining a bad one.
    // serde skips fields it does not model without checking their UTF-8.
    let Ok(text) = std::str::from_utf8(body) else {
        return Err(Invalid {
            uid: None,
            message: "body is not JSON: not valid UTF-8".into(),
        });
    };
    if let Ok(review) = serde_json::from_str::<AdmissionReview<Object>>(text) {
        let well_formed = review.types.api_version == API_VERSION
            && review.types.kind == KIND
            && review.request.as_ref().is_some_and(|r| !r.uid.is_empty());
        if well_formed && let Ok(req) = review.try_into() {
            return Ok(req);
        }
    }
    explain_invalid(body)
}

/// Why a body is not a usable AdmissionReview v1, with its uid if it has one.
fn explain_invalid(body: &[u8]) -> Result<Request, Invalid> {
    let value: Value = serde_json::from_slice(body).map_err(|e| Invalid {
        uid: None,
        message: format!("body is not JSON: {e}"),
    })?;
    let uid = value
        .pointer("/request/uid")
        .and_then(Value::as_str)
        .filter(|u| !u.is_empty())
        .map(str::to_string);
    let invalid = |message: String| Invalid {
        uid: uid.clone(),
        message,
    };
    let api_version = value
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or("");
    let kind = value.get("kind").and_then(Value::as_str).unwrap_or("");
    if api_version != API_VERSION || kind != KIND {
        return Err(invalid(format!(
            "expected apiVersion {API_VERSION} kind {KIND}, got apiVersion {api_version:?} kind {kind:?}: set \
             admissionReviewVersions: [v1] in the webhook configuration"
        )));
    }
    if value.get("request").is_none_or(Value::is_null) {
        return Err(invalid("the AdmissionReview has no request".into()));
    }
    if uid.is_none() {
        return Err(invalid("the AdmissionReview request has no uid".into()));
    }
    let review: AdmissionReview<Object> = serde_json::from_value(value)
        .map_err(|e| invalid(format!("malformed AdmissionReview request: {e}")))?;
    review
        .try_into()
        .map_err(|_| invalid("the AdmissionReview has no request".into()))
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Status {
    #[serde(skip_serializing_if = "Option::is_none")]
    code: Option<u16>,
    #[serde(skip_serializing_if = "String::is_empty")]
    message: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    reason: String,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Response {
    uid: String,
    allowed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<Status>,
    #[serde(skip_serializing_if = "Option::is_none")]
    patch: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    patch_type: Option<&'static str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    warnings: Vec<String>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ReviewOut {
    api_version: &'static str,
    kind: &'static str,
    response: Response,
}

/// The response body for a verdict (and a patch, for an allowed mutation).
pub fn respond(uid: &str, verdict: &Verdict, patch: Option<&json_patch::Patch>) -> Vec<u8> {
    let response = match verdict {
        Verdict::Allow { warnings, .. } => Response {
            uid: uid.to_string(),
            allowed: true,
            status: None,
            patch: patch.filter(|p| !p.0.is_empty()).map(|p| {
                base64::engine::general_purpose::STANDARD
                    .encode(serde_json::to_vec(p).expect("patch serializes"))
            }),
            patch_type: patch.filter(|p| !p.0.is_empty()).map(|_| "JSONPatch"),
            warnings: warnings.iter().map(|w| truncate_warning(w)).collect(),
        },
        Verdict::Deny {
            code,
            message,
            reason,
        } => Response {
            uid: uid.to_string(),
            allowed: false,
            status: Some(Status {
                code: Some(*code),
                message: message.clone(),
                reason: if *code == 403 {
                    "Forbidden".into()
                } else {
                    format!("BadRequest: {reason}")
                },
            }),
            patch: None,
            patch_type: None,
            warnings: Vec::new(),
        },
    };
    serde_json::to_vec(&ReviewOut {
        api_version: API_VERSION,
        kind: KIND,
        response,
    })
    .expect("review serializes")
}

/// Warnings over 256 characters may be dropped by clients; keep them whole.
fn truncate_warning(w: &str) -> String {
    crate::text::shorten(w, 256, "...")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::request::{group_kind, request_name};
    use crate::profile::GroupKind;
    use serde_json::json;

    fn review(request: Value) -> Vec<u8> {
        serde_json::to_vec(&json!({"apiVersion": API_VERSION, "kind": KIND, "request": request}))
            .unwrap()
    }

    fn minimal_request() -> Value {
        json!({
            "uid": "u-1",
            "kind": {"group": "helm.toolkit.fluxcd.io", "version": "v2", "kind": "HelmRelease"},
            "resource": {"group": "helm.toolkit.fluxcd.io", "version": "v2", "resource": "helmreleases"},
            "name": "kubernetes-a-csi", "namespace": "tenant-x", "operation": "DELETE",
            "userInfo": {"username": "alice"},
            "oldObject": {"apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
                          "metadata": {"name": "kubernetes-a-csi", "namespace": "tenant-x"}},
            "dryRun": true
        })
    }

    #[test]
    fn a_v1_review_decodes() {
        let req = decode(&review(minimal_request())).unwrap();
        assert_eq!(req.uid, "u-1");
        assert!(req.dry_run);
        assert_eq!(
            group_kind(&req),
            GroupKind::new("helm.toolkit.fluxcd.io", "HelmRelease")
        );
    }

    #[test]
    fn a_delete_collection_item_is_named_by_its_object() {
        // What the API server sends for each object of a DELETECOLLECTION.
        let mut r = minimal_request();
        r["name"] = json!("");
        let req = decode(&review(r)).unwrap();
        assert_eq!(request_name(&req), "kubernetes-a-csi");
        let mut r = minimal_request();
        r["name"] = json!("");
        r["oldObject"]["metadata"]["name"] = json!("");
        assert_eq!(request_name(&decode(&review(r)).unwrap()), "");
    }

    #[test]
    fn the_objects_are_read_for_their_metadata_fields_only() {
        let mut r = minimal_request();
        r["oldObject"]["metadata"] = json!({
            "name": "kubernetes-a-csi", "namespace": "tenant-x",
            "labels": {"a": "1"}, "annotations": {"b": "2"}, "finalizers": ["f"],
            "deletionTimestamp": "2026-01-01T00:00:00Z",
            "uid": "x", "managedFields": [{"manager": "helm-controller", "fieldsV1": {"f:spec": {}}}],
            "ownerReferences": [], "resourceVersion": "7"
        });
        r["oldObject"]["spec"] = json!({"values": {"deep": [1, {"x": null}]}});
        let req = decode(&review(r)).unwrap();
        let m = &req.old_object.as_ref().unwrap().metadata;
        assert_eq!(m.labels.as_ref().unwrap()["a"], "1");
        assert_eq!(m.annotations.as_ref().unwrap()["b"], "2");
        assert_eq!(m.finalizers.as_deref(), Some(&["f".to_string()][..]));
        assert!(m.deletion_timestamp.is_some());
        // What the decisions do not read is not built.
        assert!(m.uid.is_none() && m.managed_fields.is_none() && m.resource_version.is_none());
    }

    #[test]
    fn a_read_field_of_the_wrong_type_is_a_malformed_review() {
        for (field, bad) in [
            ("labels", json!({"a": 1})),
            ("annotations", json!(["b"])),
            ("finalizers", json!("f")),
            ("name", json!(7)),
            ("deletionTimestamp", json!("yesterday")),
        ] {
            let mut r = minimal_request();
            r["oldObject"]["metadata"][field] = bad;
            let e = decode(&review(r)).unwrap_err();
            assert_eq!(e.uid.as_deref(), Some("u-1"), "{field}");
            assert!(e.message.contains("malformed"), "{field}: {}", e.message);
        }
    }

    #[test]
    fn invalid_utf8_in_an_ignored_field_is_not_json() {
        let mut body = review(minimal_request());
        let at = body.len() - 2; // inside the request object
        let mut field = b",\"x\":\"".to_vec();
        field.push(0xff);
        field.push(b'"');
        body.splice(at..at, field);
        let e = decode(&body).unwrap_err();
        assert!(e.message.contains("not JSON"), "{}", e.message);
    }

    #[test]
    fn non_json_has_no_uid() {
        let e = decode(b"{\"apiVersion\": ").unwrap_err();
        assert_eq!(e.uid, None);
        assert!(e.message.contains("not JSON"), "{}", e.message);
    }

    #[test]
    fn v1beta1_is_refused_with_its_uid() {
        let mut v: Value = serde_json::from_slice(&review(minimal_request())).unwrap();
        v["apiVersion"] = json!("admission.k8s.io/v1beta1");
        let e = decode(&serde_json::to_vec(&v).unwrap()).unwrap_err();
        assert_eq!(e.uid.as_deref(), Some("u-1"));
        assert!(
            e.message.contains("admissionReviewVersions"),
            "{}",
            e.message
        );
    }

    #[test]
    fn a_missing_uid_is_named() {
        let mut r = minimal_request();
        r.as_object_mut().unwrap().remove("uid");
        let e = decode(&review(r)).unwrap_err();
        assert!(e.message.contains("no uid"), "{}", e.message);
    }

    #[test]
    fn a_malformed_request_keeps_its_uid() {
        let mut r = minimal_request();
        r["operation"] = json!("EXPLODE");
        let e = decode(&review(r)).unwrap_err();
        assert_eq!(e.uid.as_deref(), Some("u-1"));
        assert!(e.message.contains("malformed"), "{}", e.message);
    }

    #[test]
    fn a_patch_is_base64_not_a_number_array() {
        let patch: json_patch::Patch =
            serde_json::from_value(json!([{"op": "add", "path": "/a", "value": 1}])).unwrap();
        let body = respond("u", &Verdict::allow("x"), Some(&patch));
        let v: Value = serde_json::from_slice(&body).unwrap();
        let text = v["response"]["patch"].as_str().expect("patch is a string");
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(text)
            .unwrap();
        assert_eq!(
            serde_json::from_slice::<Value>(&decoded).unwrap(),
            json!([{"op": "add", "path": "/a", "value": 1}])
        );
        assert_eq!(v["response"]["patchType"], "JSONPatch");
    }

    #[test]
    fn a_denial_carries_code_and_message() {
        let body = respond(
            "u",
            &Verdict::Deny {
                reason: "r",
                code: 403,
                message: "no".into(),
            },
            None,
        );
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["response"]["allowed"], false);
        assert_eq!(v["response"]["status"]["code"], 403);
        assert_eq!(v["response"]["status"]["message"], "no");
        assert_eq!(v["apiVersion"], API_VERSION);
    }
}
