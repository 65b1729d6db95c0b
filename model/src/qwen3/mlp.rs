//! `Qwen3MLP`: SwiGLU, `down_proj(silu(gate_proj(x)) * up_proj(x))`, no biases.

use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{activation::silu, backend::Backend, Tensor};

use super::linear::{lora_linear, product, MatmulPrecision};
use super::stacked::split_columns;
use super::rms_norm::rows;
use crate::lora::LoraLayer;
use crate::device_kernels::{self, GateUp};
use crate::kernels;

/// The gated feed-forward block of a decoder layer.
#[derive(Module, Debug)]
pub struct Qwen3MLP<B: Backend> {
    pub gate_proj: Linear<B>,
    pub up_proj: Linear<B>,
    pub down_proj: Linear<B>,
    /// vLLM's `gate_up_proj`: `gate_proj`'s and `up_proj`'s weights side by side,
    /// `[hidden, 2 · intermediate]`, those two being views of its columns; set by
    /// [`crate::Qwen3ForCausalLM::with_stacked_projections`] for inference, `None` otherwise.
    /// Not a parameter.
    #[module(skip)]
    pub gate_up_proj: Option<Tensor<B, 2>>,
}

impl<B: Backend> Qwen3MLP<B> {
    /// `[.., hidden] -> [.., hidden]`, the projections at precision `matmul`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>, matmul: MatmulPrecision) -> Tensor<B, D> {
        self.forward_with_adapters(x, matmul, None, false)
    }

    /// [`Self::forward`] with the layer's LoRA adapters on the projections that have one. One
    /// product of the stacked `gate_up_proj` stands for `gate_proj`'s and `up_proj`'s where
    /// neither has an adapter. In a pass `over_cache` (generation's, over a KV cache) a GPU
    /// backend's kernel may compute `silu(gate) · up` ([`device_kernels::SiluMulFn`], reading a
    /// stacked product or two where they lie); passes without a cache keep burn's ops, as the
    /// norms do.
    pub fn forward_with_adapters<const D: usize>(
        &self,
        x: Tensor<B, D>,
        matmul: MatmulPrecision,
        adapters: Option<&LoraLayer<B>>,
        over_cache: bool,
    ) -> Tensor<B, D> {
        let (gate_adapter, up_adapter) = (adapters.and_then(|a| a.gate_proj.as_ref()), adapters.and_then(|a| a.up_proj.as_ref()));
        let (rows, dims) = rows(&x);
        let x = x.reshape(rows);
        let stacked = self.gate_up_proj.as_ref().filter(|_| gate_adapter.is_none() && up_adapter.is_none());
        let kernel = over_cache.then(device_kernels::silu_mul::<B>).flatten();
        let hidden = match (stacked, kernel) {
            (Some(gate_up_proj), Some(kernel)) => kernel(GateUp::Stacked(product(x, gate_up_proj.clone(), matmul))),
            (Some(gate_up_proj), None) => {
                let width = gate_up_proj.dims()[1] / 2;
                let [gate, up] = split_columns(product(x, gate_up_proj.clone(), matmul), [width, width]);
                silu_mul(gate, up)
            }
            (None, kernel) => {
                let gate = lora_linear(&self.gate_proj, gate_adapter, x.clone(), matmul);
                let up = lora_linear(&self.up_proj, up_adapter, x, matmul);
                match kernel.filter(|_| gate.dtype() == up.dtype()) {
                    Some(kernel) => kernel(GateUp::Separate(gate, up)),
                    None => silu_mul(gate, up),
                }
            }
        };
        let output = lora_linear(&self.down_proj, adapters.and_then(|a| a.down_proj.as_ref()), hidden, matmul);
        let mut dims = dims;
        dims[D - 1] = output.dims()[1];
        output.reshape(dims)
    }
}

/// `silu(gate) · up` by the CPU kernel, or burn's ops.
fn silu_mul<B: Backend>(gate: Tensor<B, 2>, up: Tensor<B, 2>) -> Tensor<B, 2> {
    kernels::silu_mul(&gate, &up).unwrap_or_else(|| silu(gate) * up)
}
