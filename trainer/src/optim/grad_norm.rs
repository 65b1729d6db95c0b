//! The L2 norm of the gradient over all parameters, and clipping by it (PyTorch's
//! `clip_grad_norm_`). burn's `GradientClippingConfig::Norm` clips each parameter by its own
//! norm instead, which changes the update's direction.

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, ElementConversion, Tensor};
use burn_flex::FlexTensor;
use rayon::prelude::*;

use super::flex::{from_flex, into_flex, values_mut, CHUNK};

/// Added to the norm before dividing, as PyTorch does.
pub const CLIP_EPS: f32 = 1e-6;

/// `sqrt(Σ_params Σ g²)` over every gradient of `module`'s parameters held in `grads`, each
/// parameter's sum in f32. On burn-flex, f32 gradients are summed from their buffers on the
/// host; other gradients on the device, read back once. NaN or inf when a gradient is.
pub fn global_grad_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    grads: &GradientsParams,
    module: &M,
) -> f32 {
    let mut visitor = SquaredSums::<B> {
        grads,
        sums: Vec::new(),
        host_sums: Vec::new(),
    };
    module.visit(&mut visitor);
    let mut total: f32 = visitor.host_sums.iter().sum();
    if !visitor.sums.is_empty() {
        let device: f32 = Tensor::cat(visitor.sums, 0).sum().into_scalar().elem();
        total += device;
    }
    total.sqrt()
}

/// Multiplies every gradient of `module`'s parameters by `factor`.
pub fn scale_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    grads: &mut GradientsParams,
    module: &M,
    factor: f32,
) {
    let mut visitor = Scale::<B> {
        grads,
        factor,
        backend: std::marker::PhantomData,
    };
    module.visit(&mut visitor);
}

/// PyTorch's `clip_grad_norm_`: `n = ‖g‖₂` over all parameters; if `c = max_norm / (n + 1e-6)`
/// is below 1, every gradient is multiplied by `c`. Returns `n` (before clipping). A
/// non-finite `n` leaves the gradients alone: such a step is to be skipped, not applied.
pub fn clip_grad_norm_global<B: AutodiffBackend, M: AutodiffModule<B>>(
    grads: &mut GradientsParams,
    module: &M,
    max_norm: f32,
) -> f32 {
    let norm = global_grad_norm::<B, M>(grads, module);
    let coef = max_norm / (norm + CLIP_EPS);
    if norm.is_finite() && coef < 1.0 {
        scale_grads::<B, M>(grads, module, coef);
    }
    norm
}

/// Each parameter's `Σ g²`: on the host where the gradient is a contiguous f32 burn-flex
/// tensor, else as a tensor on the device.
struct SquaredSums<'a, B: AutodiffBackend> {
    grads: &'a GradientsParams,
    sums: Vec<Tensor<B::InnerBackend, 1>>,
    host_sums: Vec<f32>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SquaredSums<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) else {
            return;
        };
        let g = match into_flex(g) {
            Ok(flex) => match flex.as_slice::<f32>() {
                Some(values) => {
                    self.host_sums.push(sum_of_squares(values));
                    return;
                }
                None => from_flex(flex),
            },
            Err(g) => g,
        };
        self.sums.push(g.cast(DType::F32).square().sum());
    }
}

/// `Σ x²` in f32: in parallel over fixed chunks, each summed in 16 lanes, the chunks' sums then
/// added in order (the same result on every call).
fn sum_of_squares(values: &[f32]) -> f32 {
    const LANES: usize = 16;
    let chunks: Vec<f32> = values
        .par_chunks(CHUNK)
        .map(|chunk| {
            let mut lanes = [0.0f32; LANES];
            let blocks = chunk.chunks_exact(LANES);
            let tail: f32 = blocks.remainder().iter().map(|x| x * x).sum();
            for block in blocks {
                for (lane, x) in lanes.iter_mut().zip(block) {
                    *lane += x * x;
                }
            }
            lanes.iter().sum::<f32>() + tail
        })
        .collect();
    chunks.iter().sum()
}

/// Multiplies a burn-flex gradient by `factor`, in its own buffer when that is not shared (as
/// `mul_scalar` would, but in parallel).
fn scale_flex<B: Backend, const D: usize>(mut g: FlexTensor, factor: f32) -> Tensor<B, D> {
    if g.dtype() == DType::F32 && g.is_unique() && g.is_contiguous() {
        values_mut(&mut g)
            .par_chunks_mut(CHUNK)
            .for_each(|chunk| chunk.iter_mut().for_each(|x| *x *= factor));
        return from_flex(g);
    }
    from_flex::<B, D>(g).mul_scalar(factor)
}

