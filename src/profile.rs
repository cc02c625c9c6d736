//! The platform profile: the one place that knows a platform's names.
//!
//! Everything volume-gate needs to recognise a tenant, its children and the
//! objects its CSI driver depends on lives here, with Cozystack as the
//! built-in default. Another platform supplies its own YAML file
//! (`--profile FILE`); a field it leaves out keeps the Cozystack value.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// An API group and kind, as the admission request names them.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GroupKind {
    /// Empty for the core group.
    #[serde(default)]
    pub group: String,
    pub kind: String,
}

impl GroupKind {
    pub fn new(group: &str, kind: &str) -> Self {
        Self {
            group: group.to_string(),
            kind: kind.to_string(),
        }
    }
}

impl std::fmt::Display for GroupKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.group.is_empty() {
            write!(f, "{}", self.kind)
        } else {
            write!(f, "{}.{}", self.kind, self.group)
        }
    }
}

/// How the parent release of a tenant is recognised.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ParentSpec {
    pub group: String,
    pub version: String,
    pub kind: String,
    /// Plural resource name, for API paths and RBAC.
    pub plural: String,
    /// Every one of these labels must be present with this value.
    pub match_labels: BTreeMap<String, String>,
    /// What every parent's name starts with (Cozystack: `kubernetes-<name>`).
    /// The gate recognises parents by their labels; the shipped webhook
    /// conditions use this to send it only objects of tenant releases.
    #[serde(default)]
    pub name_prefix: String,
    /// The annotation that asks the parent's controller to reconcile now
    /// (Flux: `reconcile.fluxcd.io/requestedAt`, what `flux reconcile`
    /// writes). The worker sets it with `Released` and `Overridden`, so the
    /// uninstall the gate made fail is retried at once instead of after
    /// Flux's backoff (up to 15 minutes). Empty: never written.
    #[serde(default = "flux_reconcile_request")]
    pub reconcile_request_annotation: String,
    /// Where the platform shows a parent's annotations to the tenant's
    /// owner: Cozystack's Application API shows only those whose key starts
    /// with `apps.cozystack.io-`, that prefix removed
    /// (`pkg/registry/apps/application/rest.go`). The worker mirrors the
    /// record's phase, message and release time there (`apps.cozystack.io-
    /// volumes.cozystack.io/phase` shows as `volumes.cozystack.io/phase` on
    /// the Kubernetes application). A mirror for reading only: the gate
    /// never reads it. Empty: no mirror.
    #[serde(default = "cozystack_visible_prefix")]
    pub visible_annotation_prefix: String,
}

fn cozystack_visible_prefix() -> String {
    "apps.cozystack.io-".into()
}

fn flux_reconcile_request() -> String {
    "reconcile.fluxcd.io/requestedAt".into()
}

/// Who the platform's controllers are, by the usernames their requests
/// carry: the gate judges some writes by who makes them (`docs/census.md`).
/// The defaults are Cozystack's, read from its release (v1.6.2); a platform
/// that runs them under other identities says so here (the chart's
/// `platform` values), or the gate refuses their everyday work.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Writers {
    /// The controller that reconciles the releases (Flux's helm-controller).
    /// It alone writes a release's status, which it trusts (a current
    /// release rewritten there by anyone else makes it uninstall:
    /// `decide::flux`), and it applies a parent release's children, so a
    /// child's chart source moved by it, on an object its parent release
    /// owns, is the parent chart's own upgrade. Cozystack runs every
    /// helm-controller (the Deployment `flux` and the flux-shard-operator's
    /// `helm-controller-shard<i>`) as ServiceAccount `cozy-fluxcd/flux`
    /// (`internal/fluxinstall/manifests/fluxcd.yaml`,
    /// `internal/fluxshardoperator/provisioner.go`).
    pub release_controllers: Vec<String>,
    /// Who sets a parent's chart source in a platform upgrade: Cozystack's
    /// cozystack-controller rewrites `spec.chartRef` from the
    /// ApplicationDefinition (`ApplicationDefinitionHelmReconciler`), and
    /// cozystack-api writes it from the same definition on every
    /// Application write. Neither takes it from a namespace editor.
    pub parent_sources: Vec<String>,
    /// Who replaces a parent whole, dropping what it does not know:
    /// cozystack-api rebuilds the HelmRelease from the Application on every
    /// update (`pkg/registry/apps/application/rest.go`), keeping only its
    /// resourceVersion and shard label. The mutating webhook carries the
    /// record, the override and the custody finalizer over from the stored
    /// object for these writers; anyone else who drops them is refused.
    pub parent_replacers: Vec<String>,
}

impl Default for Writers {
    fn default() -> Self {
        Self::cozystack()
    }
}

impl Writers {
    /// Cozystack v1.6.2's (`docs/census.md` cites each).
    pub fn cozystack() -> Self {
        let sa = |ns: &str, name: &str| format!("system:serviceaccount:{ns}:{name}");
        Self {
            release_controllers: vec![sa("cozy-fluxcd", "flux")],
            parent_sources: vec![
                sa("cozy-system", "cozystack-controller"),
                sa("cozy-system", "cozystack-api"),
            ],
            parent_replacers: vec![sa("cozy-system", "cozystack-api")],
        }
    }

    pub fn is_release_controller(&self, username: &str) -> bool {
        self.release_controllers.iter().any(|c| c == username)
    }

    pub fn sets_parent_sources(&self, username: &str) -> bool {
        self.parent_sources.iter().any(|c| c == username)
    }

    pub fn replaces_parents(&self, username: &str) -> bool {
        self.parent_replacers.iter().any(|c| c == username)
    }

    /// Every identity named, for checks that the shipped configuration
    /// names the same.
    pub fn all(&self) -> impl Iterator<Item = &String> {
        self.release_controllers
            .iter()
            .chain(&self.parent_sources)
            .chain(&self.parent_replacers)
    }

    fn validate(&self) -> Result<(), String> {
        if self.release_controllers.is_empty() {
            return Err(
                "writers.releaseControllers is empty: every release status write would be refused (Cozystack: \
                 system:serviceaccount:cozy-fluxcd:flux)"
                    .into(),
            );
        }
        self.validate_names()
    }

    /// Every name a username, on a platform with or without releases.
    fn validate_names(&self) -> Result<(), String> {
        match self
            .all()
            .find(|u| u.trim().is_empty() || u.trim() != u.as_str())
        {
            Some(u) => Err(format!(
                "writers: {u:?} is not a username (system:serviceaccount:<namespace>:<name>, or a user's name)"
            )),
            None => Ok(()),
        }
    }
}

