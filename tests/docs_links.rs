//! Every pointer an operator follows leads somewhere: a relative link in the
//! README or `docs/` names a file that exists and a heading that is there;
//! every alert the chart ships has its runbook section in
//! `docs/operations.md` and a `runbook_url` to it; every Event reason the
//! worker publishes and every error kind it counts has a section there; and
//! a citation of a section in prose or comments (`docs/X.md, "Section"`,
//! `README, "Section"`, `docs/design.md` §5b) names a heading that exists.
//!
//! Anchors are GitHub's: the heading's rendered text, lowercased, spaces to
//! `-`, every other character but letters, digits, `-` and `_` dropped; a
//! repeated heading gets `-1`, `-2`. No control plane: plain files only.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("read {rel}: {e}"))
}

/// A Markdown heading: its text as written and its GitHub anchor.
#[derive(Debug, Clone)]
struct Heading {
    text: String,
    anchor: String,
}

/// The text GitHub renders for a heading's source: code spans keep their
/// content, links their text, emphasis markers go.
fn rendered(source: &str) -> String {
    let mut out = String::new();
    let mut rest = source;
    while let Some(c) = rest.chars().next() {
        if c == '['
            && let Some(close) = rest.find("](")
            && let Some(end) = rest[close..].find(')')
        {
            out.push_str(&rendered(&rest[1..close]));
            rest = &rest[close + end + 1..];
            continue;
        }
        if c != '`' && c != '*' {
            out.push(c);
        }
        rest = &rest[c.len_utf8()..];
    }
    out.trim().to_string()
}

/// GitHub's anchor for a heading's rendered text (github-slugger).
fn slug(text: &str) -> String {
    text.to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The lines of a Markdown text outside fenced code blocks, with their
/// 1-based numbers.
fn prose_lines(markdown: &str) -> Vec<(usize, &str)> {
    let mut fence: Option<(char, usize)> = None;
    let mut out = Vec::new();
    for (i, line) in markdown.lines().enumerate() {
        let t = line.trim_start();
        let marker = t.chars().next().filter(|c| *c == '`' || *c == '~');
        if let Some(m) = marker {
            let run = t.chars().take_while(|c| *c == m).count();
            if run >= 3 {
                match fence {
                    None => fence = Some((m, run)),
                    Some((f, n)) if f == m && run >= n && t[run..].trim().is_empty() => {
                        fence = None
                    }
                    Some(_) => {}
                }
                continue;
            }
        }
        if fence.is_none() {
            out.push((i + 1, line));
        }
    }
    out
}

/// The ATX headings of a Markdown text, in order, with GitHub's anchors
/// (a repeated one numbered as GitHub numbers it).
fn headings(markdown: &str) -> Vec<Heading> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = Vec::new();
    for (_, line) in prose_lines(markdown) {
        if line.len() - line.trim_start().len() > 3 {
            continue;
        }
        let t = line.trim_start();
        let level = t.chars().take_while(|c| *c == '#').count();
        if !(1..=6).contains(&level) {
            continue;
        }
        let rest = &t[level..];
        if !(rest.is_empty() || rest.starts_with(' ') || rest.starts_with('\t')) {
            continue;
        }
        // A closing run of `#`, after a space, is not part of the text.
        let mut text = rest.trim();
        let stripped = text.trim_end_matches('#');
        if stripped.len() < text.len() && (stripped.is_empty() || stripped.ends_with(' ')) {
            text = stripped.trim_end();
        }
        let text = rendered(text);
        let base = slug(&text);
        let mut anchor = base.clone();
        let n = seen.entry(base.clone()).or_insert(0);
        if *n > 0 {
            anchor = format!("{base}-{n}");
        }
        *n += 1;
        out.push(Heading { text, anchor });
    }
    out
}

fn headings_of(rel: &str) -> Vec<Heading> {
    headings(&read(rel))
}

