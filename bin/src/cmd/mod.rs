//! One module per subcommand: each has an `Args` (clap) and a `run(args) -> anyhow::Result<()>`.

pub mod env_check;
pub mod bench;
pub mod check_device;
pub mod demo;
pub mod export;
pub mod generate;
pub mod init_model;
pub mod score;
pub mod reward;
pub mod metrics;
pub mod plot;
pub mod serve;
pub mod infer;
pub mod eval;
pub mod sft;
pub mod train;