/// How a guarded dependency names the tenant it belongs to.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GuardedSpec {
    /// What it is, in a deny message ("the tenant's control plane").
    pub role: String,
    #[serde(default)]
    pub group: String,
    pub kind: String,
    /// A name pattern in which `{tenant}` stands for the parent's name,
    /// e.g. `{tenant}-admin-kubeconfig`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A label whose value is the parent's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// A field of the object whose value is the parent's name, as a JSON
    /// pointer; the gate reads [`CLUSTER_NAME_FIELD`] (Cluster API's link
    /// from a machine to its cluster, which its controllers act on and its
    /// webhooks keep immutable, where a label can be removed first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// A field of the parent, as a JSON pointer, that names the guarded
    /// object (`{apiGroup, kind, name}`, Cluster API's v1beta2 reference,
    /// or `{apiVersion, kind, name}`, its v1beta1 one): Cluster API's
    /// `spec.controlPlaneRef` and `spec.infrastructureRef`, which its
    /// cluster controller follows to delete them. The object is the
    /// tenant's because the parent names it, whatever the object's own
    /// labels, owners or name say (a namespace's editor writes those).
    #[serde(default, rename = "ref", skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
}

/// Cluster API's `spec.clusterName`, the one field a guarded entry may name.
pub const CLUSTER_NAME_FIELD: &str = "/spec/clusterName";

/// The fields of a parent a guarded entry may follow by `ref`: Cluster
/// API's references to the control plane and the infrastructure cluster,
/// which its cluster controller deletes, in that order, after the machines
/// (`core/reconcilers/cluster/cluster_controller.go`, `reconcileDelete`,
/// v1.14.2). The gate reads only these fields of a request's spec.
pub const REFERENCE_FIELDS: [&str; 2] = ["/spec/controlPlaneRef", "/spec/infrastructureRef"];

/// Flux's HelmRelease: the kind of a tenant's child releases and its CSI
/// release (their rules, `decide::flux`, are helm-controller's), and of
/// Cozystack's parents.
pub fn flux_release_kind() -> GroupKind {
    GroupKind::new("helm.toolkit.fluxcd.io", "HelmRelease")
}

/// Where a parent's field names another object: `(group, kind, name)`
/// from a Cluster API reference, v1beta2 (`apiGroup`) or v1beta1
/// (`apiVersion`). `None` when the field is absent or incomplete.
pub fn reference_at(object: &serde_json::Value, pointer: &str) -> Option<(String, String, String)> {
    let r = object.pointer(pointer)?;
    let text = |k: &str| r.get(k).and_then(serde_json::Value::as_str);
    let group = match (text("apiGroup"), text("apiVersion")) {
        (Some(g), _) => g.to_string(),
        (None, Some(v)) => v.rsplit_once('/').map_or("", |(g, _)| g).to_string(),
        (None, None) => return None,
    };
    let (kind, name) = (text("kind")?, text("name")?);
    (!kind.is_empty() && !name.is_empty()).then(|| (group, kind.to_string(), name.to_string()))
}

/// How an object is known as part of a parent release: what Helm deletes on
/// uninstall. Helm's ownership annotations name the release and its
/// namespace; helm-controller also labels what it installs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReleaseSpec {
    pub name_annotation: String,
    pub namespace_annotation: String,
    pub name_label: String,
    pub namespace_label: String,
    /// Names (each with `{tenant}` once, any kind) of the parent chart's
    /// teardown hook objects: Helm creates them for every uninstall attempt
    /// and deletes them around it by their delete policies, and the driver
    /// needs none of them, so they are not held. Known by name, which no
    /// one can change, never by an annotation a tenant's editor could add.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<String>,
}

/// Where the worker finds the tenant's admin kubeconfig.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KubeconfigSpec {
    /// Secret name pattern, `{tenant}` standing for the parent's name.
    pub secret_name: String,
    /// Keys tried in order; the first present one is used.
    pub keys: Vec<String>,
}

/// Who may record an override: a SubjectAccessReview for this verb on this
/// resource must allow the requester.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OverridePermission {
    pub group: String,
    pub resource: String,
    pub verb: String,
}

/// The infra layer: where the disk behind a tenant volume lives in the
/// management cluster. In Cozystack the tenant's KubeVirt CSI controller
/// makes one CDI DataVolume per tenant volume in the tenant's namespace,
/// named by the volumeHandle and labelled from `--infra-cluster-labels`;
/// CDI makes a PVC of the same name, and the disk is that PVC's PV. The
/// phase counts a tenant `Released` only when both layers are gone, and
/// reads this layer alone when the tenant API cannot be reached.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InfraSpec {
    pub group: String,
    pub version: String,
    pub kind: String,
    /// Plural resource name, for API paths and RBAC.
    pub plural: String,
    /// Labels every infra object of a tenant carries, `{tenant}` standing
    /// for the parent's name (Cozystack:
    /// `cluster.x-k8s.io/cluster-name: "{tenant}"`).
    pub labels: BTreeMap<String, String>,
    /// How a tenant PV's volumeHandle names its infra object in the
    /// tenant's namespace: a pattern with `{name}` once (Cozystack:
    /// `"{name}"`, the handle is the DataVolume's name). The object's PVC
    /// has the same name.
    #[serde(default = "handle_is_name")]
    pub handle: String,
}

pub const NAME_PLACEHOLDER: &str = "{name}";

fn handle_is_name() -> String {
    NAME_PLACEHOLDER.into()
}

impl InfraSpec {
    /// Cozystack's: CDI DataVolumes made by kubevirt-csi-driver.
    pub fn cozystack() -> Self {
        Self {
            group: "cdi.kubevirt.io".into(),
            version: "v1beta1".into(),
            kind: "DataVolume".into(),
            plural: "datavolumes".into(),
            labels: BTreeMap::from([(
                "cluster.x-k8s.io/cluster-name".into(),
                TENANT_PLACEHOLDER.into(),
            )]),
            handle: handle_is_name(),
        }
    }

