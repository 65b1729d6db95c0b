//! AdamW as `torch.optim.AdamW`: decoupled weight decay and bias-corrected moments:
//!
//! ```text
//! m ← β₁·m + (1 − β₁)·g        v ← β₂·v + (1 − β₂)·g²
//! θ ← θ·(1 − lr·wd) − lr · (m / (1 − β₁ᵗ)) / (√(v / (1 − β₂ᵗ)) + eps)
//! ```
//!
//! with the operations in the order burn's own `AdamW` uses. On burn-flex, where each tensor op is a separate single-threaded pass,
//! the whole update of a parameter is one parallel loop over θ, g, m and v that writes θ, m and v
//! into their own buffers when these are not shared (a parameter's worth of fresh memory per
//! tensor and step otherwise); other backends (CUDA) run the same formula as tensor ops.

use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{LearningRate, SimpleOptimizer};
use burn::record::Record;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor};
use rayon::prelude::*;

use super::flex::{from_flex, into_flex, is_flex, owned_f32, values_mut, zeros_f32, CHUNK};

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

    /// The same update in one parallel pass, when `B` is burn-flex and everything is f32;
    /// otherwise the inputs come back untouched. The weights and moments are updated in their
    /// own buffers when these are not shared (else in copies), and on the first step the
    /// gradient's buffer becomes the first moment.
    fn step_flex<B: Backend, const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<AdamWState<B, D>>,
        time: usize,
    ) -> Result<(Tensor<B, D>, AdamWState<B, D>), Inputs<B, D>> {
        let moments = state.iter().flat_map(|s| [s.moment_1.dtype(), s.moment_2.dtype()]);
        let f32_only = [tensor.dtype(), grad.dtype()]
            .into_iter()
            .chain(moments)
            .all(|d| d == DType::F32);
        if !(is_flex::<B>() && f32_only) {
            return Err((tensor, grad, state));
        }
        let flex = |t: Tensor<B, D>| {
            into_flex(t).unwrap_or_else(|_| unreachable!("a float tensor of burn-flex"))
        };
        let mut theta = owned_f32(flex(tensor));
        let grad = flex(grad);
        let (mut m, mut v, grad) = match state {
            Some(s) => (owned_f32(flex(s.moment_1)), owned_f32(flex(s.moment_2)), Some(grad)),
            None => (owned_f32(grad), zeros_f32(theta.layout().shape().clone()), None),
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
        let grad = grad.map(|g| if g.is_contiguous() { g } else { g.to_contiguous() });
        let g = grad.as_ref().map(|g| g.as_slice::<f32>().expect("contiguous f32"));
        fused_update(
            values_mut(&mut theta),
            values_mut(&mut m),
            values_mut(&mut v),
            g,
            &step,
        );
        Ok((
            from_flex(theta),
            AdamWState {
                time,
                moment_1: from_flex(m),
                moment_2: from_flex(v),
            },
        ))
    }
}

