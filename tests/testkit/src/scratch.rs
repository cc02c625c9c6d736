//! What a test binary leaves in the temporary directory: nothing after a
//! run in which nothing panicked, everything after one in which something
//! did (a failed test), so its logs can be read.
//!
//! - [`dir`]: a directory of this process, removed when it exits unless it
//!   failed. The removal runs from `atexit`, after the last test.
//! - [`keep_on_failure`]: a directory someone else removes (the harness
//!   supervisor removes its state directory once it has stopped every
//!   process, `up --remove-state`); a panic writes `keep` into it, which
//!   tells the supervisor to leave it.
//!
//! `VOLUME_GATE_KEEP_STATE=1` keeps everything, passed or failed (the
//! harness reads the same variable).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, Once};

/// Written into a [`keep_on_failure`] directory when anything panics.
pub const KEEP_FILE: &str = "keep";
/// Set to anything but "" or "0": keep every directory.
pub const KEEP_ENV: &str = "VOLUME_GATE_KEEP_STATE";

static PANICKED: AtomicBool = AtomicBool::new(false);
/// Removed at exit if nothing panicked.
static REMOVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
/// Marked with [`KEEP_FILE`] on a panic.
static MARK: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// `$TMPDIR/volume-gate-<kind>-<pid>`, created, and removed when this
/// process exits unless something panicked or [`KEEP_ENV`] is set.
pub fn dir(kind: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("volume-gate-{kind}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    install();
    let mut remove = lock(&REMOVE);
    if !remove.contains(&dir) {
        remove.push(dir.clone());
    }
    dir
}

/// Marks `dir` with [`KEEP_FILE`] if anything in this process panics (now
/// or later): whoever removes it must leave it.
pub fn keep_on_failure(dir: &Path) {
    install();
    lock(&MARK).push(dir.to_path_buf());
    if PANICKED.load(Ordering::SeqCst) {
        mark(dir);
    }
}

/// Whether anything in this process has panicked so far.
fn failed() -> bool {
    PANICKED.load(Ordering::SeqCst)
}

fn keep_all() -> bool {
    std::env::var(KEEP_ENV).is_ok_and(|v| !v.is_empty() && v != "0")
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn mark(dir: &Path) {
    // Best effort: a panic hook must not panic.
    let _ = std::fs::write(
        dir.join(KEEP_FILE),
        b"a panic in the process that used it\n",
    );
}

/// Once per process: a panic hook (before the default one, which still
/// prints the message) and the exit handler.
fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !PANICKED.swap(true, Ordering::SeqCst) {
                lock(&MARK).iter().for_each(|d| mark(d));
            }
            previous(info)
        }));
        // SAFETY: registers a plain `extern "C" fn()` with no captured state.
        let rc = unsafe { libc::atexit(at_exit) };
        assert_eq!(rc, 0, "atexit failed");
    });
}

extern "C" fn at_exit() {
    let dirs = std::mem::take(&mut *lock(&REMOVE));
    if failed() || keep_all() {
        let dirs: Vec<PathBuf> = dirs
            .into_iter()
            .chain(lock(&MARK).iter().cloned())
            .collect();
        if !dirs.is_empty() {
            eprintln!(
                "kept for inspection: {}",
                dirs.iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        return;
    }
    for d in dirs {
        let _ = std::fs::remove_dir_all(d);
    }
}