    pub fn resource(&self) -> kube::api::ApiResource {
        kube::api::ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk(&self.group, &self.version, &self.kind),
            &self.plural,
        )
    }

    /// The labels of `tenant`'s infra objects.
    pub fn labels_of(&self, tenant: &str) -> BTreeMap<String, String> {
        self.labels
            .iter()
            .map(|(k, v)| (k.clone(), v.replace(TENANT_PLACEHOLDER, tenant)))
            .collect()
    }

    /// `tenant`'s infra labels as a label selector (`k=v,...`), for list
    /// calls and messages.
    pub fn selector_of(&self, tenant: &str) -> String {
        self.labels_of(tenant)
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Whether `labels` carry every one of `tenant`'s infra labels.
    pub fn is_tenants(&self, labels: &BTreeMap<String, String>, tenant: &str) -> bool {
        self.labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(&v.replace(TENANT_PLACEHOLDER, tenant)))
    }

    /// The infra object a volumeHandle names, if the pattern fits it and
    /// the rest is a valid object name.
    pub fn object_of(&self, handle: &str) -> Option<String> {
        let (prefix, suffix) = self.handle.split_once(NAME_PLACEHOLDER)?;
        let name = handle.strip_prefix(prefix)?.strip_suffix(suffix)?;
        crate::names::is_subdomain(name).then(|| name.to_string())
    }

    fn validate(&self) -> Result<(), String> {
        if self.kind.is_empty() || self.plural.is_empty() || self.version.is_empty() {
            return Err("infra needs group, version, kind and plural".into());
        }
        if self.labels.is_empty() || !self.labels.values().any(|v| v.contains(TENANT_PLACEHOLDER)) {
            return Err(format!(
                "infra.labels must name the tenant: at least one value containing {TENANT_PLACEHOLDER} \
                 (Cozystack: cluster.x-k8s.io/cluster-name: \"{TENANT_PLACEHOLDER}\"); leave infra out \
                 (infra: null) on a platform without an infra layer"
            ));
        }
        if self.handle.matches(NAME_PLACEHOLDER).count() != 1 {
            return Err(format!(
                "infra.handle {:?} must contain {NAME_PLACEHOLDER} exactly once",
                self.handle
            ));
        }
        Ok(())
    }
}

/// Where the management side records each tenant's control plane
/// (Kamaji's TenantControlPlane, named like the parent). The worker binds a
/// tenant only to the API server this record says runs it: its endpoint, or
/// its Service in the tenant's own namespace, never simply wherever the
/// admin kubeconfig Secret points.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ControlPlaneSpec {
    pub group: String,
    pub version: String,
    pub kind: String,
    pub plural: String,
    /// Its name, `{tenant}` standing for the parent's name.
    pub name: String,
    /// A JSON pointer to its endpoint in the object: a `host:port` string
    /// (Kamaji: `/status/controlPlaneEndpoint`) or a `{host, port}` object
    /// (Cluster API: the Cluster's `/spec/controlPlaneEndpoint`).
    pub endpoint: String,
    /// The in-cluster name of the Service in front of it, `{tenant}` and
    /// `{namespace}` standing for the parent's (Kamaji's `super-admin.svc`
    /// kubeconfig uses it); none where the kubeconfig names the endpoint
    /// itself (Cluster API's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
}

impl ControlPlaneSpec {
    /// Kamaji's TenantControlPlane.
    pub fn kamaji() -> Self {
        Self {
            group: "kamaji.clastix.io".into(),
            version: "v1alpha1".into(),
            kind: "TenantControlPlane".into(),
            plural: "tenantcontrolplanes".into(),
            name: TENANT_PLACEHOLDER.into(),
            endpoint: "/status/controlPlaneEndpoint".into(),
            service: Some(format!("{TENANT_PLACEHOLDER}.{NAMESPACE_PLACEHOLDER}.svc")),
        }
    }

    /// Cluster API's own record: the Cluster's `spec.controlPlaneEndpoint`,
    /// which the infrastructure provider sets and Cluster API's webhook
    /// keeps from changing once set (`internal/webhooks/cluster.go`,
    /// v1.14.2).
    pub fn cluster_api() -> Self {
        Self {
            group: "cluster.x-k8s.io".into(),
            version: "v1beta2".into(),
            kind: "Cluster".into(),
            plural: "clusters".into(),
            name: TENANT_PLACEHOLDER.into(),
            endpoint: "/spec/controlPlaneEndpoint".into(),
            service: None,
        }
    }

    /// The endpoint the object records, as `host:port`: a string as it
    /// is, a `{host, port}` object joined (an IPv6 host bracketed); none
    /// while it is empty.
    pub fn endpoint_in(&self, object: &serde_json::Value) -> Option<String> {
        let e = object.pointer(&self.endpoint)?;
        let joined = match e {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Object(o) => {
                let host = o.get("host").and_then(serde_json::Value::as_str)?;
                let port = o.get("port").and_then(serde_json::Value::as_u64)?;
                if host.contains(':') && !host.starts_with('[') {
                    format!("[{host}]:{port}")
                } else {
                    format!("{host}:{port}")
                }
            }
            _ => return None,
        };
        (!joined.is_empty() && !joined.starts_with(':')).then_some(joined)
    }

    pub fn resource(&self) -> kube::api::ApiResource {
        kube::api::ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk(&self.group, &self.version, &self.kind),
            &self.plural,
        )
    }

    pub fn name_of(&self, tenant: &str) -> String {
        self.name.replace(TENANT_PLACEHOLDER, tenant)
    }

    pub fn service_of(&self, namespace: &str, tenant: &str) -> Option<String> {
        self.service.as_ref().map(|s| {
            s.replace(TENANT_PLACEHOLDER, tenant)
                .replace(NAMESPACE_PLACEHOLDER, namespace)
        })
    }

    fn validate(&self) -> Result<(), String> {
        if self.kind.is_empty() || self.plural.is_empty() || self.version.is_empty() {
            return Err("controlPlane needs group, version, kind and plural".into());
        }
        if self.name.matches(TENANT_PLACEHOLDER).count() != 1
            || self
                .service
                .as_ref()
                .is_some_and(|s| !s.contains(TENANT_PLACEHOLDER))
        {
            return Err(format!(
                "controlPlane.name must contain {TENANT_PLACEHOLDER} once, and controlPlane.service, if set, at least once"
            ));
        }
        if !self.endpoint.starts_with('/') {
            return Err(format!(
                "controlPlane.endpoint {:?} must be a JSON pointer such as /status/controlPlaneEndpoint",
                self.endpoint
            ));
        }
        Ok(())
    }
}

pub const NAMESPACE_PLACEHOLDER: &str = "{namespace}";

