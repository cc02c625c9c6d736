//! AdmissionReview v1 on the wire: strict decoding, and responses that are
//! always well-formed (a patch as base64, as the API requires).

use std::collections::BTreeMap;

use std::borrow::Cow;

use base64::Engine;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::core::admission::{AdmissionRequest, AdmissionReview, Operation};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::decide::{ObjectMetaView, Verdict};
use crate::profile::GroupKind;

pub const API_VERSION: &str = "admission.k8s.io/v1";
pub const KIND: &str = "AdmissionReview";

/// An object of a review as the decisions see it: the metadata fields they
/// read (name, namespace, labels, annotations, finalizers, whether it is
/// being deleted) and a release's placement fields ([`SpecView`]), nothing
/// else. The API server sends whole objects (spec,
/// status, values, managedFields: up to megabytes); serde skips every other
/// key as [`serde::de::IgnoredAny`], which still checks that what it skips
/// is well-formed JSON, so a malformed review is refused as before
/// (`docs/benchmarks.md`, benchmark 1, for what each field costs).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Object {
    pub metadata: ObjectMeta,
    /// The spec fields that decide where a Flux HelmRelease installs and
    /// when its controller uninstalls it (`decide::flux`); empty for other
    /// kinds.
    #[serde(skip_serializing_if = "SpecView::is_empty")]
    pub spec: SpecView,
}

/// The spec fields the decisions read, as sent: a Flux HelmRelease's
/// placement (`decide::flux`) and Cluster API's `clusterName`; every other
/// key (values above all, up to megabytes) is skipped unread. Any JSON is accepted: a `spec` that is not an object (another
/// kind's) has none of them.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SpecView {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub release_name: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_namespace: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub storage_namespace: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chart: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chart_ref: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kube_config: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub install: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upgrade: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub test: Option<Value>,
    /// Cluster API's link from a machine to its cluster
    /// (`profile::CLUSTER_NAME_FIELD`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster_name: Option<Value>,
}

impl SpecView {
    pub fn is_empty(&self) -> bool {
        *self == SpecView::default()
    }
}

impl<'de> Deserialize<'de> for SpecView {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};

        struct Fields;
        impl<'de> Visitor<'de> for Fields {
            type Value = SpecView;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<SpecView, A::Error> {
                let mut s = SpecView::default();
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    let slot = match key.as_ref() {
                        "releaseName" => &mut s.release_name,
                        "targetNamespace" => &mut s.target_namespace,
                        "storageNamespace" => &mut s.storage_namespace,
                        "chart" => &mut s.chart,
                        "chartRef" => &mut s.chart_ref,
                        "kubeConfig" => &mut s.kube_config,
                        "install" => &mut s.install,
                        "upgrade" => &mut s.upgrade,
                        "test" => &mut s.test,
                        "clusterName" => &mut s.cluster_name,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                            continue;
                        }
                    };
                    *slot = Some(map.next_value()?);
                }
                Ok(s)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<SpecView, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(SpecView::default())
            }
            fn visit_bool<E>(self, _: bool) -> Result<SpecView, E> {
                Ok(SpecView::default())
            }
            fn visit_i64<E>(self, _: i64) -> Result<SpecView, E> {
                Ok(SpecView::default())
            }
            fn visit_u64<E>(self, _: u64) -> Result<SpecView, E> {
                Ok(SpecView::default())
            }
            fn visit_f64<E>(self, _: f64) -> Result<SpecView, E> {
                Ok(SpecView::default())
            }
            fn visit_str<E>(self, _: &str) -> Result<SpecView, E> {
                Ok(SpecView::default())
            }
            fn visit_unit<E>(self) -> Result<SpecView, E> {
                Ok(SpecView::default())
            }
        }
        d.deserialize_any(Fields)
    }
}

impl<'de> Deserialize<'de> for Object {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

        // Keys not named here (apiVersion, kind, status, most of spec, and
        // in the metadata uid, managedFields, ...) are skipped; of an owner
        // reference only what names the owner is kept.
        #[derive(Deserialize)]
        struct Wire {
            #[serde(default)]
            metadata: Meta,
            #[serde(default)]
            spec: SpecView,
        }
        #[derive(Default, Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Meta {
            #[serde(default)]
            name: Option<String>,
            #[serde(default)]
            namespace: Option<String>,
            #[serde(default)]
            labels: Option<BTreeMap<String, String>>,
            #[serde(default)]
            annotations: Option<BTreeMap<String, String>>,
            #[serde(default)]
            finalizers: Option<Vec<String>>,
            // Still parsed as a time: a malformed one is a malformed review.
            #[serde(default)]
            deletion_timestamp: Option<Time>,
            #[serde(default)]
            owner_references: Option<Vec<Owner>>,
        }
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Owner {
            #[serde(default)]
            api_version: String,
            #[serde(default)]
            kind: String,
            #[serde(default)]
            name: String,
        }
        let Wire { metadata: m, spec } = Wire::deserialize(d)?;
        Ok(Object {
            metadata: ObjectMeta {
                name: m.name,
                namespace: m.namespace,
                labels: m.labels,
                annotations: m.annotations,
                finalizers: m.finalizers,
                deletion_timestamp: m.deletion_timestamp,
                owner_references: m.owner_references.map(|owners| {
                    owners
                        .into_iter()
                        .map(|o| OwnerReference {
                            api_version: o.api_version,
                            kind: o.kind,
                            name: o.name,
                            ..OwnerReference::default()
                        })
                        .collect()
                }),
                ..ObjectMeta::default()
            },
            spec,
        })
    }
}

impl kube::Resource for Object {
    type DynamicType = ();
    type Scope = kube::core::DynamicResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }
    fn group(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }
    fn version(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }
    fn plural(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// An admission request, its objects reduced to their metadata.
pub type Request = AdmissionRequest<Object>;

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

pub fn operation_name(op: &Operation) -> &'static str {
    match op {
        Operation::Create => "CREATE",
        Operation::Update => "UPDATE",
        Operation::Delete => "DELETE",
        Operation::Connect => "CONNECT",
    }
}

pub fn group_kind(req: &Request) -> GroupKind {
    GroupKind::new(&req.kind.group, &req.kind.kind)
}

/// The name of the object a request is about. A DELETECOLLECTION (what the
/// namespace controller and `kubectl delete --all` send) is reviewed once per
/// object with an empty `name`: the object's own name is then the only one.
pub fn request_name(req: &Request) -> &str {
    if !req.name.is_empty() {
        return &req.name;
    }
    [req.old_object.as_ref(), req.object.as_ref()]
        .into_iter()
        .flatten()
        .find_map(|o| o.metadata.name.as_deref().filter(|n| !n.is_empty()))
        .unwrap_or("")
}

/// The metadata the decisions use, from a request object.
pub fn meta_view(obj: &Object, fallback_namespace: &str, fallback_name: &str) -> ObjectMetaView {
    let m = &obj.metadata;
    ObjectMetaView {
        namespace: m
            .namespace
            .clone()
            .unwrap_or_else(|| fallback_namespace.to_string()),
        name: m
            .name
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| fallback_name.to_string()),
        labels: m.labels.clone().unwrap_or_default(),
        annotations: m.annotations.clone().unwrap_or_default(),
        finalizers: m.finalizers.clone().unwrap_or_default(),
        deleting: m.deletion_timestamp.is_some(),
    }
}

pub fn labels_of(obj: Option<&Object>) -> BTreeMap<String, String> {
    obj.and_then(|o| o.metadata.labels.clone())
        .unwrap_or_default()
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
