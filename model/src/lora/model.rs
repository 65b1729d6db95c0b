//! What scoring and generation run: a Qwen3 base with LoRA adapters beside it, or the base
//! alone (the KL reference, or a model without adapters).

use burn::tensor::backend::Backend;

use super::adapters::LoraAdapters;
use crate::qwen3::Qwen3ForCausalLM;

/// A causal LM as [`crate::token_logprobs`], [`crate::generate`] and the trainer see it: a base
/// model and, optionally, adapters applied in its forward. Implemented by
/// [`Qwen3ForCausalLM`] (no adapters) and [`LoraModel`].
pub trait CausalLm<B: Backend> {
    /// The base model.
    fn base(&self) -> &Qwen3ForCausalLM<B>;
    /// The adapters its forward adds, if any.
    fn adapters(&self) -> Option<&LoraAdapters<B>>;
}

impl<B: Backend> CausalLm<B> for Qwen3ForCausalLM<B> {
    fn base(&self) -> &Qwen3ForCausalLM<B> {
        self
    }

    fn adapters(&self) -> Option<&LoraAdapters<B>> {
        None
    }
}

/// A base model with adapters beside it, borrowed: PEFT's `PeftModel`, without owning either.
/// `adapters: None` is the base alone (PEFT's `disable_adapter()`).
#[derive(Debug)]
pub struct LoraModel<'a, B: Backend> {
    pub base: &'a Qwen3ForCausalLM<B>,
    pub adapters: Option<&'a LoraAdapters<B>>,
}

impl<B: Backend> Clone for LoraModel<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for LoraModel<'_, B> {}

impl<'a, B: Backend> LoraModel<'a, B> {
    /// `base` with `adapters` applied.
    pub fn new(base: &'a Qwen3ForCausalLM<B>, adapters: Option<&'a LoraAdapters<B>>) -> Self {
        Self { base, adapters }
    }
}

impl<B: Backend> CausalLm<B> for LoraModel<'_, B> {
    fn base(&self) -> &Qwen3ForCausalLM<B> {
        self.base
    }

    fn adapters(&self) -> Option<&LoraAdapters<B>> {
        self.adapters
    }
}
