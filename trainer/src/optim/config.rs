//! AdamW settings with PyTorch's defaults (burn's `AdamWConfig` defaults differ: eps 1e-5 and
//! weight decay 1e-4), and the reference run's learning rate and gradient clip.

use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};

use super::adamw::AdamW;
use super::error::OptimError;

/// Our AdamW wrapped for a module `M` (its state is keyed by parameter id).
pub type AdamWOptimizer<M, B> = OptimizerAdaptor<AdamW, M, B>;

/// AdamW (decoupled weight decay, as `torch.optim.AdamW`) with a constant learning rate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerConfig {
    /// Learning rate (constant).
    pub lr: f64,
    /// `[β₁, β₂]`.
    pub betas: [f32; 2],
    /// Added to `√v̂` in the denominator (PyTorch: 1e-8).
    pub eps: f32,
    /// Decoupled weight decay: `θ ← θ·(1 − lr·wd)` before the Adam update.
    pub weight_decay: f32,
    /// Maximum global L2 norm of the gradient; larger gradients are scaled down to it.
    pub grad_clip: f32,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            lr: 1e-6,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.01,
            grad_clip: 1.0,
        }
    }
}

impl OptimizerConfig {
    /// Checks `lr > 0`, `0 ≤ β < 1`, `eps > 0`, `weight_decay ≥ 0`, `grad_clip > 0` (which may
    /// be infinite: no clipping), and that the rest is finite.
    pub fn validate(&self) -> Result<(), OptimError> {
        let bad = |what: String| Err(OptimError::Config(what));
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!("lr = {} must be a positive number", self.lr));
        }
        if let Some(b) = self.betas.iter().find(|b| !(0.0..1.0).contains(*b)) {
            return bad(format!("beta {b} must be in [0, 1)"));
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad(format!("eps = {} must be a positive number", self.eps));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!("weight_decay = {} must be ≥ 0", self.weight_decay));
        }
        if self.grad_clip.is_nan() || self.grad_clip <= 0.0 {
            return bad(format!("grad_clip = {} must be > 0", self.grad_clip));
        }
        Ok(())
    }

    /// The optimiser with these values (clipping is separate: [`super::clip_grad_norm_global`]).
    pub fn adamw(&self) -> AdamW {
        AdamW {
            beta_1: self.betas[0],
            beta_2: self.betas[1],
            epsilon: self.eps,
            weight_decay: self.weight_decay,
        }
    }

    /// A fresh optimiser for module `M`, after [`Self::validate`].
    pub fn init<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
    ) -> Result<AdamWOptimizer<M, B>, OptimError> {
        self.validate()?;
        Ok(self.adamw().init())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::module::{Module, Param};
    use burn::optim::{GradientsParams, Optimizer};
    use burn::tensor::{backend::Backend, Tensor, TensorData};

    type B = Autodiff<Flex>;

    #[derive(Module, Debug)]
    struct Scalar<B: Backend> {
        w: Param<Tensor<B, 1>>,
    }

    #[test]
    fn defaults_are_pytorch_and_the_reference_run() {
        let c: OptimizerConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(c, OptimizerConfig::default());
        assert_eq!(
            (c.lr, c.betas, c.eps, c.weight_decay, c.grad_clip),
            (1e-6, [0.9, 0.999], 1e-8, 0.01, 1.0)
        );
        assert!(serde_json::from_str::<OptimizerConfig>(r#"{"epsilon":1e-8}"#).is_err());
    }

    #[test]
    fn validation_rejects_bad_values() {
        assert!(OptimizerConfig::default().validate().is_ok());
        let infinite_clip = OptimizerConfig {
            grad_clip: f32::INFINITY,
            ..Default::default()
        };
        assert!(infinite_clip.validate().is_ok());
        for c in [
            OptimizerConfig {
                lr: 0.0,
                ..Default::default()
            },
            OptimizerConfig {
                betas: [0.9, 1.0],
                ..Default::default()
            },
            OptimizerConfig {
                eps: 0.0,
                ..Default::default()
            },
            OptimizerConfig {
                weight_decay: -0.1,
                ..Default::default()
            },
            OptimizerConfig {
                grad_clip: 0.0,
                ..Default::default()
            },
        ] {
            assert!(c.validate().is_err(), "{c:?}");
        }
    }

    /// One AdamW step on θ = 1 with gradient g = 1e-6 (lr 0.1, wd 0.01), as torch.optim.AdamW:
    /// m̂ = g, v̂ = g², θ ← θ·(1 − 0.1·0.01) − 0.1·g/(|g| + eps)
    ///   = 0.999 − 0.1·1e-6/(1e-6 + 1e-8) = 0.999 − 0.0990099 = 0.8999901.
    /// (burn's default eps 1e-5 would give 0.999 − 0.0090909 = 0.9899091.)
    #[test]
    fn adamw_step_matches_pytorch_formula() {
        let _autodiff = crate::autodiff_lock::exclusive_autodiff();
        let device = Default::default();
        let module = Scalar::<B> {
            w: Param::from_tensor(Tensor::from_data(
                TensorData::new(vec![1.0f32], [1]),
                &device,
            )),
        };
        let config = OptimizerConfig {
            lr: 0.1,
            ..Default::default()
        };
        let mut optim = config.init::<B, Scalar<B>>().unwrap();
        let loss = module.w.val().mul_scalar(1e-6).sum();
        let grads = GradientsParams::from_grads(loss.backward(), &module);
        let module = optim.step(config.lr, module, grads);
        let w: f32 = module.w.val().into_scalar();
        assert!((w - 0.8999901).abs() < 1e-6, "{w}");
    }
}
