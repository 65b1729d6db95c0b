//! Rotary position embedding in HF's "rotate_half" layout (the first half of each head pairs
//! with the second half), not burn's interleaved `RotaryEncoding`.
//!
//! HF computes `q * cos + rotate_half(q) * sin` with `rotate_half(x) = cat(-x2, x1)`. Here the
//! sign lives in the table instead: `rotate_half(x) * sin == swap_halves(x) * signed_sin` with
//! `swap_halves(x) = cat(x2, x1)` and `signed_sin = cat(-sin1, sin2)`, which saves a negation per
//! layer. The tables are expanded to every head once per forward pass and laid out
//! `[b, q, heads, head_dim]`, the layout of the projections, so each layer multiplies contiguous
//! tensors of equal shape (the fast element-wise path of CPU backends).
//!
//! Through burn's ops (GPU backends, the portable CPU path) `swap_halves` is one `select` of the
//! last axis with a permutation built once per pass, which CubeCL's fusion reads inside the
//! element-wise kernel around it; burn's `cat` of the two halves would fill an empty tensor with
//! one `slice_assign` kernel per half, for each of q and k in every layer.

use burn::tensor::{backend::Backend, DType, Int, Tensor, TensorData};

use cpu_kernels::Kernels;

use crate::kernels;

/// The inverse frequencies `1 / theta^(2i/d)` of the default RoPE.
#[derive(Debug, Clone)]
pub struct Qwen3RotaryEmbedding {
    inv_freq: Vec<f32>,
}

/// `cos` and `signed_sin` for one forward pass, `[b, q, heads, head_dim]`, and the permutation
/// of `head_dim` that [`swap_halves`] applies.
#[derive(Debug, Clone)]
pub struct RotaryTables<B: Backend> {
    pub cos: Tensor<B, 4>,
    pub signed_sin: Tensor<B, 4>,
    /// `[d/2, .., d-1, 0, .., d/2-1]`.
    pub halves_swapped: Tensor<B, 1, Int>,
}

impl Qwen3RotaryEmbedding {
    pub fn new(head_dim: usize, rope_theta: f64) -> Self {
        let inv_freq = (0..head_dim / 2)
            .map(|i| (1.0 / rope_theta.powf((2 * i) as f64 / head_dim as f64)) as f32)
            .collect();
        Self { inv_freq }
    }

    /// The tables for `position_ids` `[b, q]` for one head, `[b, q, 1, head_dim]`, in `dtype`
    /// (computed in f32 as HF does, then cast); [`RotaryTables::repeat_heads`] widens them.
    pub fn tables<B: Backend>(&self, position_ids: Tensor<B, 2, Int>, dtype: DType, cpu_kernels: Kernels) -> RotaryTables<B> {
        let device = position_ids.device();
        let half = self.inv_freq.len();
        // HF's `emb = cat(freqs, freqs)` from the frequencies laid out twice, and the sign of
        // `signed_sin` as a row of ±1 (exact): the same values, with no `cat` (two
        // `slice_assign` kernels each on a GPU) in every pass.
        let row = |values: Vec<f32>| Tensor::<B, 1>::from_data(TensorData::new(values, [2 * half]), (&device, DType::F32)).reshape([1, 1, 2 * half]);
        let inv_freq = row(self.inv_freq.iter().chain(&self.inv_freq).copied().collect());
        let sign = row((0..2 * half).map(|i| if i < half { -1.0 } else { 1.0 }).collect());
        let positions = position_ids.float().cast(DType::F32).unsqueeze_dim::<3>(2);
        let freqs = positions * inv_freq;
        let cos = freqs.clone().cos();
        let signed_sin = freqs.sin() * sign;
        let one_head = |t: Tensor<B, 3>| kernels::cast(cpu_kernels, t.unsqueeze_dim::<4>(2), dtype);
        let halves_swapped: Vec<i64> = (half..2 * half).chain(0..half).map(|i| i as i64).collect();
        RotaryTables {
            cos: one_head(cos),
            signed_sin: one_head(signed_sin),
            halves_swapped: Tensor::from_data(halves_swapped.as_slice(), &device),
        }
    }
}

impl<B: Backend> RotaryTables<B> {
    /// The tables repeated (materialised) over `heads` along the head axis.
    pub fn repeat_heads(&self, heads: usize) -> Self {
        Self {
            cos: self.cos.clone().repeat_dim(2, heads),
            signed_sin: self.signed_sin.clone().repeat_dim(2, heads),
            halves_swapped: self.halves_swapped.clone(),
        }
    }
}

/// `cat(x2, x1)` over the last axis, HF's `rotate_half` without its negation, as one `select`
/// with the tables' permutation.
pub fn swap_halves<B: Backend>(x: Tensor<B, 4>, tables: &RotaryTables<B>) -> Tensor<B, 4> {
    x.select(3, tables.halves_swapped.clone())
}

