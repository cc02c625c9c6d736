//! The HTTPS accept loop.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use hyper_util::service::TowerToHyperService;
use rustls::ServerConfig;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

/// A client that connects and stalls must not hold a task forever.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Slowloris guard for HTTP/1: a request head must arrive within this (hyper
/// also starts it while a keep-alive connection idles, so it bounds idle time).
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Pings detect HTTP/2 peers that vanished without closing the connection.
const H2_KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(20);
/// Within the default 30 s termination grace period, with room to spare.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(20);
/// Pause after an accept error such as EMFILE, instead of spinning on it.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(200);

type Http = auto::Builder<TokioExecutor>;

/// Serves `router` over TLS on `listener` until `shutdown`, then stops
/// accepting and drains open connections for up to 20 s.
pub async fn serve(
    listener: TcpListener,
    config: Arc<ServerConfig>,
    router: Router,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let acceptor = TlsAcceptor::from(config);
    let mut http = auto::Builder::new(TokioExecutor::new());
    http.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .keep_alive(true);
    http.http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(H2_KEEP_ALIVE_INTERVAL);
    let http = Arc::new(http);
    let service = TowerToHyperService::new(router);
    let graceful = GracefulShutdown::new();
    let mut connections = JoinSet::new();

    loop {
        let (tcp, peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            Some(done) = connections.join_next(), if !connections.is_empty() => {
                if let Err(e) = done
                    && e.is_panic()
                {
                    error!(error = %e, "a connection task panicked");
                }
                continue;
            }
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) if is_per_connection(&e) => continue,
                Err(e) => {
                    warn!(error = %e, "cannot accept connections; retrying");
                    tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                    continue;
                }
            },
        };
        connections.spawn(serve_connection(
            tcp,
            peer,
            acceptor.clone(),
            Arc::clone(&http),
            service.clone(),
            graceful.watcher(),
        ));
    }

    drop(listener);
    info!(open = connections.len(), "draining HTTPS connections");
    if tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown())
        .await
        .is_err()
    {
        warn!(
            open = connections.len(),
            "connections still open after {DRAIN_TIMEOUT:?}; closing them"
        );
    }
    connections.shutdown().await;
    Ok(())
}

async fn serve_connection(
    tcp: TcpStream,
    peer: SocketAddr,
    acceptor: TlsAcceptor,
    http: Arc<Http>,
    service: TowerToHyperService<Router>,
    watcher: Watcher,
) {
    // Small request/response exchanges: do not wait to fill a segment.
    let _ = tcp.set_nodelay(true);
    // Scanners, probes and clients that distrust the CA fail here all day long:
    // debug, not error.
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            debug!(%peer, error = %e, "TLS handshake failed");
            return;
        }
        Err(_) => {
            debug!(%peer, "TLS handshake timed out after {HANDSHAKE_TIMEOUT:?}");
            return;
        }
    };
    let connection = http.serve_connection(TokioIo::new(tls), service);
    if let Err(e) = watcher.watch(connection).await {
        debug!(%peer, error = %e, "connection closed with an error");
    }
}

/// Errors that concern one incoming connection, not the listener.
fn is_per_connection(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}
