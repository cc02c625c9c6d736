//! The management cluster's real node (`harness up --node`,
//! `tests/harness/node.go`): the kubelet, containerd with runc, a CNI
//! bridge. volume-gate's image is assembled here from the binary the tests
//! run, as the Dockerfile describes it (the binary, the glibc it links, user
//! 65532 and no shell), without a daemon or a registry, and imported into the
//! node's runtime under the name the chart's values give, so the chart is
//! installed with no test-only value.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use super::cluster::{ControlPlane, repo_root};

/// The node's name (node.go's `nodeName`).
pub const NODE: &str = "vg-node";

/// The node's IP (node.go's `nodeIP`), by which Pods reach the harness's
/// API servers.
pub const NODE_IP: &str = "10.244.0.1";

/// The node's IP when this binary's control plane runs the real node.
pub fn address() -> Option<&'static str> {
    super::cluster::running()
        .filter(|cp| cp.node)
        .map(|_| NODE_IP)
}

/// The image the chart's values name: `repository:tag`.
pub fn chart_image() -> String {
    let path = repo_root().join("manifests/chart/volume-gate/values.yaml");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let values: Value =
        serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()));
    let image = &values["image"];
    format!(
        "{}:{}",
        image["repository"].as_str().expect("image.repository"),
        image["tag"].as_str().expect("image.tag")
    )
}

/// The shared libraries `binary` loads, as `ldd` resolves them on this
/// machine (the distroless `cc` base the Dockerfile uses carries the same
/// glibc of Debian 12).
fn shared_libraries(binary: &Path) -> Vec<PathBuf> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .unwrap_or_else(|e| panic!("ldd {}: {e}", binary.display()));
    assert!(
        out.status.success(),
        "ldd {}: {}",
        binary.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or
            // "/lib64/ld-linux-x86-64.so.2 (0x...)"; the vdso has no file.
            let path = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

/// Writes volume-gate's image archive (from `binary`) under the state
/// directory and imports it into the node under the name the chart's values
/// give; returns that name.
pub fn import_volume_gate_image(cp: &ControlPlane, binary: &Path) -> String {
    import_volume_gate_image_as(cp, binary, &chart_image())
}

/// The same image imported under `name` (another tag, for an upgrade).
pub fn import_volume_gate_image_as(cp: &ControlPlane, binary: &Path, name: &str) -> String {
    let name = name.to_string();
    let dir = cp.state.join("images");
    std::fs::create_dir_all(&dir).expect("images dir");
    // distroless/cc's nonroot user and group.
    let passwd = dir.join("passwd");
    std::fs::write(
        &passwd,
        "root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n",
    )
    .unwrap();
    let group = dir.join("group");
    std::fs::write(&group, "root:x:0:\nnonroot:x:65532:\n").unwrap();
    let archive = dir.join(format!(
        "volume-gate-{}.tar",
        name.rsplit(':').next().unwrap_or("image")
    ));
    let mut cmd = Command::new(&cp.harness);
    cmd.arg("image")
        .arg("--out")
        .arg(&archive)
        .args(["--name", &name])
        .args(["--entrypoint", r#"["/usr/local/bin/volume-gate"]"#])
        .args(["--cmd", r#"["--help"]"#])
        .args(["--user", "65532:65532"])
        .arg("--file")
        .arg(format!("/usr/local/bin/volume-gate={}", binary.display()))
        .arg("--file")
        .arg(format!("/etc/passwd={}", passwd.display()))
        .arg("--file")
        .arg(format!("/etc/group={}", group.display()))
        .arg("--file")
        .arg("/etc/ssl/certs/ca-certificates.crt=/etc/ssl/certs/ca-certificates.crt");
    for lib in shared_libraries(binary) {
        cmd.arg("--file")
            .arg(format!("{}={}", lib.display(), lib.display()));
    }
    run(&mut cmd, "harness image");
    run(
        Command::new(&cp.harness)
            .args(["node", "import", "--state"])
            .arg(&cp.state)
            .arg(&archive),
        "harness node import",
    );
    name
}

fn run(cmd: &mut Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