/// HF's `apply_rotary_pos_emb` for one of q or k, `[b, q, heads, head_dim]`, by a CPU kernel
/// where `cpu_kernels` run one.
pub fn apply_rotary_pos_emb<B: Backend>(x: Tensor<B, 4>, tables: &RotaryTables<B>, cpu_kernels: Kernels) -> Tensor<B, 4> {
    kernels::rotary(cpu_kernels, &x, &tables.cos, &tables.signed_sin)
        .unwrap_or_else(|| x.clone() * tables.cos.clone() + swap_halves(x, tables) * tables.signed_sin.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::Distribution;

    #[test]
    fn swap_halves_swaps() {
        let device = Default::default();
        let x = Tensor::<Flex, 1>::from_floats([1.0, 2.0, 3.0, 4.0], &device).reshape([1, 1, 1, 4]);
        let tables = Qwen3RotaryEmbedding::new(4, 10_000.0).tables(Tensor::<Flex, 2, Int>::from_ints([[0]], &device), DType::F32, Kernels::default());
        let r: Vec<f32> = swap_halves(x, &tables).into_data().to_vec().unwrap();
        assert_eq!(r, vec![3.0, 4.0, 1.0, 2.0]);
    }

    #[test]
    fn position_zero_is_identity() {
        let rope = Qwen3RotaryEmbedding::new(4, 10_000.0);
        let pos = Tensor::<Flex, 2, Int>::from_ints([[0, 1]], &Default::default());
        let tables = rope.tables(pos, DType::F32, Kernels::default()).repeat_heads(2);
        assert_eq!(tables.cos.dims(), [1, 2, 2, 4]);
        let cos: Vec<f32> = tables.cos.into_data().to_vec().unwrap();
        let sin: Vec<f32> = tables.signed_sin.into_data().to_vec().unwrap();
        assert_eq!(&cos[..8], &[1.0; 8]);
        assert!(sin[..8].iter().all(|s| *s == 0.0));
        let (s0, s1) = (1f32.sin(), 0.01f32.sin());
        for head in [8, 12] {
            assert_eq!(&sin[head..head + 4], &[-s0, -s1, s0, s1]);
        }
    }

    /// Matches HF's `q * cos + rotate_half(q) * sin` with `rotate_half(x) = cat(-x2, x1)`.
    #[test]
    fn matches_rotate_half_formula() {
        let device = Default::default();
        let (b, q, h, d) = (2, 3, 2, 8);
        let rope = Qwen3RotaryEmbedding::new(d, 10_000.0);
        let pos = Tensor::<Flex, 2, Int>::from_ints([[0, 5, 9], [3, 4, 100]], &device);
        let x = Tensor::<Flex, 4>::random([b, q, h, d], Distribution::Normal(0.0, 1.0), &device);
        let ours: Vec<f32> = apply_rotary_pos_emb(x.clone(), &rope.tables(pos, DType::F32, Kernels::default()).repeat_heads(h), Kernels::default())
            .into_data()
            .to_vec()
            .unwrap();
        let xs: Vec<f32> = x.into_data().to_vec().unwrap();
        let positions = [[0.0f32, 5.0, 9.0], [3.0, 4.0, 100.0]];
        for (i, got) in ours.iter().enumerate() {
            let (bi, qi, j) = (i / (q * h * d), (i / (h * d)) % q, i % d);
            let freq = positions[bi][qi] * (1.0 / 10_000f32.powf((2 * (j % (d / 2))) as f32 / d as f32));
            let rotated = if j < d / 2 { -xs[i + d / 2] } else { xs[i - d / 2] };
            let want = xs[i] * freq.cos() + rotated * freq.sin();
            assert!((got - want).abs() < 1e-4, "element {i}: {got} vs {want}");
        }
    }

    /// In bf16 the fused kernel gives the bits of the tensor formula, where each product and
    /// the sum are rounded to bf16 as in PyTorch.
    #[test]
    fn bf16_kernel_matches_the_tensor_formula() {
        let device = Default::default();
        let (q, h, d) = (5, 3, 16);
        let rope = Qwen3RotaryEmbedding::new(d, 1_000_000.0);
        let pos = Tensor::<Flex, 2, Int>::from_ints([[0, 1, 7, 300, 4095]], &device);
        let tables = rope.tables(pos, DType::BF16, Kernels::default()).repeat_heads(h);
        let x = Tensor::<Flex, 4>::random([1, q, h, d], Distribution::Normal(0.0, 3.0), &device).cast(DType::BF16);
        let fused = kernels::rotary(Kernels::default(), &x, &tables.cos, &tables.signed_sin).expect("bf16 on burn-flex is fused");
        let formula = x.clone() * tables.cos.clone() + swap_halves(x, &tables) * tables.signed_sin.clone();
        assert_eq!(fused.dtype(), DType::BF16);
        let bits = |t: Tensor<Flex, 4>| -> Vec<u16> {
            t.into_data().to_vec::<half::bf16>().unwrap().iter().map(|v| v.to_bits()).collect()
        };
        assert_eq!(bits(fused), bits(formula));
    }
}
