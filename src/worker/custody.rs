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

#[derive(clap::Subcommand, Debug, Clone)]
pub enum CustodyCommand {
    /// Uninstall step: remove the custody finalizer from every tenant that is
    /// not being deleted, so removing volume-gate strands nothing. Stop the
    /// worker and delete the webhook configurations first.
    Release(CustodyArgs),
    /// Install step: add the custody finalizer to every tenant that is not
    /// being deleted (the worker also does this on its own).
    Adopt(CustodyArgs),
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
    let (args, adopt) = match cmd {
        CustodyCommand::Release(a) => (a, false),
        CustodyCommand::Adopt(a) => (a, true),
    };
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
