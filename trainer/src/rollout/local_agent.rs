//! The agent as a local Qwen3 checkpoint run by our burn model: every active episode of a batch
//! generates its turn in one left-padded batch with a KV cache, and the context is built token by
//! token (the first prompt and each environment text are tokenised once, on their own; the
//! agent's sampled tokens are recorded as sampled, with their log-probs).

use burn::tensor::backend::Backend;
use env::{Agent, AgentContext, AgentError, TurnEnd, TurnText};
use model::generation::row_seed;
use model::tokenizer::Qwen3Tokenizer;
use model::{generate_seeded, LoraAdapters, LoraModel, Qwen3ForCausalLM, Sampling, SamplingConfig};

/// A local checkpoint acting as the Prompt-R1 agent (with LoRA adapters, if given).
pub struct LocalAgent<'m, B: Backend> {
    model: LoraModel<'m, B>,
    tokenizer: &'m Qwen3Tokenizer,
    /// How turns are sampled; `sampling.seed` is the base seed: each episode and turn derives
    /// its own stream from it.
    sampling: Sampling,
    /// Distinguishes batches of episodes run with the same agent (e.g. training steps), so that
    /// episode `i` of two batches does not repeat its samples.
    batch_stream: u64,
    stop_ids: Vec<u32>,
    turns_generated: Vec<u64>,
    /// Tokens run through prefill so far: each turn's prompt, the row's whole history.
    prefill_tokens: u64,
}

impl<'m, B: Backend> LocalAgent<'m, B> {
    /// An agent over a loaded model and its tokenizer.
    pub fn new(
        model: &'m Qwen3ForCausalLM<B>,
        tokenizer: &'m Qwen3Tokenizer,
        sampling: Sampling,
    ) -> Self {
        let special = *tokenizer.special();
        Self {
            model: LoraModel::new(model, None),
            tokenizer,
            sampling,
            batch_stream: 0,
            stop_ids: vec![special.im_end, special.endoftext],
            turns_generated: Vec::new(),
            prefill_tokens: 0,
        }
    }

    /// The agent with LoRA `adapters` applied to its model's forward.
    pub fn with_adapters(mut self, adapters: Option<&'m LoraAdapters<B>>) -> Self {
        self.model.adapters = adapters;
        self
    }

    /// Sets the stream of the next batch of episodes (e.g. the training step), which together
    /// with the episode index and turn number seeds every turn's sampling.
    pub fn set_batch_stream(&mut self, stream: u64) {
        self.batch_stream = stream;
    }

    /// Tokens this agent has run through prefill: every turn prefills its episode's whole
    /// history (the rows' own tokens, left padding not counted).
    pub fn prefill_tokens(&self) -> u64 {
        self.prefill_tokens
    }

    fn turn_seed(&self, episode: usize, turn: u64) -> u64 {
        let batch = row_seed(self.sampling.seed, self.batch_stream);
        row_seed(row_seed(batch, episode as u64), turn)
    }
}

impl<B: Backend> Agent for LocalAgent<'_, B> {
    fn begin_episode(&mut self, ctx: &mut AgentContext) -> Result<(), AgentError> {
        let ids = self
            .tokenizer
            .encode(&ctx.prompt().chatml())
            .map_err(|e| AgentError::Model(e.to_string()))?;
        ctx.record_context_tokens(&ids);
        if self.turns_generated.len() <= ctx.index() {
            self.turns_generated.resize(ctx.index() + 1, 0);
        }
        self.turns_generated[ctx.index()] = 0;
        Ok(())
    }

    fn generate_turns(
        &mut self,
        episodes: &mut [&mut AgentContext],
    ) -> Vec<Result<TurnText, AgentError>> {
        if episodes.is_empty() {
            return Vec::new();
        }
        let prompts: Vec<Vec<u32>> = episodes.iter().map(|c| c.trace().ids().to_vec()).collect();
        self.prefill_tokens += prompts.iter().map(|p| p.len() as u64).sum::<u64>();
        let seeds: Vec<u64> = episodes
            .iter()
            .map(|c| {
                self.turn_seed(
                    c.index(),
                    self.turns_generated.get(c.index()).copied().unwrap_or(0),
                )
            })
            .collect();
        let budget = episodes.iter().map(|c| c.turn_budget()).max().unwrap_or(0);
        // The seeds are per row (`seeds`), so the config's own seed is not used.
        let config = SamplingConfig {
            sampling: self.sampling.clone(),
            max_new_tokens: budget,
            stop_token_ids: self.stop_ids.clone(),
        };
        let generated = match generate_seeded(&self.model, &prompts, &config, &seeds) {
            Ok(g) => g,
            Err(e) => {
                let message = e.to_string();
                return episodes
                    .iter()
                    .map(|_| Err(AgentError::Model(message.clone())))
                    .collect();
            }
        };
        let im_end = self.tokenizer.special().im_end;
        episodes
            .iter_mut()
            .zip(generated)
            .map(|(ctx, out)| {
                if let Some(n) = self.turns_generated.get_mut(ctx.index()) {
                    *n += 1;
                }
                // Rows share one budget (the largest); each keeps only its own.
                let keep = out.tokens.len().min(ctx.turn_budget());
                let tokens = &out.tokens[..keep];
                for (&id, &lp) in tokens.iter().zip(&out.logprobs) {
                    ctx.record_agent_token(id, lp);
                }
                let ended = tokens.last() == Some(&im_end);
                let body = if ended { &tokens[..keep - 1] } else { tokens };
                let text = self
                    .tokenizer
                    .decode(body, false)
                    .map_err(|e| AgentError::Model(e.to_string()))?;
                Ok(TurnText {
                    text,
                    tokens: keep,
                    end: if ended {
                        TurnEnd::ImEnd
                    } else {
                        TurnEnd::Length
                    },
                })
            })
            .collect()
    }

    fn append_environment(
        &mut self,
        ctx: &mut AgentContext,
        text: &str,
    ) -> Result<usize, AgentError> {
        let ids = self
            .tokenizer
            .encode(text)
            .map_err(|e| AgentError::Model(e.to_string()))?;
        ctx.record_context_tokens(&ids);
        Ok(ids.len())
    }
}
