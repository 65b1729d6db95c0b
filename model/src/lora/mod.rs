//! LoRA (low-rank adapters) as PEFT implements it, for Qwen3's projections.
//!
//! - [`config`]: the settings (`rank`, `alpha`, `dropout`, `target_modules`).
//! - [`adapters`]: the adapters as a burn module ([`LoraAdapters`]) beside the immutable model;
//!   the forward takes them as a value (`Qwen3ForCausalLM::forward_with_adapters`). The adapted
//!   projection itself is `qwen3::lora_linear`, next to the plain one.
//! - [`model`]: a base with adapters as the scoring and generation functions take it.
//! - [`peft`]: PEFT's adapter directory, read and written.
//! - [`merge`]: the adapters folded into the base weights.

pub mod adapters;
pub mod config;
pub mod merge;
pub mod model;
pub mod peft;

pub use adapters::{AdapterWeights, LoraAdapters, LoraLayer, LoraLinear};
pub use config::{LoraConfig, LoraTarget};
pub use merge::merge_adapters;
pub use model::{CausalLm, LoraModel};
pub use peft::{
    base_model_dir, is_adapter_dir, load_adapter, peft_key, read_adapter_config, save_adapter, AdapterConfig,
    ADAPTER_CONFIG, ADAPTER_WEIGHTS,
};
