//! Target 4: the tenant's admin kubeconfig (`worker::tenant::parse_kubeconfig`)
//! from arbitrary bytes, and, when it is accepted, `worker::tenant::client_for`
//! (what the worker does next).
//!
//! Invariants, on every input:
//! - never panics;
//! - Ok implies: at least one cluster and one context; every cluster has
//!   details, an https:// server, no CA file, no insecure-skip-tls-verify,
//!   no proxy-url; no user has an exec plugin, an auth provider, a client
//!   certificate/key file or a token file;
//! - an Err message is one of parse_kubeconfig's templates with only a
//!   cluster or user name (Debug-quoted) or a byte count substituted, so it
//!   echoes nothing else of the input; and it contains no 16-byte window of
//!   any credential value (token, password, client key/cert data, CA data,
//!   exec/auth-provider settings);
//! - `client_for`'s error message for an accepted kubeconfig contains no
//!   16-byte window of a credential value either.
//!
//! A credential window found in a message is confirmed differentially
//! (the input re-run with the credential's letters and digits rotated must
//! show the rotated window instead): libFuzzer splices the messages' own
//! text into inputs, and such a window is not an echo.
//!
//! `VG_FUZZ_STRICT_ECHO=1` also forbids any 16-byte window of the input in an
//! Err message, names included (they are echoed by design: finding F4).

#![no_main]

#[path = "../common/mod.rs"]
mod common;

use std::sync::LazyLock;
use std::time::Duration;

use kube::config::Kubeconfig;
use libfuzzer_sys::fuzz_target;
use volume_gate::worker::tenant::{MAX_KUBECONFIG_BYTES, client_for, parse_kubeconfig};

const WINDOW: usize = 16;

static RT: LazyLock<tokio::runtime::Runtime> =
    LazyLock::new(|| tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime"));

/// parse_kubeconfig's messages: (prefix, suffix) around an entry's index
/// (names are never echoed: finding F4).
const NAMED: [(&str, &str); 9] = [
    ("clusters[", "] has no details"),
    ("clusters[", "] server must be an https:// URL"),
    ("clusters[", "] refers to a CA file; only certificate-authority-data is accepted"),
    ("clusters[", "] sets tls-server-name, which would accept a server certified for another name"),
    ("clusters[", "] has no certificate-authority-data: the worker knows a tenant cluster by the CA that certified its API server"),
    ("clusters[", "] skips TLS verification, which would hand admin credentials to anyone"),
    ("clusters[", "] sets a proxy-url, which is not accepted"),
    ("users[", "] uses an exec plugin or auth provider, which is not accepted"),
    ("users[", "] refers to files; only inline -data fields and token are accepted"),
];

const FIXED: [&str; 3] = ["not UTF-8 text", "not a kubeconfig (YAML parse failed)", "it names no cluster or no context"];

fuzz_target!(|data: &[u8]| {
    let parsed = std::str::from_utf8(data).ok().and_then(|t| Kubeconfig::from_yaml(t).ok());
    let secrets = parsed.as_ref().map(credentials).unwrap_or_default();
    match parse_kubeconfig(data) {
        Ok(kc) => {
            check_accepted(&kc);
            let secrets = credentials(&kc);
            let result = RT.block_on(async { client_for(kc, Duration::from_secs(1)).await });
            if let Err(msg) = result {
                no_credential_echo("client_for", &msg, &secrets, data, &client_for_message);
            }
        }
        Err(msg) => {
            check_template(&msg, parsed.as_ref(), data);
            no_credential_echo("parse_kubeconfig", &msg, &secrets, data, &|d: &[u8]| parse_kubeconfig(d).err());
            if std::env::var_os("VG_FUZZ_STRICT_ECHO").is_some_and(|v| v == "1") {
                if let Some(w) = common::echoed_window(msg.as_bytes(), data, WINDOW) {
                    let static_text = NAMED.iter().any(|(p, s)| p.contains(lossy(w)) || s.contains(lossy(w)))
                        || FIXED.iter().any(|f| f.contains(lossy(w)));
                    assert!(static_text, "the error echoes input bytes {:?}: {msg}", lossy(w));
                }
            }
        }
    }
});

fn lossy(b: &[u8]) -> &str {
    std::str::from_utf8(b).unwrap_or("\u{fffd}")
}

fn check_accepted(kc: &Kubeconfig) {
    assert!(!kc.clusters.is_empty() && !kc.contexts.is_empty(), "accepted without cluster or context");
    for c in &kc.clusters {
        let cluster = c.cluster.as_ref().unwrap_or_else(|| panic!("accepted cluster {:?} without details", c.name));
        assert!(cluster.server.as_deref().is_some_and(|s| s.starts_with("https://")), "accepted a non-https server");
        assert!(cluster.certificate_authority.is_none(), "accepted a CA file");
        assert_ne!(cluster.insecure_skip_tls_verify, Some(true), "accepted insecure-skip-tls-verify");
        assert!(cluster.proxy_url.is_none(), "accepted a proxy-url");
    }
    for a in &kc.auth_infos {
        let Some(auth) = &a.auth_info else { continue };
        assert!(auth.exec.is_none(), "accepted an exec plugin");
        assert!(auth.auth_provider.is_none(), "accepted an auth provider");
        assert!(auth.client_certificate.is_none() && auth.client_key.is_none(), "accepted a client cert/key file");
        assert!(auth.token_file.is_none(), "accepted a token file");
    }
}

/// Every credential value of at least WINDOW bytes.
fn credentials(kc: &Kubeconfig) -> Vec<String> {
    let mut out = Vec::new();
    for c in &kc.clusters {
        if let Some(d) = c.cluster.as_ref().and_then(|c| c.certificate_authority_data.clone()) {
            out.push(d);
        }
    }
    for a in &kc.auth_infos {
        let Some(auth) = &a.auth_info else { continue };
        // AuthInfo serialises its secrets in clear (SecretString fields
        // included): the simplest way to reach every one of them.
        let v = serde_json::to_value(auth).unwrap_or_default();
        for key in ["password", "token", "client-certificate-data", "client-key-data"] {
            if let Some(s) = v.get(key).and_then(|s| s.as_str()) {
                out.push(s.to_string());
            }
        }
        for key in ["exec", "auth-provider"] {
            collect_strings(&v[key], &mut out);
        }
    }
    out.retain(|s| s.len() >= WINDOW);
    out
}

fn collect_strings(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::String(s) => out.push(s.clone()),
        serde_json::Value::Array(a) => a.iter().for_each(|x| collect_strings(x, out)),
        serde_json::Value::Object(m) => m.values().for_each(|x| collect_strings(x, out)),
        _ => {}
    }
}