/// A parameter, its gradient and its state, as given to [`AdamW::step_flex`].
type Inputs<B, const D: usize> = (Tensor<B, D>, Tensor<B, D>, Option<AdamWState<B, D>>);

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
        let (tensor, state) = match self.step_flex(lr, tensor, grad, state, time) {
            Ok(done) => done,
            Err((tensor, grad, state)) => self.step_tensors(lr, tensor, grad, state, time),
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

/// One AdamW step in place, element by element in the order of [`AdamW::step_tensors`]. With
/// `g`, `m` and `v` hold the moments; without (the first step), `m` holds the gradient and `v`'s
/// contents are not read.
fn fused_update(
    theta: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: Option<&[f32]>,
    c: &Constants,
) {
    let n = theta.len();
    assert!(m.len() == n && v.len() == n && g.is_none_or(|g| g.len() == n));
    theta
        .par_chunks_mut(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(chunk, ((theta, m), v))| match g {
            Some(g) => {
                let g = &g[chunk * CHUNK..][..theta.len()];
                for i in 0..theta.len() {
                    let grad = g[i];
                    let m1 = m[i] * c.b1 + grad * (1.0 - c.b1);
                    let m2 = v[i] * c.b2 + grad * grad * (1.0 - c.b2);
                    theta[i] = c.apply(theta[i], m1, m2);
                    m[i] = m1;
                    v[i] = m2;
                }
            }
            None => {
                for i in 0..theta.len() {
                    let grad = m[i];
                    let m1 = grad * (1.0 - c.b1);
                    let m2 = grad * grad * (1.0 - c.b2);
                    theta[i] = c.apply(theta[i], m1, m2);
                    m[i] = m1;
                    v[i] = m2;
                }
            }
        });
}

impl Constants {
    /// The new weight from the old one and the new moments.
    #[inline(always)]
    fn apply(&self, theta: f32, m1: f32, m2: f32) -> f32 {
        let delta = (m1 / self.correction_1) / ((m2 / self.correction_2).sqrt() + self.eps);
        let decayed = self.decay.map_or(theta, |d| theta * d);
        decayed - delta * self.lr
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::{TensorData, TensorPrimitive};

    const ADAMW: AdamW = AdamW {
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-8,
        weight_decay: 0.01,
    };

    fn values<const D: usize>(t: Tensor<Flex, D>) -> Vec<f32> {
        t.into_data().to_vec().unwrap()
    }

    /// Deterministic values in about [-2, 2) from `seed`. Not the backend's seeded random
    /// tensors: that seed is global, and tests running beside this one would reseed it between
    /// two draws that must be equal.
    fn random(seed: u64) -> Tensor<Flex, 2> {
        let (rows, cols) = (300, 257);
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let values: Vec<f32> = (0..rows * cols)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 22) as f32 - 2.0
            })
            .collect();
        Tensor::from_data(TensorData::new(values, [rows, cols]), &Default::default())
    }

    /// Where `t`'s elements are stored.
    fn address<const D: usize>(t: &Tensor<Flex, D>) -> *const u8 {
        match t.clone().into_primitive() {
            TensorPrimitive::Float(flex) => flex.bytes().as_ptr(),
            TensorPrimitive::QFloat(_) => unreachable!(),
        }
    }

    /// Three steps through the one-pass loop equal three through tensor ops, bit for bit, both
    /// in place and on shared (copied) inputs.
    #[test]
    fn fused_pass_equals_the_tensor_formula() {
        for share in [false, true] {
            let (mut fused, mut plain) = (random(1), random(1));
            let (mut fused_state, mut plain_state) = (None::<AdamWState<Flex, 2>>, None);
            for (time, seed) in (1..=3).zip(10..) {
                let grad = random(seed).mul_scalar(1e-3);
                let shared = share.then(|| (fused.clone(), grad.clone(), fused_state.clone()));
                let (t, s) = ADAMW
                    .step_flex(1e-2, fused, grad, fused_state, time)
                    .ok()
                    .expect("flex f32 takes the fused pass");
                drop(shared);
                (fused, fused_state) = (t, Some(s));
                let grad = random(seed).mul_scalar(1e-3);
                let (t, s) = ADAMW.step_tensors(1e-2, plain, grad, plain_state, time);
                (plain, plain_state) = (t, Some(s));
            }
            assert_eq!(values(fused), values(plain));
            let (f, p) = (fused_state.unwrap(), plain_state.unwrap());
            assert_eq!(f.time, p.time);
            assert_eq!(values(f.moment_1), values(p.moment_1));
            assert_eq!(values(f.moment_2), values(p.moment_2));
        }
    }

    /// Unshared buffers are updated where they are: the weights in theirs, the first moment in
    /// the first gradient's, then both moments in their own.
    #[test]
    fn unique_buffers_are_updated_in_place() {
        let (theta, grad) = (random(1), random(2).mul_scalar(1e-3));
        let (theta_at, grad_at) = (address(&theta), address(&grad));
        let (theta, state) = ADAMW.step_flex(1e-2, theta, grad, None, 1).ok().unwrap();
        assert_eq!(address(&theta), theta_at);
        assert_eq!(address(&state.moment_1), grad_at);
        let moments_at = (address(&state.moment_1), address(&state.moment_2));
        let grad = random(3).mul_scalar(1e-3);
        let (theta, state) = ADAMW.step_flex(1e-2, theta, grad, Some(state), 2).ok().unwrap();
        assert_eq!(address(&theta), theta_at);
        assert_eq!((address(&state.moment_1), address(&state.moment_2)), moments_at);
    }

    /// Inputs that are shared elsewhere keep their values; the results are in new buffers.
    #[test]
    fn shared_inputs_are_left_unchanged() {
        let (theta, grad) = (random(1), random(2).mul_scalar(1e-3));
        let (theta_values, grad_values) = (values(theta.clone()), values(grad.clone()));
        let (updated, state) = ADAMW
            .step_flex(1e-2, theta.clone(), grad.clone(), None, 1)
            .ok()
            .unwrap();
        assert_ne!(address(&updated), address(&theta));
        assert_ne!(address(&state.moment_1), address(&grad));
        assert_eq!(values(theta), theta_values);
        assert_eq!(values(grad), grad_values);

        let kept = (
            values(updated.clone()),
            values(state.moment_1.clone()),
            values(state.moment_2.clone()),
        );
        let grad = random(3).mul_scalar(1e-3);
        let (next, _) = ADAMW
            .step_flex(1e-2, updated.clone(), grad, Some(state.clone()), 2)
            .ok()
            .unwrap();
        assert_ne!(values(next), kept.0);
        assert_eq!((values(updated), values(state.moment_1), values(state.moment_2)), kept);
    }

    #[test]
    fn autodiff_and_other_dtypes_take_tensor_ops() {
        type Ad = burn::backend::Autodiff<Flex>;
        let device = Default::default();
        let t = Tensor::<Ad, 1>::ones([4], &device);
        let (back, _, _) = ADAMW.step_flex(0.1, t.clone(), t.clone(), None, 1).err().unwrap();
        assert_eq!(back.into_data().to_vec::<f32>().unwrap(), vec![1.0; 4]);
        let b = Tensor::<Flex, 1>::ones([4], &device).cast(DType::BF16);
        let (back, _, _) = ADAMW.step_flex(0.1, b.clone(), b, None, 1).err().unwrap();
        assert_eq!(back.dtype(), DType::BF16);
    }
}
