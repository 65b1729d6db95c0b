//! vLLM's stacked projections for inference: `q_proj`, `k_proj` and `v_proj` as one product
//! (`qkv_proj`), `gate_proj` and `up_proj` as another (`gate_up_proj`), so that a decoder layer
//! launches two products where it launched five. The separate weights stay, as views of the
//! stacked ones' columns (no second copy where the backend slices in place, as CubeCL's do), so
//! LoRA adapters, exports and the HF names see the model as before.

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::{backend::Backend, Tensor};

use super::causal_lm::Qwen3ForCausalLM;

impl<B: Backend> Qwen3ForCausalLM<B> {
    /// The model with each layer's `q_proj`, `k_proj` and `v_proj` weights stacked into
    /// `qkv_proj`, and `gate_proj` and `up_proj` into `gate_up_proj`: a pass then takes one
    /// product for each group of projections that have no LoRA adapter, and a GPU backend's
    /// kernels read the products' columns where they lie. The result is the same up to the
    /// products' rounding.
    ///
    /// For inference copies only: the stacked weights are not parameters (neither trained nor
    /// saved). Code that replaces weights goes through [`Self::restacked_after`] (casting does;
    /// merging adapters unstacks and stacks again itself), so that none is left stale. Module
    /// methods that do not know of them mishandle them: `map` and `load_record` leave them
    /// stale, `to_device` and `fork` move them and their views apart (the weights twice on the
    /// new device), and an autodiff wrapper would not track them. Stack after such steps, never
    /// before. A model already stacked is returned as it is.
    pub fn with_stacked_projections(mut self) -> Self {
        for layer in &mut self.model.layers {
            let attention = &mut layer.self_attn;
            if attention.qkv_proj.is_none() {
                attention.qkv_proj = stack([&mut attention.q_proj, &mut attention.k_proj, &mut attention.v_proj]);
            }
            let mlp = &mut layer.mlp;
            if mlp.gate_up_proj.is_none() {
                mlp.gate_up_proj = stack([&mut mlp.gate_proj, &mut mlp.up_proj]);
            }
        }
        self
    }

    /// The model prepared for inference on its backend: [`Self::with_stacked_projections`]
    /// where the backend lends, and the model's choice runs, the GPU kernels that read a stacked
    /// product's columns in place (the norms' and SwiGLU's, see [`crate::device_kernels`]), the
    /// model as it is elsewhere (the CPU, whose kernels take the projections one by one).
    pub fn for_inference(self) -> Self {
        let kernels = self.model.compute.device_kernels;
        let lent = kernels.norms::<B>().is_some() && kernels.silu_mul::<B>().is_some();
        if lent {
            self.with_stacked_projections()
        } else {
            self
        }
    }

    /// Whether the projections are stacked ([`Self::with_stacked_projections`]).
    pub fn is_stacked(&self) -> bool {
        self.model.layers.iter().any(|l| l.self_attn.qkv_proj.is_some() || l.mlp.gate_up_proj.is_some())
    }

    /// The model without its stacked projections (the separate weights, views of them, stay
    /// valid): what code that replaces weights starts from, stacking again after.
    pub fn unstacked(mut self) -> Self {
        for layer in &mut self.model.layers {
            layer.self_attn.qkv_proj = None;
            layer.mlp.gate_up_proj = None;
        }
        self
    }

    /// `change` applied to the model's weights, the projections stacked again after where they
    /// were stacked before (so that no stacked weight is left stale).
    pub fn restacked_after(self, change: impl FnOnce(Self) -> Self) -> Self {
        let stacked = self.is_stacked();
        let changed = change(self.unstacked());
        if stacked {
            changed.with_stacked_projections()
        } else {
            changed
        }
    }
}

/// The `[in, out]` weights of `linears` side by side, `[in, Σ out]`, each linear's weight
/// replaced by a view of its columns; `None` (nothing changed) where their dtypes or input
/// widths differ.
fn stack<B: Backend, const N: usize>(linears: [&mut Linear<B>; N]) -> Option<Tensor<B, 2>> {
    let weights: Vec<Tensor<B, 2>> = linears.iter().map(|linear| linear.weight.val()).collect();
    let (dtype, inputs) = (weights[0].dtype(), weights[0].dims()[0]);
    if weights.iter().any(|w| w.dtype() != dtype || w.dims()[0] != inputs) || linears.iter().any(|l| l.bias.is_some()) {
        return None;
    }
    let widths = linears.each_ref().map(|linear| linear.weight.dims()[1]);
    let stacked = Tensor::cat(weights, 1);
    for (linear, columns) in linears.into_iter().zip(split_columns(stacked.clone(), widths)) {
        linear.weight = Param::initialized(linear.weight.id, columns);
    }
    Some(stacked)
}

