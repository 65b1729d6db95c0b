//! The adapters themselves: per decoder layer, per target projection, PEFT's `lora_A` and
//! `lora_B`, as a burn module of their own beside the (frozen) model.
// PEFT's names (`lora_A`, `lora_B`), kept for the reader who compares with it.
#![allow(non_snake_case)]

use burn::module::{Module, Param};
use burn::nn::{Dropout, DropoutConfig};
use burn::tensor::{backend::Backend, DType, Tensor, TensorData};
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::config::{LoraConfig, LoraTarget};
use super::peft::peft_key;
use crate::config::Qwen3Config;
use crate::weights::param_id;

/// PEFT's `lora.Linear` without its base layer: the low-rank term added to one projection,
/// `lora_B(lora_A(lora_dropout(x))) · scaling`. The weights are kept in f32 whatever the
/// base's dtype.
#[derive(Module, Debug)]
pub struct LoraLinear<B: Backend> {
    /// `[in, r]`: burn's layout of PEFT's `lora_A.weight` (`[r, in]`).
    pub lora_A: Param<Tensor<B, 2>>,
    /// `[r, out]`: burn's layout of PEFT's `lora_B.weight` (`[out, r]`).
    pub lora_B: Param<Tensor<B, 2>>,
    /// Applied to the adapter's input under autodiff only (burn's `Dropout` is the identity on
    /// a backend without it), as `nn.Dropout` in training mode.
    pub lora_dropout: Dropout,
    /// `alpha / r`.
    pub scaling: f64,
}

/// The adapters of one decoder layer, `None` where a projection is not a target.
#[derive(Module, Debug)]
pub struct LoraLayer<B: Backend> {
    pub q_proj: Option<LoraLinear<B>>,
    pub k_proj: Option<LoraLinear<B>>,
    pub v_proj: Option<LoraLinear<B>>,
    pub o_proj: Option<LoraLinear<B>>,
    pub gate_proj: Option<LoraLinear<B>>,
    pub up_proj: Option<LoraLinear<B>>,
    pub down_proj: Option<LoraLinear<B>>,
}

impl<B: Backend> LoraLayer<B> {
    /// The adapter of `target`, if it has one.
    pub fn get(&self, target: LoraTarget) -> Option<&LoraLinear<B>> {
        match target {
            LoraTarget::QProj => self.q_proj.as_ref(),
            LoraTarget::KProj => self.k_proj.as_ref(),
            LoraTarget::VProj => self.v_proj.as_ref(),
            LoraTarget::OProj => self.o_proj.as_ref(),
            LoraTarget::GateProj => self.gate_proj.as_ref(),
            LoraTarget::UpProj => self.up_proj.as_ref(),
            LoraTarget::DownProj => self.down_proj.as_ref(),
        }
    }

    fn slot(&mut self, target: LoraTarget) -> &mut Option<LoraLinear<B>> {
        match target {
            LoraTarget::QProj => &mut self.q_proj,
            LoraTarget::KProj => &mut self.k_proj,
            LoraTarget::VProj => &mut self.v_proj,
            LoraTarget::OProj => &mut self.o_proj,
            LoraTarget::GateProj => &mut self.gate_proj,
            LoraTarget::UpProj => &mut self.up_proj,
            LoraTarget::DownProj => &mut self.down_proj,
        }
    }

    fn empty() -> Self {
        Self {
            q_proj: None,
            k_proj: None,
            v_proj: None,
            o_proj: None,
            gate_proj: None,
            up_proj: None,
            down_proj: None,
        }
    }
}

/// LoRA adapters for every layer of one Qwen3 model: a value passed beside the model to its
/// forward (`Qwen3ForCausalLM::forward_with_adapters`), never part of it, so one base serves the
/// policy (with them) and the KL reference (without). Parameter ids derive from the PEFT tensor
/// names, so optimiser state saved with a checkpoint finds its parameters again.
#[derive(Module, Debug)]
pub struct LoraAdapters<B: Backend> {
    pub layers: Vec<LoraLayer<B>>,
    #[module(skip)]
    config: LoraConfig,
}

/// One adapter's weights in burn layout (`lora_A` `[in, r]`, `lora_B` `[r, out]`), f32.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterWeights {
    pub lora_A: TensorData,
    pub lora_B: TensorData,
}

impl<B: Backend> LoraAdapters<B> {
    /// Fresh adapters as PEFT initialises them (`init_lora_weights=True`): `lora_A` from
    /// `kaiming_uniform_(a=√5)`, i.e. uniform in `±1/√in`, and `lora_B` zero, so the adapted
    /// model starts as the base. Each `lora_A` draws from a generator seeded by `seed` and its
    /// PEFT name.
    pub fn init(config: &LoraConfig, model: &Qwen3Config, seed: u64, device: &B::Device) -> Self {
        Self::from_weights(config, model, device, |layer, target, (fan_in, fan_out)| {
            let r = config.rank;
            let name = peft_key(layer, target, 'A');
            let mut rng = StdRng::seed_from_u64(seed ^ fnv1a(&name));
            let bound = 1.0 / (fan_in as f32).sqrt();
            let a: Vec<f32> = (0..fan_in * r).map(|_| rng.random_range(-bound..bound)).collect();
            AdapterWeights {
                lora_A: TensorData::new(a, [fan_in, r]),
                lora_B: TensorData::new(vec![0.0f32; r * fan_out], [r, fan_out]),
            }
        })
    }

