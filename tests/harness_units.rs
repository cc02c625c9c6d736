//! The harness's own pieces that decide whether a process is alive (the
//! owner a control plane follows, the supervisor `up` waits for), tested
//! with `go test`: they once declared a live process gone, and the control
//! plane never came up. They build without Kubernetes, in seconds.

use std::process::Command;

#[test]
fn the_harness_liveness_checks_pass_their_go_tests() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/harness");
    let out = Command::new("go")
        .args(["test", "-count=1", "-v", "./liveness/"])
        .current_dir(&dir)
        .env("GOWORK", "off")
        .output()
        .expect("run go test (Go must be on PATH, as for the harness)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    assert!(out.status.success(), "go test ./liveness/ failed:\n{text}");
    assert!(
        text.contains("--- PASS: TestAStartedChildIsAliveFromTheFirstCheck"),
        "the start race test ran:\n{text}"
    );
}
