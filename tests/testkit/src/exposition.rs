//! Reading the text a process serves on /metrics (Prometheus text or
//! OpenMetrics exposition): every sample with its labels, strictly (what
//! cannot be read is an error, not skipped), and lookups of one metric for
//! the tests that read a gauge or counter of the real processes.

use std::collections::{BTreeMap, BTreeSet};

/// One sample of a text exposition: its metric name, labels and value.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// The samples of a Prometheus text or OpenMetrics exposition (what
/// `/metrics` serves). Comments (`# HELP`, `# TYPE`, `# UNIT`, `# EOF`) are
/// skipped; a sample with a timestamp, or a series given twice, is an error:
/// the converter writes each sample at its scrape's time.
pub fn parse_exposition(text: &str) -> Result<Vec<Sample>, String> {
    let mut out = Vec::new();
    let mut seen = BTreeSet::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let sample = parse_line(line).map_err(|e| format!("line {}: {e}: {line}", n + 1))?;
        let key = series_key(&sample.name, &sample.labels);
        if !seen.insert(key.clone()) {
            return Err(format!("line {}: {key} given twice", n + 1));
        }
        out.push(sample);
    }
    Ok(out)
}

fn parse_line(line: &str) -> Result<Sample, String> {
    let name_end = line
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        return Err("no metric name".into());
    }
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(after) = rest.strip_prefix('{') {
        let (parsed, tail) = parse_labels(after)?;
        labels = parsed;
        rest = tail;
    }
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let value = match fields.as_slice() {
        [value] => parse_value(value)?,
        [_, _] => return Err("samples with a timestamp are not supported".into()),
        _ => return Err("expected one value".into()),
    };
    Ok(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// `l="v",...}` after the `{`: the labels and what follows the `}`.
fn parse_labels(mut s: &str) -> Result<(BTreeMap<String, String>, &str), String> {
    let mut labels = BTreeMap::new();
    loop {
        s = s.trim_start();
        if let Some(tail) = s.strip_prefix('}') {
            return Ok((labels, tail));
        }
        let eq = s.find('=').ok_or("a label without '='")?;
        let name = s[..eq].trim();
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!("bad label name {name:?}"));
        }
        s = s[eq + 1..]
            .trim_start()
            .strip_prefix('"')
            .ok_or("a label value not quoted")?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            match chars.next() {
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    other => return Err(format!("bad escape {other:?} in a label value")),
                },
                Some((_, c)) => value.push(c),
                None => return Err("unterminated label value".into()),
            }
        };
        if labels.insert(name.to_string(), value).is_some() {
            return Err(format!("label {name} given twice"));
        }
        s = s[end + 1..].trim_start();
        s = s.strip_prefix(',').unwrap_or(s);
    }
}

fn parse_value(s: &str) -> Result<f64, String> {
    match s {
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => s.parse().map_err(|_| format!("bad value {s:?}")),
    }
}

/// `name{a="x",b="y"}` with the labels sorted and values escaped as PromQL
/// strings: the series' identity, and promtool's `series:` notation.
pub fn series_key(name: &str, labels: &BTreeMap<String, String>) -> String {
    let labels: Vec<String> = labels
        .iter()
        .map(|(k, v)| {
            let v = v
                .replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n");
            format!("{k}=\"{v}\"")
        })
        .collect();
    format!("{name}{{{}}}", labels.join(","))
}

/// Every sample of `name` (exactly) in `exposition`.
pub fn samples(exposition: &str, name: &str) -> Vec<Sample> {
    parse_exposition(exposition)
        .unwrap_or_else(|e| panic!("the exposition parses: {e}\n{exposition}"))
        .into_iter()
        .filter(|s| s.name == name)
        .collect()
}

/// The value of the one sample of `name` whose labels include `with`.
pub fn value(exposition: &str, name: &str, with: &[(&str, &str)]) -> Option<f64> {
    let found: Vec<Sample> = samples(exposition, name)
        .into_iter()
        .filter(|s| {
            with.iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .collect();
    assert!(
        found.len() <= 1,
        "{name} with {with:?} is more than one sample: {found:?}"
    );
    found.first().map(|s| s.value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_metric_is_looked_up_by_its_labels() {
        let text = "# HELP x y\nvolume_gate_t{tenant_namespace=\"a\",tenant=\"b\\\"c\",phase=\"Blocked\"} 42\nvolume_gate_t_other 1\nvolume_gate_u 3\n";
        let s = samples(text, "volume_gate_t");
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].labels["tenant"], "b\"c");
        assert_eq!(value(text, "volume_gate_u", &[]), Some(3.0));
        assert_eq!(
            value(text, "volume_gate_t", &[("tenant_namespace", "a")]),
            Some(42.0)
        );
        assert_eq!(
            value(text, "volume_gate_t", &[("tenant_namespace", "z")]),
            None
        );
    }
}