/// The Markdown files whose links are checked: the README and `docs/*.md`.
fn markdown_files() -> Vec<String> {
    let mut files = vec!["README.md".to_string()];
    let mut docs: Vec<String> = std::fs::read_dir(repo().join("docs"))
        .expect("read docs/")
        .map(|e| {
            e.expect("a docs/ entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The targets of the inline links `[text](target)` of a Markdown line,
/// outside code spans.
fn link_targets(line: &str) -> Vec<String> {
    // Code spans are not links: blank them out first.
    let mut plain = String::new();
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
            plain.push(' ');
        } else {
            plain.push(if in_code { ' ' } else { c });
        }
    }
    let mut out = Vec::new();
    let mut rest = plain.as_str();
    while let Some(i) = rest.find("](") {
        let after = &rest[i + 2..];
        let Some(end) = after.find(')') else { break };
        // A title after the path (`(path "title")`) is not part of it.
        let target = after[..end].split_whitespace().next().unwrap_or("");
        out.push(target.trim_matches(['<', '>']).to_string());
        rest = &after[end..];
    }
    out
}

#[test]
fn relative_links_in_the_readme_and_docs_reach_a_file_and_a_heading_there() {
    let mut missing = Vec::new();
    let mut checked = 0;
    for file in markdown_files() {
        let text = read(&file);
        let dir = Path::new(&file)
            .parent()
            .unwrap_or(Path::new(""))
            .to_path_buf();
        for (n, line) in prose_lines(&text) {
            for target in link_targets(line) {
                if target.contains("://") || target.starts_with("mailto:") || target.is_empty() {
                    continue;
                }
                checked += 1;
                let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
                let linked = if path.is_empty() {
                    PathBuf::from(&file)
                } else {
                    dir.join(path)
                };
                if !repo().join(&linked).exists() {
                    missing.push(format!(
                        "{file}:{n}: link ({target}): no file {}",
                        linked.display()
                    ));
                    continue;
                }
                if anchor.is_empty() || linked.extension().is_none_or(|e| e != "md") {
                    continue;
                }
                let there = headings_of(&linked.display().to_string());
                if !there.iter().any(|h| h.anchor == anchor) {
                    missing.push(format!(
                        "{file}:{n}: link ({target}): {} has no heading with anchor #{anchor} (its anchors: {})",
                        linked.display(),
                        there
                            .iter()
                            .map(|h| h.anchor.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ));
                }
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} relative links found: the links are not being read"
    );
    assert!(
        missing.is_empty(),
        "broken links (fix the link, or the heading it names):\n{}",
        missing.join("\n")
    );
}

const RUNBOOK: &str = "docs/operations.md";
const ALERTS: &str = "manifests/chart/volume-gate/templates/monitoring.yaml";

/// The runbook's section for `name`: a heading whose text is exactly it.
fn runbook_section<'a>(runbook: &'a [Heading], name: &str) -> Option<&'a Heading> {
    runbook.iter().find(|h| h.text == name)
}

/// The alerts of the chart's PrometheusRule: each `- alert: Name` and the
/// lines of its rule (up to the next rule, or the end of the list; the
/// template's own `{{ ... }}` lines do not end a rule).
fn alert_rules(template: &str) -> Vec<(usize, String, Vec<String>)> {
    let lines: Vec<&str> = template.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        let Some(name) = t.strip_prefix("- alert:") else {
            continue;
        };
        let indent = line.len() - t.len();
        let mut body = Vec::new();
        for next in &lines[i + 1..] {
            let nt = next.trim_start();
            if nt.is_empty() || (nt.starts_with("{{") && nt.ends_with("}}")) {
                continue;
            }
            if nt.starts_with("- alert:") || next.len() - nt.len() <= indent {
                break;
            }
            body.push(nt.to_string());
        }
        out.push((i + 1, name.trim().trim_matches('"').to_string(), body));
    }
    out
}

/// Whether `url` ends its address with `fragment` (`#anchor`, then the end
/// of the value, a quote or a space; not a longer anchor).
fn leads_to(url: &str, fragment: &str) -> bool {
    url.match_indices(fragment).any(|(i, _)| {
        url[i + fragment.len()..]
            .chars()
            .next()
            .is_none_or(|c| !(c.is_alphanumeric() || c == '-' || c == '_'))
    })
}

#[test]
fn every_alert_has_a_runbook_section_and_a_runbook_url_to_it() {
    let runbook = headings_of(RUNBOOK);
    let rules = alert_rules(&read(ALERTS));
    assert!(
        rules.len() >= 4,
        "{ALERTS}: only {} alerts found: the rules are not being read",
        rules.len()
    );
    let mut missing = Vec::new();
    for (line, name, body) in &rules {
        let Some(section) = runbook_section(&runbook, name) else {
            missing.push(format!(
                "{ALERTS}:{line}: alert {name}: {RUNBOOK} has no heading `{name}` (its runbook section)"
            ));
            continue;
        };
        let fragment = format!("#{}", section.anchor);
        match body.iter().find(|l| l.starts_with("runbook_url:")) {
            None => missing.push(format!(
                "{ALERTS}:{line}: alert {name}: no runbook_url annotation (it should end in {fragment}, the anchor of its section in {RUNBOOK})"
            )),
            Some(url) if !leads_to(url, &fragment) => missing.push(format!(
                "{ALERTS}:{line}: alert {name}: `{url}` does not lead to {fragment}, the anchor of its section in {RUNBOOK}"
            )),
            Some(_) => {}
        }
    }
    assert!(
        missing.is_empty(),
        "alerts without a runbook:\n{}",
        missing.join("\n")
    );
}

/// The names an enum gives its values in `fn as_str`, read from the source
/// as the code defines them (`Reason::X => "X",`), checked against the
/// length of its `ALL` array so a misread cannot pass unnoticed.
fn as_str_names(rel: &str, ty: &str) -> Vec<String> {
    let source = read(rel);
    let start = source
        .find(&format!("impl {ty} {{"))
        .unwrap_or_else(|| panic!("{rel}: no `impl {ty}`"));
    let body = &source[start..];
    let all = body
        .find(&format!("pub const ALL: [{ty}; "))
        .unwrap_or_else(|| panic!("{rel}: no `{ty}::ALL`"));
    let len: usize = body[all..]
        .split("; ")
        .nth(1)
        .and_then(|s| s.split(']').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("{rel}: cannot read the length of `{ty}::ALL`"));
    let f = body
        .find("fn as_str(self)")
        .unwrap_or_else(|| panic!("{rel}: no `{ty}::as_str`"));
    let f = &body[f..];
    let f = &f[..f.find("\n    }\n").unwrap_or(f.len())];
    let names: Vec<String> = f
        .lines()
        .filter_map(|l| l.split_once("=> \""))
        .filter_map(|(_, rest)| rest.split('"').next())
        .map(str::to_string)
        .collect();
    assert_eq!(
        names.len(),
        len,
        "{rel}: read {names:?} from `{ty}::as_str`, but `{ty}::ALL` has {len}"
    );
    names
}

#[test]
fn every_event_reason_and_error_kind_has_a_runbook_section() {
    let runbook = headings_of(RUNBOOK);
    let mut missing = Vec::new();
    for (rel, ty, what) in [
        ("src/worker/events.rs", "Reason", "Event reason"),
        ("src/worker/errors.rs", "ErrorKind", "error kind"),
    ] {
        for name in as_str_names(rel, ty) {
            if runbook_section(&runbook, &name).is_none() {
                missing.push(format!(
                    "{rel}: {what} {name} has no heading `{name}` in {RUNBOOK}"
                ));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "what the worker reports, without a runbook section:\n{}",
        missing.join("\n")
    );
}

/// Every text file under `dir`, relative to the repository.
fn files_under(dir: &str, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(repo().join(dir)).unwrap_or_else(|e| panic!("read {dir}: {e}")) {
        let entry = entry.expect("a directory entry");
        let rel = format!("{dir}/{}", entry.file_name().to_string_lossy());
        if entry.path().is_dir() {
            files_under(&rel, out);
        } else {
            out.push(rel);
        }
    }
}

/// A file's prose as one line: each line without its indentation and
/// comment markers (`//!`, `///`, `//`, `#`, `*` outside Markdown), joined
/// by spaces, so a citation broken over two comment lines reads whole;
/// with the offset each line starts at.
fn joined(rel: &str, text: &str) -> (String, Vec<usize>) {
    let markdown = rel.ends_with(".md");
    let mut out = String::new();
    let mut starts = Vec::new();
    for line in text.lines() {
        let mut t = line.trim();
        if !markdown {
            for marker in ["//!", "///", "//", "#", "*"] {
                if let Some(rest) = t.strip_prefix(marker) {
                    t = rest.trim_start();
                    break;
                }
            }
        }
        starts.push(out.len());
        out.push_str(t);
        out.push(' ');
    }
    if rel.ends_with(".rs") {
        // A citation inside a Rust string literal.
        out = out.replace("\\\"", "\"");
    }
    (out, starts)
}

/// One citation: the document, and the section it names, if any.
#[derive(Debug)]
struct Citation {
    offset: usize,
    document: String,
    section: Option<Section>,
}

#[derive(Debug)]
enum Section {
    /// `, "Title"`: a heading that is the title, or begins with it followed
    /// by `:`, `,` or ` (` (a title cited by its first words: "The disk
    /// path" for "The disk path: which parts are Kubernetes' own").
    Quoted(String),
    /// `§5b`: a heading that starts with it.
    Numbered(String),
}

/// The citations of documents in a text: `docs/X.md` or `README` (optionally
/// `.md`, optionally in backticks), followed by `, "Section"`, `"Section"`
/// or `§N`.
fn citations(text: &str) -> Vec<Citation> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    for (i, _) in text.match_indices(['d', 'R']) {
        if i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || b"/_-.".contains(&bytes[i - 1])) {
            continue;
        }
        let rest = &text[i..];
        let document = if let Some(name) = rest.strip_prefix("docs/") {
            let stem: String = name
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
                .collect();
            if stem.is_empty() || !name[stem.len()..].starts_with(".md") {
                continue;
            }
            format!("docs/{stem}.md")
        } else if let Some(after) = rest.strip_prefix("README") {
            let longer = after
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
            if longer {
                continue;
            }
            "README.md".to_string()
        } else {
            continue;
        };
        let written = if document == "README.md" && !rest.starts_with("README.md") {
            "README".len()
        } else {
            document.len()
        };
        let after = rest[written..]
            .strip_prefix('`')
            .unwrap_or(&rest[written..]);
        let after = after.strip_prefix(',').unwrap_or(after).trim_start();
        let section = if let Some(quoted) = after.strip_prefix('"') {
            quoted
                .find('"')
                .map(|end| Section::Quoted(quoted[..end].to_string()))
        } else if let Some(number) = after.strip_prefix('§') {
            let n: String = number
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect();
            (!n.is_empty()).then(|| Section::Numbered(format!("§{n}")))
        } else {
            None
        };
        out.push(Citation {
            offset: i,
            document,
            section,
        });
    }
    out
}

#[test]
fn every_cited_document_and_section_exists() {
    let mut files = vec!["README.md".to_string()];
    for dir in ["docs", "manifests", "src"] {
        files_under(dir, &mut files);
    }
    let mut cache: BTreeMap<String, Option<Vec<Heading>>> = BTreeMap::new();
    let mut sections = 0;
    let mut missing = Vec::new();
    for file in files {
        let Ok(text) = std::fs::read_to_string(repo().join(&file)) else {
            continue;
        };
        let (text, starts) = joined(&file, &text);
        for c in citations(&text) {
            let line = starts.partition_point(|s| *s <= c.offset);
            let headings = cache
                .entry(c.document.clone())
                .or_insert_with(|| {
                    std::fs::read_to_string(repo().join(&c.document))
                        .ok()
                        .map(|t| headings(&t))
                })
                .clone();
            let Some(headings) = headings else {
                missing.push(format!(
                    "{file}:{line}: cites {}, which does not exist",
                    c.document
                ));
                continue;
            };
            let Some(section) = &c.section else {
                continue;
            };
            sections += 1;
            let (found, cited) = match section {
                Section::Quoted(title) => (
                    headings.iter().any(|h| {
                        h.text == *title
                            || h.text
                                .strip_prefix(title.as_str())
                                .is_some_and(|r| [":", ",", " ("].iter().any(|p| r.starts_with(p)))
                    }),
                    format!("\"{title}\""),
                ),
                Section::Numbered(n) => (
                    headings
                        .iter()
                        .any(|h| h.text == *n || h.text.starts_with(&format!("{n} "))),
                    n.clone(),
                ),
            };
            if !found {
                missing.push(format!(
                    "{file}:{line}: cites {}, {cited}: no such heading there",
                    c.document
                ));
            }
        }
    }
    assert!(
        sections > 20,
        "only {sections} cited sections found: the citations are not being read"
    );
    assert!(
        missing.is_empty(),
        "citations of sections that do not exist (fix the citation, or the heading):\n{}",
        missing.join("\n")
    );
}

#[test]
fn anchors_are_githubs() {
    let md = "# A\n\n## §7 Where things live\n\n```sh\n# not a heading\n```\n\n\
              ### The reviewed surface (`tests/surface.rs`)\n\n## Benchmarks 3–5: a_b, [link](x.md) **bold**\n\n\
              ## Results\n\n## Results\n\n## Results ##\n";
    let anchors: Vec<String> = headings(md).into_iter().map(|h| h.anchor).collect();
    assert_eq!(
        anchors,
        [
            "a",
            "7-where-things-live",
            "the-reviewed-surface-testssurfacers",
            "benchmarks-35-a_b-link-bold",
            "results",
            "results-1",
            "results-2",
        ]
    );
}

#[test]
fn a_runbook_url_leads_to_its_anchor_and_not_a_longer_one() {
    let url = "runbook_url: {{ $base }}#volumegateresidue";
    assert!(leads_to(url, "#volumegateresidue"));
    assert!(leads_to(
        &format!("{url}\"  # quoted"),
        "#volumegateresidue"
    ));
    assert!(!leads_to(url, "#volumegateresidu"));
    assert!(!leads_to(
        "runbook_url: {{ $base }}#volumegate-residue",
        "#volumegateresidue"
    ));
}
