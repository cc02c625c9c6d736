#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "volume-gate",
    version,
    about = "Frees a Cozystack tenant's volumes before its CSI driver is removed"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the validating and mutating admission webhook.
    Webhook(volume_gate::args::WebhookArgs),
    /// Run the worker: custody of every tenant and the volume-release phase.
    Worker(volume_gate::args::WorkerArgs),
    /// Serving certificates for the webhook.
    #[command(subcommand)]
    Certs(CertsCommand),
    /// Show every tenant and its release state.
    Status(volume_gate::worker::status::StatusArgs),
    /// List the storage that tenants already gone left on the management
    /// cluster (read-only: it only lists, and never writes).
    ///
    /// DataVolumes, their PVCs and PVs labelled for tenants whose parent
    /// release no longer exists, the PVs volume-gate kept for such tenants,
    /// Released PVs whose claim was in a tenant namespace, and the
    /// VolumeSnapshotContents of those tenants; each with its size, age and
    /// the commands that free it, which it prints and never runs. A tenant
    /// whose parent exists is never listed. Uses your kubeconfig, or the
    /// worker's identity when run in its Pod:
    /// kubectl -n volume-gate exec deploy/volume-gate-worker --
    /// /usr/local/bin/volume-gate orphans
    Orphans(volume_gate::worker::orphans::OrphansArgs),
    /// Print the profile in effect (Cozystack's, or --profile checked) as JSON,
    /// a starting point for another platform's profile file.
    Profile(volume_gate::args::ProfileArgs),
    /// Add or remove the custody finalizer on tenants (install and uninstall).
    #[command(subcommand)]
    Custody(volume_gate::worker::custody::CustodyCommand),
}

#[derive(Subcommand)]
enum CertsCommand {
    /// Generate a CA and a serving certificate for the webhook Service.
    Generate(volume_gate::certs::GenerateArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("volume-gate: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result: Result<(), String> = runtime.block_on(async move {
        match cli.command {
            Command::Webhook(args) => {
                let _logs = volume_gate::telemetry::init_json_logs();
                volume_gate::admission::server::run(args)
                    .await
                    .map_err(|e| e.to_string())
            }
            Command::Worker(args) => {
                let _logs = volume_gate::telemetry::init_json_logs();
                volume_gate::worker::run(args)
                    .await
                    .map_err(|e| e.to_string())
            }
            Command::Certs(CertsCommand::Generate(args)) => {
                volume_gate::certs::run_generate(args).map_err(|e| e.to_string())
            }
            Command::Status(args) => volume_gate::worker::status::run(args)
                .await
                .map_err(|e| e.to_string()),
            Command::Orphans(args) => volume_gate::worker::orphans::run(args).await,
            Command::Profile(args) => {
                volume_gate::profile::Profile::load_or_default(args.profile.path())
                    .map_err(|e| e.to_string())
                    .and_then(|p| serde_json::to_string_pretty(&p).map_err(|e| e.to_string()))
                    .map(|json| println!("{json}"))
            }
            Command::Custody(cmd) => volume_gate::worker::custody::run_command(cmd)
                .await
                .map_err(|e| e.to_string()),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("volume-gate: {e}");
            ExitCode::FAILURE
        }
    }
}
