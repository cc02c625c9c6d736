//! The harness's own pieces that decide whether a process is alive (the
//! owner a control plane follows, the supervisor `up` waits for), tested
//! with `go test`: they once declared a live process gone, and the control
//! plane never came up. They build without Kubernetes, in seconds.
//!
//! And what a control plane leaves behind once its owner is gone (these two
//! start a real one, from the cached harness): nothing after a run that
//! passed (`up --remove-state`), its logs after one that failed (the `keep`
//! mark a test binary's panic hook writes).
//!
//! And the fixture's rule for its shared environment: one configuration per
//! test binary, a second one refused aloud.

use volume_gate_testkit as common;

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;
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

/// A pidfd on `pid` (a process that is not our child: the supervisor runs
/// in a session of its own), to learn of its exit without polling /proc.
fn pidfd_open(pid: i32) -> OwnedFd {
    // SAFETY: pidfd_open(2) with no flags; the returned fd is ours.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    assert!(
        fd >= 0,
        "pidfd_open({pid}): {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: a fresh descriptor nothing else owns.
    unsafe { OwnedFd::from_raw_fd(fd as i32) }
}

/// Blocks until the process behind `fd` has exited (the pidfd turns
/// readable), or panics after `timeout_ms`.
fn wait_exit(fd: &OwnedFd, what: &str, timeout_ms: i32) {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    assert_eq!(n, 1, "{what} still running after {timeout_ms} ms");
}

/// Starts a control plane in `state` whose owner is a `sleep` we start,
/// then ends the owner; returns once the supervisor has exited.
fn up_then_lose_the_owner(state: &Path, extra: &[&str], before_owner_dies: impl FnOnce()) {
    let mut owner = Command::new("sleep")
        .arg("600")
        .spawn()
        .expect("start sleep");
    let out = Command::new(common::cluster::harness_binary())
        .args(["up", "--state"])
        .arg(state)
        .args(["--owner-pid", &owner.id().to_string(), "--tenant", "t0"])
        .args(extra)
        .output()
        .expect("run harness up");
    assert!(
        out.status.success(),
        "harness up: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pid: i32 = std::fs::read_to_string(state.join("supervisor.pid"))
        .expect("supervisor.pid")
        .trim()
        .parse()
        .expect("a PID in supervisor.pid");
    let supervisor = pidfd_open(pid);
    assert!(
        state.join("logs/etcd.log").exists(),
        "the state directory holds the logs while the clusters run"
    );
    before_owner_dies();
    owner.kill().expect("kill the owner");
    owner.wait().expect("reap the owner");
    wait_exit(&supervisor, "the supervisor", 120_000);
}

#[test]
fn a_supervisor_told_to_remove_its_state_leaves_nothing_once_its_owner_is_gone() {
    let root = tempfile::tempdir().unwrap();
    let state = root.path().join("cp");
    up_then_lose_the_owner(&state, &["--remove-state"], || {});
    assert!(
        !state.exists(),
        "state directory {} still there after the supervisor exited: {:?}",
        state.display(),
        std::fs::read_dir(&state).map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
    );
}

#[test]
fn a_state_directory_marked_keep_outlives_the_supervisor_with_its_logs() {
    let root = tempfile::tempdir().unwrap();
    let state = root.path().join("cp");
    // What a test binary's panic hook writes (common::scratch).
    up_then_lose_the_owner(&state, &["--remove-state"], || {
        std::fs::write(state.join(common::scratch::KEEP_FILE), "a test failed\n").unwrap()
    });
    let log =
        std::fs::read_to_string(state.join("logs/supervisor.log")).expect("supervisor log kept");
    assert!(
        log.contains("kept:") && log.contains(common::scratch::KEEP_FILE),
        "the supervisor says why it kept the directory:\n{log}"
    );
    assert!(
        state.join("logs/etcd.log").exists(),
        "the clusters' logs are kept"
    );
}

#[test]
#[should_panic(expected = "shared environment was started with")]
fn a_second_environment_configuration_is_refused_naming_both() {
    let started = common::EnvConfig::gated();
    let asked = common::EnvConfig::gated_short();
    assert_ne!(started, asked);
    common::refuse_another("shared environment", &started, &asked);
}

#[test]
fn the_same_environment_configuration_is_the_same_environment() {
    common::refuse_another(
        "shared environment",
        &common::EnvConfig::gated_short().tenant_only(),
        &common::EnvConfig::gated_short().tenant_only(),
    );
    common::refuse_another(
        "helm-controller",
        &common::flux::FluxConfig::default(),
        &common::EnvConfig::gated().flux,
    );
}