/// The `N` consecutive column ranges of `widths` of a stacked product `[.., Σ widths]`.
pub(crate) fn split_columns<B: Backend, const D: usize, const N: usize>(product: Tensor<B, D>, widths: [usize; N]) -> [Tensor<B, D>; N] {
    let mut start = 0;
    widths.map(|width| {
        let columns = product.clone().narrow(D - 1, start, width);
        start += width;
        columns
    })
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::tensor::{DType, Int, Tensor};

    use crate::checkpoint::StorageDtype;
    use crate::lora::{merge_adapters, LoraAdapters, LoraConfig};
    use crate::{load_pretrained, with_dtype, LoadOptions, Preset, Qwen3ForCausalLM};

    fn tiny() -> Qwen3ForCausalLM<Flex> {
        let config = Preset::Tiny.config(300, vec![299]);
        let dir = tempfile::tempdir().unwrap();
        crate::init::write_random_checkpoint(&config, dir.path(), 5, StorageDtype::F32).unwrap();
        load_pretrained::<Flex>(dir.path(), &Default::default(), LoadOptions::default()).unwrap()
    }

    fn logits(model: &Qwen3ForCausalLM<Flex>) -> Vec<f32> {
        let device = Default::default();
        let ids = Tensor::<Flex, 2, Int>::from_ints([[1, 5, 9, 200, 7, 42], [3, 3, 8, 1, 0, 250]], &device);
        let positions = Tensor::<Flex, 2, Int>::from_ints([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]], &device);
        model.forward(ids, positions, None, None).cast(DType::F32).into_data().to_vec().unwrap()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    /// Stacking changes no result beyond the products' rounding, and the separate weights are
    /// the stacked weight's columns.
    #[test]
    fn stacked_projections_compute_what_the_separate_ones_do() {
        let model = tiny();
        let plain = logits(&model);
        let stacked = model.with_stacked_projections();
        assert!(stacked.is_stacked());
        let attention = &stacked.model.layers[0].self_attn;
        let qkv = attention.qkv_proj.clone().unwrap();
        let [_, q_width] = attention.q_proj.weight.dims();
        let q_columns: Vec<f32> = qkv.narrow(1, 0, q_width).into_data().to_vec().unwrap();
        assert_eq!(q_columns, attention.q_proj.weight.val().into_data().to_vec::<f32>().unwrap());
        let diff = max_diff(&logits(&stacked), &plain);
        assert!(diff < 1e-5, "{diff}");
        assert!(!stacked.unstacked().is_stacked());
    }

    /// Merging adapters into a stacked model, or casting it, stacks the new weights: the merged
    /// stacked model computes what the merged unstacked one computes, and a cast one holds its
    /// stacked weights in the new dtype.
    #[test]
    fn changed_weights_leave_no_stale_stack() {
        let model = tiny();
        let mut adapters = LoraAdapters::<Flex>::init(&LoraConfig::default(), &model.config, 1, &Default::default());
        for layer in &mut adapters.layers {
            for a in [&mut layer.q_proj, &mut layer.v_proj, &mut layer.up_proj].into_iter().flatten() {
                a.lora_B = a.lora_B.clone().map(|b| b.ones_like().mul_scalar(0.05));
            }
        }
        let merged = logits(&merge_adapters(model.clone(), &adapters));
        let merged_stacked = merge_adapters(model.clone().with_stacked_projections(), &adapters);
        assert!(merged_stacked.is_stacked());
        assert!(max_diff(&merged, &logits(&model)) > 1e-2, "the adapters change the logits");
        let diff = max_diff(&logits(&merged_stacked), &merged);
        assert!(diff < 1e-5, "{diff}");

        let cast = with_dtype(model.with_stacked_projections(), DType::BF16);
        let layer = &cast.model.layers[0];
        assert_eq!(layer.self_attn.qkv_proj.as_ref().map(|w| w.dtype()), Some(DType::BF16));
        let gate_up = layer.mlp.gate_up_proj.clone().unwrap();
        let [_, width] = layer.mlp.up_proj.weight.dims();
        let values = |t: Tensor<Flex, 2>| t.cast(DType::F32).into_data().to_vec::<f32>().unwrap();
        assert_eq!(values(gate_up.narrow(1, width, width)), values(layer.mlp.up_proj.weight.val()), "the stacked weight holds the cast values");
    }
}
