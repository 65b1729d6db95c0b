//! `nn.Linear` without bias (every Qwen3 projection), and the precision of f32 products.

use burn::nn::Linear;
use burn::tensor::{backend::Backend, module, DType, Tensor};
use serde::{Deserialize, Serialize};

use super::compute::{Compute, PassKernels};
use crate::kernels::{self, WeightLayout};
use crate::lora::LoraLinear;

/// How the projections multiply f32 activations by f32 weights (bf16 weights always give bf16
/// products).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MatmulPrecision {
    /// f32 operands and sums.
    #[default]
    F32,
    /// Both operands rounded to bf16 (to nearest, ties to even) and the products summed in f32,
    /// forward and backward (the output gradient rounded too): PyTorch's bf16 autocast, i.e.
    /// mixed precision with f32 weights. Products of at most 16 rows (decode steps) stay f32:
    /// they are memory-bound, and rounding the weights would cost more than it saves.
    ///
    /// Every path computes the same products for scoring and for the update, so a step's first
    /// ratio is exactly 1. On the CPU the f32 sums are kept as they are (the kernels of
    /// `prompt-r1-cpu-kernels`, at every instruction-set level); through burn's ops (GPU
    /// backends, or the kernels switched off) the operands are cast to bf16, multiplied by the
    /// backend's bf16 matmul and its bf16 result cast back to f32, as PyTorch's autocast returns
    /// a bf16 tensor. Whether bf16 pays on a CPU: see `cpu_kernels::Bf16Products`.
    Bf16,
}

/// Row counts up to which [`MatmulPrecision::Bf16`] leaves a product in f32.
const F32_ROWS: usize = 16;

/// `layer.forward(x)` as `compute` says (its precision and CPU kernels) in one forward `pass`
/// (a bias-free projection through [`pass_product`]).
pub fn linear<B: Backend, const D: usize>(layer: &Linear<B>, x: Tensor<B, D>, compute: &Compute, pass: PassKernels) -> Tensor<B, D> {
    let weight = layer.weight.val();
    match layer.bias {
        None => pass_product(x, weight, compute, pass),
        Some(ref bias) => linear_rows(x, weight, Some(bias.val())),
    }
}

/// Whether `compute`'s [`MatmulPrecision::Bf16`] rounds a product of `rows` rows with operands
/// of these dtypes to bf16 (f32 operands past [`F32_ROWS`] rows).
fn rounds_to_bf16(compute: &Compute, rows: usize, x: DType, w: DType) -> bool {
    compute.matmul == MatmulPrecision::Bf16 && rows > F32_ROWS && x == DType::F32 && w == DType::F32
}

/// `x · w` for a `[in, out]` weight in one forward `pass`: through the skinny-matmul kernel a GPU
/// backend lends ([`crate::device_kernels::SkinnyMatmulFn`]) where the pass runs it and `x` has
/// few rows (a decoding step's), else as [`product`]. Products that `compute`'s
/// [`MatmulPrecision::Bf16`] rounds to bf16 keep that path.
pub(crate) fn pass_product<B: Backend, const D: usize>(x: Tensor<B, D>, w: Tensor<B, 2>, compute: &Compute, pass: PassKernels) -> Tensor<B, D> {
    let mut dims = x.dims();
    let rows: usize = dims[..D - 1].iter().product();
    let dtype = x.dtype();
    let fits = dtype == w.dtype() && matches!(dtype, DType::F32 | DType::F16 | DType::BF16) && !rounds_to_bf16(compute, rows, dtype, w.dtype());
    match pass.device.skinny_matmul::<B>(rows).filter(|_| fits) {
        Some(kernel) => {
            let y = kernel(x.reshape([rows, dims[D - 1]]), w);
            dims[D - 1] = y.dims()[1];
            y.reshape(dims)
        }
        None => project(x, w, WeightLayout::InOut, compute),
    }
}

