//! `volume-gate status`: every tenant and its release state.

#[derive(clap::Args, Debug, Clone)]
pub struct StatusArgs {}

pub async fn run(_args: StatusArgs) -> Result<(), String> {
    Err("status is not built yet".into())
}
