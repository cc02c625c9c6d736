//! Reading the OpenMetrics text a process serves on /metrics: the samples
//! of one metric, with their labels.

use std::collections::BTreeMap;

/// One sample: its labels and value.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Every sample of `name` (exactly: `name{...} v` or `name v`).
pub fn samples(exposition: &str, name: &str) -> Vec<Sample> {
    exposition
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            let (labels, value) = match rest.strip_prefix('{') {
                Some(r) => r.split_once("} ")?,
                None => ("", rest.strip_prefix(' ')?),
            };
            Some(Sample {
                labels: parse_labels(labels),
                value: value.split(' ').next()?.parse().ok()?,
            })
        })
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

/// `a="x",b="y"`, values with `\"` and `\\` escapes as the text format has them.
fn parse_labels(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = text;
    while let Some((key, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, e)) = chars.next() {
                        value.push(match e {
                            'n' => '\n',
                            other => other,
                        });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.insert(key.trim_start_matches(',').trim().to_string(), value);
        rest = &after[end..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_read_with_their_labels() {
        let text = "# HELP x y\nvolume_gate_t{tenant_namespace=\"a\",tenant=\"b\\\"c\",phase=\"Blocked\"} 42\nvolume_gate_t_other 1\nvolume_gate_u 3\n";
        let s = samples(text, "volume_gate_t");
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].labels["tenant"], "b\"c");
        assert_eq!(s[0].labels["phase"], "Blocked");
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
