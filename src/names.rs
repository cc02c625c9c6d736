//! Kubernetes' name rules, once: what the API server accepts as the name of
//! an object or a namespace. A value that breaks them names nothing that can
//! exist, so it is safe to tell apart from a name before it reaches a URL,
//! a selector or a certificate.

/// A DNS-1123 subdomain: what Kubernetes allows as the name of a namespace
/// or of most objects (a HelmRelease among them), and so safe in a URL
/// path. A tenant marker that is not one names no tenant that can exist.
pub fn is_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_part)
}

/// A DNS-1123 label: a Service's name, one part of a DNS name.
pub fn is_label(s: &str) -> bool {
    s.len() <= 63 && is_part(s)
}

/// Lowercase letters, digits and '-', not empty, starting and ending with a
/// letter or digit.
fn is_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subdomain_is_dns_1123() {
        for ok in [
            "a",
            "tenant-a",
            "kubernetes-a.b",
            "a.b-c.d",
            "0x",
            &"a".repeat(253),
        ] {
            assert!(is_subdomain(ok), "{ok}");
        }
        for bad in [
            "",
            "A",
            "-a",
            "a-",
            "a..b",
            ".a",
            "a.",
            "a.-b",
            "a_b",
            "a/b",
            "NOT_A_TENANT",
            "ü",
            &"a".repeat(254),
        ] {
            assert!(!is_subdomain(bad), "{bad}");
        }
    }

    #[test]
    fn a_label_is_one_part_of_at_most_63() {
        assert!(is_label("volume-gate"));
        assert!(is_label(&"a".repeat(63)));
        for bad in ["", "a.b", "Gate", "-a", &"a".repeat(64)] {
            assert!(!is_label(bad), "{bad}");
        }
    }
}
