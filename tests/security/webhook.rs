//! The webhook under load: DELETEs of guarded objects sent in a loop and
//! what became of each, dry-run parent creates in streams and how many
//! were admitted, and the serving certificate the webhook presents.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::api::{Api, DeleteParams, DynamicObject, ObjectMeta, PostParams};
use serde_json::json;

use crate::common;
use crate::common::gate::{binary, helmrelease_resource};
use crate::common::wait::eventually;

/// What became of DELETE attempts.
#[derive(Default, Debug)]
pub struct Attempts {
    pub succeeded: Vec<String>,
    /// Refused by the gate.
    pub refused: usize,
    /// Refused by the API server, which could not call the webhook.
    pub webhook_down: usize,
    pub other: Vec<String>,
}

async fn delete_attempt(api: &Api<DynamicObject>, name: &str, what: &str, out: &Mutex<Attempts>) {
    let r = api.delete(name, &DeleteParams::default()).await;
    let mut a = out.lock().unwrap();
    match r {
        Ok(_) => a.succeeded.push(what.to_string()),
        Err(e) => {
            let m = e.to_string();
            if m.contains("volume-gate: refusing to delete") {
                a.refused += 1;
            } else if m.contains("failed calling webhook") {
                a.webhook_down += 1;
            } else {
                a.other.push(format!("{what}: {m}"));
            }
        }
    }
}

/// DELETEs of `targets` (`(api, name, what)`), one after the other in a
/// loop, for `duration`.
pub struct DeleteLoad {
    attempts: Arc<Mutex<Attempts>>,
    task: tokio::task::JoinHandle<usize>,
}

impl DeleteLoad {
    pub fn start(
        targets: Vec<(Api<DynamicObject>, String, &'static str)>,
        duration: Duration,
    ) -> DeleteLoad {
        let attempts: Arc<Mutex<Attempts>> = Arc::default();
        let task = {
            let attempts = attempts.clone();
            tokio::spawn(async move {
                let deadline = Instant::now() + duration;
                let mut n = 0usize;
                while Instant::now() < deadline {
                    for (api, name, what) in &targets {
                        delete_attempt(api, name, what, &attempts).await;
                        n += 1;
                    }
                }
                n
            })
        };
        DeleteLoad { attempts, task }
    }

    /// Waits until at least `n` attempts were refused by the gate.
    pub async fn wait_refused(&self, n: usize) {
        eventually(
            "refusals while the webhook is up",
            Duration::from_secs(10),
            || async {
                let a = self.attempts.lock().unwrap();
                if a.refused >= n {
                    Ok(())
                } else {
                    Err(format!("{a:?}"))
                }
            },
        )
        .await;
    }

    /// Waits for the load's end: how many attempts it made, and what
    /// became of them.
    pub async fn finish(self) -> (usize, Attempts) {
        let total = self.task.await.unwrap();
        let attempts = std::mem::take(&mut *self.attempts.lock().unwrap());
        (total, attempts)
    }
}

/// A parent `kubernetes-<app>` with Cozystack's labels and a spec Flux
/// leaves alone, to create (dry run) again and again.
pub fn parent(app: &str) -> DynamicObject {
    let profile = common::profile();
    let name = format!("{}{app}", profile.parent.name_prefix);
    let mut labels = profile.parent.match_labels.clone();
    labels.insert("apps.cozystack.io/application.name".into(), app.into());
    let mut parent = DynamicObject::new(&name, &helmrelease_resource());
    parent.metadata = ObjectMeta {
        name: Some(name),
        labels: Some(labels),
        ..Default::default()
    };
    parent.data = json!({"spec": common::flux::inert_spec("kubernetes")});
    parent
}

/// Streams of dry-run creates of one parent, each admitted only if it
/// comes back in custody; every other outcome is a failure.
pub struct AdmissionStreams {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicUsize>,
    failures: Arc<Mutex<Vec<String>>>,
    streams: Vec<tokio::task::JoinHandle<()>>,
}

impl AdmissionStreams {
    pub fn start(api: &Api<DynamicObject>, parent: &DynamicObject, streams: usize) -> Self {
        let finalizer = common::profile().custody_finalizer;
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicUsize::new(0));
        let failures: Arc<Mutex<Vec<String>>> = Arc::default();
        let streams = (0..streams)
            .map(|_| {
                let (api, parent, stop, ok, failures, finalizer) = (
                    api.clone(),
                    parent.clone(),
                    stop.clone(),
                    ok.clone(),
                    failures.clone(),
                    finalizer.clone(),
                );
                tokio::spawn(async move {
                    while !stop.load(Ordering::SeqCst) {
                        let dry_run = PostParams {
                            dry_run: true,
                            ..Default::default()
                        };
                        match api.create(&dry_run, &parent).await {
                            Ok(o)
                                if o.metadata
                                    .finalizers
                                    .as_deref()
                                    .unwrap_or_default()
                                    .contains(&finalizer) =>
                            {
                                ok.fetch_add(1, Ordering::SeqCst);
                            }
                            Ok(o) => failures
                                .lock()
                                .unwrap()
                                .push(format!("no custody finalizer: {:?}", o.metadata.finalizers)),
                            Err(e) => failures.lock().unwrap().push(e.to_string()),
                        }
                    }
                })
            })
            .collect();
        AdmissionStreams {
            stop,
            ok,
            failures,
            streams,
        }
    }

    /// Admissions so far.
    pub fn admitted(&self) -> usize {
        self.ok.load(Ordering::SeqCst)
    }

    /// Waits until `what`: `done(admitted)` holds.
    pub async fn wait_until(&self, what: &str, done: impl Fn(usize) -> bool) {
        eventually(what, Duration::from_secs(30), || async {
            let n = self.admitted();
            if done(n) {
                Ok(())
            } else {
                Err(format!(
                    "{n} admitted, failures {:?}",
                    self.failures.lock().unwrap()
                ))
            }
        })
        .await;
    }

    /// Stops the streams: how many were admitted, and every failure.
    pub async fn stop(self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::SeqCst);
        for s in self.streams {
            s.await.unwrap();
        }
        let failures = self.failures.lock().unwrap().clone();
        (self.ok.load(Ordering::SeqCst), failures)
    }
}

/// A new serving certificate from the same CA in `certs`, written where the
/// webhook reads it (`volume-gate certs generate --reuse-ca`).
pub fn rotate_serving_certificate(certs: &Path) {
    let out = Command::new(binary())
        .args([
            "certs",
            "generate",
            "--reuse-ca",
            "--san",
            "127.0.0.1",
            "--out",
        ])
        .arg(certs)
        .output()
        .expect("run volume-gate certs generate --reuse-ca");
    assert!(
        out.status.success(),
        "certs generate --reuse-ca: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The leaf certificate the server on loopback `port` presents in a full
/// handshake, verified against the CA in `ca`.
pub async fn served_leaf(port: u16, ca: &Path) -> Result<Vec<u8>, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(ca).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    // A full handshake every time: it shows the certificate served now.
    config.resumption = rustls::client::Resumption::disabled();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let tls = connector
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .map_err(|e| format!("TLS handshake: {e}"))?;
    let leaf = tls
        .get_ref()
        .1
        .peer_certificates()
        .ok_or("no peer certificate")?[0]
        .to_vec();
    Ok(leaf)
}

/// The leaf certificate in the PEM file `path`.
pub fn leaf_in(path: &Path) -> Vec<u8> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    CertificateDer::from_pem_file(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .to_vec()
}
