//! What every long-running role starts the same way, built once: the
//! profile, a client of the management API, the metrics, the shutdown on
//! SIGTERM and the admin port (health and metrics). The webhook and the
//! worker add what is theirs on top.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::args::{CommonArgs, ListenAddr};
use crate::metrics::Metrics;
use crate::profile::Profile;

/// Why a role could not start.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error(transparent)]
    Profile(#[from] crate::profile::ProfileError),
    #[error("cannot build a Kubernetes client (in-cluster config or KUBECONFIG): {0}")]
    Client(#[source] kube::Error),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: ListenAddr,
        source: std::io::Error,
    },
}

/// Binds `addr`, naming it in the error: `IP:PORT` as given; `:PORT` on
/// every address ([`bind_every_address`]).
pub async fn listen(addr: ListenAddr) -> Result<tokio::net::TcpListener, BootError> {
    let bound = match addr {
        ListenAddr::Addr(a) => tokio::net::TcpListener::bind(a).await,
        ListenAddr::Every(port) => bind_every_address(port, bind_dual_stack).and_then(|(l, _)| {
            l.set_nonblocking(true)?;
            tokio::net::TcpListener::from_std(l)
        }),
    };
    bound.map_err(|source| BootError::Listen { addr, source })
}

/// What a `:PORT` listener answers on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `[::]:PORT` with IPV6_V6ONLY off: IPv6, and IPv4 as mapped addresses.
    DualStack,
    /// `0.0.0.0:PORT`: the host has no IPv6.
    Ipv4Only,
}

/// Binds `port` on every address: one dual-stack socket (`dual_stack`),
/// or `0.0.0.0:PORT` when that cannot be had (a kernel or a Pod without
/// IPv6), which is logged. A port already taken is an error, not a reason
/// to fall back.
pub fn bind_every_address(
    port: u16,
    dual_stack: impl FnOnce(u16) -> std::io::Result<TcpListener>,
) -> std::io::Result<(TcpListener, Family)> {
    match dual_stack(port) {
        Ok(l) => Ok((l, Family::DualStack)),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(e),
        Err(e) => {
            tracing::info!(
                port,
                error = %e,
                "no IPv6 on this host: listening on 0.0.0.0 (IPv4 only)"
            );
            let l = TcpListener::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))?;
            Ok((l, Family::Ipv4Only))
        }
    }
}

/// `[::]:PORT` with IPV6_V6ONLY off, whatever the host's default
/// (`net.ipv6.bindv6only`): IPv4 clients reach it as `::ffff:a.b.c.d`.
pub fn bind_dual_stack(port: u16) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::IPV6, Type::STREAM, Some(Protocol::TCP))?;
    socket.set_only_v6(false)?;
    socket.set_reuse_address(true)?;
    socket.bind(&SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)).into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// A running role's shared parts.
pub struct Runtime {
    pub profile: Profile,
    pub client: kube::Client,
    pub metrics: Arc<Metrics>,
    /// Cancelled on SIGTERM or SIGINT, or by the role when it stops.
    pub shutdown: CancellationToken,
    /// Where the admin port listens (`[::]:PORT` when on every address).
    pub admin_addr: SocketAddr,
    admin: JoinHandle<std::io::Result<()>>,
}

impl Runtime {
    /// Loads the profile, builds the client, binds and serves the admin
    /// port, and cancels `shutdown` on a signal.
    pub async fn start(common: &CommonArgs) -> Result<Runtime, BootError> {
        let profile = Profile::load_or_default(common.profile.path())?;
        let client = kube::Client::try_default()
            .await
            .map_err(BootError::Client)?;
        let metrics = Metrics::new();
        let shutdown = CancellationToken::new();
        let admin_listener = listen(common.admin_listen).await?;
        let admin_addr = admin_listener
            .local_addr()
            .map_err(|source| BootError::Listen {
                addr: common.admin_listen,
                source,
            })?;
        let readiness = Arc::new(crate::admin::ApiServerReadiness::new(client.clone()));
        let admin = tokio::spawn(crate::admin::serve_admin(
            admin_listener,
            metrics.clone(),
            readiness,
            shutdown.clone(),
        ));
        tokio::spawn(crate::shutdown_on_signal(shutdown.clone()));
        Ok(Runtime {
            profile,
            client,
            metrics,
            shutdown,
            admin_addr,
            admin,
        })
    }

