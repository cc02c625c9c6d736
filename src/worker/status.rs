//! `volume-gate status`: every tenant and its release state, like `kubectl get`.

use kube::api::DynamicObject;
use kube::core::PartialObjectMeta;
use kube::{Resource, ResourceExt};
use serde::Serialize;

use super::custody::list_parents;
use crate::profile::Profile;
use crate::record::{Keys, Record};

#[derive(clap::Args, Debug, Clone)]
pub struct StatusArgs {
    /// Only tenants in this namespace.
    #[arg(long, short = 'n')]
    pub namespace: Option<String>,
    /// Output format: table or json.
    #[arg(long, short = 'o', default_value = "table", value_parser = ["table", "wide", "json"])]
    pub output: String,
    #[command(flatten)]
    pub profile: crate::args::ProfileArg,
}

/// One tenant's row.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TenantStatus {
    pub namespace: String,
    pub name: String,
    /// Releasing, Released, Blocked, Overridden, or NotStarted.
    pub phase: String,
    pub in_custody: bool,
    pub deleting: bool,
    pub volumes_total: Option<usize>,
    pub volumes_left: Option<usize>,
    pub created: Option<String>,
    /// When the tenant's deletion was asked for.
    pub deleted: Option<String>,
    pub released_at: Option<String>,
    pub override_by: Option<String>,
    pub message: Option<String>,
}

pub fn tenant_status(
    keys: &Keys,
    profile: &Profile,
    p: &PartialObjectMeta<DynamicObject>,
) -> TenantStatus {
    let record = Record::from_annotations(keys, p.annotations());
    TenantStatus {
        namespace: p.namespace().unwrap_or_default(),
        name: p.name_any(),
        phase: record
            .phase
            .map_or_else(|| "NotStarted".to_string(), |ph| ph.to_string()),
        in_custody: p.finalizers().contains(&profile.custody_finalizer),
        deleting: p.meta().deletion_timestamp.is_some(),
        volumes_total: record.inventory.as_ref().map(|i| i.total),
        volumes_left: record.inventory.as_ref().map(|i| i.left()),
        created: p
            .meta()
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.to_string()),
        deleted: p
            .meta()
            .deletion_timestamp
            .as_ref()
            .map(|t| t.0.to_string()),
        released_at: record.released_at.clone(),
        override_by: record.override_.as_ref().and_then(|o| o.by.clone()),
        message: record.message.clone(),
    }
}

