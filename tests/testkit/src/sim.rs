//! The simulator (`harness sim`): storage ledger, CSI driver, kubelets,
//! Kamaji's control-plane stop, and the management node that runs the Pods
//! of Jobs (the tenant chart's pre-delete hook, created by the real
//! helm-controller). The storage directory is the ground truth: one file per
//! volume, named by its volumeHandle.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use super::cluster::{ControlPlane, run_build_script};
use super::process::Process;

/// The directory `tests/csi/build.sh` prints: Kubernetes' CSI sidecars
/// `csi-provisioner`, `csi-attacher`, `csi-snapshotter` and
/// `snapshot-controller`, which the simulator runs beside its CSI plugin for
/// every tenant driver and for the management storage, and in `crds/` the
/// snapshot.storage.k8s.io CRDs of the external-snapshotter client module
/// they are compiled against (v8.6.0).
pub fn sidecars_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| run_build_script("tests/csi/build.sh"))
        .clone()
}

/// The snapshot.storage.k8s.io CRDs (VolumeSnapshotClass,
/// VolumeSnapshotContent, VolumeSnapshot) of the external-snapshotter
/// client module the sidecars are compiled against: what Cozystack installs in a tenant
/// cluster (its vsnap-crd release) and what the management cluster's storage
/// serves.
pub fn snapshot_crds() -> Vec<PathBuf> {
    let dir = sidecars_dir().join("crds");
    [
        "volumesnapshotclasses",
        "volumesnapshotcontents",
        "volumesnapshots",
    ]
    .iter()
    .map(|r| dir.join(format!("snapshot.storage.k8s.io_{r}.yaml")))
    .collect()
}

pub struct Simulator {
    pub process: Process,
    pub storage: PathBuf,
}

impl Simulator {
    /// Starts a simulator for every tenant of the control plane: storage,
    /// CSI driver, kubelets, Kamaji's control planes, and the management
    /// node that runs the Pods of Jobs (the tenant chart's real pre-delete
    /// hook, run by the real helm-controller). The world is `profile`'s:
    /// with an infra layer, tenant volumes are DataVolumes whose management
    /// PVs hold the disks; without one, the tenant's driver holds them.
    pub fn start(cp: &ControlPlane, profile: &volume_gate::profile::Profile) -> Simulator {
        let storage = cp.state.join(cp.unique("storage"));
        std::fs::create_dir_all(&storage).expect("storage dir");
        let control = std::fs::read_to_string(cp.state.join("control.addr"))
            .expect("control.addr")
            .trim()
            .to_string();
        let control = if control.starts_with("http") {
            control
        } else {
            format!("http://{control}")
        };
        // The platform's names, from the profile the product uses.
        let json = serde_json::to_string(profile).expect("profile serializes");
        let profile = cp.state.join(cp.unique("profile.json"));
        std::fs::write(&profile, json).expect("write the profile");
        let mut cmd = Command::new(&cp.harness);
        crate::process::go_program(&mut cmd);
        cmd.arg("sim")
            .arg("--profile")
            .arg(&profile)
            .arg("--management")
            .arg(&cp.management.kubeconfig)
            .arg("--storage")
            .arg(&storage)
            .arg("--sidecars")
            .arg(sidecars_dir())
            // With the control plane's logs, which the tests read (and the
            // security tests search for secrets).
            .arg("--sidecar-logs")
            .arg(cp.state.join("logs"))
            // Sockets and kubeconfigs in the state directory (removed with
            // it), as the simulator is killed with its owner.
            .arg("--run-dir")
            .arg(cp.state.join(cp.unique("csi")))
            .args(["--control", &control, "--probe-interval", "1s"])
            // The Pods of Jobs (a chart's hooks) run as local shells on the
            // simulated node, unless the management cluster has a real one.
            .args(super::node::address().is_none().then_some("--run-jobs"))
            .args(
                super::node::address()
                    .map(|ip| ["--node-ip", ip])
                    .into_iter()
                    .flatten(),
            )
            // In the state directory, which the harness removes: the
            // simulator is killed with its owner, before it could.
            .arg("--jobs-dir")
            .arg(cp.state.join(cp.unique("jobs")))
            // A Job in volume-gate's own image (the chart's uninstall hook)
            // runs the binary the tests built, as the image's entrypoint.
            .arg("--image-binary")
            .arg(format!(
                "{}={}",
                super::node::chart_image_repository(),
                super::gate::binary().display()
            ));
        let log = cp
            .state
            .join("logs")
            .join(format!("{}.log", cp.unique("sim")));
        Simulator {
            process: Process::start("simulator", cmd, log),
            storage,
        }
    }

    /// Waits until the ledger holds exactly `n` of the tenant's disks (for
    /// a count that only falls, as disks are freed, or only rises, as they
    /// are provisioned) and returns them.
    pub async fn wait_disks(&self, namespace: &str, tenant: &str, n: usize) -> Vec<String> {
        super::wait::eventually(
            &format!("{n} disks of {namespace}/{tenant} on storage"),
            std::time::Duration::from_secs(90),
            || {
                let disks = self.volumes_of(namespace, tenant);
                async move {
                    if disks.len() == n {
                        Ok(disks)
                    } else {
                        Err(format!("{disks:?}"))
                    }
                }
            },
        )
        .await
    }

