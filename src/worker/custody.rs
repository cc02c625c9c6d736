//! `volume-gate custody`: hand custody back on uninstall, take it on install.

#[derive(clap::Subcommand, Debug, Clone)]
pub enum CustodyCommand {}

pub async fn run_command(cmd: CustodyCommand) -> Result<(), String> {
    match cmd {}
}