/// A guarded entry's kind that, with `ref`, stands for any kind of its
/// group: the parent's reference names the kind (Cluster API's control
/// plane and infrastructure providers each have their own).
pub const ANY_KIND: &str = "*";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Profile {
    /// A name for logs and `status`.
    pub name: String,
    /// Prefix of the record's annotation keys, ending in `/`.
    pub annotation_prefix: String,
    /// The custody finalizer on every parent.
    pub custody_finalizer: String,
    pub parent: ParentSpec,
    /// Label on each child release (a Flux HelmRelease) whose value is the
    /// parent's name; none on a platform whose tenants have no child
    /// releases so labelled (a child that installs into the tenant with its
    /// kubeconfig Secret is known by that, `spec.kubeConfig`, either way).
    pub child_label: Option<String>,
    /// Name pattern of the CSI driver's release (a Flux HelmRelease in the
    /// parent's namespace); none where the driver is not installed by one
    /// (inside the tenant, held by holding its machines, or a
    /// management-side Deployment named in `guarded`).
    pub csi_release: Option<String>,
    pub kubeconfig: KubeconfigSpec,
    pub guarded: Vec<GuardedSpec>,
    /// Objects of a parent release are guarded during teardown: the CSI
    /// controller's identity (its ServiceAccount and RBAC) goes with it.
    /// None where the parent is no Helm release (a Cluster API Cluster).
    pub release: Option<ReleaseSpec>,
    pub override_permission: OverridePermission,
    /// The infra layer behind tenant volumes; `null` on a platform whose
    /// tenant volumes have none (the phase then reads the tenant API only).
    pub infra: Option<InfraSpec>,
    /// The management side's record of each tenant's control plane; `null`
    /// on a platform without one (a tenant is then bound to the cluster
    /// its admin kubeconfig first reaches).
    pub control_plane: Option<ControlPlaneSpec>,
    /// Who the platform's controllers are.
    pub writers: Writers,
}

pub const TENANT_PLACEHOLDER: &str = "{tenant}";

/// The label that opts a Cluster API `Cluster` into volume-gate's custody
/// under [`Profile::cluster_api`]: the operator sets it (`"true"`); once
/// the Cluster is in custody, removing it is refused like any parent label.
pub const CLUSTER_API_OPT_IN: &str = "volumes.cozystack.io/protected";