    /// Once the role is done: stops the admin port and waits for it.
    pub async fn finish(self) {
        self.shutdown.cancel();
        if let Ok(Err(e)) = self.admin.await {
            tracing::warn!(error = %e, "the admin port stopped with an error");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpStream;

    /// Accepts one connection on `l` from `to` and echoes a byte: the
    /// listener answers on that address.
    fn answers(l: &TcpListener, to: SocketAddr) {
        let mut c = TcpStream::connect(to).unwrap_or_else(|e| panic!("connect {to}: {e}"));
        let (mut s, peer) = l.accept().unwrap();
        assert_eq!(peer.ip().to_canonical(), to.ip(), "the peer is {peer}");
        c.write_all(b"x").unwrap();
        let mut b = [0u8; 1];
        s.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"x");
    }

    /// This machine has an IPv6 loopback when a socket can bind `[::1]:0`.
    fn ipv6_loopback() -> Result<(), std::io::Error> {
        TcpListener::bind((Ipv6Addr::LOCALHOST, 0)).map(drop)
    }

    #[test]
    fn every_address_answers_on_ipv4_and_ipv6_loopback_or_says_why_not() {
        let (l, family) = bind_every_address(0, bind_dual_stack).unwrap();
        let port = l.local_addr().unwrap().port();
        let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, port));
        match ipv6_loopback() {
            Ok(()) => {
                assert_eq!(family, Family::DualStack, "this machine has IPv6");
                assert_eq!(l.local_addr().unwrap().ip(), Ipv6Addr::UNSPECIFIED);
                answers(&l, v4);
                answers(&l, v6);
            }
            Err(e) => {
                // Said, not skipped: the fallback is what such a host runs.
                println!(
                    "no IPv6 loopback on this machine ({e}): ::1 not tested; \
                     the listener is {family:?}, tested on 127.0.0.1"
                );
                answers(&l, v4);
            }
        }
    }

    #[test]
    fn without_ipv6_every_address_is_ipv4_and_a_taken_port_is_an_error() {
        // A host without IPv6: the socket cannot be made.
        let no_ipv6 = |_| -> std::io::Result<TcpListener> {
            Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
        };
        let (l, family) = bind_every_address(0, no_ipv6).unwrap();
        assert_eq!(family, Family::Ipv4Only);
        assert_eq!(l.local_addr().unwrap().ip(), Ipv4Addr::UNSPECIFIED);
        let port = l.local_addr().unwrap().port();
        answers(&l, SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
        if ipv6_loopback().is_ok() {
            assert!(
                TcpStream::connect((Ipv6Addr::LOCALHOST, port)).is_err(),
                "an IPv4 socket does not answer on ::1"
            );
        }
        // A port in use is not a missing IPv6: no silent IPv4-only listener.
        let taken = |_| -> std::io::Result<TcpListener> {
            Err(std::io::Error::from(std::io::ErrorKind::AddrInUse))
        };
        let e = bind_every_address(0, taken).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
        // And for real: the dual-stack socket refuses a port taken on IPv4.
        let held = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap();
        let port = held.local_addr().unwrap().port();
        assert!(bind_every_address(port, bind_dual_stack).is_err());
    }

    #[tokio::test]
    async fn listen_takes_every_address_or_one() {
        let every = listen(ListenAddr::Every(0)).await.unwrap();
        let port = every.local_addr().unwrap().port();
        tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port))
            .await
            .expect("IPv4 reaches :PORT");
        let one = listen(ListenAddr::Addr("127.0.0.1:0".parse().unwrap()))
            .await
            .unwrap();
        assert_eq!(one.local_addr().unwrap().ip(), Ipv4Addr::LOCALHOST);
        let taken = ListenAddr::Addr(one.local_addr().unwrap());
        let e = listen(taken).await.unwrap_err().to_string();
        assert!(e.contains(&taken.to_string()), "{e}");
    }
}
