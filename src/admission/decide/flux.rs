//! What Flux's helm-controller does with a HelmRelease's spec, as far as
//! the gate must know it: which changes make it remove what it installed
//! while the HelmRelease object stays (`docs/design.md` §4, "What counts as
//! a delete"). Read from helm-controller v1.6.0; the functions cited are
//! its own.
//!
//! - `action.ReleaseTargetChanged` (called by `reconcileRelease`): when the
//!   release name (`GetReleaseName`), the release namespace
//!   (`GetReleaseNamespace`), the storage namespace (`GetStorageNamespace`)
//!   or the loaded chart's name differ from the current release in
//!   `status.history`, it uninstalls the current release, hooks included,
//!   then installs the new target. The chart's name is inside the artifact,
//!   which admission cannot see: any change of the chart's source is judged
//!   instead (a source serving a chart of the same name but other content
//!   removes by upgrade what the new content lacks, which is as bad).
//! - `UninstallRemediation` (`atomic_release.go`, state `Failed`): with
//!   `upgrade.remediation.strategy: uninstall` a failed upgrade uninstalls
//!   the release; install remediation (always `uninstall`) acts on a
//!   deployed release whose tests failed. Arming either is judged.
//! - `spec.kubeConfig` is not part of the target check: changing it makes
//!   every later action, the uninstall included, act on another cluster.
//!   It steers where the release lives, so it is judged too.
//!
//! Everything else in the spec is content (values, post-renderers, version,
//! timeouts): an upgrade that renders the driver away is the chart's and its
//! values' authority, which admission cannot judge; the release phase then
//! reports the volumes it cannot free (`docs/reliability.md`).

use serde_json::Value;

use crate::admission::request::SpecView;

/// The top-level spec fields whose change the webhook conditions send for
/// judging as written (the chart template's `chart`/`sourceRef` and the
/// remediation and test subtrees are sent by their paths).
pub const TOP_LEVEL_FIELDS: [&str; 5] = [
    "releaseName",
    "targetNamespace",
    "storageNamespace",
    "chartRef",
    "kubeConfig",
];

/// Where a release is installed, as helm-controller computes it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Placement {
    release_name: String,
    release_namespace: String,
    storage_namespace: String,
}

fn text(v: Option<&Value>) -> Option<&str> {
    v.and_then(Value::as_str).filter(|s| !s.is_empty())
}

/// `GetReleaseName`, `GetReleaseNamespace`, `GetStorageNamespace` (api/v2).
fn placement(name: &str, namespace: &str, spec: &SpecView) -> Placement {
    let target = text(spec.target_namespace.as_ref());
    Placement {
        release_name: match (text(spec.release_name.as_ref()), target) {
            (Some(r), _) => r.to_string(),
            (None, Some(t)) => format!("{t}-{name}"),
            (None, None) => name.to_string(),
        },
        release_namespace: target.unwrap_or(namespace).to_string(),
        storage_namespace: text(spec.storage_namespace.as_ref())
            .unwrap_or(namespace)
            .to_string(),
    }
}

/// A source reference with its namespace defaulted to the release's.
fn source(reference: Option<&Value>, namespace: &str) -> Option<(String, String, String)> {
    let r = reference?;
    Some((
        text(r.get("kind")).unwrap_or("").to_string(),
        text(r.get("name")).unwrap_or("").to_string(),
        text(r.get("namespace")).unwrap_or(namespace).to_string(),
    ))
}

/// What chart a release installs, and from where: the chart template's
/// chart name and source, or the `chartRef`.
fn chart(namespace: &str, spec: &SpecView) -> (Option<String>, Option<(String, String, String)>) {
    let template = spec.chart.as_ref().and_then(|c| c.get("spec"));
    match spec.chart_ref.as_ref() {
        Some(r) => (None, source(Some(r), namespace)),
        None => (
            text(template.and_then(|t| t.get("chart"))).map(str::to_string),
            source(template.and_then(|t| t.get("sourceRef")), namespace),
        ),
    }
}

fn number(v: Option<&Value>) -> i64 {
    v.and_then(Value::as_i64).unwrap_or(0)
}

fn flag(v: Option<&Value>) -> bool {
    v.and_then(Value::as_bool).unwrap_or(false)
}

/// Whether a failure makes helm-controller uninstall the release
/// (`UninstallRemediation`): an upgrade remediated by `uninstall` that can
/// remediate at all (retries not 0, or the last failure remediated), or
/// install remediation reached through failing tests.
fn get<'a>(v: &'a Option<Value>, pointer: &str) -> Option<&'a Value> {
    v.as_ref().and_then(|v| v.pointer(pointer))
}

