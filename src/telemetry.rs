//! JSON logs via tracing.
//!
//! Lines are formatted on the thread that logs and written by a writer
//! thread (`tracing_appender::non_blocking`), so an admission decision does
//! not wait for its line's `write(2)` to the container's stderr pipe
//! (`docs/benchmarks.md`, benchmark 1's cost table). It is not lossy: when
//! its buffer is full, logging waits, as a blocking writer would. The guard
//! flushes the lines not yet written when dropped, at the end of `main`; a
//! process killed with SIGKILL loses those lines, as klog's buffered output
//! does.

use tracing_appender::non_blocking::{NonBlockingBuilder, WorkerGuard};

/// Installs the global subscriber: JSON lines on stderr, `RUST_LOG` filter.
/// Keep the guard until the process ends.
#[must_use = "dropping the guard stops the log writer"]
pub fn init_json_logs() -> WorkerGuard {
    init_json_logs_to(std::io::stderr())
}

/// As [`init_json_logs`], writing to `w` (the benchmarks: `/dev/null`).
#[must_use = "dropping the guard stops the log writer"]
pub fn init_json_logs_to<W: std::io::Write + Send + 'static>(w: W) -> WorkerGuard {
    use tracing_subscriber::{EnvFilter, fmt};
    let (writer, guard) = NonBlockingBuilder::default()
        .lossy(false)
        .thread_name("volume-gate-log")
        .finish(w);
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = fmt()
        .json()
        .flatten_event(true)
        .with_current_span(false)
        .with_target(false)
        .with_env_filter(filter)
        .with_writer(writer)
        .try_init();
    guard
}