/// `5m`, `3h`, `2d`, as kubectl prints ages.
pub fn age(created: Option<&str>, now: jiff::Timestamp) -> String {
    let Some(t) = created.and_then(|c| c.parse::<jiff::Timestamp>().ok()) else {
        return "<unknown>".into();
    };
    let secs = (now.as_second() - t.as_second()).max(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 2 * 3600 => format!("{}m", s / 60),
        s if s < 48 * 3600 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

/// How long a tenant in teardown has waited since its deletion, until its
/// release ends (`Released` or `Overridden`); `-` otherwise.
pub fn waiting(r: &TenantStatus, now: jiff::Timestamp) -> String {
    let ended = matches!(r.phase.as_str(), "Released" | "Overridden");
    match &r.deleted {
        Some(d) if !ended => age(Some(d), now),
        _ => "-".into(),
    }
}

/// The table, columns padded like `kubectl get`.
pub fn render_table(rows: &[TenantStatus], wide: bool, now: jiff::Timestamp) -> String {
    let mut table: Vec<Vec<String>> = vec![
        [
            "NAMESPACE",
            "NAME",
            "PHASE",
            "VOLUMES LEFT",
            "WAITING",
            "AGE",
            "OVERRIDE BY",
        ]
        .map(String::from)
        .to_vec(),
    ];
    if wide {
        table[0].extend(["CUSTODY", "MESSAGE"].map(String::from));
    }
    for r in rows {
        let left = match (r.volumes_left, r.volumes_total) {
            (Some(l), Some(t)) => format!("{l}/{t}"),
            _ => "-".into(),
        };
        let phase = if r.deleting && r.phase == "NotStarted" {
            "Deleting".to_string()
        } else {
            r.phase.clone()
        };
        let mut row = vec![
            r.namespace.clone(),
            r.name.clone(),
            phase,
            left,
            waiting(r, now),
            age(r.created.as_deref(), now),
            r.override_by.clone().unwrap_or_else(|| "-".into()),
        ];
        if wide {
            row.push(if r.in_custody {
                "yes".into()
            } else {
                "no".into()
            });
            row.push(r.message.clone().unwrap_or_default());
        }
        table.push(row);
    }
    let widths: Vec<usize> = (0..table[0].len())
        .map(|c| table.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in &table {
        let line: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(i, cell)| format!("{cell:<w$}", w = widths[i]))
            .collect();
        out.push_str(line.join("   ").trim_end());
        out.push('\n');
    }
    out
}

pub async fn run(args: StatusArgs) -> Result<(), String> {
    let profile = Profile::load_or_default(args.profile.path()).map_err(|e| e.to_string())?;
    let keys = Keys::new(&profile.annotation_prefix);
    let client = kube::Client::try_default()
        .await
        .map_err(|e| format!("cannot reach the management cluster: {e}"))?;
    let parents = list_parents(&client, &profile, args.namespace.as_deref())
        .await
        .map_err(|e| format!("cannot list tenants: {e}"))?;
    let rows: Vec<TenantStatus> = parents
        .iter()
        .map(|p| tenant_status(&keys, &profile, p))
        .collect();
    if args.output == "json" {
        println!(
            "{}",
            serde_json::to_string_pretty(&rows).expect("rows serialize")
        );
    } else if rows.is_empty() {
        eprintln!("No tenants found.");
    } else {
        print!(
            "{}",
            render_table(&rows, args.output == "wide", jiff::Timestamp::now())
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(phase: &str) -> TenantStatus {
        TenantStatus {
            namespace: "tenant-a".into(),
            name: "kubernetes-a".into(),
            phase: phase.into(),
            in_custody: true,
            deleting: false,
            volumes_total: Some(10),
            volumes_left: Some(3),
            created: Some("2026-12-02T09:00:00Z".into()),
            deleted: None,
            released_at: None,
            override_by: None,
            message: Some("3/10".into()),
        }
    }

    #[test]
    fn the_table_has_kubectl_like_columns() {
        let now: jiff::Timestamp = "2026-12-02T10:30:00Z".parse().unwrap();
        let t = render_table(&[row("Blocked")], false, now);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("NAMESPACE"), "{t}");
        assert!(
            lines[1].contains("Blocked") && lines[1].contains("3/10") && lines[1].contains("90m"),
            "{t}"
        );
    }

    #[test]
    fn waiting_counts_from_the_deletion_until_the_release_ends() {
        let now: jiff::Timestamp = "2026-12-02T10:30:00Z".parse().unwrap();
        let mut blocked = row("Blocked");
        assert_eq!(waiting(&blocked, now), "-", "not being deleted");
        blocked.deleting = true;
        blocked.deleted = Some("2026-12-02T10:00:00Z".into());
        assert_eq!(waiting(&blocked, now), "30m");
        let t = render_table(std::slice::from_ref(&blocked), false, now);
        let header: Vec<&str> = t.lines().next().unwrap().split_whitespace().collect();
        assert!(header.contains(&"WAITING"), "{t}");
        // A tenant's age is not how long it has waited.
        assert!(t.lines().nth(1).unwrap().contains("90m"), "{t}");
        for ended in ["Released", "Overridden"] {
            let mut r = blocked.clone();
            r.phase = ended.into();
            assert_eq!(waiting(&r, now), "-", "{ended}");
        }
    }

    #[test]
    fn ages_read_like_kubectl() {
        let now: jiff::Timestamp = "2026-12-05T00:00:00Z".parse().unwrap();
        assert_eq!(age(Some("2026-12-04T23:59:30Z"), now), "30s");
        assert_eq!(age(Some("2026-12-04T23:00:00Z"), now), "60m");
        assert_eq!(age(Some("2026-12-04T00:00:00Z"), now), "24h");
        assert_eq!(age(Some("2026-12-01T00:00:00Z"), now), "4d");
        assert_eq!(age(None, now), "<unknown>");
    }
}
