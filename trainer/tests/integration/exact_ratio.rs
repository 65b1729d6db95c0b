//! One precision for scoring and update: with one optimiser step per rollout batch, the old
//! log-probs (scored on the plain backend) equal the update's own (under autodiff) bit for bit,
//! so every PPO ratio is exactly 1: no approximate KL, nothing clipped. Checked through burn's
//! portable ops (the path GPU backends take) and at every CPU instruction-set level this host
//! can run (at the AVX-512 BF16 level with each of its two bf16 product kernels), with f32 and
//! with bf16 products, training every weight and training LoRA adapters
//! (dropout 0) beside the frozen base.

use crate::common::{setup, train, with_lora};
use model::cpu_kernels::{Bf16Products, Isa, Kernels};
use model::MatmulPrecision;

#[derive(Debug, Clone, Copy)]
enum Path {
    /// Every kernel off: burn's ops.
    PortableOps,
    /// The kernels at this level, the packed bf16 products with this kernel.
    Kernels(Isa, Bf16Products),
}

impl Path {
    /// The run's CPU kernels on this path.
    fn kernels(self) -> Kernels {
        match self {
            Path::PortableOps => Kernels::off(),
            Path::Kernels(level, products) => Kernels::at(level).with_bf16_products(products),
        }
    }
}

#[test]
fn every_first_ratio_is_exactly_one_on_every_path() {
    let mut paths = vec![Path::PortableOps];
    for level in Isa::available() {
        // Only the AVX-512 BF16 level has two product kernels: run both there.
        let kernels: &[Bf16Products] = if level == Isa::Avx512Bf16 { &Bf16Products::ALL } else { &[Bf16Products::Pairs] };
        paths.extend(kernels.iter().map(|&k| Path::Kernels(level, k)));
    }
    for level in Isa::ALL.into_iter().filter(|&l| l > Isa::host()) {
        println!(
            "skipped: the {level} level (this CPU's best is {})",
            Isa::host()
        );
    }
    for path in paths {
        for matmul in [MatmulPrecision::F32, MatmulPrecision::Bf16] {
            for lora in [false, true] {
                let dir = tempfile::tempdir().unwrap();
                let mut config = setup(dir.path());
                config.grpo.matmul = matmul;
                config.cpu_kernels = path.kernels();
                if lora {
                    config = with_lora(config);
                }
                let (trainer, records) = train(config, 3, false);
                assert_eq!(trainer.adapters().is_some(), lora);
                for r in &records {
                    assert_eq!(
                        r.optimizer_steps, 1,
                        "{path:?} {matmul:?}: the setup takes one optimiser step per step"
                    );
                    assert!(
                        r.policy.approx_kl == 0.0 && r.policy.clip_frac == 0.0,
                        "{path:?}, {matmul:?} products, LoRA {lora}, step {}: approx_kl {}, clip_frac {} (scoring and update differ)",
                        r.step,
                        r.policy.approx_kl,
                        r.policy.clip_frac
                    );
                }
                assert!(
                    records[2].grad_norm.is_some_and(|n| n > 0.0),
                    "{path:?}: the update moved something"
                );
                println!(
                    "{path:?}, {matmul:?} products, LoRA {lora}: 3 steps, every ratio exactly 1"
                );
            }
        }
    }
}