struct Scale<'a, B> {
    grads: &'a mut GradientsParams,
    factor: f32,
    backend: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let scaled = match into_flex(g) {
                Ok(flex) => scale_flex::<B::InnerBackend, D>(flex, self.factor),
                Err(g) => g.mul_scalar(self.factor),
            };
            self.grads.register(param.id, scaled);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::module::Module;
    use burn::tensor::{backend::Backend, TensorData};

    type B = Autodiff<Flex>;

    #[derive(Module, Debug)]
    struct Two<B: Backend> {
        a: Param<Tensor<B, 1>>,
        b: Param<Tensor<B, 2>>,
    }

    fn module() -> Two<B> {
        let device = Default::default();
        Two {
            a: Param::from_tensor(Tensor::from_data(
                TensorData::new(vec![0.5f32; 3], [3]),
                &device,
            )),
            b: Param::from_tensor(Tensor::from_data(
                TensorData::new(vec![-1.0f32; 4], [2, 2]),
                &device,
            )),
        }
    }

    /// Gradients of `Σ ca·a + Σ cb·b` are `ca` and `cb`.
    fn grads(m: &Two<B>, ca: [f32; 3], cb: [f32; 4]) -> GradientsParams {
        let _autodiff = crate::autodiff_lock::exclusive_autodiff();
        let device = Default::default();
        let ca = Tensor::<B, 1>::from_data(TensorData::new(ca.to_vec(), [3]), &device);
        let cb = Tensor::<B, 2>::from_data(TensorData::new(cb.to_vec(), [2, 2]), &device);
        let loss = (m.a.val() * ca).sum() + (m.b.val() * cb).sum();
        GradientsParams::from_grads(loss.backward(), m)
    }

    fn host<const D: usize>(g: &GradientsParams, id: burn::module::ParamId) -> Vec<f32> {
        g.get::<Flex, D>(id)
            .unwrap()
            .into_data()
            .convert::<f32>()
            .into_vec()
            .unwrap()
    }

    #[test]
    fn clips_by_the_norm_over_all_parameters() {
        // ‖(1, 2, 2)‖² = 9, ‖(4, 0, 0, 0)‖² = 16 → global norm 5; max 1 → every gradient × 1/5.
        // (Per-parameter clipping would give a = (1/3, 2/3, 2/3) and b = (1, 0, 0, 0).)
        let m = module();
        let mut g = grads(&m, [1.0, 2.0, 2.0], [4.0, 0.0, 0.0, 0.0]);
        let norm = clip_grad_norm_global::<B, _>(&mut g, &m, 1.0);
        assert!((norm - 5.0).abs() < 1e-6);
        let (a, b) = (host::<1>(&g, m.a.id), host::<2>(&g, m.b.id));
        for (got, want) in a.iter().chain(&b).zip([0.2, 0.4, 0.4, 0.8, 0.0, 0.0, 0.0]) {
            assert!((got - want).abs() < 1e-6, "{a:?} {b:?}");
        }
        assert!((global_grad_norm::<B, _>(&g, &m) - 1.0).abs() < 1e-5);
    }

    #[test]
    fn leaves_small_gradients_alone() {
        // Norm 5 ≤ 10: unchanged.
        let m = module();
        let mut g = grads(&m, [1.0, 2.0, 2.0], [4.0, 0.0, 0.0, 0.0]);
        assert!((clip_grad_norm_global::<B, _>(&mut g, &m, 10.0) - 5.0).abs() < 1e-6);
        assert_eq!(host::<1>(&g, m.a.id), vec![1.0, 2.0, 2.0]);
    }

    #[test]
    fn non_finite_norm_is_reported_and_leaves_gradients() {
        let m = module();
        let mut g = grads(&m, [1.0, f32::NAN, 2.0], [4.0, 0.0, 0.0, 0.0]);
        assert!(clip_grad_norm_global::<B, _>(&mut g, &m, 1.0).is_nan());
        assert_eq!(host::<2>(&g, m.b.id), vec![4.0, 0.0, 0.0, 0.0]);
        let mut g = grads(&m, [1.0, f32::INFINITY, 2.0], [4.0, 0.0, 0.0, 0.0]);
        assert_eq!(
            clip_grad_norm_global::<B, _>(&mut g, &m, 1.0),
            f32::INFINITY
        );
    }

    /// Where the gradient of `id` is stored.
    fn address<const D: usize>(g: &GradientsParams, id: burn::module::ParamId) -> *const u8 {
        match g.get::<Flex, D>(id).unwrap().into_primitive() {
            burn::tensor::TensorPrimitive::Float(flex) => flex.bytes().as_ptr(),
            burn::tensor::TensorPrimitive::QFloat(_) => unreachable!(),
        }
    }

    #[test]
    fn gradients_are_scaled_in_place() {
        let m = module();
        let mut g = grads(&m, [1.0, 2.0, 2.0], [4.0, 0.0, 0.0, 0.0]);
        let before = (address::<1>(&g, m.a.id), address::<2>(&g, m.b.id));
        clip_grad_norm_global::<B, _>(&mut g, &m, 1.0);
        assert_eq!((address::<1>(&g, m.a.id), address::<2>(&g, m.b.id)), before);
    }

    #[test]
    fn sum_of_squares_is_exact_enough_and_repeatable() {
        let values: Vec<f32> = (0..3 * CHUNK + 37)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let exact: f64 = values.iter().map(|&x| f64::from(x).powi(2)).sum();
        let sum = sum_of_squares(&values);
        assert!(
            (f64::from(sum) - exact).abs() <= 1e-6 * exact,
            "{sum} vs {exact}"
        );
        assert_eq!(sum.to_bits(), sum_of_squares(&values).to_bits());
    }
}
