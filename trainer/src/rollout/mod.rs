//! Rollouts: the local burn model as an episode agent ([`LocalAgent`]), driven by the `env`
//! crate's episode loop against an environment.

mod local_agent;

pub use local_agent::LocalAgent;
