//! PEFT's `merge_and_unload`: the adapters folded into the base weights,
//! `W ← W + scaling · (B·A)` (in burn's `[in, out]` layout `W + scaling · A·B`), computed in
//! f32 and rounded once to the weight's dtype.

use burn::nn::Linear;
use burn::tensor::{backend::Backend, DType};
use cpu_kernels::Kernels;

use super::adapters::{LoraAdapters, LoraLinear};
use super::config::LoraTarget;
use crate::qwen3::{Qwen3DecoderLayer, Qwen3ForCausalLM};

/// `base` with every adapter merged into its projection: the returned model alone computes
/// what `base` with `adapters` computes (up to rounding).
/// A base with stacked projections comes back stacked, of the merged weights, where the
/// adapters replace every weight stacking takes
/// ([`LoraAdapters::adapt_every_stacked_projection`]); otherwise unstacked, its unadapted
/// weights still the base's (stacking them again would hold them twice).
pub fn merge_adapters<B: Backend>(base: Qwen3ForCausalLM<B>, adapters: &LoraAdapters<B>) -> Qwen3ForCausalLM<B> {
    assert_eq!(
        adapters.layers.len(),
        base.model.layers.len(),
        "adapters for a model of another depth"
    );
    let restack = base.is_stacked() && adapters.adapt_every_stacked_projection();
    let mut merged_model = base.unstacked();
    for (l, target, adapter) in adapters.iter() {
        let cpu_kernels = merged_model.model.compute.cpu_kernels;
        let linear = projection(&mut merged_model.model.layers[l], target);
        linear.weight = linear.weight.clone().map(|w| merged(cpu_kernels, w, adapter));
    }
    if restack {
        merged_model.with_stacked_projections()
    } else {
        merged_model
    }
}

fn merged<B: Backend>(cpu_kernels: Kernels, w: burn::tensor::Tensor<B, 2>, adapter: &LoraLinear<B>) -> burn::tensor::Tensor<B, 2> {
    let dtype = w.dtype();
    let delta = adapter
        .lora_A
        .val()
        .matmul(adapter.lora_B.val())
        .mul_scalar(adapter.scaling);
    crate::kernels::cast(cpu_kernels, w.cast(DType::F32) + delta, dtype)
}

fn projection<B: Backend>(layer: &mut Qwen3DecoderLayer<B>, target: LoraTarget) -> &mut Linear<B> {
    match target {
        LoraTarget::QProj => &mut layer.self_attn.q_proj,
        LoraTarget::KProj => &mut layer.self_attn.k_proj,
        LoraTarget::VProj => &mut layer.self_attn.v_proj,
        LoraTarget::OProj => &mut layer.self_attn.o_proj,
        LoraTarget::GateProj => &mut layer.mlp.gate_proj,
        LoraTarget::UpProj => &mut layer.mlp.up_proj,
        LoraTarget::DownProj => &mut layer.mlp.down_proj,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::StorageDtype;
    use crate::lora::LoraConfig;
    use crate::{load_pretrained, LoadOptions};
    use burn::backend::Flex;
    use burn::tensor::{Int, Tensor};

    fn logits(model: &Qwen3ForCausalLM<Flex>, adapters: Option<&LoraAdapters<Flex>>) -> Vec<f32> {
        let device = Default::default();
        let ids = Tensor::<Flex, 2, Int>::from_ints([[1, 5, 9, 200, 7, 42]], &device);
        let positions = Tensor::<Flex, 2, Int>::from_ints([[0, 1, 2, 3, 4, 5]], &device);
        let out = model.forward_with_adapters(ids, positions, None, None, adapters);
        out.cast(DType::F32).into_data().to_vec().unwrap()
    }

    /// Fresh adapters (B = 0) leave the logits exactly as the base's; trained ones (B ≠ 0) give
    /// the logits of the merged model, and move them.
    #[test]
    fn adapters_add_what_merging_adds() {
        let config = crate::config::Preset::Tiny.config(300, vec![299]);
        let dir = tempfile::tempdir().unwrap();
        crate::init::write_random_checkpoint(&config, dir.path(), 3, StorageDtype::F32).unwrap();
        let device = Default::default();
        let base = load_pretrained::<Flex>(dir.path(), &device, LoadOptions::default()).unwrap();
        let mut adapters = LoraAdapters::<Flex>::init(&LoraConfig::default(), &config, 1, &device);
        let plain = logits(&base, None);
        assert_eq!(logits(&base, Some(&adapters)), plain, "B = 0 adds nothing");

        for layer in &mut adapters.layers {
            for a in [&mut layer.q_proj, &mut layer.o_proj, &mut layer.down_proj]
                .into_iter()
                .flatten()
            {
                a.lora_B = a.lora_B.clone().map(|b| b.ones_like().mul_scalar(0.05));
            }
        }
        let adapted = logits(&base, Some(&adapters));
        let merged = logits(&merge_adapters(base, &adapters), None);
        let max_diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(max_diff(&adapted, &plain) > 1e-2, "the adapters change the logits");
        assert!(max_diff(&adapted, &merged) < 1e-5, "{}", max_diff(&adapted, &merged));
    }

    /// On a bf16 base the adapter path runs in f32 and the activations stay bf16.
    #[test]
    fn a_bf16_base_keeps_bf16_activations() {
        let config = crate::config::Preset::Tiny.config(300, vec![299]);
        let dir = tempfile::tempdir().unwrap();
        crate::init::write_random_checkpoint(&config, dir.path(), 3, StorageDtype::F32).unwrap();
        let device = Default::default();
        let base = load_pretrained::<Flex>(dir.path(), &device, LoadOptions { dtype: DType::BF16, ..Default::default() }).unwrap();
        let adapters = LoraAdapters::<Flex>::init(&LoraConfig::default(), &config, 1, &device);
        let a = &adapters.layers[0].q_proj.as_ref().unwrap().lora_A;
        assert_eq!(a.val().dtype(), DType::F32);
        let ids = Tensor::<Flex, 2, Int>::from_ints([[1, 5, 9]], &device);
        let positions = Tensor::<Flex, 2, Int>::from_ints([[0, 1, 2]], &device);
        let out = base.forward_with_adapters(ids, positions, None, None, Some(&adapters));
        assert_eq!(out.dtype(), DType::BF16);
        assert_eq!(
            logits(&base, Some(&adapters)),
            logits(&base, None),
            "B = 0 adds nothing in bf16 too"
        );
    }
}
