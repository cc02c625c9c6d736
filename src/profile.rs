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
}

/// Cluster API's `spec.clusterName`, the one field a guarded entry may name.
pub const CLUSTER_NAME_FIELD: &str = "/spec/clusterName";

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
    /// A JSON pointer to its `host:port` endpoint in the object (Kamaji:
    /// `/status/controlPlaneEndpoint`).
    pub endpoint: String,
    /// The in-cluster name of the Service in front of it, `{tenant}` and
    /// `{namespace}` standing for the parent's (Kamaji's `super-admin.svc`
    /// kubeconfig uses it).
    pub service: String,
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
            service: format!("{TENANT_PLACEHOLDER}.{NAMESPACE_PLACEHOLDER}.svc"),
        }
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

    pub fn service_of(&self, namespace: &str, tenant: &str) -> String {
        self.service
            .replace(TENANT_PLACEHOLDER, tenant)
            .replace(NAMESPACE_PLACEHOLDER, namespace)
    }

    fn validate(&self) -> Result<(), String> {
        if self.kind.is_empty() || self.plural.is_empty() || self.version.is_empty() {
            return Err("controlPlane needs group, version, kind and plural".into());
        }
        if self.name.matches(TENANT_PLACEHOLDER).count() != 1
            || !self.service.contains(TENANT_PLACEHOLDER)
        {
            return Err(format!(
                "controlPlane.name must contain {TENANT_PLACEHOLDER} once and controlPlane.service at least once"
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
    /// Label on each child release whose value is the parent's name.
    pub child_label: String,
    /// Name pattern of the CSI driver release.
    pub csi_release: String,
    pub kubeconfig: KubeconfigSpec,
    pub guarded: Vec<GuardedSpec>,
    /// Objects of a parent release are guarded during teardown: the CSI
    /// controller's identity (its ServiceAccount and RBAC) goes with it.
    pub release: ReleaseSpec,
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
                }
            };
        let by_cluster_name = |kind: &str| GuardedSpec {
            role: "the tenant's worker machines, which run the driver".into(),
            group: "cluster.x-k8s.io".into(),
            kind: kind.into(),
            name: None,
            label: None,
            field: Some(CLUSTER_NAME_FIELD.into()),
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
            child_label: "cozystack.io/target-cluster-name".into(),
            csi_release: "{tenant}-csi".into(),
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
            release: ReleaseSpec {
                name_annotation: "meta.helm.sh/release-name".into(),
                namespace_annotation: "meta.helm.sh/release-namespace".into(),
                name_label: "helm.toolkit.fluxcd.io/name".into(),
                namespace_label: "helm.toolkit.fluxcd.io/namespace".into(),
                // The pre-delete hook's ServiceAccount, Role and RoleBinding,
                // and its Job.
                hooks: vec!["{tenant}-cleanup".into(), "{tenant}-pre-cleanup".into()],
            },
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

    pub fn from_yaml(text: &str) -> Result<Self, ProfileError> {
        let profile: Profile = serde_saphyr::from_str(text).map_err(|e| ProfileError::Parse {
            path: "<inline>".into(),
            message: e.to_string(),
        })?;
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
        if self.child_label.is_empty() {
            return Err("childLabel is empty".into());
        }
        if self.csi_release.matches(TENANT_PLACEHOLDER).count() != 1 {
            return Err(format!(
                "csiRelease {:?} must contain {TENANT_PLACEHOLDER} exactly once",
                self.csi_release
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
            match (&g.name, &g.label, &g.field) {
                (Some(n), None, None) if n.matches(TENANT_PLACEHOLDER).count() == 1 => {}
                (None, Some(l), None) if !l.is_empty() => {}
                (None, None, Some(f)) if f == CLUSTER_NAME_FIELD => {}
                _ => {
                    return Err(format!(
                        "guarded[{i}] ({}) needs exactly one of `name` (containing {TENANT_PLACEHOLDER} once), \
                         `label`, or `field` ({CLUSTER_NAME_FIELD}, the one field the gate reads)",
                        g.kind
                    ));
                }
            }
        }
        if let Some(infra) = &self.infra {
            infra.validate()?;
        }
        if let Some(cp) = &self.control_plane {
            cp.validate()?;
        }
        self.writers.validate()?;
        for (i, h) in self.release.hooks.iter().enumerate() {
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
            .hooks
            .iter()
            .any(|h| h.replace(TENANT_PLACEHOLDER, tenant) == name)
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

    pub fn csi_release_name(&self, tenant: &str) -> String {
        self.csi_release.replace(TENANT_PLACEHOLDER, tenant)
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
        assert_eq!(p.child_label, "acme.io/cluster");
        assert_eq!(p.csi_release, "{tenant}-csi");
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
}