    /// Adapters of `config` for a model of `model`, with the weights `weights(layer, target,
    /// (in, out))` gives (burn layout, shapes checked by the caller).
    pub fn from_weights(
        config: &LoraConfig,
        model: &Qwen3Config,
        device: &B::Device,
        mut weights: impl FnMut(usize, LoraTarget, (usize, usize)) -> AdapterWeights,
    ) -> Self {
        let dropout = DropoutConfig::new(config.dropout).init();
        let scaling = config.scaling();
        let layers = (0..model.num_hidden_layers)
            .map(|layer| {
                let mut adapters = LoraLayer::empty();
                for &target in &config.target_modules {
                    let w = weights(layer, target, target.features(model));
                    let param = |data: TensorData, which| {
                        let tensor = Tensor::from_data(data.convert_dtype(DType::F32), (device, DType::F32));
                        Param::initialized(param_id(&peft_key(layer, target, which)), tensor.require_grad())
                    };
                    *adapters.slot(target) = Some(LoraLinear {
                        lora_A: param(w.lora_A, 'A'),
                        lora_B: param(w.lora_B, 'B'),
                        lora_dropout: dropout.clone(),
                        scaling,
                    });
                }
                adapters
            })
            .collect();
        Self {
            layers,
            config: config.clone(),
        }
    }

    /// The settings these adapters were made with.
    pub fn config(&self) -> &LoraConfig {
        &self.config
    }

    /// Whether every layer has an adapter on each projection an inference copy stacks (`q_proj`,
    /// `k_proj`, `v_proj`, `gate_proj`, `up_proj`): merged, they replace every weight stacking
    /// takes, so a merged copy can stack without holding a weight of the base twice.
    pub fn adapt_every_stacked_projection(&self) -> bool {
        const STACKED: [LoraTarget; 5] = [LoraTarget::QProj, LoraTarget::KProj, LoraTarget::VProj, LoraTarget::GateProj, LoraTarget::UpProj];
        self.layers.iter().all(|layer| STACKED.iter().all(|&t| layer.get(t).is_some()))
    }

    /// Every adapter with its layer and target, in layer order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, LoraTarget, &LoraLinear<B>)> {
        self.layers.iter().enumerate().flat_map(|(l, layer)| {
            LoraTarget::ALL
                .into_iter()
                .filter_map(move |t| layer.get(t).map(|a| (l, t, a)))
        })
    }
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn init_is_peft_s_kaiming_uniform_and_zero() {
        let model = crate::config::Preset::Tiny.config(300, vec![299]);
        let config = LoraConfig {
            rank: 4,
            ..Default::default()
        };
        let adapters = LoraAdapters::<Flex>::init(&config, &model, 3, &Default::default());
        assert_eq!(adapters.layers.len(), model.num_hidden_layers);
        assert_eq!(adapters.iter().count(), 7 * model.num_hidden_layers);
        for (_, target, a) in adapters.iter() {
            let (fan_in, fan_out) = target.features(&model);
            assert_eq!(a.lora_A.val().dims(), [fan_in, 4]);
            assert_eq!(a.lora_B.val().dims(), [4, fan_out]);
            assert_eq!(a.scaling, 4.0);
            let values: Vec<f32> = a.lora_A.val().into_data().to_vec().unwrap();
            let bound = 1.0 / (fan_in as f32).sqrt();
            assert!(values.iter().all(|v| v.abs() <= bound));
            // Uniform in ±bound: the largest draw of hundreds comes close to the bound.
            assert!(values.iter().fold(0.0f32, |m, v| m.max(v.abs())) > 0.9 * bound);
            let b: Vec<f32> = a.lora_B.val().into_data().to_vec().unwrap();
            assert!(b.iter().all(|&v| v == 0.0));
        }
        let again = LoraAdapters::<Flex>::init(&config, &model, 3, &Default::default());
        let first = |a: &LoraAdapters<Flex>| a.layers[1].v_proj.as_ref().unwrap().lora_A.val().into_data();
        assert_eq!(first(&adapters), first(&again), "seeded");
        let other = LoraAdapters::<Flex>::init(&config, &model, 4, &Default::default());
        assert_ne!(first(&adapters), first(&other));
    }

    #[test]
    fn only_the_targets_get_adapters() {
        let model = crate::config::Preset::Tiny.config(300, vec![299]);
        let config = LoraConfig {
            target_modules: vec![LoraTarget::VProj, LoraTarget::UpProj],
            ..Default::default()
        };
        let adapters = LoraAdapters::<Flex>::init(&config, &model, 0, &Default::default());
        let targets: Vec<LoraTarget> = adapters.iter().filter(|(l, _, _)| *l == 0).map(|(_, t, _)| t).collect();
        assert_eq!(targets, vec![LoraTarget::VProj, LoraTarget::UpProj]);
        let (h, kv) = (model.hidden_size, model.num_key_value_heads * model.head_dim);
        let per_layer = 8 * (h + kv) + 8 * (h + model.intermediate_size);
        assert_eq!(adapters.num_params(), model.num_hidden_layers * per_layer);
    }
}
