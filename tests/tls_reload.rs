//! HTTPS with a real TLS client: the generated CA is what the client trusts,
//! only TLS 1.2 and 1.3 are spoken, and the serving certificate rotates under
//! traffic, through a Secret-volume symlink swap, without a failed request.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use rustls::client::Resumption;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, ProtocolVersion, RootCertStore, SupportedProtocolVersion};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_util::sync::CancellationToken;
use volume_gate::certs::{self, CertBundle, ServingSpec};

use secret_volume::SecretVolume;
use volume_gate::tls::{self, CertReloader};
use volume_gate_testkit::secret_volume;

const DEADLINE: Duration = Duration::from_secs(20);

fn spec() -> ServingSpec {
    let mut spec = ServingSpec::new("volume-gate-webhook", "volume-gate");
    spec.extra_sans = vec!["127.0.0.1".into()];
    spec
}

fn leaf_der(bundle: &CertBundle) -> Vec<u8> {
    CertificateDer::from_pem_slice(bundle.tls_cert.as_bytes())
        .unwrap()
        .to_vec()
}

/// The volume's files for `bundle`, as a `kubernetes.io/tls` Secret has them.
fn tls_files(bundle: &CertBundle) -> [(&'static str, &[u8]); 3] {
    [
        ("tls.crt", bundle.tls_cert.as_bytes()),
        ("tls.key", bundle.tls_key.as_bytes()),
        ("ca.crt", bundle.ca.cert.as_bytes()),
    ]
}

struct Server {
    addr: SocketAddr,
    reloader: Arc<CertReloader>,
    shutdown: CancellationToken,
    task: JoinHandle<std::io::Result<()>>,
}

impl Server {
    async fn start(volume: &SecretVolume) -> Self {
        let reloader = CertReloader::load(volume.path("tls.crt"), volume.path("tls.key")).unwrap();
        let shutdown = CancellationToken::new();
        reloader.spawn_reload(Duration::from_millis(25), shutdown.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::new().route("/hello", get(|| async { "hello" }));
        let task = tokio::spawn(tls::serve(
            listener,
            tls::server_config(reloader.clone()),
            router,
            shutdown.clone(),
        ));
        Self {
            addr,
            reloader,
            shutdown,
            task,
        }
    }

    /// Stops the server; it must drain and return well within its 20 s bound.
    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(15), self.task)
            .await
            .expect("serve did not return after shutdown")
            .unwrap()
            .unwrap();
    }
}

/// A client that trusts only `ca_pem`. Resumption is off so that every new
/// connection is a full handshake that shows the certificate being served, as
/// with the API server's Go client.
fn connector(
    ca_pem: &str,
    versions: &[&'static SupportedProtocolVersion],
    alpn: &[&[u8]],
) -> TlsConnector {
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap())
        .unwrap();
    let mut config =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_protocol_versions(versions)
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    config.resumption = Resumption::disabled();
    TlsConnector::from(Arc::new(config))
}

async fn connect(
    connector: &TlsConnector,
    addr: SocketAddr,
) -> std::io::Result<BufReader<TlsStream<TcpStream>>> {
    let tcp = TcpStream::connect(addr).await?;
    let tls = connector
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await?;
    Ok(BufReader::new(tls))
}

fn peer_leaf(stream: &BufReader<TlsStream<TcpStream>>) -> Vec<u8> {
    stream.get_ref().get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

/// One HTTP/1.1 request on a kept-alive connection; the body is read by Content-Length.
async fn request<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut BufReader<S>,
    path: &str,
) -> Result<(u16, String), String> {
    let io = |e: std::io::Error| e.to_string();
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await
        .map_err(io)?;
    stream.flush().await.map_err(io)?;
    let mut status_line = String::new();
    stream.read_line(&mut status_line).await.map_err(io)?;
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let mut length = 0;
    loop {
        let mut line = String::new();
        if stream.read_line(&mut line).await.map_err(io)? == 0 {
            return Err("connection closed inside the response head".into());
        }
        if line == "\r\n" {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value
                .trim()
                .parse()
                .map_err(|_| format!("bad header {line:?}"))?;
        }
    }
    let mut body = vec![0; length];
    stream.read_exact(&mut body).await.map_err(io)?;
    Ok((status, String::from_utf8(body).map_err(|e| e.to_string())?))
}

async fn expect_hello<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut BufReader<S>,
) -> Result<(), String> {
    match request(stream, "/hello").await? {
        (200, body) if body == "hello" => Ok(()),
        other => Err(format!("unexpected response {other:?}")),
    }
}

