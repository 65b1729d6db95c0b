//! One optimiser step guarded by the gradient norm: clip globally, or skip when not finite.

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;

use super::grad_norm::clip_grad_norm_global;

/// What happened to one step's gradients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepOutcome {
    /// The update was applied; `grad_norm` is the norm before clipping.
    Applied { grad_norm: f32, clipped: bool },
    /// The norm was NaN or infinite: neither the weights nor the optimiser state changed.
    Skipped { grad_norm: f32 },
}

impl StepOutcome {
    /// The gradient norm before clipping.
    pub fn grad_norm(&self) -> f32 {
        match *self {
            StepOutcome::Applied { grad_norm, .. } | StepOutcome::Skipped { grad_norm } => {
                grad_norm
            }
        }
    }

    pub fn is_skipped(&self) -> bool {
        matches!(self, StepOutcome::Skipped { .. })
    }
}

/// Clips `grads` to the global norm `max_norm` ([`clip_grad_norm_global`]) and applies them with
/// `optimizer` at learning rate `lr`, unless the norm is not finite, in which case `module` is
/// returned untouched and the gradients are dropped.
pub fn clip_and_step<B, M, O>(
    optimizer: &mut O,
    lr: f64,
    module: M,
    mut grads: GradientsParams,
    max_norm: f32,
) -> (M, StepOutcome)
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    let grad_norm = clip_grad_norm_global::<B, M>(&mut grads, &module, max_norm);
    if !grad_norm.is_finite() {
        return (module, StepOutcome::Skipped { grad_norm });
    }
    let clipped = max_norm / (grad_norm + super::grad_norm::CLIP_EPS) < 1.0;
    let module = optimizer.step(lr, module, grads);
    (module, StepOutcome::Applied { grad_norm, clipped })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::OptimizerConfig;
    use burn::backend::{Autodiff, Flex};
    use burn::module::{Module, Param};
    use burn::tensor::{backend::Backend, Tensor, TensorData};

    type B = Autodiff<Flex>;

    #[derive(Module, Debug)]
    struct Vector<B: Backend> {
        w: Param<Tensor<B, 1>>,
    }

    fn module() -> Vector<B> {
        Vector {
            w: Param::from_tensor(Tensor::from_data(
                TensorData::new(vec![1.0f32, -1.0], [2]),
                &Default::default(),
            )),
        }
    }

    fn grads(m: &Vector<B>, c: [f32; 2]) -> GradientsParams {
        let _autodiff = crate::autodiff_lock::exclusive_autodiff();
        let c = Tensor::<B, 1>::from_data(TensorData::new(c.to_vec(), [2]), &Default::default());
        GradientsParams::from_grads((m.w.val() * c).sum().backward(), m)
    }

    fn weights(m: &Vector<B>) -> Vec<f32> {
        m.w.val().into_data().convert::<f32>().into_vec().unwrap()
    }

    /// A NaN step changes nothing, not even AdamW's moments: the next finite step gives exactly
    /// what a fresh optimiser's first step gives.
    #[test]
    fn non_finite_step_is_skipped_without_touching_state() {
        let config = OptimizerConfig {
            lr: 0.1,
            ..Default::default()
        };
        let mut optim = config.init::<B, Vector<B>>().unwrap();
        let m = module();
        let g = grads(&m, [f32::NAN, 1.0]);
        let (m, outcome) = clip_and_step(&mut optim, config.lr, m, g, config.grad_clip);
        assert!(outcome.is_skipped() && outcome.grad_norm().is_nan());
        assert_eq!(weights(&m), vec![1.0, -1.0]);

        let g = grads(&m, [0.3, -0.4]);
        let (m, outcome) = clip_and_step(&mut optim, config.lr, m, g, config.grad_clip);
        assert!(
            matches!(outcome, StepOutcome::Applied { grad_norm, clipped: false } if (grad_norm - 0.5).abs() < 1e-6)
        );

        let mut fresh = config.init::<B, Vector<B>>().unwrap();
        let f = module();
        let g = grads(&f, [0.3, -0.4]);
        let (f, _) = clip_and_step(&mut fresh, config.lr, f, g, config.grad_clip);
        assert_eq!(weights(&m), weights(&f));
        // First AdamW step: θ·(1 − 0.001) − 0.1·sign(g) → [0.999 − 0.1, −0.999 + 0.1].
        let w = weights(&m);
        assert!(
            (w[0] - 0.899).abs() < 1e-5 && (w[1] + 0.899).abs() < 1e-5,
            "{w:?}"
        );
    }

    #[test]
    fn large_gradients_are_clipped() {
        // Norm of (3, 4) = 5 > 1.
        let config = OptimizerConfig::default();
        let mut optim = config.init::<B, Vector<B>>().unwrap();
        let m = module();
        let g = grads(&m, [3.0, 4.0]);
        let (_, outcome) = clip_and_step(&mut optim, config.lr, m, g, 1.0);
        assert!(
            matches!(outcome, StepOutcome::Applied { grad_norm, clipped: true } if (grad_norm - 5.0).abs() < 1e-5)
        );
    }
}