/// A credential echo is confirmed differentially: the same input with the
/// credential's letters and digits rotated (a→b, 9→0, ...) must give a message
/// with the rotated window instead of the original. A window that stays is
/// the error's own text (the fuzzer splices message text into inputs).
fn no_credential_echo(what: &str, msg: &str, secrets: &[String], data: &[u8], rerun: &dyn Fn(&[u8]) -> Option<String>) {
    for s in secrets {
        let Some(w) = common::echoed_window(msg.as_bytes(), s.as_bytes(), WINDOW) else { continue };
        let Ok(text) = std::str::from_utf8(data) else { continue };
        let rotated_secret = rotate(s);
        let rotated_input = text.replace(s.as_str(), &rotated_secret);
        if rotated_input == text {
            continue; // quoted or folded in the YAML: cannot be rotated in place
        }
        let Some(msg2) = rerun(rotated_input.as_bytes()) else { continue };
        let rw = rotate(lossy(w));
        if msg2.contains(rw.as_str()) && !msg2.contains(lossy(w)) {
            panic!(
                "{what} echoes {WINDOW} bytes of a credential ({:?}): {msg}\ninput (hex): {}",
                lossy(w),
                common::hex(&data[..data.len().min(4096)])
            );
        }
    }
}

fn rotate(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            'a'..='y' | 'A'..='Y' | '0'..='8' => char::from(c as u8 + 1),
            'z' => 'a',
            'Z' => 'A',
            '9' => '0',
            other => other,
        })
        .collect()
}

fn client_for_message(data: &[u8]) -> Option<String> {
    let kc = parse_kubeconfig(data).ok()?;
    RT.block_on(async { client_for(kc, Duration::from_secs(1)).await }).err()
}

/// The message is a template with only a name or a size substituted.
fn check_template(msg: &str, parsed: Option<&Kubeconfig>, data: &[u8]) {
    if FIXED.contains(&msg) {
        return;
    }
    let size_suffix = format!(" bytes, more than the {MAX_KUBECONFIG_BYTES} a kubeconfig may have");
    if let Some(n) = msg.strip_suffix(&size_suffix) {
        assert!(n.bytes().all(|b| b.is_ascii_digit()), "{msg}");
        assert_eq!(n.parse::<usize>().ok(), Some(data.len()));
        return;
    }
    let kc = parsed.unwrap_or_else(|| panic!("a named message for input that does not parse: {msg}"));
    let names: Vec<String> = kc
        .clusters
        .iter()
        .enumerate()
        .map(|(i, _)| format!("clusters[{i}"))
        .chain(kc.auth_infos.iter().enumerate().map(|(i, _)| format!("users[{i}")))
        .collect();
    let ok = NAMED.iter().any(|(prefix, suffix)| {
        msg.strip_suffix(suffix).is_some_and(|head| head.starts_with(prefix) && names.iter().any(|n| n == head))
    });
    assert!(ok, "an error message outside parse_kubeconfig's templates: {msg}");
}
