//! The trainer's engine over rollout workers: rollouts through [`ServerAgent`], and each new
//! policy written where the workers read it and pushed to them.

use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use env::Trajectory;
use model::checkpoint::StorageDtype;
use model::lora::save_adapter;
use model::{save_pretrained, LoraModel};

use super::agent::ServerAgent;
use super::pool::ServerPool;
use crate::rollout::{RolloutBatch, RolloutEngine, RolloutStats};
use crate::run::{InferenceDtype, TrainConfig, TrainError};

/// Policies kept in the policy directory (the newest; older ones are removed).
const KEEP_POLICIES: usize = 2;

/// Rollouts on the workers of `[rollout.servers]` (see the module docs of `servers`).
pub struct ServerEngine {
    pool: ServerPool,
    /// Where each step's policy is written (`policy_dir`, else `<out_dir>/policy`).
    policy_root: PathBuf,
    /// The initial model directory: the base LoRA adapters name, and the tokenizer files
    /// copied beside full weights.
    initial: PathBuf,
    /// The dtype full weights are written in (`rollout.dtype`).
    storage: StorageDtype,
    /// When episodes begin, and how many are in flight over all the workers.
    admission: env::Admission,
}

impl ServerEngine {
    /// The engine of a run's configuration (`engine = "servers"`; validated). Contacts no
    /// worker: the first [`RolloutEngine::policy_changed`] does.
    pub fn from_config(config: &TrainConfig) -> Result<Self, TrainError> {
        let settings = config
            .rollout
            .servers
            .as_ref()
            .ok_or_else(|| TrainError::Invalid("rollout.engine = \"servers\" needs a [rollout.servers] table".into()))?;
        let pool = ServerPool::new(settings, config.lora.is_some())?;
        let policy_root = settings.policy_dir.clone().unwrap_or_else(|| config.run.out_dir.join("policy"));
        let storage = match config.rollout.dtype {
            InferenceDtype::F32 => StorageDtype::F32,
            InferenceDtype::Bf16 => StorageDtype::BF16,
        };
        Ok(Self::new(pool, policy_root, config.model.clone(), storage, config.rollout.generation_batch).with_admission(config.rollout.admission()))
    }

    /// An engine on `pool`, writing policies under `policy_root`, running `generation_batch`
    /// episodes at a time.
    pub fn new(pool: ServerPool, policy_root: PathBuf, initial: PathBuf, storage: StorageDtype, generation_batch: usize) -> Self {
        Self { pool, policy_root, initial, storage, admission: env::Admission::Batches(generation_batch.max(1)) }
    }

    /// The engine beginning episodes as `admission` says.
    pub fn with_admission(mut self, admission: env::Admission) -> Self {
        self.admission = admission;
        self
    }

    /// The workers.
    pub fn pool(&self) -> &ServerPool {
        &self.pool
    }

    /// Writes the policy of `step` atomically as `<policy_root>/step-<step>` (absolute): LoRA
    /// adapters as a PEFT directory naming the initial model as their base, or full weights
    /// in HF layout (`config.json`, `model.safetensors` in `rollout.dtype`) with the initial
    /// model's tokenizer files.
    fn write_policy<B: Backend>(&self, step: u64, policy: &LoraModel<'_, B>) -> Result<PathBuf, TrainError> {
        let root = &self.policy_root;
        std::fs::create_dir_all(root).map_err(TrainError::io(root))?;
        let root = root.canonicalize().map_err(TrainError::io(root))?;
        let name = crate::run::checkpoint::checkpoint_name(step);
        let tmp = root.join(format!(".tmp-{name}"));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(TrainError::io(&tmp))?;
        }
        std::fs::create_dir_all(&tmp).map_err(TrainError::io(&tmp))?;
        match policy.adapters {
            Some(adapters) => {
                let base = std::path::absolute(&self.initial).unwrap_or_else(|_| self.initial.clone());
                save_adapter(adapters, &tmp, &base.to_string_lossy())?
            }
            None => {
                save_pretrained(policy.base, &tmp, self.storage)?;
                crate::run::checkpoint::copy_tokenizer_files(&self.initial, &tmp)?;
            }
        }
        crate::run::checkpoint::sync_dir(&tmp)?;
        let target = root.join(&name);
        if target.exists() {
            std::fs::remove_dir_all(&target).map_err(TrainError::io(&target))?;
        }
        std::fs::rename(&tmp, &target).map_err(TrainError::io(&target))?;
        crate::run::checkpoint::sync_dir(&root)?;
        Ok(target)
    }

    /// Removes the policies older than the newest [`KEEP_POLICIES`] (never `current`).
    fn prune(&self, current: &Path) -> Result<(), TrainError> {
        let root = current.parent().unwrap_or(&self.policy_root);
        let mut steps: Vec<(u64, PathBuf)> = std::fs::read_dir(root)
            .map_err(TrainError::io(root))?
            .filter_map(|entry| {
                let path = entry.ok()?.path();
                let step = crate::run::checkpoint::checkpoint_step(path.file_name()?.to_str()?)?;
                (path.is_dir() && path != current).then_some((step, path))
            })
            .collect();
        steps.sort();
        let excess = (steps.len() + 1).saturating_sub(KEEP_POLICIES);
        for (_, old) in &steps[..excess.min(steps.len())] {
            std::fs::remove_dir_all(old).map_err(TrainError::io(old))?;
        }
        Ok(())
    }
}

impl<B: Backend> RolloutEngine<B> for ServerEngine {
    fn samples_locally(&self) -> bool {
        false
    }

    /// One episode per question, at most `generation_batch` in flight over all the workers (as
    /// `rollout.admission` begins them). An error when no worker is left by the end: episodes
    /// failed.
    fn rollouts(&mut self, batch: RolloutBatch<'_, B>) -> Result<(Vec<Trajectory>, RolloutStats), TrainError> {
        if self.pool.live() == 0 {
            return Err(TrainError::Servers(format!("no rollout worker is usable: {}", self.pool.describe_failures())));
        }
        let retries = self.pool.retries();
        let vocab_size = batch.policy.base.config.vocab_size;
        let mut agent = ServerAgent::new(&mut self.pool, batch.tokenizer, batch.sampling.clone(), vocab_size);
        agent.set_batch_stream(batch.stream);
        let out = env::run_episodes_admitted(&mut agent, batch.env, batch.questions, batch.episode, self.admission, &mut env::NoObserver);
        let decoder = model::DecoderStats { prefill_tokens: agent.prefill_tokens(), ..Default::default() };
        drop(agent);
        if self.pool.live() == 0 {
            return Err(TrainError::Servers(format!(
                "every rollout worker failed during the rollout: {}",
                self.pool.describe_failures()
            )));
        }
        Ok((
            out,
            RolloutStats {
                decoder,
                server_retries: self.pool.retries() - retries,
                workers_left_out: self.pool.left_out(),
                steps: Default::default(),
            },
        ))
    }

    /// Writes the policy (see `ServerEngine::write_policy`), has every worker load it and
    /// checks that each serves it; then removes the older policies but the newest two.
    fn policy_changed(&mut self, step: u64, policy: LoraModel<'_, B>) -> Result<(), TrainError> {
        let path = self.write_policy(step, &policy)?;
        self.pool.push_policy(&path, &self.initial).map_err(TrainError::Servers)?;
        self.prune(&path)
    }
}
