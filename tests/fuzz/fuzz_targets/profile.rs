//! Target 3: platform profiles (src/profile.rs) from arbitrary UTF-8.
//!
//! Invariants, on every input:
//! - `Profile::from_yaml` never panics (nor hangs or blows memory: the run's
//!   -timeout and -rss_limit_mb say so);
//! - Ok implies `validate()` is Ok;
//! - Ok implies the profile recognises what it names: for sample tenants,
//!   the CSI release `csi_release_name(t).expect("Cozystack has a CSI release")` classifies as that tenant's CSI
//!   release, and each guarded `name` pattern filled with t classifies as
//!   guarded for t (unless an earlier guarded entry of the same kind, or
//!   the parent kind, claims it first: reported, not asserted); the
//!   parent's labels make a parent; `override_command` and
//!   `parent_selector` never panic.

#![no_main]

#[path = "../common/mod.rs"]
mod common;

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use volume_gate::admission::decide::{Target, classify};
use volume_gate::profile::{GroupKind, Profile, TENANT_PLACEHOLDER, flux_release_kind, tenant_from_name};

const TENANTS: [&str; 3] = ["kubernetes-a", "x", "t-csi"];

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(p) = Profile::from_yaml(text) else { return };
    if let Err(e) = p.validate() {
        panic!("from_yaml accepted a profile validate() refuses: {e}");
    }
    let _ = p.override_command("ns", "t");
    let _ = p.parent_selector();
    let _ = p.kubeconfig_secret_name("t");

    let parent_kind = p.parent_kind();
    let none = BTreeMap::new();
    for t in TENANTS {
        assert_eq!(classify(&p, &parent_kind, t, &p.parent.match_labels), Target::Parent { tenant: t.to_string() });

        // A profile without a CSI release (Cluster API's) has none to recognise.
        if let (Some(csi), Some(pattern)) = (p.csi_release_name(t), p.csi_release.as_deref()) {
            let got = classify(&p, &flux_release_kind(), &csi, &none);
            // F2 (known): validate() lets csiRelease hold {tenant} more than once,
            // and such a pattern never matches the name it describes.
            let known_f2 = pattern.matches(TENANT_PLACEHOLDER).count() > 1 && !common::check_known("F2");
            if !known_f2 {
                assert_eq!(
                    got,
                    Target::CsiRelease { tenant: t.to_string() },
                    "csiRelease {pattern:?}: the CSI release {csi:?} of tenant {t:?} is not recognised"
                );
            }
        }

        for (i, g) in p.guarded.iter().enumerate() {
            let Some(pattern) = &g.name else { continue };
            let kind = GroupKind::new(&g.group, &g.kind);
            let name = pattern.replace(TENANT_PLACEHOLDER, t);
            assert_eq!(tenant_from_name(pattern, &name).as_deref(), Some(t), "guarded[{i}] pattern {pattern:?}");
            let shadowed = kind == parent_kind
                || p.guarded[..i].iter().any(|e| e.group == g.group && e.kind == g.kind);
            if !shadowed {
                let got = classify(&p, &kind, &name, &none);
                assert_eq!(got, Target::Guarded { tenant: t.to_string(), role: g.role.clone() }, "guarded[{i}] {name:?}");
            }
        }
    }
});
