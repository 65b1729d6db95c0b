//! AdamW as `torch.optim.AdamW`: decoupled weight decay and bias-corrected moments:
//!
//! ```text
//! m ← β₁·m + (1 − β₁)·g        v ← β₂·v + (1 − β₂)·g²
//! θ ← θ·(1 − lr·wd) − lr · (m / (1 − β₁ᵗ)) / (√(v / (1 − β₂ᵗ)) + eps)
//! ```
//!
//! with the operations in the order burn's own `AdamW` uses. On burn-flex, where each tensor op is a separate single-threaded pass,
//! the whole update of a parameter is one parallel loop over θ, g, m and v; other backends
//! (CUDA) run the same formula as tensor ops.

use std::any::Any;

use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{LearningRate, SimpleOptimizer};
use burn::record::Record;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bytes, DType, Tensor, TensorPrimitive};
use burn_flex::{FlexTensor, Layout};
use rayon::prelude::*;

/// AdamW's hyper-parameters (the learning rate comes with each step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    pub beta_1: f32,
    pub beta_2: f32,
    pub epsilon: f32,
    pub weight_decay: f32,
}

/// The moments of one parameter and the number of steps taken.
#[derive(Record, Clone)]
pub struct AdamWState<B: Backend, const D: usize> {
    pub time: usize,
    pub moment_1: Tensor<B, D>,
    pub moment_2: Tensor<B, D>,
}

impl AdamW {
    /// This optimiser for module `M`, its state keyed by parameter id.
    pub fn init<B: AutodiffBackend, M: AutodiffModule<B>>(self) -> OptimizerAdaptor<Self, M, B> {
        OptimizerAdaptor::from(self)
    }

    /// The per-step constants: `1 − lr·wd`, `1 − β₁ᵗ`, `1 − β₂ᵗ`.
    fn factors(&self, lr: LearningRate, time: usize) -> (f32, f32, f32) {
        let decay = 1.0 - lr * self.weight_decay as f64;
        let t = time as i32;
        (decay as f32, 1.0 - self.beta_1.powi(t), 1.0 - self.beta_2.powi(t))
    }

    fn step_tensors<B: Backend, const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<AdamWState<B, D>>,
        time: usize,
    ) -> (Tensor<B, D>, AdamWState<B, D>) {
        let (b1, b2) = (self.beta_1, self.beta_2);
        let (moment_1, moment_2) = match state {
            Some(s) => (
                s.moment_1.mul_scalar(b1).add(grad.clone().mul_scalar(1.0 - b1)),
                s.moment_2.mul_scalar(b2).add(grad.square().mul_scalar(1.0 - b2)),
            ),
            None => (grad.clone().mul_scalar(1.0 - b1), grad.square().mul_scalar(1.0 - b2)),
        };
        let (decay, correction_1, correction_2) = self.factors(lr, time);
        let delta = moment_1.clone().div_scalar(correction_1).div(
            moment_2
                .clone()
                .div_scalar(correction_2)
                .sqrt()
                .add_scalar(self.epsilon),
        );
        let decayed = if self.weight_decay == 0.0 { tensor } else { tensor.mul_scalar(decay) };
        let updated = decayed - delta.mul_scalar(lr);
        (updated, AdamWState { time, moment_1, moment_2 })
    }

    /// The same update in one parallel pass, when `B` is burn-flex and everything is f32.
    fn step_flex<B: Backend, const D: usize>(
        &self,
        lr: LearningRate,
        tensor: &Tensor<B, D>,
        grad: &Tensor<B, D>,
        state: Option<&AdamWState<B, D>>,
        time: usize,
    ) -> Option<(Tensor<B, D>, AdamWState<B, D>)> {
        let f32_only = [tensor.dtype(), grad.dtype()].iter().all(|d| *d == DType::F32);
        if !f32_only {
            return None;
        }
        let theta = to_flex(tensor.clone())?.to_contiguous();
        let g = to_flex(grad.clone())?.to_contiguous();
        let moments = match state {
            Some(s) => Some((
                to_flex(s.moment_1.clone())?.to_contiguous(),
                to_flex(s.moment_2.clone())?.to_contiguous(),
            )),
            None => None,
        };
        let theta = theta.as_slice::<f32>()?;
        let g = g.as_slice::<f32>()?;
        let (m, v) = match &moments {
            Some((m, v)) => (Some(m.as_slice::<f32>()?), Some(v.as_slice::<f32>()?)),
            None => (None, None),
        };
        let (decay, correction_1, correction_2) = self.factors(lr, time);
        let step = Constants {
            b1: self.beta_1,
            b2: self.beta_2,
            eps: self.epsilon,
            decay: (self.weight_decay != 0.0).then_some(decay),
            correction_1,
            correction_2,
            lr: lr as f32,
        };
        let (theta, m, v) = fused_update(theta, g, m, v, &step);
        let dims = tensor.dims();
        Some((
            from_flex(theta, dims)?,
            AdamWState {
                time,
                moment_1: from_flex(m, dims)?,
                moment_2: from_flex(v, dims)?,
            },
        ))
    }
}