impl Default for Profile {
    fn default() -> Self {
        Self::cozystack()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("cannot read profile file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("profile file {path} is not valid YAML for a profile: {message}")]
    Parse { path: String, message: String },
    #[error("profile {path}: {message}")]
    Invalid { path: String, message: String },
}

impl Profile {
    /// The Cozystack profile (`docs/design.md` §1).
    pub fn cozystack() -> Self {
        let guarded =
            |role: &str, group: &str, kind: &str, name: Option<&str>, label: Option<&str>| {
                GuardedSpec {
                    role: role.to_string(),
                    group: group.to_string(),
                    kind: kind.to_string(),
                    name: name.map(str::to_string),
                    label: label.map(str::to_string),
                    field: None,
                    reference: None,
                }
            };
        let by_cluster_name = |kind: &str| GuardedSpec {
            role: "the tenant's worker machines, which run the driver".into(),
            group: "cluster.x-k8s.io".into(),
            kind: kind.into(),
            name: None,
            label: None,
            field: Some(CLUSTER_NAME_FIELD.into()),
            reference: None,
        };
        const CAPI_LABEL: &str = "cluster.x-k8s.io/cluster-name";
        const KCSI: &str = "{tenant}-kcsi";
        Self {
            name: "cozystack".into(),
            annotation_prefix: "volumes.cozystack.io/".into(),
            custody_finalizer: "volumes.cozystack.io/release".into(),
            parent: ParentSpec {
                group: "helm.toolkit.fluxcd.io".into(),
                version: "v2".into(),
                kind: "HelmRelease".into(),
                plural: "helmreleases".into(),
                // Not sharding.fluxcd.io/key: another webhook rewrites it.
                match_labels: BTreeMap::from([
                    (
                        "apps.cozystack.io/application.kind".into(),
                        "Kubernetes".into(),
                    ),
                    (
                        "apps.cozystack.io/application.group".into(),
                        "apps.cozystack.io".into(),
                    ),
                ]),
                name_prefix: "kubernetes-".into(),
                reconcile_request_annotation: flux_reconcile_request(),
                visible_annotation_prefix: cozystack_visible_prefix(),
            },
            child_label: Some("cozystack.io/target-cluster-name".into()),
            csi_release: Some("{tenant}-csi".into()),
            kubeconfig: KubeconfigSpec {
                secret_name: "{tenant}-admin-kubeconfig".into(),
                keys: vec!["super-admin.svc".into(), "super-admin.conf".into()],
            },
            guarded: vec![
                guarded(
                    "the tenant's control plane",
                    "controlplane.cluster.x-k8s.io",
                    "KamajiControlPlane",
                    Some("{tenant}"),
                    None,
                ),
                guarded(
                    "the tenant's API server",
                    "kamaji.clastix.io",
                    "TenantControlPlane",
                    Some("{tenant}"),
                    None,
                ),
                guarded(
                    "the tenant's Cluster API cluster",
                    "cluster.x-k8s.io",
                    "Cluster",
                    Some("{tenant}"),
                    None,
                ),
                guarded(
                    "the tenant's Cluster API cluster",
                    "cluster.x-k8s.io",
                    "Cluster",
                    None,
                    Some(CAPI_LABEL),
                ),
                guarded(
                    "the tenant's worker machines, which run the driver",
                    "cluster.x-k8s.io",
                    "MachineDeployment",
                    None,
                    Some(CAPI_LABEL),
                ),
                guarded(
                    "the tenant's worker machines, which run the driver",
                    "cluster.x-k8s.io",
                    "Machine",
                    None,
                    Some(CAPI_LABEL),
                ),
                // And by the field Cluster API itself acts on: the label
                // can be removed before the teardown, the field cannot.
                by_cluster_name("MachineDeployment"),
                by_cluster_name("Machine"),
                guarded(
                    "the tenant's admin kubeconfig, which the release phase needs",
                    "",
                    "Secret",
                    Some("{tenant}-admin-kubeconfig"),
                    None,
                ),
                guarded(
                    "the tenant's CSI controller (KubeVirt path)",
                    "apps",
                    "Deployment",
                    Some("{tenant}-kcsi-controller"),
                    None,
                ),
                // Its identity, by name too: Helm's markers on them can be
                // removed before the teardown, a name cannot.
                guarded(
                    "the identity the tenant's CSI controller frees disks with",
                    "",
                    "ServiceAccount",
                    Some(KCSI),
                    None,
                ),
                guarded(
                    "the identity the tenant's CSI controller frees disks with",
                    "rbac.authorization.k8s.io",
                    "Role",
                    Some(KCSI),
                    None,
                ),
                guarded(
                    "the identity the tenant's CSI controller frees disks with",
                    "rbac.authorization.k8s.io",
                    "RoleBinding",
                    Some(KCSI),
                    None,
                ),
            ],
            release: Some(ReleaseSpec {
                name_annotation: "meta.helm.sh/release-name".into(),
                namespace_annotation: "meta.helm.sh/release-namespace".into(),
                name_label: "helm.toolkit.fluxcd.io/name".into(),
                namespace_label: "helm.toolkit.fluxcd.io/namespace".into(),
                // The pre-delete hook's ServiceAccount, Role and RoleBinding,
                // and its Job.
                hooks: vec!["{tenant}-cleanup".into(), "{tenant}-pre-cleanup".into()],
            }),
            override_permission: OverridePermission {
                group: "volumes.cozystack.io".into(),
                resource: "tenants".into(),
                verb: "override".into(),
            },
            infra: Some(InfraSpec::cozystack()),
            control_plane: Some(ControlPlaneSpec::kamaji()),
            writers: Writers::cozystack(),
        }
    }

    /// A plain Cluster API platform (`docs/cluster-api.md`): a parent is a
    /// `Cluster` the operator opts in with the label
    /// [`CLUSTER_API_OPT_IN`]; its machines (by `spec.clusterName` and
    /// Cluster API's cluster-name label), the control plane and
    /// infrastructure objects its references name, and its kubeconfig
    /// Secret are held until its volumes are released. Every name is
    /// Cluster API's own (v1.14.2): the kubeconfig Secret `<cluster>-kubeconfig`
    /// with the key `value` (`util/secret/consts.go`, `secret.go`), the
    /// label `cluster.x-k8s.io/cluster-name` (`api/core/v1beta2/common_types.go`).
    /// Where the platform's CSI controller runs management-side or is
    /// installed by a Flux HelmRelease, the operator's profile file names
    /// it (`guarded`, `csiRelease`); by default the driver runs inside the
    /// cluster, on the machines held here.
    pub fn cluster_api() -> Self {
        let by = |role: &str, group: &str, kind: &str| GuardedSpec {
            role: role.to_string(),
            group: group.to_string(),
            kind: kind.to_string(),
            name: None,
            label: None,
            field: None,
            reference: None,
        };
        const MACHINES: &str =
            "the cluster's machines, which run the CSI driver and the Pods that hold its volumes";
        let mut guarded = Vec::new();
        for kind in ["MachineDeployment", "MachineSet", "Machine", "MachinePool"] {
            guarded.push(GuardedSpec {
                field: Some(CLUSTER_NAME_FIELD.into()),
                ..by(MACHINES, "cluster.x-k8s.io", kind)
            });
            guarded.push(GuardedSpec {
                label: Some("cluster.x-k8s.io/cluster-name".into()),
                ..by(MACHINES, "cluster.x-k8s.io", kind)
            });
        }
        guarded.push(GuardedSpec {
            reference: Some(REFERENCE_FIELDS[0].into()),
            ..by(
                "the cluster's control plane, whose API server the release phase works through",
                "controlplane.cluster.x-k8s.io",
                ANY_KIND,
            )
        });
        guarded.push(GuardedSpec {
            reference: Some(REFERENCE_FIELDS[1].into()),
            ..by(
                "the cluster's infrastructure, which its machines and control plane run on",
                "infrastructure.cluster.x-k8s.io",
                ANY_KIND,
            )
        });
        guarded.push(GuardedSpec {
            name: Some("{tenant}-kubeconfig".into()),
            ..by(
                "the cluster's kubeconfig, which the release phase needs",
                "",
                "Secret",
            )
        });
        Self {
            name: "cluster-api".into(),
            parent: ParentSpec {
                group: "cluster.x-k8s.io".into(),
                version: "v1beta2".into(),
                kind: "Cluster".into(),
                plural: "clusters".into(),
                match_labels: BTreeMap::from([(CLUSTER_API_OPT_IN.into(), "true".into())]),
                name_prefix: String::new(),
                // Cluster API reconciles a Cluster on every write to it:
                // the record's own write retries the deletion it refused.
                reconcile_request_annotation: String::new(),
                visible_annotation_prefix: String::new(),
            },
            child_label: None,
            csi_release: None,
            kubeconfig: KubeconfigSpec {
                secret_name: "{tenant}-kubeconfig".into(),
                keys: vec!["value".into()],
            },
            guarded,
            release: None,
            infra: None,
            control_plane: Some(ControlPlaneSpec::cluster_api()),
            writers: Writers {
                release_controllers: Vec::new(),
                parent_sources: Vec::new(),
                parent_replacers: Vec::new(),
            },
            ..Self::cozystack()
        }
    }

    /// The built-in profile of this name (`--profile-name`): `cozystack`
    /// or `cluster-api`.
    pub fn builtin(name: &str) -> Option<Self> {
        match name {
            "cozystack" => Some(Self::cozystack()),
            "cluster-api" => Some(Self::cluster_api()),
            _ => None,
        }
    }

    /// Loads a profile file; fields it omits keep the Cozystack defaults.
    pub fn load(path: &Path) -> Result<Self, ProfileError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ProfileError::Read {
            path: shown.clone(),
            source,
        })?;
        Self::from_yaml(&text).map_err(|e| match e {
            ProfileError::Parse { message, .. } => ProfileError::Parse {
                path: shown.clone(),
                message,
            },
            ProfileError::Invalid { message, .. } => ProfileError::Invalid {
                path: shown.clone(),
                message,
            },
            other => other,
        })
    }

    /// The profile a command was given (`--profile`), or Cozystack's.
    pub fn load_or_default(path: Option<&Path>) -> Result<Self, ProfileError> {
        path.map_or_else(|| Ok(Self::cozystack()), Self::load)
    }