fn uninstall_armed(spec: &SpecView) -> bool {
    let remediates = |v: &Option<Value>| {
        number(get(v, "/remediation/retries")) != 0
            || flag(get(v, "/remediation/remediateLastFailure"))
    };
    let upgrade_armed = text(get(&spec.upgrade, "/remediation/strategy")) == Some("uninstall")
        && remediates(&spec.upgrade);
    let tests_fail_it = flag(get(&spec.test, "/enable"))
        && !flag(get(&spec.test, "/ignoreFailures"))
        && !flag(get(&spec.install, "/remediation/ignoreTestFailures"));
    upgrade_armed || (tests_fail_it && remediates(&spec.install))
}

/// A release as the gate sees it: its object's name and namespace, and the
/// spec fields helm-controller decides placement and removal by.
#[derive(Clone, Copy, Debug)]
pub struct Release<'a> {
    pub name: &'a str,
    pub namespace: &'a str,
    pub spec: &'a SpecView,
}

/// The removal a change of the chart's source is reported as.
pub const CHART: &str = "the chart it installs";

/// What in a change from `old` to `new` makes helm-controller remove what
/// the release installed, in words for a refusal; empty when nothing does.
pub fn removals(old: Release<'_>, new: Release<'_>) -> Vec<&'static str> {
    let mut out = Vec::new();
    let (before, after) = (
        placement(old.name, old.namespace, old.spec),
        placement(new.name, new.namespace, new.spec),
    );
    if before.release_name != after.release_name {
        out.push("its Helm release name");
    }
    if before.release_namespace != after.release_namespace {
        out.push("its target namespace");
    }
    if before.storage_namespace != after.storage_namespace {
        out.push("its storage namespace");
    }
    if chart(old.namespace, old.spec) != chart(new.namespace, new.spec) {
        out.push(CHART);
    }
    if old.spec.kube_config != new.spec.kube_config {
        out.push("the cluster it installs into (kubeConfig)");
    }
    if !uninstall_armed(old.spec) && uninstall_armed(new.spec) {
        out.push("a remediation that uninstalls it on a failure");
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn spec(v: Value) -> SpecView {
        serde_json::from_value(v).unwrap()
    }

    fn judge(old: Value, new: Value) -> Vec<&'static str> {
        let (o, n) = (spec(old), spec(new));
        removals(
            Release {
                name: "kubernetes-a-csi",
                namespace: "tenant-x",
                spec: &o,
            },
            Release {
                name: "kubernetes-a-csi",
                namespace: "tenant-x",
                spec: &n,
            },
        )
    }

    fn base() -> Value {
        json!({"releaseName": "csi", "targetNamespace": "kube-system", "storageNamespace": "kube-system",
               "chartRef": {"kind": "ExternalArtifact", "name": "chart-csi"},
               "kubeConfig": {"secretRef": {"name": "kubernetes-a-admin-kubeconfig", "key": "super-admin.svc"}},
               "values": {"a": 1}, "interval": "5m"})
    }

    fn with(mut v: Value, pointer: &str, x: Value) -> Value {
        let (parent, key) = pointer.rsplit_once('/').unwrap();
        let mut at = &mut v;
        for k in parent.split('/').filter(|k| !k.is_empty()) {
            if at.get(k).is_none() {
                at[k] = json!({});
            }
            at = at.get_mut(k).unwrap();
        }
        if x.is_null() {
            at.as_object_mut().unwrap().remove(key);
        } else {
            at[key] = x;
        }
        v
    }

    #[test]
    fn each_field_of_the_release_target_is_a_removal() {
        for (pointer, value, what) in [
            ("/releaseName", json!("csi2"), "its Helm release name"),
            ("/releaseName", Value::Null, "its Helm release name"),
            ("/targetNamespace", json!("default"), "its target namespace"),
            (
                "/storageNamespace",
                json!("default"),
                "its storage namespace",
            ),
            (
                "/chartRef/name",
                json!("chart-cilium"),
                "the chart it installs",
            ),
            (
                "/chartRef/namespace",
                json!("cozy-system"),
                "the chart it installs",
            ),
            (
                "/chartRef/kind",
                json!("OCIRepository"),
                "the chart it installs",
            ),
            (
                "/kubeConfig/secretRef/name",
                json!("kubernetes-b-admin-kubeconfig"),
                "the cluster it installs into (kubeConfig)",
            ),
        ] {
            assert_eq!(
                judge(base(), with(base(), pointer, value.clone())),
                vec![what],
                "{pointer} = {value}"
            );
        }
    }

    #[test]
    fn the_release_name_is_derived_as_helm_controller_derives_it() {
        // No releaseName: targetNamespace-name; setting the same name
        // explicitly is no change, dropping the target namespace is one.
        let derived = with(base(), "/releaseName", Value::Null);
        let explicit = with(
            base(),
            "/releaseName",
            json!("kube-system-kubernetes-a-csi"),
        );
        assert!(judge(derived.clone(), explicit).is_empty());
        let no_target = with(derived.clone(), "/targetNamespace", Value::Null);
        assert_eq!(
            judge(derived, no_target),
            vec!["its Helm release name", "its target namespace"]
        );
        // An explicit default is the default.
        let none = json!({"chartRef": {"kind": "ExternalArtifact", "name": "c"}});
        let same = json!({"storageNamespace": "tenant-x", "chartRef": {"kind": "ExternalArtifact", "name": "c", "namespace": "tenant-x"}});
        assert!(judge(none, same).is_empty());
    }

    #[test]
    fn a_chart_template_changes_by_its_chart_or_its_source_not_its_version() {
        let t = json!({"chart": {"spec": {"chart": "csi", "version": "1.0.0",
            "sourceRef": {"kind": "HelmRepository", "name": "cozy"}}}});
        assert!(
            judge(
                t.clone(),
                with(t.clone(), "/chart/spec/version", json!("2.0.0"))
            )
            .is_empty()
        );
        assert_eq!(
            judge(
                t.clone(),
                with(t.clone(), "/chart/spec/chart", json!("cilium"))
            ),
            vec!["the chart it installs"]
        );
        assert_eq!(
            judge(
                t.clone(),
                with(t.clone(), "/chart/spec/sourceRef/name", json!("evil"))
            ),
            vec!["the chart it installs"]
        );
        // From a template to a chartRef is another chart.
        assert_eq!(judge(t, base()).len(), 5, "every field moved");
    }

    #[test]
    fn ordinary_upgrades_are_no_removal() {
        for (pointer, value) in [
            ("/values/a", json!(2)),
            ("/values", Value::Null),
            ("/interval", json!("1m")),
            ("/suspend", json!(true)),
            ("/postRenderers", json!([{"kustomize": {"patches": []}}])),
            ("/upgrade/remediation/retries", json!(-1)),
            ("/install/remediation/retries", json!(3)),
            ("/upgrade/timeout", json!("1s")),
            ("/test/enable", json!(true)),
        ] {
            assert!(
                judge(base(), with(base(), pointer, value.clone())).is_empty(),
                "{pointer} = {value}"
            );
        }
    }

    #[test]
    fn arming_an_uninstalling_remediation_is_a_removal_and_only_arming_it() {
        let armed = "a remediation that uninstalls it on a failure";
        let upgrade = with(base(), "/upgrade/remediation/strategy", json!("uninstall"));
        // strategy uninstall with retries 0 and no last-failure remediation
        // never remediates (RetriesExhausted, MustRemediateLastFailure false).
        assert!(judge(base(), upgrade.clone()).is_empty());
        for (pointer, value) in [
            ("/upgrade/remediation/retries", json!(1)),
            ("/upgrade/remediation/retries", json!(-1)),
            ("/upgrade/remediation/remediateLastFailure", json!(true)),
        ] {
            let on = with(upgrade.clone(), pointer, value.clone());
            assert_eq!(
                judge(base(), on.clone()),
                vec![armed],
                "{pointer} = {value}"
            );
            assert_eq!(
                judge(upgrade.clone(), on.clone()),
                vec![armed],
                "{pointer} = {value}"
            );
            // Already armed: further edits are not judged again; disarming is fine.
            assert!(judge(on.clone(), with(on.clone(), "/values/a", json!(3))).is_empty());
            assert!(judge(on, base()).is_empty());
        }
        // Install remediation uninstalls a deployed release whose tests fail.
        let retries = with(base(), "/install/remediation/retries", json!(-1));
        let tests = with(retries.clone(), "/test/enable", json!(true));
        assert_eq!(judge(retries.clone(), tests.clone()), vec![armed]);
        assert!(
            judge(
                retries.clone(),
                with(tests.clone(), "/test/ignoreFailures", json!(true))
            )
            .is_empty()
        );
        assert!(
            judge(
                retries,
                with(
                    tests,
                    "/install/remediation/ignoreTestFailures",
                    json!(true)
                )
            )
            .is_empty()
        );
    }
}
