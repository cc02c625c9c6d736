//! What the security scenarios of `tests/security.rs` are made of, one
//! module per scenario's subject, beside the fixture (`tests/testkit`).

pub mod hostile;
pub mod logs;
pub mod racer;
pub mod rbac;
pub mod webhook;

use std::time::Instant;

use crate::common;

/// The gated environment every scenario runs in.
pub fn env() -> &'static common::Env {
    common::gated()
}

/// The environment's gate (its processes), locked.
pub fn gate() -> std::sync::MutexGuard<'static, common::gate::Gate> {
    env()
        .gate
        .as_ref()
        .expect("gated env")
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// Prints how long a test ran (after taking the serial lock), for the report.
pub struct Timed(&'static str, Instant);

impl Timed {
    pub fn start(name: &'static str) -> Self {
        Timed(name, Instant::now())
    }
}

impl Drop for Timed {
    fn drop(&mut self) {
        eprintln!(
            "[timing] {}: {:.1}s",
            self.0,
            self.1.elapsed().as_secs_f64()
        );
    }
}
