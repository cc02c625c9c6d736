//! Text as volume-gate writes it for people: bounded, one line, counted.
//! Everything a tenant can write reaches logs, records and Events only
//! through these, so nothing it writes can flood them.

/// `s`, cut at a character boundary to at most `max` bytes with the cut
/// stated, so a shortened value is never mistaken for the whole one.
pub fn bounded(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    shorten(s, max, &format!("…[{} bytes]", s.len()))
}

/// `s` whole if it fits in `max` bytes; otherwise cut at a character
/// boundary and ended with `suffix`, the two together within `max`.
pub fn shorten(s: &str, max: usize, suffix: &str) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut cut = max.saturating_sub(suffix.len());
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}{suffix}", &s[..cut])
}

/// `1 volume`, `3 volumes`: a count with its noun.
pub fn count(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// `a, b and 3 more`: at most `n` of `names`, in their order.
pub fn listed<'a>(names: impl IntoIterator<Item = &'a String>, n: usize) -> String {
    let names: Vec<&String> = names.into_iter().collect();
    let shown: Vec<&str> = names.iter().take(n).map(|s| s.as_str()).collect();
    match names.len() - shown.len() {
        0 => shown.join(", "),
        more => format!("{} and {more} more", shown.join(", ")),
    }
}

/// Rows as aligned columns, as `kubectl get` prints them: each cell padded
/// to its column's widest, three spaces between columns, no trailing
/// spaces. The first row is the header.
pub fn columns(rows: &[Vec<String>]) -> String {
    let n = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..n)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|cell| cell.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
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

/// `5m`, `3h`, `2d`, as kubectl prints ages: from `created` (RFC 3339)
/// to `now`.
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

/// Messages are one human line, bounded.
pub fn one_line(s: &str) -> String {
    shorten(
        &s.split_whitespace().collect::<Vec<_>>().join(" "),
        1024,
        "...",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listed_names_at_most_n_and_counts_the_rest() {
        let names: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        assert_eq!(listed(&names, 5), "a, b, c");
        assert_eq!(listed(&names, 2), "a, b and 1 more");
        assert_eq!(listed(&Vec::new(), 2), "");
    }

    #[test]
    fn bounded_cuts_at_a_char_boundary_and_states_the_length() {
        assert_eq!(bounded("short", 10), "short");
        let cut = bounded(&"é".repeat(600), 64);
        assert!(cut.len() <= 64 && cut.ends_with("…[1200 bytes]"), "{cut}");
    }

    #[test]
    fn messages_are_bounded_on_a_char_boundary() {
        let long = "é".repeat(2000);
        let s = one_line(&long);
        assert!(s.len() <= 1024 + 3);
        assert!(s.ends_with("..."));
    }

    #[test]
    fn columns_are_aligned_on_the_widest_cell_without_trailing_spaces() {
        let rows: Vec<Vec<String>> = [
            ["KIND", "NAME", "AGE"],
            ["DataVolume", "é-1", ""],
            ["PV", "pvc-123456", "3d"],
        ]
        .iter()
        .map(|r| r.map(String::from).to_vec())
        .collect();
        let t = columns(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "KIND         NAME         AGE");
        assert_eq!(lines[1], "DataVolume   é-1");
        assert_eq!(lines[2], "PV           pvc-123456   3d");
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

    #[test]
    fn a_count_names_its_noun_in_the_right_number() {
        assert_eq!(count(1, "volume"), "1 volume");
        assert_eq!(count(0, "volume"), "0 volumes");
        assert_eq!(count(3, "PV"), "3 PVs");
    }
}
