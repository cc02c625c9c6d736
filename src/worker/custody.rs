//! Custody: the finalizer on every parent, as patches that never clobber a
//! concurrent change, and `volume-gate custody` to take it on install and
//! hand it back on uninstall.

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation, RemoveOperation, TestOperation};
use kube::api::{Api, DynamicObject, ListParams, PatchParams};
use kube::core::PartialObjectMeta;
use kube::{Resource, ResourceExt};
use serde_json::json;

use crate::profile::Profile;
use crate::record::{Keys, Record};

/// A JSON Patch adding `finalizer`, valid only at `resource_version`: a stale
/// view fails (409/422) instead of racing a deletion.
pub fn add_finalizer_patch(
    finalizers: &[String],
    resource_version: &str,
    finalizer: &str,
) -> Patch {
    let add = if finalizers.is_empty() {
        AddOperation {
            path: PointerBuf::from_tokens(["metadata", "finalizers"]),
            value: json!([finalizer]),
        }
    } else {
        AddOperation {
            path: PointerBuf::from_tokens(["metadata", "finalizers", "-"]),
            value: json!(finalizer),
        }
    };
    Patch(vec![
        PatchOperation::Test(TestOperation {
            path: PointerBuf::from_tokens(["metadata", "resourceVersion"]),
            value: json!(resource_version),
        }),
        PatchOperation::Add(add),
    ])
}

/// A JSON Patch removing `finalizer` by index, guarded by a `test` of that
/// index; `None` when it is not there.
pub fn remove_finalizer_patch(finalizers: &[String], finalizer: &str) -> Option<Patch> {
    let i = finalizers.iter().position(|f| f == finalizer)?;
    let path = PointerBuf::from_tokens([
        "metadata".to_string(),
        "finalizers".to_string(),
        i.to_string(),
    ]);
    Some(Patch(vec![
        PatchOperation::Test(TestOperation {
            path: path.clone(),
            value: json!(finalizer),
        }),
        PatchOperation::Remove(RemoveOperation { path }),
    ]))
}

/// One JSON Patch that records an outcome that ends the phase and ends
/// custody with it: each of `annotations` set (or the whole map, when the
/// parent has no annotations at all) and `finalizer` removed by index under
/// a `test`, when it is there. One write, so no version of the parent ever
/// asks its controller to reconcile while still carrying the finalizer: a
/// controller that patches finalizers from the version it read (Flux's
/// helm-controller does, with a merge patch) would otherwise put it back,
/// which the API server refuses on an object being deleted.
pub fn outcome_patch(
    finalizers: &[String],
    finalizer: &str,
    has_annotations: bool,
    annotations: &serde_json::Map<String, serde_json::Value>,
) -> Patch {
    let mut ops = remove_finalizer_patch(finalizers, finalizer).map_or_else(Vec::new, |p| p.0);
    if has_annotations {
        ops.extend(annotations.iter().map(|(k, v)| {
            PatchOperation::Add(AddOperation {
                path: PointerBuf::from_tokens(["metadata", "annotations", k.as_str()]),
                value: v.clone(),
            })
        }));
    } else {
        ops.push(PatchOperation::Add(AddOperation {
            path: PointerBuf::from_tokens(["metadata", "annotations"]),
            value: serde_json::Value::Object(annotations.clone()),
        }));
    }
    Patch(ops)
}

/// Every parent release (metadata), in one namespace or all.
pub async fn list_parents(
    client: &kube::Client,
    profile: &Profile,
    namespace: Option<&str>,
) -> Result<Vec<PartialObjectMeta<DynamicObject>>, kube::Error> {
    let ar = profile.parent_resource();
    let api: Api<DynamicObject> = match namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    };
    let mut items = api
        .list_metadata(&ListParams::default().labels(&profile.parent_selector()))
        .await?
        .items;
    items.sort_by_key(|p| (p.namespace(), p.name_any()));
    Ok(items)
}

/// A tenant whose volume-release phase has begun and not ended: being
/// deleted (it, or its namespace), in custody, and not done. Handing
/// custody back now would let its teardown remove the CSI driver before its
/// volumes are freed.
pub fn mid_release(
    profile: &Profile,
    keys: &Keys,
    parent: &PartialObjectMeta<DynamicObject>,
    namespace_deleting: bool,
) -> Option<String> {
    let deleting = parent.meta().deletion_timestamp.is_some() || namespace_deleting;
    let in_custody = parent.finalizers().contains(&profile.custody_finalizer);
    let record = Record::from_annotations(keys, parent.annotations());
    (deleting && in_custody && !record.is_done()).then(|| {
        format!(
            "{}/{} ({})",
            parent.namespace().unwrap_or_default(),
            parent.name_any(),
            record.summary()
        )
    })
}