/// Polls `condition` until it holds; panics with `what` at the deadline.
async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_client_trusting_the_generated_ca_gets_answers() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = certs::generate(&spec(), None).unwrap();
    let volume = SecretVolume::new(dir.path(), &tls_files(&bundle));
    let server = Server::start(&volume).await;

    let client = connector(&bundle.ca.cert, rustls::DEFAULT_VERSIONS, &[b"http/1.1"]);
    let mut stream = connect(&client, server.addr).await.unwrap();
    expect_hello(&mut stream).await.unwrap();
    expect_hello(&mut stream).await.unwrap();
    let session = stream.get_ref().get_ref().1;
    assert_eq!(session.protocol_version(), Some(ProtocolVersion::TLSv1_3));
    assert_eq!(session.alpn_protocol(), Some(&b"http/1.1"[..]));
    assert_eq!(peer_leaf(&stream), leaf_der(&bundle));

    let h2_first = connector(
        &bundle.ca.cert,
        rustls::DEFAULT_VERSIONS,
        &[b"h2", b"http/1.1"],
    );
    let stream = connect(&h2_first, server.addr).await.unwrap();
    assert_eq!(
        stream.get_ref().get_ref().1.alpn_protocol(),
        Some(&b"h2"[..])
    );

    let other_ca = certs::generate(&spec(), None).unwrap();
    let stranger = connector(&other_ca.ca.cert, rustls::DEFAULT_VERSIONS, &[b"http/1.1"]);
    let err = connect(&stranger, server.addr)
        .await
        .expect_err("a client trusting another CA must refuse the server");
    assert!(
        err.to_string().contains("invalid peer certificate"),
        "{err}"
    );

    server.stop().await;
}

#[tokio::test]
async fn tls_1_2_and_1_3_are_spoken_and_older_versions_refused() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = certs::generate(&spec(), None).unwrap();
    let volume = SecretVolume::new(dir.path(), &tls_files(&bundle));
    let server = Server::start(&volume).await;

    for (version, expected) in [
        (&rustls::version::TLS12, ProtocolVersion::TLSv1_2),
        (&rustls::version::TLS13, ProtocolVersion::TLSv1_3),
    ] {
        let client = connector(&bundle.ca.cert, &[version], &[b"http/1.1"]);
        let mut stream = connect(&client, server.addr).await.unwrap();
        expect_hello(&mut stream).await.unwrap();
        assert_eq!(
            stream.get_ref().get_ref().1.protocol_version(),
            Some(expected)
        );
    }

    // rustls cannot offer TLS 1.0 or 1.1, so write those ClientHellos by hand.
    for legacy in [[3, 1], [3, 2]] {
        let alert = answer_to_legacy_hello(server.addr, legacy).await;
        assert_eq!(
            alert.get(..1),
            Some(&[0x15][..]),
            "expected an alert record for TLS {legacy:?}, got {alert:02x?}"
        );
        assert_eq!(
            alert.get(5..7),
            Some(&[2, 70][..]),
            "expected fatal protocol_version for TLS {legacy:?}, got {alert:02x?}"
        );
    }

    server.stop().await;
}

/// Sends a ClientHello whose highest version is `version` (no
/// supported_versions extension) and returns the server's first bytes.
async fn answer_to_legacy_hello(addr: SocketAddr, version: [u8; 2]) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&version);
    body.extend_from_slice(&[0x42; 32]); // random
    body.push(0); // empty session id
    body.extend_from_slice(&[0, 4, 0xc0, 0x09, 0xc0, 0x13]); // ECDHE-ECDSA/RSA-AES128-SHA
    body.extend_from_slice(&[1, 0]); // null compression
    // signature_algorithms (ecdsa_secp256r1_sha256): rustls wants it before looking at versions.
    let extensions = [0x00, 0x0d, 0x00, 0x04, 0x00, 0x02, 0x04, 0x03];
    body.extend_from_slice(&(extensions.len() as u16).to_be_bytes());
    body.extend_from_slice(&extensions);

    let mut handshake = vec![1]; // client_hello
    handshake.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    handshake.extend_from_slice(&body);
    let mut record = vec![0x16, 3, 1];
    record.extend_from_slice(&(handshake.len() as u16).to_be_bytes());
    record.extend_from_slice(&handshake);

    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(&record).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(DEADLINE, tcp.read_to_end(&mut answer))
        .await
        .expect("the server neither answered nor closed")
        .unwrap();
    answer
}

#[derive(Default)]
struct Traffic {
    fresh_ok: u64,
    kept_alive_ok: u64,
    failures: Vec<String>,
    leaves_seen: HashSet<Vec<u8>>,
}

/// New connection per request until `stop`, recording each server certificate.
async fn fresh_connections(
    client: TlsConnector,
    addr: SocketAddr,
    traffic: Arc<Mutex<Traffic>>,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        let outcome = async {
            let mut stream = connect(&client, addr)
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let leaf = peer_leaf(&stream);
            expect_hello(&mut stream).await?;
            let _ = stream.shutdown().await;
            Ok::<_, String>(leaf)
        }
        .await;
        let mut traffic = traffic.lock().unwrap();
        match outcome {
            Ok(leaf) => {
                traffic.fresh_ok += 1;
                traffic.leaves_seen.insert(leaf);
            }
            Err(e) => traffic.failures.push(format!("new connection: {e}")),
        }
    }
}