    /// Volumes on storage for a tenant: the files whose names start with
    /// `<namespace>.<tenant>.`.
    pub fn volumes_of(&self, namespace: &str, tenant: &str) -> Vec<String> {
        let prefix = format!("{namespace}.{tenant}.");
        let mut v: Vec<String> = std::fs::read_dir(&self.storage)
            .expect("read storage")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().to_string())
            .filter(|n| n.starts_with(&prefix))
            .collect();
        v.sort();
        v
    }

    pub fn log(&self) -> String {
        self.process.log_text()
    }

    /// The last `n` lines of the simulator's log about tenant
    /// `namespace/tenant`, for a failure message: what it saw and did.
    pub fn tail_of(&self, namespace: &str, tenant: &str, n: usize) -> String {
        let key = format!(" {namespace}/{tenant} ");
        let log = self.log();
        let lines: Vec<&str> = log.lines().filter(|l| l.contains(&key)).collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

/// One run of a Job's Pod on the simulator's management node, from its log
/// (`TIME job N/JOB running|output|exited pod P: ...`).
#[derive(Debug, Clone)]
pub struct JobRun {
    pub pod: String,
    /// When the simulator started the Pod's script.
    pub started: jiff::Timestamp,
    /// The script's output lines (stdout and stderr), in order.
    pub output: Vec<String>,
    /// `exit N (Phase)`, once it ended.
    pub exit: Option<String>,
}

impl JobRun {
    /// The numbers of the `Step N` lines the run printed, in order, repeats
    /// collapsed (`Step 4b` is part of step 4).
    pub fn steps(&self) -> Vec<u32> {
        let mut seq: Vec<u32> = Vec::new();
        for l in &self.output {
            let Some(rest) = l.strip_prefix("Step ") else {
                continue;
            };
            let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
            let n: u32 = digits
                .parse()
                .unwrap_or_else(|_| panic!("unparseable step in {l:?}"));
            if seq.last() != Some(&n) {
                seq.push(n);
            }
        }
        seq
    }

    pub fn succeeded(&self) -> bool {
        self.exit.as_deref() == Some("exit 0 (Succeeded)")
    }

    pub fn render(&self) -> String {
        format!(
            "pod {} started {}:\n  {}\n  => {}",
            self.pod,
            self.started,
            self.output.join("\n  "),
            self.exit.as_deref().unwrap_or("(running)")
        )
    }
}

impl Simulator {
    /// The simulator's lines about Job `namespace/job`, in log order.
    pub fn job_lines(&self, namespace: &str, job: &str) -> Vec<String> {
        // `TIME job<padding> N/JOB ...`
        let key = format!(" {namespace}/{job} ");
        self.log()
            .lines()
            .filter(|l| l.contains(" job ") && l.contains(&key))
            .map(str::to_string)
            .collect()
    }

    /// The lines about tenant release `release`'s pre-delete hook
    /// (Job `<release>-pre-cleanup` of the tenant chart).
    pub fn hook_lines(&self, namespace: &str, release: &str) -> Vec<String> {
        self.job_lines(namespace, &format!("{release}-pre-cleanup"))
    }

    /// The runs of Job `namespace/job` (one per Pod: Helm creates a new Job
    /// for each attempt of a hook), in the order they started.
    pub fn job_runs(&self, namespace: &str, job: &str) -> Vec<JobRun> {
        let mut runs: Vec<JobRun> = Vec::new();
        for line in self.job_lines(namespace, job) {
            // `TIME job<padding> KEY ACTION pod P: DETAIL`
            let mut rest = line.as_str();
            let mut fields = [""; 4];
            for f in &mut fields {
                rest = rest.trim_start();
                let end = rest.find(' ').unwrap_or(rest.len());
                *f = &rest[..end];
                rest = &rest[end..];
            }
            let [at, _, _, action] = fields;
            let rest = rest.strip_prefix(' ').unwrap_or(rest);
            let Some((pod, detail)) = rest
                .strip_prefix("pod ")
                .and_then(|r| r.split_once(": "))
                .or_else(|| {
                    rest.strip_prefix("pod ")
                        .map(|r| (r.trim_end_matches(':'), ""))
                })
            else {
                continue;
            };
            match action {
                "running" => runs.push(JobRun {
                    pod: pod.to_string(),
                    started: at.parse().expect("simulator log timestamp"),
                    output: Vec::new(),
                    exit: None,
                }),
                "output" | "exited" => {
                    let Some(run) = runs.iter_mut().rev().find(|r| r.pod == pod) else {
                        continue;
                    };
                    if action == "output" {
                        run.output.push(detail.to_string());
                    } else {
                        run.exit = Some(detail.to_string());
                    }
                }
                _ => {}
            }
        }
        runs
    }

    /// The runs of release `release`'s pre-delete hook (see [`Simulator::job_runs`]).
    pub fn hook_runs(&self, namespace: &str, release: &str) -> Vec<JobRun> {
        self.job_runs(namespace, &format!("{release}-pre-cleanup"))
    }
}
