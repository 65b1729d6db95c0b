//! `Qwen3MLP`: SwiGLU, `down_proj(silu(gate_proj(x)) * up_proj(x))`, no biases.

use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{activation::silu, backend::Backend, Tensor};

use super::linear::{lora_linear, product, MatmulPrecision};
use super::stacked::split_columns;
use super::rms_norm::rows;
use crate::lora::LoraLayer;
use crate::{device_kernels, kernels};

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
    /// backend's kernel may compute `silu(gate) · up` ([`device_kernels::SiluMulFn`]), reading
    /// a stacked product's halves where they lie; passes without a cache keep burn's ops, as
    /// the norms do.
    pub fn forward_with_adapters<const D: usize>(
        &self,
        x: Tensor<B, D>,
        matmul: MatmulPrecision,
        adapters: Option<&LoraLayer<B>>,
        over_cache: bool,
    ) -> Tensor<B, D> {
        let (gate_adapter, up_adapter) = (adapters.and_then(|a| a.gate_proj.as_ref()), adapters.and_then(|a| a.up_proj.as_ref()));
        let stacked = self.gate_up_proj.as_ref().filter(|_| gate_adapter.is_none() && up_adapter.is_none());
        let hidden = match stacked {
            Some(gate_up_proj) => {
                // Two dimensions, so that the halves are columns a kernel reads in place.
                let (rows, dims) = rows(&x);
                let width = gate_up_proj.dims()[1] / 2;
                let [gate, up] = split_columns(product(x.reshape(rows), gate_up_proj.clone(), matmul), [width, width]);
                let mut dims = dims;
                dims[D - 1] = width;
                swiglu(gate, up, over_cache).reshape(dims)
            }
            None => {
                let gate = lora_linear(&self.gate_proj, gate_adapter, x.clone(), matmul);
                let up = lora_linear(&self.up_proj, up_adapter, x, matmul);
                swiglu(gate, up, over_cache)
            }
        };
        lora_linear(&self.down_proj, adapters.and_then(|a| a.down_proj.as_ref()), hidden, matmul)
    }
}

/// `silu(gate) · up`: by the CPU kernel, a GPU backend's kernel in a pass `over_cache`, or
/// burn's ops.
fn swiglu<B: Backend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>, over_cache: bool) -> Tensor<B, D> {
    let lent = over_cache && gate.dtype() == up.dtype();
    kernels::silu_mul(&gate, &up)
        .or_else(|| {
            let kernel = lent.then(device_kernels::silu_mul::<B>).flatten()?;
            let (rows, dims) = rows(&gate);
            Some(kernel(gate.clone().reshape(rows), up.clone().reshape(rows)).reshape(dims))
        })
        .unwrap_or_else(|| silu(gate) * up)
}