/// `layer.forward(x)` as `compute` says plus, when the projection has an adapter, PEFT's
/// LoRA term: `result + lora_B(lora_A(lora_dropout(x))) · scaling`. As in PEFT's
/// `lora.Linear.forward`, the adapter path runs in the adapter's dtype (f32; `x` is cast to it)
/// and the sum is cast back to the base result's dtype, so a bf16 base keeps bf16 activations.
/// The base product takes the same path (and kernels) as without an adapter: in a `pass` that
/// runs a GPU backend's skinny-matmul kernel, that one for few rows (see [`pass_product`]).
#[allow(non_snake_case)]
pub fn lora_linear<B: Backend, const D: usize>(
    layer: &Linear<B>,
    lora: Option<&LoraLinear<B>>,
    x: Tensor<B, D>,
    compute: &Compute,
    pass: PassKernels,
) -> Tensor<B, D> {
    let Some(lora) = lora else {
        return linear(layer, x, compute, pass);
    };
    let result = linear(layer, x.clone(), compute, pass);
    let torch_result_dtype = result.dtype();
    let lora_A = lora.lora_A.val();
    let cpu = compute.cpu_kernels;
    let x = kernels::cast(cpu, x, lora_A.dtype());
    let lora_out = linear_rows(linear_rows(lora.lora_dropout.forward(x), lora_A, None), lora.lora_B.val(), None)
        .mul_scalar(lora.scaling);
    if torch_result_dtype == lora_out.dtype() {
        result + lora_out
    } else {
        kernels::cast(cpu, kernels::cast(cpu, result, lora_out.dtype()) + lora_out, torch_result_dtype)
    }
}

/// `x · w` for a `[in, out]` weight as `compute` says, by the path every projection takes
/// (for benchmarks and callers outside the model).
pub fn product<B: Backend, const D: usize>(x: Tensor<B, D>, w: Tensor<B, 2>, compute: &Compute) -> Tensor<B, D> {
    project(x, w, WeightLayout::InOut, compute)
}

/// `x · w` for a `[in, out]` weight as a decoding step's projections compute it (a pass over a
/// KV cache: see [`pass_product`]), for benchmarks.
pub fn decoding_product<B: Backend, const D: usize>(x: Tensor<B, D>, w: Tensor<B, 2>, compute: &Compute) -> Tensor<B, D> {
    pass_product(x, w, compute, compute.pass(true))
}

/// `x · w` for a bias-free projection whose weight is stored as `layout` says, at `compute`'s
/// precision, by its CPU kernels where they run.
pub(crate) fn project<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
    layout: WeightLayout,
    compute: &Compute,
) -> Tensor<B, D> {
    let rows: usize = x.dims()[..D - 1].iter().product();
    let cpu = compute.cpu_kernels;
    if rounds_to_bf16(compute, rows, x.dtype(), w.dtype()) {
        return kernels::linear_bf16(cpu, &x, &w, layout).unwrap_or_else(|| {
            plain_product(x.cast(DType::BF16), w.cast(DType::BF16), layout).cast(DType::F32)
        });
    }
    kernels::linear(cpu, &x, &w, layout).unwrap_or_else(|| plain_product(x, w, layout))
}

/// `x · w` through burn's ops.
fn plain_product<B: Backend, const D: usize>(x: Tensor<B, D>, w: Tensor<B, 2>, layout: WeightLayout) -> Tensor<B, D> {
    match layout {
        WeightLayout::InOut => linear_rows(x, w, None),
        WeightLayout::OutIn => tied_head(x, w),
    }
}

/// `x @ embedᵀ` computed as `(embed @ xᵀ)ᵀ`: the `[vocab, hidden]` table is used as stored,
/// and only the small activations are transposed (a transposed view of the table would be
/// copied into a fresh vocab×hidden buffer on every call by backends that need contiguous
/// matmul operands).
fn tied_head<B: Backend, const D: usize>(x: Tensor<B, D>, embed: Tensor<B, 2>) -> Tensor<B, D> {
    let mut dims = x.dims();
    let rows = dims[..D - 1].iter().product();
    let columns = x.reshape([rows, dims[D - 1]]).transpose();
    dims[D - 1] = embed.dims()[0];
    embed.matmul(columns).transpose().reshape(dims)
}

/// `x · weight (+ bias)` for a `[in, out]` weight, with every leading dimension of `x` folded
/// into one row dimension first. burn's `linear` on a rank-3 input broadcasts the weight to
/// `[1, in, out]`; its backward then copies the transposed weight for the input gradient (a
/// reshape of a transposed view) and computes one weight gradient per batch element before
/// summing them. On a 2-D input both are a single strided matmul.
pub fn linear_rows<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    let mut dims = x.dims();
    let rows = dims[..D - 1].iter().product();
    let y = module::linear(x.reshape([rows, dims[D - 1]]), weight, bias);
    dims[D - 1] = y.dims()[1];
    y.reshape(dims)
}
