//! The Qwen3 decoder, module by module as in `modeling_qwen3.py`: `Qwen3RMSNorm`,
//! `Qwen3RotaryEmbedding` (with `rotate_half` folded into its tables), `Qwen3Attention`, `Qwen3MLP`, `Qwen3DecoderLayer`,
//! `Qwen3Model` and `Qwen3ForCausalLM`. The model is immutable in use (`&self`): the KV cache,
//! the attention mask and the positions are values passed in; how it computes ([`Compute`]:
//! the attention implementation, the precision of products) is one value chosen at load. An
//! inference copy may stack its projections as vLLM does (`qkv_proj`, `gate_up_proj`:
//! [`Qwen3ForCausalLM::for_inference`]).

pub mod attention;
mod cache;
mod causal_lm;
pub mod compute;
mod decoder_layer;
mod linear;
mod mask;
mod mlp;
mod rms_norm;
mod rotary;
mod stacked;

pub use attention::autodiff::register_autodiff_attention;
pub use attention::{AttentionInputs, Qwen3Attention};
pub use cache::{grown_capacity, CachedKv, KvCache, LayerKvCache, PoolLike, BLOCK_SIZE, GROWTH_STEP, SCRATCH_SLOT};
pub use causal_lm::{ModelOutput, Qwen3ForCausalLM, Qwen3Model};
pub use compute::{AttnImplementation, Compute, CpuKernelsInUse, GpuKernelsInUse, KernelsInUse};
pub use decoder_layer::{Qwen3DecoderLayer, ResidualStream};
pub use mask::{attention_bias, AttentionMask, MASK_VALUE};
pub use linear::{decoding_product, lora_linear, product, MatmulPrecision};
pub use mlp::Qwen3MLP;
pub use rms_norm::Qwen3RMSNorm;
pub use rotary::{apply_rotary_pos_emb, swap_halves, Qwen3RotaryEmbedding, RotaryTables};