impl<B: Backend> SimpleOptimizer<B> for AdamW {
    type State<const D: usize> = AdamWState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let time = state.as_ref().map_or(1, |s| s.time + 1);
        let (tensor, state) = match self.step_flex(lr, &tensor, &grad, state.as_ref(), time) {
            Some(done) => done,
            None => self.step_tensors(lr, tensor, grad, state, time),
        };
        (tensor, Some(state))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        AdamWState {
            time: state.time,
            moment_1: state.moment_1.to_device(device),
            moment_2: state.moment_2.to_device(device),
        }
    }
}

/// One step's scalars; `decay` is `None` without weight decay.
struct Constants {
    b1: f32,
    b2: f32,
    eps: f32,
    decay: Option<f32>,
    correction_1: f32,
    correction_2: f32,
    lr: f32,
}

/// Elements per rayon task.
const CHUNK: usize = 64 * 1024;

/// `(θ', m', v')` from θ, g and the moments (`None`: zero, the first step), element by element in
/// the order of [`AdamW::step_tensors`].
fn fused_update(
    theta: &[f32],
    g: &[f32],
    m: Option<&[f32]>,
    v: Option<&[f32]>,
    c: &Constants,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let n = theta.len();
    let (mut theta_out, mut m_out, mut v_out) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
    theta_out
        .par_chunks_mut(CHUNK)
        .zip(m_out.par_chunks_mut(CHUNK))
        .zip(v_out.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(chunk, ((theta_out, m_out), v_out))| {
            let from = chunk * CHUNK;
            for i in 0..theta_out.len() {
                let j = from + i;
                let grad = g[j];
                let m1 = match m {
                    Some(m) => m[j] * c.b1 + grad * (1.0 - c.b1),
                    None => grad * (1.0 - c.b1),
                };
                let m2 = match v {
                    Some(v) => v[j] * c.b2 + grad * grad * (1.0 - c.b2),
                    None => grad * grad * (1.0 - c.b2),
                };
                let delta = (m1 / c.correction_1) / ((m2 / c.correction_2).sqrt() + c.eps);
                let decayed = c.decay.map_or(theta[j], |d| theta[j] * d);
                theta_out[i] = decayed - delta * c.lr;
                m_out[i] = m1;
                v_out[i] = m2;
            }
        });
    (theta_out, m_out, v_out)
}

/// The burn-flex tensor behind `t`, when `B` is burn-flex.
fn to_flex<B: Backend, const D: usize>(t: Tensor<B, D>) -> Option<FlexTensor> {
    let primitive: Box<dyn Any> = Box::new(t.into_primitive().tensor());
    primitive.downcast::<FlexTensor>().ok().map(|t| *t)
}

/// An f32 buffer as a tensor of `B` (burn-flex when this is reached).
fn from_flex<B: Backend, const D: usize>(values: Vec<f32>, dims: [usize; D]) -> Option<Tensor<B, D>> {
    let flex = FlexTensor::new(
        Bytes::from_elems(values),
        Layout::contiguous(burn::tensor::Shape::from(dims.to_vec())),
        DType::F32,
    );
    let primitive: Box<dyn Any> = Box::new(flex);
    let primitive = primitive.downcast::<B::FloatTensorPrimitive>().ok()?;
    Some(Tensor::from_primitive(TensorPrimitive::Float(*primitive)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::Distribution;

    const ADAMW: AdamW = AdamW {
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-8,
        weight_decay: 0.01,
    };

    fn values<const D: usize>(t: Tensor<Flex, D>) -> Vec<f32> {
        t.into_data().to_vec().unwrap()
    }

    /// Three steps through the one-pass loop equal three through tensor ops, bit for bit.
    #[test]
    fn fused_pass_equals_the_tensor_formula() {
        let device = Default::default();
        let random = |seed| {
            <Flex as Backend>::seed(&device, seed);
            Tensor::<Flex, 2>::random([300, 257], Distribution::Normal(0.0, 1.0), &device)
        };
        let (mut fused, mut plain) = (random(1), random(1));
        let (mut fused_state, mut plain_state) = (None, None);
        for (time, seed) in (1..=3).zip(10..) {
            let grad = random(seed).mul_scalar(1e-3);
            let (t, s) = ADAMW
                .step_flex(1e-2, &fused, &grad, fused_state.as_ref(), time)
                .expect("flex f32 takes the fused pass");
            (fused, fused_state) = (t, Some(s));
            let (t, s) = ADAMW.step_tensors(1e-2, plain, grad, plain_state, time);
            (plain, plain_state) = (t, Some(s));
        }
        assert_eq!(values(fused), values(plain));
        let (f, p) = (fused_state.unwrap(), plain_state.unwrap());
        assert_eq!(f.time, p.time);
        assert_eq!(values(f.moment_1), values(p.moment_1));
        assert_eq!(values(f.moment_2), values(p.moment_2));
    }

    #[test]
    fn autodiff_and_other_dtypes_take_tensor_ops() {
        type Ad = burn::backend::Autodiff<Flex>;
        let device = Default::default();
        let t = Tensor::<Ad, 1>::ones([4], &device);
        assert!(ADAMW.step_flex(0.1, &t, &t, None, 1).is_none());
        let b = Tensor::<Flex, 1>::ones([4], &device).cast(DType::BF16);
        assert!(ADAMW.step_flex(0.1, &b, &b, None, 1).is_none());
    }
}
