//! Qwen3 in burn: Hugging Face checkpoints in, logits identical to transformers out.
//!
//! - [`config`]: `config.json` in both transformers key styles, and the `init-model` presets.
//! - [`checkpoint`]: memory-mapped safetensors files (single or sharded), and writing them.
//! - [`weights`]: HF tensor names ↔ model parameters (import/export, apart from the math).
//! - [`qwen3`]: the decoder itself, module by module with HF's names.
//! - [`tokenizer`], [`chat_template`], [`tiny_tokenizer`]: Qwen3's tokenizer and ChatML template,
//!   and the small BPE tokenizer the tiny presets ship with.
//! - [`batch`], [`logprobs`], [`generation`], [`decode`]: padded batches, per-token log-probs
//!   (what GRPO needs), generation, and the one decode loop under it (sequences joining and
//!   leaving a batch, their KV caches kept); [`device_sampling`] chooses tokens on the model's device.
//! - [`lora`]: LoRA adapters as PEFT makes them, beside the model; PEFT's adapter files.
//! - [`probe`]: one small sum on a device, turning a missing GPU runtime into an error.
//! - `kernels` (private): the named points where the CPU kernels of [`cpu_kernels`] (the
//!   `prompt-r1-cpu-kernels` crate, re-exported) stand in for burn's ops on burn-flex.

pub mod batch;
pub mod chat_template;
pub mod checkpoint;
pub mod config;
pub mod decode;
pub mod device_kernels;
pub mod device_memory;
pub mod device_sampling;
pub mod error;
pub mod generation;
pub mod host_memory;
pub mod init;
mod kernels;
pub mod logprobs;
pub mod lora;
pub mod probe;
pub mod publish;
pub mod qwen3;
pub mod tiny_tokenizer;
pub mod tokenizer;
pub mod weights;

pub use config::{Preset, Qwen3Config};
pub use error::{ModelError, SettingError};
pub use qwen3::{AttnImplementation, Compute, KvCache, MatmulPrecision, Qwen3ForCausalLM};
pub use device_kernels::DeviceKernelChoice;
pub use batch::{Padding, TokenBatch};
pub use cpu_kernels;
pub use chat::Sampling;
pub use decode::{Decoder, DecoderLimits, DecoderStats, SequenceId, StepLogits};
pub use generation::{choose_row_tokens, generate, generate_observed, generate_seeded, FinishReason, GeneratedSequence, RowSampling, SamplingConfig};
pub use logprobs::{completion_logprobs, last_hidden_state, map_hidden_chunks, map_logits_chunks, token_logprobs, token_logprobs_from_hidden};
pub use lora::{CausalLm, LoraAdapters, LoraConfig, LoraModel};
pub use weights::{load_pretrained, save_pretrained, with_dtype, LoadOptions};