#[derive(clap::Subcommand, Debug, Clone)]
pub enum CustodyCommand {
    /// Uninstall step: remove the custody finalizer from every tenant that is
    /// not being deleted, so removing volume-gate strands nothing. Stop the
    /// worker and delete the webhook configurations first.
    Release(CustodyArgs),
    /// Install step: add the custody finalizer to every tenant that is not
    /// being deleted (the worker also does this on its own).
    Adopt(CustodyArgs),
    /// The whole uninstall, as the chart's pre-delete hook runs it: refuse
    /// while any tenant is mid-release (naming each); otherwise stop the
    /// worker, delete the webhook configurations, and remove the custody
    /// finalizer from every tenant, so removing volume-gate strands none.
    HandBack(HandBackArgs),
}

#[derive(clap::Args, Debug, Clone)]
pub struct HandBackArgs {
    /// The namespace volume-gate is installed in.
    #[arg(long, env = "POD_NAMESPACE", default_value = "volume-gate")]
    pub install_namespace: String,
    /// The worker's Deployment, scaled to zero first so it takes no tenant
    /// back into custody.
    #[arg(long, default_value = "volume-gate-worker")]
    pub worker_deployment: String,
    /// The Validating- and MutatingWebhookConfiguration to delete (both
    /// are named this).
    #[arg(long, default_value = "volume-gate")]
    pub webhook_configuration: String,
    /// How long to wait for the worker's Pods to stop.
    #[arg(long, default_value = "2m", value_parser = crate::args::parse_duration)]
    pub timeout: std::time::Duration,
    #[command(flatten)]
    pub profile: crate::args::ProfileArg,
}

#[derive(clap::Args, Debug, Clone)]
pub struct CustodyArgs {
    /// Only tenants in this namespace.
    #[arg(long, short = 'n')]
    pub namespace: Option<String>,
    /// Print what would change without changing it.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub profile: crate::args::ProfileArg,
}

pub async fn run_command(cmd: CustodyCommand) -> Result<(), String> {
    match cmd {
        CustodyCommand::Release(a) => release_or_adopt(a, false).await,
        CustodyCommand::Adopt(a) => release_or_adopt(a, true).await,
        CustodyCommand::HandBack(a) => hand_back(a).await,
    }
}

/// `custody release` (`adopt` false) or `custody adopt`.
async fn release_or_adopt(args: CustodyArgs, adopt: bool) -> Result<(), String> {
    let profile = Profile::load_or_default(args.profile.path()).map_err(|e| e.to_string())?;
    let client = kube::Client::try_default()
        .await
        .map_err(|e| format!("cannot reach the management cluster: {e}"))?;
    let ar = profile.parent_resource();
    let parents = list_parents(&client, &profile, args.namespace.as_deref())
        .await
        .map_err(|e| format!("cannot list tenants: {e}"))?;
    let (mut changed, mut skipped, mut failed) = (0, 0, 0);
    for p in parents {
        let ns = p.namespace().unwrap_or_default();
        let name = p.name_any();
        let finalizers = p.finalizers().to_vec();
        let has = finalizers.contains(&profile.custody_finalizer);
        if p.meta().deletion_timestamp.is_some() {
            println!("{ns}/{name}: being deleted; left to the worker");
            skipped += 1;
            continue;
        }
        let patch = match (adopt, has) {
            (true, false) => add_finalizer_patch(
                &finalizers,
                &p.resource_version().unwrap_or_default(),
                &profile.custody_finalizer,
            ),
            (false, true) => {
                remove_finalizer_patch(&finalizers, &profile.custody_finalizer).expect("present")
            }
            _ => continue,
        };
        let verb = if adopt {
            "custody taken"
        } else {
            "custody released"
        };
        if args.dry_run {
            println!(
                "{ns}/{name}: would be {}",
                if adopt {
                    "taken into custody"
                } else {
                    "released from custody"
                }
            );
            changed += 1;
            continue;
        }
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &ar);
        match api
            .patch_metadata(
                &name,
                &PatchParams::default(),
                &kube::api::Patch::<()>::Json(patch),
            )
            .await
        {
            Ok(_) => {
                println!("{ns}/{name}: {verb}");
                changed += 1;
            }
            Err(e) => {
                eprintln!("{ns}/{name}: failed: {e}");
                failed += 1;
            }
        }
    }
    println!("{changed} changed, {skipped} skipped (being deleted), {failed} failed");
    if failed > 0 {
        let hint = if adopt {
            ""
        } else {
            " (if the webhook refused it, delete the webhook configurations first)"
        };
        return Err(format!("{failed} tenants could not be changed{hint}"));
    }
    Ok(())
}

