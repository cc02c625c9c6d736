//! The map of the tree is `docs/design.md` §7, one table: every source
//! file is in it, and everything it names exists. The module docs and the
//! README point to it; this keeps it from drifting as files come and go.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const ROOTS: [&str; 5] = ["src/", "tests/", "docs/", "manifests/", "examples/"];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The paths the §7 table names in its right-hand column. A name is a path
/// from the repository's root, or (without one of its roots) relative to
/// the directory of the root path before it in the same cell:
/// "`src/admission/decide.rs`, `decide/update.rs`".
fn mapped() -> BTreeSet<String> {
    let design =
        std::fs::read_to_string(repo().join("docs/design.md")).expect("read docs/design.md");
    let start = design
        .find("## §7 Where things live")
        .expect("design.md has §7");
    let section = &design[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
    let mut out = BTreeSet::new();
    for row in section
        .lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|---"))
    {
        let cells: Vec<&str> = row.split('|').collect();
        let Some(files) = cells.get(cells.len().saturating_sub(2)) else {
            continue;
        };
        let mut dir: Option<String> = None;
        for quoted in files.split('`').skip(1).step_by(2) {
            for name in quoted.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                // A name with a note ("`context.rs` (`run_phase`)") is split by
                // the backticks already; a command or flag is not a path.
                if name.contains([' ', '*', '<']) || !name.contains('.') && !name.ends_with('/') {
                    continue;
                }
                let path = if ROOTS.iter().any(|r| name.starts_with(r)) {
                    name.to_string()
                } else if let Some(d) = &dir {
                    format!("{d}/{name}")
                } else {
                    continue;
                };
                let parent = Path::new(&path).parent().map(|p| p.display().to_string());
                if ROOTS.iter().any(|r| name.starts_with(r)) {
                    dir = if path.ends_with('/') {
                        Some(path.trim_end_matches('/').to_string())
                    } else {
                        parent
                    };
                }
                out.insert(path);
            }
        }
    }
    out
}

fn sources(dir: &Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).expect("read a source directory") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path.strip_prefix(repo()).unwrap().display().to_string());
        }
    }
}

#[test]
fn every_source_file_is_on_the_map_and_every_mapped_path_exists() {
    let mapped = mapped();
    assert!(
        mapped.len() > 40,
        "the §7 table names too few paths to be read right: {mapped:?}"
    );
    let mut files = Vec::new();
    sources(&repo().join("src"), &mut files);
    let missing: Vec<&String> = files
        .iter()
        .filter(|f| {
            !mapped.contains(*f)
                && !mapped
                    .iter()
                    .any(|m| m.ends_with('/') && f.starts_with(m.as_str()))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "source files missing from docs/design.md §7 (add a row, or name them in one): {missing:?}"
    );
    let stale: Vec<&String> = mapped
        .iter()
        .filter(|m| !repo().join(m.trim_end_matches('/')).exists())
        .collect();
    assert!(
        stale.is_empty(),
        "docs/design.md §7 names paths that do not exist: {stale:?}"
    );
}
