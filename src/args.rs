//! Command-line arguments: what every command shares (the profile), what
//! both long-running roles share ([`CommonArgs`]), each role's own, and the
//! one duration parser.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

/// AdmissionReview bodies larger than this are refused, so it must exceed
/// any review the API server can send, or a legitimately large object would
/// be refused by everyone (the webhooks fail closed). etcd holds an object
/// of at most 1.5 MiB; in a review's JSON it grows up to six times (Go's
/// encoder writes `<`, `>`, `&` and control characters as `\u00XX`, and a
/// built-in kind is stored as protobuf, which does not), and an UPDATE
/// carries the object twice: 18 MiB. The API server's own 3 MiB limit is on
/// one request's body, and a patch can grow an object in many.
pub const DEFAULT_MAX_BODY_BYTES: usize = 24 * 1024 * 1024;
/// The worker's username as the shipped manifests name its ServiceAccount.
pub const DEFAULT_WORKER_IDENTITY: &str = "system:serviceaccount:volume-gate:volume-gate-worker";

/// `--profile`, which every command takes.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ProfileArg {
    /// Platform profile (YAML); Cozystack when absent.
    #[arg(long = "profile", env = "VOLUME_GATE_PROFILE")]
    pub file: Option<PathBuf>,
}

impl ProfileArg {
    pub fn path(&self) -> Option<&std::path::Path> {
        self.file.as_deref()
    }
}

/// What the webhook and the worker both take (`runtime::Runtime`).
#[derive(clap::Args, Debug, Clone)]
pub struct CommonArgs {
    /// Plain-HTTP address for /healthz, /readyz and /metrics: `:PORT` for
    /// every address of the host (IPv6 and IPv4), or `IP:PORT`.
    #[arg(long, default_value = ":8080", env = "VOLUME_GATE_ADMIN_LISTEN")]
    pub admin_listen: ListenAddr,
    #[command(flatten)]
    pub profile: ProfileArg,
}

/// Where a server listens (`--listen`, `--admin-listen`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenAddr {
    /// `:PORT`: every address of the host, IPv6 and IPv4 alike (one
    /// dual-stack socket; IPv4 only on a host without IPv6). A Pod's
    /// addresses are whatever its cluster gives it, one family or both.
    Every(u16),
    /// `IP:PORT` (`[IPv6]:PORT`): that address only.
    Addr(SocketAddr),
}

impl FromStr for ListenAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "{s:?} is not an address to listen on: use :PORT for every address \
                 (IPv6 and IPv4), or IP:PORT ([IPv6]:PORT) for one"
            )
        };
        match s.strip_prefix(':') {
            Some(port) => port.parse().map(ListenAddr::Every).map_err(|_| bad()),
            None => s.parse().map(ListenAddr::Addr).map_err(|_| bad()),
        }
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Every(port) => write!(f, ":{port}"),
            ListenAddr::Addr(addr) => addr.fmt(f),
        }
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct WebhookArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// HTTPS address for admission reviews: `:PORT` for every address of
    /// the host (IPv6 and IPv4), or `IP:PORT`.
    #[arg(long, default_value = ":8443", env = "VOLUME_GATE_LISTEN")]
    pub listen: ListenAddr,
    /// Serving certificate (PEM); reloaded when it changes.
    #[arg(long, default_value = "/etc/volume-gate/tls/tls.crt")]
    pub tls_cert: PathBuf,
    /// Serving key (PEM); reloaded when it changes.
    #[arg(long, default_value = "/etc/volume-gate/tls/tls.key")]
    pub tls_key: PathBuf,
    /// How often to re-read the certificate and key.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub cert_reload_interval: Duration,
    /// After SIGTERM, how long to go on serving before draining: the time
    /// for the API server (and kube-proxy) to stop choosing this Pod. The
    /// chart sets it; 0 drains at once.
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    pub shutdown_delay: Duration,
    /// The worker's username: the only identity that writes the record and
    /// removes the custody finalizer.
    #[arg(long, default_value = DEFAULT_WORKER_IDENTITY, env = "VOLUME_GATE_WORKER_IDENTITY")]
    pub worker_identity: String,
    /// AdmissionReview bodies larger than this are refused.
    #[arg(long, default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    #[command(flatten)]
    pub writers: WritersArgs,
}

/// Who the platform's controllers are (the profile's `writers`), from the
/// chart's `platform` values: each flag, repeated once per username,
/// replaces that list of the profile when given.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct WritersArgs {
    /// A username of the release controller (Flux's helm-controller),
    /// which alone writes a release's status and applies a parent
    /// release's children.
    #[arg(long = "release-controller")]
    pub release_controllers: Vec<String>,
    /// A username that sets parents' chart sources in a platform upgrade.
    #[arg(long = "parent-source-writer")]
    pub parent_sources: Vec<String>,
    /// A username that replaces a parent whole on an update (cozystack-api).
    #[arg(long = "parent-replacer")]
    pub parent_replacers: Vec<String>,
}