/// One connection, kept alive across the rotation, until `stop` or a failure.
async fn kept_alive_connection(
    client: TlsConnector,
    addr: SocketAddr,
    traffic: Arc<Mutex<Traffic>>,
    stop: CancellationToken,
) {
    let mut stream = match connect(&client, addr).await {
        Ok(stream) => stream,
        Err(e) => {
            traffic
                .lock()
                .unwrap()
                .failures
                .push(format!("keep-alive connect: {e}"));
            return;
        }
    };
    traffic
        .lock()
        .unwrap()
        .leaves_seen
        .insert(peer_leaf(&stream));
    while !stop.is_cancelled() {
        let outcome = expect_hello(&mut stream).await;
        let mut traffic = traffic.lock().unwrap();
        match outcome {
            Ok(()) => traffic.kept_alive_ok += 1,
            Err(e) => {
                traffic.failures.push(format!("keep-alive connection: {e}"));
                return;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_rotates_under_traffic_without_a_failed_request() {
    let dir = tempfile::tempdir().unwrap();
    let first = certs::generate(&spec(), None).unwrap();
    let mut volume = SecretVolume::new(dir.path(), &tls_files(&first));
    let server = Server::start(&volume).await;
    let (first_leaf, generation_before) = (leaf_der(&first), server.reloader.generation());

    // The client trusts the CA only: rotation must not require touching it.
    let client = connector(&first.ca.cert, rustls::DEFAULT_VERSIONS, &[b"http/1.1"]);
    let traffic = Arc::new(Mutex::new(Traffic::default()));
    let stop = CancellationToken::new();
    let fresh = tokio::spawn(fresh_connections(
        client.clone(),
        server.addr,
        traffic.clone(),
        stop.clone(),
    ));
    let kept = tokio::spawn(kept_alive_connection(
        client,
        server.addr,
        traffic.clone(),
        stop.clone(),
    ));
    // Each wait also ends on a failure, which the final assertion then reports.
    let observe = |condition: &dyn Fn(&Traffic) -> bool| {
        let traffic = traffic.lock().unwrap();
        condition(&traffic) || !traffic.failures.is_empty()
    };

    wait_until("traffic on the first certificate", || {
        observe(&|t| t.leaves_seen.contains(&first_leaf) && t.fresh_ok > 0 && t.kept_alive_ok > 0)
    })
    .await;

    let second = certs::generate(&spec(), Some(&first.ca)).unwrap();
    assert!(second.ca_reused);
    let second_leaf = leaf_der(&second);
    assert_ne!(second_leaf, first_leaf);
    volume.publish(&tls_files(&second));

    wait_until("the reloader to swap", || {
        server.reloader.generation() > generation_before
    })
    .await;
    assert_eq!(server.reloader.current_leaf_der(), second_leaf);
    wait_until("a new connection to be served the new certificate", || {
        observe(&|t| t.leaves_seen.contains(&second_leaf))
    })
    .await;
    let kept_alive_at_swap = traffic.lock().unwrap().kept_alive_ok;
    wait_until(
        "the kept-alive connection to keep answering after the swap",
        || observe(&|t| t.kept_alive_ok > kept_alive_at_swap),
    )
    .await;

    stop.cancel();
    fresh.await.unwrap();
    kept.await.unwrap();
    {
        let traffic = traffic.lock().unwrap();
        assert!(
            traffic.failures.is_empty(),
            "failed requests during rotation: {:#?}",
            traffic.failures
        );
        assert!(
            traffic.leaves_seen.contains(&first_leaf) && traffic.leaves_seen.contains(&second_leaf)
        );
        assert_eq!(traffic.leaves_seen.len(), 2);
        assert!(traffic.fresh_ok >= 2 && traffic.kept_alive_ok >= 2);
    }
    server.stop().await;
}

#[tokio::test]
async fn shutdown_closes_idle_keep_alive_connections_promptly() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = certs::generate(&spec(), None).unwrap();
    let volume = SecretVolume::new(dir.path(), &tls_files(&bundle));
    let server = Server::start(&volume).await;
    let client = connector(&bundle.ca.cert, rustls::DEFAULT_VERSIONS, &[b"http/1.1"]);
    let mut stream = connect(&client, server.addr).await.unwrap();
    expect_hello(&mut stream).await.unwrap();

    let addr = server.addr;
    server.stop().await;
    let mut rest = Vec::new();
    let read = tokio::time::timeout(DEADLINE, stream.read_to_end(&mut rest))
        .await
        .expect("the idle connection was not closed");
    assert!(
        read.is_ok_and(|n| n == 0),
        "an idle connection ends cleanly: {rest:?}"
    );
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "the listener is closed"
    );
}
