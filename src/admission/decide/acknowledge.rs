//! A kept disk acknowledged (`docs/operations.md`, "Acknowledging a kept
//! disk"): a PV the worker kept on the management side (label `kept:
//! "true"`) stays on storage on purpose, and alerts as residue until an
//! operator writes `kept-acknowledged` on it. The mutating webhook stamps
//! who wrote it and when (`kept-acknowledged-by`, `-at`) from the request
//! itself, so neither can be written by hand: any write that changes one of
//! the three is stamped anew, and withdrawing the acknowledgement removes
//! the stamps. The worker counts a kept disk as acknowledged only with its
//! stamp.

use super::update::{Change, Mutation, Requester};
use crate::record::Keys;

/// The mutations for a CREATE or UPDATE of a PersistentVolume; none when
/// the write leaves the acknowledgement and its stamps as they were.
pub fn acknowledge(
    keys: &Keys,
    change: Change<'_>,
    who: Requester<'_>,
    now: jiff::Timestamp,
) -> Vec<Mutation> {
    let Change { old, new } = change;
    let value = |m: Option<&crate::admission::request::ObjectMetaView>, k: &str| {
        m.and_then(|m| m.annotations.get(k)).cloned()
    };
    let ours = [
        &keys.kept_acknowledged,
        &keys.kept_acknowledged_by,
        &keys.kept_acknowledged_at,
    ];
    if ours.iter().all(|k| value(old, k) == value(Some(new), k)) {
        return Vec::new();
    }
    if value(Some(new), &keys.kept_acknowledged).is_some_and(|v| !v.trim().is_empty()) {
        return vec![Mutation::StampAcknowledged {
            by: who.username.to_string(),
            at: crate::record::rfc3339(now),
        }];
    }
    let present: Vec<String> = [&keys.kept_acknowledged_by, &keys.kept_acknowledged_at]
        .into_iter()
        .filter(|k| new.annotations.contains_key(k.as_str()))
        .cloned()
        .collect();
    if present.is_empty() {
        Vec::new()
    } else {
        vec![Mutation::Unstamp { keys: present }]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::request::ObjectMetaView;

    fn pv(annotations: &[(&str, &str)]) -> ObjectMetaView {
        ObjectMetaView {
            name: "pvc-1".into(),
            annotations: annotations
                .iter()
                .map(|(k, v)| (format!("volumes.cozystack.io/{k}"), v.to_string()))
                .collect(),
            ..Default::default()
        }
    }

    fn run(old: Option<&ObjectMetaView>, new: &ObjectMetaView, user: &str) -> Vec<Mutation> {
        let keys = Keys::new("volumes.cozystack.io/");
        let now = "2026-12-07T12:00:00Z".parse().unwrap();
        acknowledge(
            &keys,
            Change { old, new },
            Requester {
                username: user,
                is_worker: false,
            },
            now,
        )
    }

    fn stamp(by: &str) -> Vec<Mutation> {
        vec![Mutation::StampAcknowledged {
            by: by.into(),
            at: "2026-12-07T12:00:00Z".into(),
        }]
    }

    #[test]
    fn an_acknowledgement_is_stamped_with_who_wrote_it() {
        let old = pv(&[("kept", "true")]);
        let new = pv(&[("kept", "true"), ("kept-acknowledged", "restored by hand")]);
        assert_eq!(run(Some(&old), &new, "alice"), stamp("alice"));
    }

    #[test]
    fn a_stamp_written_by_hand_is_replaced_by_the_writer() {
        let old = pv(&[
            ("kept-acknowledged", "x"),
            ("kept-acknowledged-by", "alice"),
            ("kept-acknowledged-at", "2026-12-01T00:00:00Z"),
        ]);
        let forged = pv(&[
            ("kept-acknowledged", "x"),
            ("kept-acknowledged-by", "the-boss"),
            ("kept-acknowledged-at", "2026-12-01T00:00:00Z"),
        ]);
        assert_eq!(run(Some(&old), &forged, "mallory"), stamp("mallory"));
        // On a CREATE too: nothing is taken from the object as written.
        assert_eq!(run(None, &forged, "mallory"), stamp("mallory"));
    }

    #[test]
    fn other_writes_leave_the_stamp_alone() {
        let a = pv(&[
            ("kept-acknowledged", "x"),
            ("kept-acknowledged-by", "alice"),
            ("kept-acknowledged-at", "2026-12-01T00:00:00Z"),
        ]);
        let mut b = a.clone();
        b.labels.insert("unrelated".into(), "yes".into());
        assert_eq!(run(Some(&a), &b, "pv-controller"), vec![]);
        assert_eq!(run(None, &pv(&[("kept", "true")]), "worker"), vec![]);
    }

    #[test]
    fn a_withdrawn_or_empty_acknowledgement_loses_its_stamps() {
        let old = pv(&[
            ("kept-acknowledged", "x"),
            ("kept-acknowledged-by", "alice"),
            ("kept-acknowledged-at", "2026-12-01T00:00:00Z"),
        ]);
        let withdrawn = pv(&[
            ("kept-acknowledged-by", "alice"),
            ("kept-acknowledged-at", "2026-12-01T00:00:00Z"),
        ]);
        assert_eq!(
            run(Some(&old), &withdrawn, "bob"),
            vec![Mutation::Unstamp {
                keys: vec![
                    "volumes.cozystack.io/kept-acknowledged-by".into(),
                    "volumes.cozystack.io/kept-acknowledged-at".into()
                ]
            }]
        );
        let empty = pv(&[
            ("kept-acknowledged", " "),
            ("kept-acknowledged-by", "alice"),
        ]);
        assert_eq!(
            run(Some(&old), &empty, "bob"),
            vec![Mutation::Unstamp {
                keys: vec!["volumes.cozystack.io/kept-acknowledged-by".into()]
            }]
        );
    }
}