/// The tenants mid-release now (`mid_release`), each with its summary.
async fn tenants_mid_release(
    client: &kube::Client,
    profile: &Profile,
) -> Result<Vec<String>, String> {
    let keys = Keys::new(&profile.annotation_prefix);
    let parents = list_parents(client, profile, None)
        .await
        .map_err(|e| format!("cannot list tenants: {e}"))?;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let deleting: std::collections::BTreeSet<String> = namespaces
        .list_metadata(&ListParams::default())
        .await
        .map_err(|e| format!("cannot list namespaces: {e}"))?
        .items
        .into_iter()
        .filter(|n| n.metadata.deletion_timestamp.is_some())
        .map(|n| n.name_any())
        .collect();
    Ok(parents
        .iter()
        .filter_map(|p| {
            let ns = p.namespace().unwrap_or_default();
            mid_release(profile, &keys, p, deleting.contains(&ns))
        })
        .collect())
}

/// The refusal when tenants are mid-release.
fn refuse_mid_release(profile: &Profile, tenants: &[String], then: &str) -> String {
    format!(
        "volume-gate is releasing the volumes of {} being deleted: {}. Uninstalling it now would let their \
         teardown remove the CSI driver before their volumes are freed{then}. Wait until `volume-gate status` \
         shows them Released (or record an override for each: {}), then uninstall again.",
        crate::text::count(tenants.len(), "tenant"),
        tenants.join("; "),
        profile.override_command("<namespace>", "<name>")
    )
}

/// Sets the worker Deployment's replicas; returns what they were.
async fn scale_worker(
    deployments: &Api<k8s_openapi::api::apps::v1::Deployment>,
    name: &str,
    replicas: i32,
) -> Result<i32, String> {
    let before = deployments
        .get(name)
        .await
        .map_err(|e| format!("cannot read Deployment {name}: {e}"))?
        .spec
        .replicas
        .unwrap_or(1);
    deployments
        .patch(
            name,
            &PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"replicas": replicas}})),
        )
        .await
        .map_err(|e| format!("cannot scale Deployment {name} to {replicas}: {e}"))?;
    Ok(before)
}

/// Waits until no Pod of the worker runs (terminating ones included: a
/// worker stopping may still be writing).
async fn wait_worker_stopped(
    client: &kube::Client,
    namespace: &str,
    deployment: &str,
    timeout: std::time::Duration,
) -> Result<(), String> {
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(client.clone(), namespace);
    let selector = deployments
        .get(deployment)
        .await
        .map_err(|e| format!("cannot read Deployment {deployment}: {e}"))?
        .spec
        .selector
        .match_labels
        .unwrap_or_default()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    if selector.is_empty() {
        return Err(format!(
            "Deployment {deployment} selects its Pods by no matchLabels"
        ));
    }
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), namespace);
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let left = pods
            .list_metadata(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| format!("cannot list the worker's Pods: {e}"))?
            .items
            .len();
        if left == 0 {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!(
                "{} of Deployment {deployment} still running after {}s",
                crate::text::count(left, "Pod"),
                timeout.as_secs()
            ));
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

