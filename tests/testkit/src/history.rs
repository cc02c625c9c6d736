//! The parent release as a watch saw it, from before the tenant was created
//! until the end of the test: every version of it, and its disappearance.
//!
//! A state the teardown moves past (`Releasing`, `Overridden`, a `Blocked`
//! between two retries) may last less than one poll on a fast, idle machine:
//! a test that polled for `Overridden` once found the parent already gone.
//! Tests read such states from this history instead, so they cannot miss
//! them, and read it in order with a cursor, so "the next Blocked" means one
//! written after the state the test last waited for.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Api, DynamicObject};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;

use volume_gate::record::Record;

/// One observation of the parent: a version of it, or its absence.
#[derive(Clone, Debug)]
pub enum Seen {
    Parent(Arc<DynamicObject>),
    Gone,
}

impl Seen {
    /// The record this version carried (`None` once the parent is gone).
    pub fn record(&self) -> Option<Record> {
        match self {
            Seen::Parent(p) => Some(Record::from_annotations(
                &super::keys(),
                &p.metadata.annotations.clone().unwrap_or_default(),
            )),
            Seen::Gone => None,
        }
    }

    fn describe(&self) -> String {
        match (self, self.record()) {
            (Seen::Parent(p), Some(r)) => format!(
                "phase {:?}, message {:?}, finalizers {:?}, deleting {}",
                r.phase,
                r.message,
                p.metadata.finalizers.as_deref().unwrap_or_default(),
                p.metadata.deletion_timestamp.is_some()
            ),
            _ => "parent gone".into(),
        }
    }
}

/// The history of one parent release, filled by a watch task that ends
/// with the history.
pub struct ParentHistory {
    name: String,
    seen: watch::Receiver<Vec<Seen>>,
    cursor: Mutex<usize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ParentHistory {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ParentHistory {
    /// Opens the watch on `name` (which may not exist yet) and returns once
    /// its first list is done, so nothing that happens after this call is
    /// missed.
    pub async fn open(api: Api<DynamicObject>, name: &str) -> ParentHistory {
        let (tx, rx) = watch::channel(Vec::new());
        let (synced_tx, synced_rx) = tokio::sync::oneshot::channel();
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let task = tokio::spawn(async move {
            let mut stream = watcher(api, config).default_backoff().boxed();
            let mut synced = Some(synced_tx);
            let mut listed = false;
            while let Some(event) = stream.next().await {
                let push = |s: Seen| tx.send_modify(|v| v.push(s));
                match event {
                    Ok(watcher::Event::Init) => listed = false,
                    Ok(watcher::Event::InitApply(o)) | Ok(watcher::Event::Apply(o)) => {
                        listed = true;
                        push(Seen::Parent(Arc::new(o)));
                    }
                    Ok(watcher::Event::Delete(_)) => push(Seen::Gone),
                    Ok(watcher::Event::InitDone) => {
                        // A re-list that no longer finds a parent seen before:
                        // it went while the watch was down.
                        let was_there = matches!(tx.borrow().last(), Some(Seen::Parent(_)));
                        if !listed && was_there {
                            push(Seen::Gone);
                        }
                        if let Some(s) = synced.take() {
                            let _ = s.send(());
                        }
                    }
                    // The watcher retries with backoff; a relist catches up.
                    Err(_) => {}
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(30), synced_rx)
            .await
            .unwrap_or_else(|_| panic!("watch on HelmRelease {name} not synced within 30s"))
            .expect("watch task alive");
        ParentHistory {
            name: name.to_string(),
            seen: rx,
            cursor: Mutex::new(0),
            task,
        }
    }

    /// Waits for the first observation after the cursor that satisfies
    /// `matches`, moves the cursor past it and returns it; panics after
    /// `timeout` naming `what` and the last observations.
    pub async fn next_matching<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut matches: impl FnMut(&Seen) -> Option<T>,
    ) -> T {
        let from = *self.cursor.lock().unwrap();
        let mut found = None;
        let mut rx = self.seen.clone();
        let waited = tokio::time::timeout(
            timeout,
            rx.wait_for(|seen| {
                for (i, s) in seen.iter().enumerate().skip(from) {
                    if let Some(v) = matches(s) {
                        found = Some((i, v));
                        return true;
                    }
                }
                false
            }),
        )
        .await
        .map(|r| r.map(drop));
        match (waited, found) {
            (Ok(Ok(_)), Some((i, v))) => {
                *self.cursor.lock().unwrap() = i + 1;
                v
            }
            (Ok(Err(_)), _) => panic!("the watch on {} ended while waiting for {what}", self.name),
            _ => panic!(
                "timed out after {timeout:?} waiting for {what} on {}; last seen:\n{}",
                self.name,
                self.tail(5)
            ),
        }
    }

    /// The record of the first version after the cursor that satisfies
    /// `matches` (see [`Self::next_matching`]).
    pub async fn next_record(
        &self,
        what: &str,
        timeout: Duration,
        matches: impl Fn(&Record) -> bool,
    ) -> Record {
        self.next_matching(what, timeout, |s| s.record().filter(|r| matches(r)))
            .await
    }

    /// Everything seen so far, oldest first.
    pub fn all(&self) -> Vec<Seen> {
        self.seen.borrow().clone()
    }

    fn tail(&self, n: usize) -> String {
        let seen = self.seen.borrow();
        seen.iter()
            .skip(seen.len().saturating_sub(n))
            .map(|s| format!("  {}", s.describe()))
            .collect::<Vec<_>>()
            .join("\n")
    }
}