    /// The API resource of the parent release (group, version, kind, plural).
    pub fn parent_resource(&self) -> kube::api::ApiResource {
        let p = &self.parent;
        kube::api::ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk(&p.group, &p.version, &p.kind),
            &p.plural,
        )
    }

    /// A profile file: the fields it names over a built-in profile's, the
    /// one its `base` names (`cozystack` when it names none).
    pub fn from_yaml(text: &str) -> Result<Self, ProfileError> {
        let parse = |message: String| ProfileError::Parse {
            path: "<inline>".into(),
            message,
        };
        let mut file: serde_json::Value =
            serde_saphyr::from_str(text).map_err(|e| parse(e.to_string()))?;
        let fields = match &mut file {
            serde_json::Value::Object(fields) => fields,
            serde_json::Value::Null => &mut serde_json::Map::new(),
            other => {
                return Err(parse(format!(
                    "a profile is a mapping of fields, not {other}"
                )));
            }
        };
        let base = match fields.remove("base") {
            None => Self::cozystack(),
            Some(serde_json::Value::String(name)) => Self::builtin(&name).ok_or_else(|| {
                parse(format!(
                    "base {name:?} is no built-in profile: use \"cozystack\" or \"cluster-api\""
                ))
            })?,
            Some(other) => {
                return Err(parse(format!("base must be a profile's name, not {other}")));
            }
        };
        let serde_json::Value::Object(mut merged) =
            serde_json::to_value(&base).expect("a profile serializes")
        else {
            unreachable!("a profile serializes to an object")
        };
        // `writers` is merged list by list: a file that names one list
        // keeps the base's others (Cozystack's identities must not slip
        // into a Cluster API profile that named only its replacers).
        if let (
            Some(serde_json::Value::Object(base_writers)),
            Some(serde_json::Value::Object(file_writers)),
        ) = (merged.get("writers").cloned(), fields.remove("writers"))
        {
            let mut writers = base_writers;
            writers.extend(file_writers);
            merged.insert("writers".into(), serde_json::Value::Object(writers));
        }
        // `extraGuarded` adds entries to the `guarded` list (the file's own,
        // or else the base's), so a file that guards one more object need
        // not copy the base's entries (the chart's management-side CSI
        // controller, docs/cluster-api.md).
        let extra = match fields.remove("extraGuarded") {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(serde_json::Value::Array(entries)) => entries,
            Some(other) => {
                return Err(parse(format!(
                    "extraGuarded must be a list of guarded entries, not {other}"
                )));
            }
        };
        merged.extend(std::mem::take(fields));
        if let Some(serde_json::Value::Array(guarded)) = merged.get_mut("guarded") {
            guarded.extend(extra);
        }
        let profile: Profile = serde_json::from_value(serde_json::Value::Object(merged))
            .map_err(|e| parse(e.to_string()))?;
        profile
            .validate()
            .map_err(|message| ProfileError::Invalid {
                path: "<inline>".into(),
                message,
            })?;
        Ok(profile)
    }

    /// Rejects a profile that could never match or would gate nothing.
    pub fn validate(&self) -> Result<(), String> {
        if !self.annotation_prefix.ends_with('/') || self.annotation_prefix.len() < 2 {
            return Err(format!(
                "annotationPrefix {:?} must be a DNS prefix ending in '/'",
                self.annotation_prefix
            ));
        }
        if self.custody_finalizer.is_empty() || !self.custody_finalizer.contains('/') {
            return Err(format!(
                "custodyFinalizer {:?} must be a qualified name like example.com/release",
                self.custody_finalizer
            ));
        }
        if self.parent.match_labels.is_empty() {
            return Err(
                "parent.matchLabels is empty: every HelmRelease would count as a tenant".into(),
            );
        }
        if self.parent.kind.is_empty()
            || self.parent.plural.is_empty()
            || self.parent.version.is_empty()
        {
            return Err("parent needs group, version, kind and plural".into());
        }
        if self.child_label.as_ref().is_some_and(String::is_empty) {
            return Err(
                "childLabel is empty: name the label, or leave it out (childLabel: null)".into(),
            );
        }
        if let Some(csi) = &self.csi_release
            && csi.matches(TENANT_PLACEHOLDER).count() != 1
        {
            return Err(format!(
                "csiRelease {csi:?} must contain {TENANT_PLACEHOLDER} exactly once"
            ));
        }
        if !self.kubeconfig.secret_name.contains(TENANT_PLACEHOLDER)
            || self.kubeconfig.keys.is_empty()
        {
            return Err(
                "kubeconfig needs a secretName containing {tenant} and at least one key".into(),
            );
        }
        for (i, g) in self.guarded.iter().enumerate() {
            match (&g.name, &g.label, &g.field, &g.reference) {
                (Some(n), None, None, None) if n.matches(TENANT_PLACEHOLDER).count() == 1 => {}
                (None, Some(l), None, None) if !l.is_empty() => {}
                (None, None, Some(f), None) if f == CLUSTER_NAME_FIELD => {}
                (None, None, None, Some(r)) if REFERENCE_FIELDS.contains(&r.as_str()) => {}
                _ => {
                    return Err(format!(
                        "guarded[{i}] ({}) needs exactly one of `name` (containing {TENANT_PLACEHOLDER} once), \
                         `label`, `field` ({CLUSTER_NAME_FIELD}, the one field the gate reads), or `ref` (the \
                         parent's field that names the object: one of {})",
                        g.kind,
                        REFERENCE_FIELDS.join(", ")
                    ));
                }
            }
            if g.kind == ANY_KIND && g.reference.is_none() {
                return Err(format!(
                    "guarded[{i}]: kind {ANY_KIND:?} stands for the kind a parent's reference names, so it needs `ref`"
                ));
            }
            if g.reference.is_some()
                && (g.kind.is_empty() || g.kind == self.parent.kind && g.group == self.parent.group)
            {
                return Err(format!(
                    "guarded[{i}]: an entry by `ref` names the kind the parent's reference may name, not the parent's own"
                ));
            }
        }
        if let Some(infra) = &self.infra {
            infra.validate()?;
        }
        if let Some(cp) = &self.control_plane {
            cp.validate()?;
        }
        if self.has_releases() {
            self.writers.validate()?;
        } else {
            self.writers.validate_names()?;
        }
        for (i, h) in self.release.iter().flat_map(|r| r.hooks.iter()).enumerate() {
            if h.matches(TENANT_PLACEHOLDER).count() != 1 {
                return Err(format!(
                    "release.hooks[{i}] {h:?} must contain {TENANT_PLACEHOLDER} exactly once"
                ));
            }
        }
        Ok(())
    }

    /// Whether `name` is one of release `tenant`'s teardown hook objects.
    pub fn is_release_hook(&self, name: &str, tenant: &str) -> bool {
        self.release
            .iter()
            .flat_map(|r| r.hooks.iter())
            .any(|h| h.replace(TENANT_PLACEHOLDER, tenant) == name)
    }

    /// Whether the platform has Flux releases of a tenant to judge: parents
    /// that are HelmReleases (Cozystack's), a CSI release or child releases.
    pub fn has_releases(&self) -> bool {
        self.parent_kind() == flux_release_kind()
            || self.csi_release.is_some()
            || self.child_label.is_some()
    }

    /// The guarded entries that follow a reference of the parent to an
    /// object of `kind` (an entry's kind `*`: any kind of its group, the
    /// reference naming the kind).
    pub fn referenced<'a>(&'a self, kind: &'a GroupKind) -> impl Iterator<Item = &'a GuardedSpec> {
        self.guarded.iter().filter(move |g| {
            g.reference.is_some()
                && g.group == kind.group
                && (g.kind == kind.kind || g.kind == ANY_KIND)
        })
    }

    /// The tenants among `parents` (name and spec, as listed) whose
    /// reference, by a guarded entry, names object `name` of `kind`, with
    /// that entry's role.
    pub fn referrers(
        &self,
        kind: &GroupKind,
        name: &str,
        parents: &[(String, serde_json::Value)],
    ) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for g in self.referenced(kind) {
            let pointer = g.reference.as_deref().unwrap_or_default();
            for (parent, object) in parents {
                let named = reference_at(object, pointer)
                    .is_some_and(|(gr, k, n)| gr == kind.group && k == kind.kind && n == name);
                if named && !out.iter().any(|(p, _)| p == parent) {
                    out.push((parent.clone(), g.role.clone()));
                }
            }
        }
        out
    }

    pub fn parent_kind(&self) -> GroupKind {
        GroupKind::new(&self.parent.group, &self.parent.kind)
    }

    /// Whether labels mark an object as a tenant's parent release.
    pub fn is_parent(&self, labels: &BTreeMap<String, String>) -> bool {
        self.parent
            .match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
    }

    /// The parent label selector, for list and watch calls.
    pub fn parent_selector(&self) -> String {
        self.parent
            .match_labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn csi_release_name(&self, tenant: &str) -> Option<String> {
        self.csi_release
            .as_ref()
            .map(|c| c.replace(TENANT_PLACEHOLDER, tenant))
    }

    pub fn kubeconfig_secret_name(&self, tenant: &str) -> String {
        self.kubeconfig
            .secret_name
            .replace(TENANT_PLACEHOLDER, tenant)
    }

    /// The `kubectl annotate` command that records an override.
    pub fn override_command(&self, namespace: &str, tenant: &str) -> String {
        format!(
            "kubectl annotate {}.{} -n {namespace} {tenant} {}override='<why these volumes may be abandoned>'",
            self.parent.plural, self.parent.group, self.annotation_prefix
        )
    }
}

