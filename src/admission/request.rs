//! The request model: an admission request and its objects as the rules
//! read them (metadata, a release's placement fields), with the accessors
//! every layer above uses. It depends on nothing of the gate's: the rules
//! ([`super::decide`], [`super::judge`]) are built on it, and the wire
//! format ([`super::review`]) decodes into it.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::core::admission::{AdmissionRequest, Operation};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::profile::GroupKind;

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
    /// Cluster API's references from a Cluster to the objects its cluster
    /// controller deletes with it (`profile::REFERENCE_FIELDS`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub control_plane_ref: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub infrastructure_ref: Option<Value>,
}

impl SpecView {
    /// The spec as a JSON object holding the fields read, for JSON pointers
    /// (`/spec/...`) into it.
    pub fn as_object(&self) -> Value {
        serde_json::json!({ "spec": self })
    }
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
                        "controlPlaneRef" => &mut s.control_plane_ref,
                        "infrastructureRef" => &mut s.infrastructure_ref,
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

/// The parts of ObjectMeta the guards look at.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ObjectMetaView {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub finalizers: Vec<String>,
    pub deleting: bool,
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