/// `volume-gate custody hand-back`: the uninstall, in the order that leaves
/// no tenant stranded and none released unprotected (`docs/operations.md`,
/// "Uninstall"):
///
/// 1. refuse while a tenant is mid-release, naming each: nothing changed;
/// 2. scale the worker to zero and wait for its Pods to stop (it would take
///    tenants back into custody), then check again: a deletion that began
///    meanwhile gets the worker back and the same refusal;
/// 3. delete the webhook configurations (the mutating one adds custody to
///    every parent written; the validating one lets only the worker end it);
/// 4. remove the custody finalizer from every tenant;
/// 5. a tenant whose deletion began between 2 and 3 keeps custody, the
///    worker is scaled back to finish it, and the command fails naming it.
pub async fn hand_back(args: HandBackArgs) -> Result<(), String> {
    use k8s_openapi::api::admissionregistration::v1::{
        MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
    };
    let profile = Profile::load_or_default(args.profile.path()).map_err(|e| e.to_string())?;
    let client = kube::Client::try_default()
        .await
        .map_err(|e| format!("cannot reach the management cluster: {e}"))?;
    let busy = tenants_mid_release(&client, &profile).await?;
    if !busy.is_empty() {
        return Err(refuse_mid_release(&profile, &busy, ""));
    }
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(client.clone(), &args.install_namespace);
    let replicas = scale_worker(&deployments, &args.worker_deployment, 0).await?;
    println!(
        "{}/{}: scaled from {replicas} to 0",
        args.install_namespace, args.worker_deployment
    );
    let restore = |why: String| {
        let (deployments, name) = (&deployments, &args.worker_deployment);
        async move {
            match scale_worker(deployments, name, replicas).await {
                Ok(_) => format!("{why} (the worker is scaled back to {replicas})"),
                Err(e) => {
                    format!("{why}; and the worker could not be scaled back to {replicas}: {e}")
                }
            }
        }
    };
    if let Err(e) = wait_worker_stopped(
        &client,
        &args.install_namespace,
        &args.worker_deployment,
        args.timeout,
    )
    .await
    {
        return Err(restore(e).await);
    }
    let busy = tenants_mid_release(&client, &profile).await?;
    if !busy.is_empty() {
        return Err(restore(refuse_mid_release(&profile, &busy, "")).await);
    }
    let name = &args.webhook_configuration;
    let mutating: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let validating: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    for (kind, deleted) in [
        (
            "MutatingWebhookConfiguration",
            mutating.delete(name, &Default::default()).await.map(|_| ()),
        ),
        (
            "ValidatingWebhookConfiguration",
            validating
                .delete(name, &Default::default())
                .await
                .map(|_| ()),
        ),
    ] {
        match deleted {
            Ok(()) => println!("{kind} {name}: deleted"),
            Err(kube::Error::Api(s)) if s.code == 404 => println!("{kind} {name}: already gone"),
            Err(e) => return Err(restore(format!("cannot delete {kind} {name}: {e}")).await),
        }
    }
    release_or_adopt(
        CustodyArgs {
            namespace: None,
            dry_run: false,
            profile: args.profile.clone(),
        },
        false,
    )
    .await?;
    let busy = tenants_mid_release(&client, &profile).await?;
    if !busy.is_empty() {
        return Err(restore(refuse_mid_release(
            &profile,
            &busy,
            "; they began their deletion while this uninstall ran, and keep custody. Restore the webhook \
             configurations (helm upgrade with the same values, or kubectl apply -k manifests/) so the worker \
             releases them behind the gate",
        ))
        .await);
    }
    println!("custody handed back; no tenant is being released");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removal_tests_the_index_it_removes() {
        let f = vec!["a".to_string(), "volumes.cozystack.io/release".to_string()];
        let p = serde_json::to_value(
            remove_finalizer_patch(&f, "volumes.cozystack.io/release").unwrap(),
        )
        .unwrap();
        assert_eq!(p[0]["op"], "test");
        assert_eq!(p[0]["path"], "/metadata/finalizers/1");
        assert_eq!(p[1]["op"], "remove");
        assert!(remove_finalizer_patch(&f, "other").is_none());
    }

    #[test]
    fn adding_creates_the_list_or_appends_and_tests_the_version() {
        let p = serde_json::to_value(add_finalizer_patch(&[], "42", "x/y")).unwrap();
        assert_eq!(p[0]["value"], "42");
        assert_eq!(p[1]["path"], "/metadata/finalizers");
        let p = serde_json::to_value(add_finalizer_patch(&["a".into()], "42", "x/y")).unwrap();
        assert_eq!(p[1]["path"], "/metadata/finalizers/-");
    }

    #[test]
    fn a_stale_version_makes_the_add_fail() {
        let mut doc = json!({"metadata": {"resourceVersion": "43", "finalizers": ["a"]}});
        assert!(
            json_patch::patch(&mut doc, &add_finalizer_patch(&["a".into()], "42", "x/y")).is_err()
        );
    }
}