/// Extracts the tenant from a name matching `pattern` (one `{tenant}`).
pub fn tenant_from_name(pattern: &str, name: &str) -> Option<String> {
    let (prefix, suffix) = pattern.split_once(TENANT_PLACEHOLDER)?;
    let middle = name.strip_prefix(prefix)?.strip_suffix(suffix)?;
    (!middle.is_empty()).then(|| middle.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cozystack_profile_is_valid_and_is_the_default() {
        Profile::cozystack().validate().unwrap();
        assert_eq!(Profile::default(), Profile::cozystack());
    }

    #[test]
    fn empty_file_yields_the_cozystack_profile() {
        assert_eq!(Profile::from_yaml("{}").unwrap(), Profile::cozystack());
    }

    #[test]
    fn a_partial_file_overrides_only_what_it_names() {
        let p = Profile::from_yaml("name: acme\nchildLabel: acme.io/cluster\n").unwrap();
        assert_eq!(p.name, "acme");
        assert_eq!(p.child_label.as_deref(), Some("acme.io/cluster"));
        assert_eq!(p.csi_release.as_deref(), Some("{tenant}-csi"));
    }

    #[test]
    fn unknown_fields_are_refused_by_name() {
        let err = Profile::from_yaml("childLable: x\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("childLable"), "{err}");
    }

    #[test]
    fn a_guarded_entry_without_matcher_is_refused() {
        let err = Profile::from_yaml("guarded:\n- role: x\n  kind: Secret\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("guarded[0]"), "{err}");
    }

    #[test]
    fn an_empty_parent_selector_is_refused() {
        let y = "parent: {group: g, version: v1, kind: K, plural: ks, matchLabels: {}}\n";
        let err = Profile::from_yaml(y).unwrap_err().to_string();
        assert!(err.contains("matchLabels"), "{err}");
    }

    #[test]
    fn a_csi_release_pattern_with_two_placeholders_is_refused() {
        let err = Profile::from_yaml("csiRelease: \"{tenant}-{tenant}-csi\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("exactly once"), "{err}");
    }

    #[test]
    fn garbage_is_a_parse_error() {
        assert!(matches!(
            Profile::from_yaml("[1, 2"),
            Err(ProfileError::Parse { .. })
        ));
    }

    #[test]
    fn tenant_is_extracted_from_name_patterns() {
        assert_eq!(
            tenant_from_name("{tenant}-csi", "kubernetes-a-csi").as_deref(),
            Some("kubernetes-a")
        );
        assert_eq!(
            tenant_from_name("{tenant}", "kubernetes-a").as_deref(),
            Some("kubernetes-a")
        );
        assert_eq!(
            tenant_from_name("{tenant}-admin-kubeconfig", "x-admin-kubeconfig").as_deref(),
            Some("x")
        );
        assert_eq!(tenant_from_name("{tenant}-csi", "-csi"), None);
        assert_eq!(
            tenant_from_name("{tenant}-csi", "kubernetes-a-cilium"),
            None
        );
    }

    #[test]
    fn parent_selector_requires_every_label() {
        let p = Profile::cozystack();
        let mut labels = p.parent.match_labels.clone();
        assert!(p.is_parent(&labels));
        labels.insert(
            "apps.cozystack.io/application.kind".into(),
            "Postgres".into(),
        );
        assert!(!p.is_parent(&labels));
        assert!(!p.is_parent(&BTreeMap::new()));
    }

    #[test]
    fn the_cluster_api_profile_is_valid_and_a_file_takes_it_as_its_base() {
        Profile::cluster_api().validate().unwrap();
        assert_eq!(
            Profile::from_yaml("base: cluster-api\n").unwrap(),
            Profile::cluster_api()
        );
        // A CSI release needs the identity that alone writes its status.
        let csi = "base: cluster-api\ncsiRelease: \"{tenant}-csi\"\n";
        let err = Profile::from_yaml(csi).unwrap_err().to_string();
        assert!(err.contains("releaseControllers"), "{err}");
        let flux = "writers: {releaseControllers: [\"system:serviceaccount:flux-system:helm-controller\"]}\n";
        let p = Profile::from_yaml(&format!("{csi}{flux}")).unwrap();
        assert_eq!(p.csi_release_name("c1").as_deref(), Some("c1-csi"));
        assert_eq!(p.parent.kind, "Cluster");
        assert!(p.has_releases());
        assert!(!Profile::cluster_api().has_releases());
        // A list the file leaves out of `writers` is the base's, not Cozystack's.
        let p =
            Profile::from_yaml("base: cluster-api\nwriters: {parentReplacers: [alice]}\n").unwrap();
        assert_eq!(p.writers.parent_replacers, vec!["alice".to_string()]);
        assert!(p.writers.release_controllers.is_empty(), "{:?}", p.writers);
        assert!(p.writers.parent_sources.is_empty(), "{:?}", p.writers);
        let err = Profile::from_yaml("base: capi\n").unwrap_err().to_string();
        assert!(err.contains("cluster-api"), "{err}");
    }

    #[test]
    fn extra_guarded_entries_are_added_to_the_base_s_or_the_file_s_list() {
        let entry = "{role: the CSI controller, group: apps, kind: Deployment, name: \"{tenant}-kubevirt-csi-controller\"}";
        let p =
            Profile::from_yaml(&format!("base: cluster-api\nextraGuarded:\n- {entry}\n")).unwrap();
        let base = Profile::cluster_api().guarded;
        assert_eq!(p.guarded.len(), base.len() + 1);
        assert_eq!(p.guarded[..base.len()], base[..]);
        assert_eq!(
            p.guarded[base.len()].name.as_deref(),
            Some("{tenant}-kubevirt-csi-controller")
        );
        let own = "guarded:\n- {role: x, kind: Secret, name: \"{tenant}-a\"}\n";
        let p = Profile::from_yaml(&format!("{own}extraGuarded:\n- {entry}\n")).unwrap();
        assert_eq!(p.guarded.len(), 2, "{:?}", p.guarded);
        // Each extra entry is checked like any other.
        let bad = "base: cluster-api\nextraGuarded:\n- {role: x, kind: Deployment}\n";
        let err = Profile::from_yaml(bad).unwrap_err().to_string();
        assert!(err.contains("guarded["), "{err}");
        let err = Profile::from_yaml("extraGuarded: {a: b}\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("extraGuarded must be a list"), "{err}");
    }

    #[test]
    fn a_reference_entry_follows_only_the_fields_the_gate_reads() {
        let y =
            "base: cluster-api\nguarded:\n- {role: x, group: g.io, kind: K, ref: /spec/anything}\n";
        let err = Profile::from_yaml(y).unwrap_err().to_string();
        assert!(err.contains("/spec/controlPlaneRef"), "{err}");
        let y = "guarded:\n- {role: x, group: g.io, kind: \"*\", name: \"{tenant}\"}\n";
        let err = Profile::from_yaml(y).unwrap_err().to_string();
        assert!(err.contains("needs `ref`"), "{err}");
    }

    #[test]
    fn references_are_read_in_both_cluster_api_versions() {
        let v1beta2 = serde_json::json!({"spec": {"controlPlaneRef":
            {"apiGroup": "controlplane.cluster.x-k8s.io", "kind": "KamajiControlPlane", "name": "a"}}});
        let v1beta1 = serde_json::json!({"spec": {"controlPlaneRef":
            {"apiVersion": "controlplane.cluster.x-k8s.io/v1alpha1", "kind": "KamajiControlPlane", "name": "a"}}});
        let want = Some((
            "controlplane.cluster.x-k8s.io".to_string(),
            "KamajiControlPlane".to_string(),
            "a".to_string(),
        ));
        assert_eq!(reference_at(&v1beta2, "/spec/controlPlaneRef"), want);
        assert_eq!(reference_at(&v1beta1, "/spec/controlPlaneRef"), want);
        assert_eq!(reference_at(&v1beta1, "/spec/infrastructureRef"), None);
        let p = Profile::cluster_api();
        let kind = GroupKind::new("controlplane.cluster.x-k8s.io", "KamajiControlPlane");
        let parents = vec![
            ("c1".to_string(), v1beta2),
            ("c2".to_string(), serde_json::json!({})),
        ];
        assert_eq!(
            p.referrers(&kind, "a", &parents),
            vec![(
                "c1".to_string(),
                p.guarded
                    .iter()
                    .find(|g| g.reference.is_some())
                    .unwrap()
                    .role
                    .clone()
            )]
        );
        assert!(p.referrers(&kind, "b", &parents).is_empty());
    }

    #[test]
    fn an_endpoint_is_a_string_or_cluster_api_s_host_and_port() {
        let kamaji = ControlPlaneSpec::kamaji();
        let capi = ControlPlaneSpec::cluster_api();
        let o = serde_json::json!({"status": {"controlPlaneEndpoint": "10.0.0.1:6443"},
            "spec": {"controlPlaneEndpoint": {"host": "127.0.0.1", "port": 36443}}});
        assert_eq!(kamaji.endpoint_in(&o).as_deref(), Some("10.0.0.1:6443"));
        assert_eq!(capi.endpoint_in(&o).as_deref(), Some("127.0.0.1:36443"));
        let v6 =
            serde_json::json!({"spec": {"controlPlaneEndpoint": {"host": "::1", "port": 6443}}});
        assert_eq!(capi.endpoint_in(&v6).as_deref(), Some("[::1]:6443"));
        // Not set yet: Cluster API's zero value.
        let unset = serde_json::json!({"spec": {"controlPlaneEndpoint": {"host": "", "port": 0}}});
        assert_eq!(capi.endpoint_in(&unset), None);
        assert_eq!(capi.service_of("ns", "c1"), None);
    }
}
