//! Processes a test starts (webhook, worker, simulator), stopped by their
//! own PIDs: on drop, and by the kernel if the test process dies first.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Children are spawned from one thread that lives as long as the test
/// process: PR_SET_PDEATHSIG fires when the *spawning thread* exits, and
/// libtest ends a test's thread when the test ends.
fn keeper() -> &'static Mutex<mpsc::Sender<SpawnRequest>> {
    static KEEPER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    KEEPER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("process-keeper".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    use std::os::unix::process::CommandExt;
                    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
                    unsafe {
                        cmd.pre_exec(|| {
                            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                                return Err(std::io::Error::last_os_error());
                            }
                            Ok(())
                        });
                    }
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("spawn keeper thread");
        Mutex::new(tx)
    })
}

pub struct Process {
    pub name: String,
    pub log: PathBuf,
    child: Mutex<Option<Child>>,
}

impl Process {
    /// Starts `cmd` with stdout and stderr appended to `log`.
    pub fn start(name: &str, mut cmd: Command, log: PathBuf) -> Process {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("open log");
        cmd.stdin(Stdio::null())
            .stdout(file.try_clone().expect("dup log"))
            .stderr(file);
        let (tx, rx) = mpsc::channel();
        keeper()
            .lock()
            .unwrap()
            .send((cmd, tx))
            .expect("keeper alive");
        let child = rx
            .recv()
            .expect("keeper replies")
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        Process {
            name: name.into(),
            log,
            child: Mutex::new(Some(child)),
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.lock().unwrap().as_ref().map(|c| c.id())
    }

    /// Sends `signal` (e.g. libc::SIGKILL) and reaps the process.
    pub fn kill(&self, signal: i32) {
        if let Some(mut child) = self.child.lock().unwrap().take() {
            // SAFETY: a plain kill(2) of our own child's PID.
            unsafe { libc::kill(child.id() as i32, signal) };
            let _ = child.wait();
        }
    }

    /// Sends `signal` without waiting for the process.
    pub fn signal(&self, signal: i32) {
        if let Some(child) = self.child.lock().unwrap().as_ref() {
            // SAFETY: a plain kill(2) of our own, not yet reaped, child's PID.
            unsafe { libc::kill(child.id() as i32, signal) };
        }
    }

    /// Waits up to `bound` for the process to exit by itself and reaps it:
    /// its exit status, or None if it is still running.
    pub fn wait_exit(&self, bound: std::time::Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + bound;
        loop {
            {
                let mut guard = self.child.lock().unwrap();
                let child = guard.as_mut()?;
                if let Ok(Some(status)) = child.try_wait() {
                    guard.take();
                    return Some(status);
                }
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// Whether it is still running.
    pub fn alive(&self) -> bool {
        match self.child.lock().unwrap().as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill(libc::SIGTERM);
    }
}

/// The test world's Go programs (the harness's clusters, etcd, the
/// simulator and its CSI sidecars, helm-controller, cozystack-controller,
/// cert-manager) each run with one Go scheduler thread, as a container
/// limited to one CPU does: up to ~200 of them share this machine's 2
/// cores in the load test, and with a thread per core each they kept the
/// run queue at a load average of 45-70, their tenant API servers answered
/// `/readyz` late and the teardown did not finish
/// (`docs/benchmarks-scale.md`, "50 light tenants on 2 cores"). It changes
/// no behaviour: a Go program with one P still serves concurrently. The
/// product's own processes (Rust) are not Go programs.
/// Runs `cmd` to its end and returns its stdout; fails the test naming
/// `what` and the program's stderr when it does not succeed.
pub fn run_ok(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap_or_else(|e| panic!("{what}: output not UTF-8: {e}"))
}

pub fn go_program(cmd: &mut Command) -> &mut Command {
    cmd.env("GOMAXPROCS", "1")
}