impl WritersArgs {
    /// `writers` with the lists these flags give put in place.
    pub fn apply(&self, writers: &mut crate::profile::Writers) {
        for (given, list) in [
            (&self.release_controllers, &mut writers.release_controllers),
            (&self.parent_sources, &mut writers.parent_sources),
            (&self.parent_replacers, &mut writers.parent_replacers),
        ] {
            if !given.is_empty() {
                list.clone_from(given);
            }
        }
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// At most this many tenants are released at once.
    #[arg(long, default_value_t = 4)]
    pub max_concurrent_releases: usize,
    /// Bound on the tenant /readyz probe.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub probe_timeout: Duration,
    /// How long one pass waits with no volume freed before Blocked (counted
    /// from the last volume gone, so a slow driver that keeps freeing is
    /// waited for).
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pub wait_bound: Duration,
    /// How long one tenant's pass may hold a release slot while another
    /// tenant waits for one: past it, a pass waiting on its driver gives the
    /// slot up and queues again (first come, first served), so slow drivers
    /// cannot keep every slot from the tenants behind them.
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    pub release_turn: Duration,
    /// How long a tenant being deleted must stay unreachable (no kubeconfig,
    /// no answer) before the phase frees its inventoried volumes with reclaim
    /// policy Delete from the management side (profile `infra`).
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    pub infra_after: Duration,
    /// First retry delay after Blocked; doubles up to --retry-max.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub retry_base: Duration,
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pub retry_max: Duration,
    /// Lease for leader election, in the worker's namespace.
    #[arg(long, default_value = "volume-gate-worker")]
    pub lease_name: String,
    #[arg(long, env = "POD_NAMESPACE", default_value = "volume-gate")]
    pub lease_namespace: String,
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    pub lease_duration: Duration,
    /// This replica's identity in the Lease (the Pod name in a cluster).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Only watch parents in this namespace (tests); all namespaces when absent.
    #[arg(long)]
    pub namespace: Option<String>,
}

/// `volume-gate profile`: print the effective profile.
#[derive(clap::Args, Debug, Clone)]
pub struct ProfileArgs {
    #[command(flatten)]
    pub profile: ProfileArg,
}

/// A duration as operators write it: `500ms`, `10s`, `5m`, `1h30m`, or a bare
/// number of seconds (`1.5`). Parsed by jiff's friendly format, so an absurd value
/// (`99999999999999999999h`) is an error naming the input, never a panic.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let bare = !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit() || b == b'.');
    let text = if bare { format!("{s}s") } else { s.to_string() };
    let signed: jiff::SignedDuration = text
        .parse()
        .map_err(|e| format!("{s:?} is not a duration like 500ms, 10s, 5m or 1h30m: {e}"))?;
    Duration::try_from(signed).map_err(|_| format!("{s:?}: a duration must not be negative"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("3").unwrap(), Duration::from_secs(3));
        assert_eq!(parse_duration("1.5").unwrap(), Duration::from_millis(1500));
        assert!(parse_duration("ten").unwrap_err().contains("ten"));
        assert!(parse_duration("").is_err());
        assert!(parse_duration("5d").is_err(), "days are not a fixed length");
    }

    #[test]
    fn listen_addresses_are_every_address_or_one() {
        assert_eq!(":8443".parse(), Ok(ListenAddr::Every(8443)));
        assert_eq!(":0".parse(), Ok(ListenAddr::Every(0)));
        assert_eq!(
            "127.0.0.1:8080".parse(),
            Ok(ListenAddr::Addr("127.0.0.1:8080".parse().unwrap()))
        );
        assert_eq!(
            "[::1]:8080".parse(),
            Ok(ListenAddr::Addr("[::1]:8080".parse().unwrap()))
        );
        for bad in [
            "8080",
            ":",
            ":http",
            ":65536",
            "localhost:8080",
            "::1:8080",
            "",
        ] {
            let e = bad.parse::<ListenAddr>().unwrap_err();
            assert!(
                e.contains(&format!("{bad:?}")) && e.contains(":PORT"),
                "{e}"
            );
        }
        for text in [":8443", "127.0.0.1:8080", "[::1]:8080"] {
            assert_eq!(text.parse::<ListenAddr>().unwrap().to_string(), text);
        }
    }

    #[test]
    fn absurd_or_negative_durations_are_errors_not_panics() {
        let e = parse_duration("99999999999999999999h").unwrap_err();
        assert!(e.contains("99999999999999999999h"), "{e}");
        assert!(parse_duration("-5s").is_err());
        assert!(parse_duration("1e400s").is_err());
    }
}
