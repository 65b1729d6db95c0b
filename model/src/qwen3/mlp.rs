//! `Qwen3MLP`: SwiGLU, `down_proj(silu(gate_proj(x)) * up_proj(x))`, no biases.

use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{activation::silu, backend::Backend, Tensor};

use super::compute::{Compute, PassKernels};
use super::linear::{lora_linear, pass_product};
use super::stacked::split_columns;
use super::rms_norm::rows;
use crate::lora::LoraLayer;
use crate::device_kernels::GateUp;
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
    /// `[.., hidden] -> [.., hidden]`, computed as `compute` says, in a pass without a cache.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>, compute: &Compute) -> Tensor<B, D> {
        self.forward_with_adapters(x, compute, None, compute.pass(false))
    }

    /// [`Self::forward`] with the layer's LoRA adapters on the projections that have one. One
    /// product of the stacked `gate_up_proj` stands for `gate_proj`'s and `up_proj`'s where
    /// neither has an adapter. Where the `pass` allows a GPU backend's (generation's
    /// passes over a KV cache), it may compute `silu(gate) · up` ([`device_kernels::SiluMulFn`],
    /// reading a stacked product or two where they lie); other passes keep burn's ops there, as
    /// the norms do.
    pub fn forward_with_adapters<const D: usize>(
        &self,
        x: Tensor<B, D>,
        compute: &Compute,
        adapters: Option<&LoraLayer<B>>,
        pass: PassKernels,
    ) -> Tensor<B, D> {
        let (gate_adapter, up_adapter) = (adapters.and_then(|a| a.gate_proj.as_ref()), adapters.and_then(|a| a.up_proj.as_ref()));
        let (rows, dims) = rows(&x);
        let x = x.reshape(rows);
        let stacked = self.gate_up_proj.as_ref().filter(|_| gate_adapter.is_none() && up_adapter.is_none());
        let kernel = pass.device.silu_mul::<B>();
        let hidden = match (stacked, kernel) {
            (Some(gate_up_proj), Some(kernel)) => kernel(GateUp::Stacked(pass_product(x, gate_up_proj.clone(), compute, pass))),
            (Some(gate_up_proj), None) => {
                let width = gate_up_proj.dims()[1] / 2;
                let [gate, up] = split_columns(pass_product(x, gate_up_proj.clone(), compute, pass), [width, width]);
                silu_mul(pass, gate, up)
            }
            (None, kernel) => {
                let gate = lora_linear(&self.gate_proj, gate_adapter, x.clone(), compute, pass);
                let up = lora_linear(&self.up_proj, up_adapter, x, compute, pass);
                match kernel.filter(|_| gate.dtype() == up.dtype()) {
                    Some(kernel) => kernel(GateUp::Separate(gate, up)),
                    None => silu_mul(pass, gate, up),
                }
            }
        };
        let output = lora_linear(&self.down_proj, adapters.and_then(|a| a.down_proj.as_ref()), hidden, compute, pass);
        let mut dims = dims;
        dims[D - 1] = output.dims()[1];
        output.reshape(dims)
    }
}

/// `silu(gate) · up` by the CPU kernel where the `pass` runs one, or burn's ops.
fn silu_mul<B: Backend>(pass: PassKernels, gate: Tensor<B, 2>, up: Tensor<B, 2>) -> Tensor<B, 2> {
    kernels::silu_mul(pass.cpu, &gate, &up).unwrap_or_else(|| silu(gate) * up)
}
