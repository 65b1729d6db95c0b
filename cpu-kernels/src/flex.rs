//! Between burn tensors and the host slices the kernels read: the burn-flex tensor behind a
//! tensor of a generic backend (checked at run time by type, so callers stay generic), results
//! handed back as tensors, and contiguous copies of strided views.

use std::any::Any;

use burn::backend::{Autodiff, Flex};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, bf16, Bytes, DType, Int, Shape, Tensor, TensorPrimitive};
use burn_flex::{FlexTensor, Layout};
use rayon::prelude::*;

use crate::bf16_bits;
use crate::Kernels;

/// Whether `B` is burn-flex or burn-flex under autodiff, the backends these kernels serve
/// (decided by type, without touching a device). Other backends (the GPU ones) never reach the
/// kernels, so their results do not depend on the [`Kernels`] chosen.
pub fn is_flex_backend<B: Backend>() -> bool {
    use std::any::TypeId;
    let primitive = TypeId::of::<FloatTensor<B>>();
    primitive == TypeId::of::<FloatTensor<Flex>>() || primitive == TypeId::of::<FloatTensor<Autodiff<Flex>>>()
}

/// Whether `B` is plain burn-flex (not under autodiff), whether or not the kernels are on.
pub fn is_plain_flex<B: Backend>() -> bool {
    std::any::TypeId::of::<FloatTensor<B>>() == std::any::TypeId::of::<FloatTensor<Flex>>()
}

/// The burn-flex tensor behind `t` (for writes that compute nothing, whether or not the kernels
/// are on), or `t` back when `B` is not burn-flex.
pub(crate) fn flex_of<B: Backend, const D: usize>(t: Tensor<B, D>) -> Result<FlexTensor, Tensor<B, D>> {
    if std::any::TypeId::of::<FloatTensor<B>>() != std::any::TypeId::of::<FloatTensor<Flex>>() {
        return Err(t);
    }
    let primitive: Box<dyn Any> = Box::new(t.into_primitive().tensor());
    Ok(*primitive.downcast::<FlexTensor>().expect("B is burn-flex"))
}

/// The burn-flex tensor behind `t`, when `B` is burn-flex.
pub(crate) fn to_flex<B: Backend, const D: usize>(t: Tensor<B, D>) -> Option<FlexTensor> {
    let primitive: Box<dyn Any> = Box::new(t.into_primitive().tensor());
    primitive.downcast::<FlexTensor>().ok().map(|t| *t)
}

/// The burn-flex tensor behind the integer tensor `t`, when `B` is burn-flex.
pub(crate) fn to_flex_int<B: Backend, const D: usize>(t: Tensor<B, D, Int>) -> Option<FlexTensor> {
    let primitive: Box<dyn Any> = Box::new(t.into_primitive());
    primitive.downcast::<FlexTensor>().ok().map(|t| *t)
}

/// `t` as `B`'s float primitive, when `B` is burn-flex.
pub(crate) fn from_flex<B: Backend>(t: FlexTensor) -> Option<B::FloatTensorPrimitive> {
    let primitive: Box<dyn Any> = Box::new(t);
    primitive
        .downcast::<B::FloatTensorPrimitive>()
        .ok()
        .map(|t| *t)
}

/// `t` itself when its strides are non-negative and its last axis is contiguous, else a
/// contiguous copy.
pub(crate) fn rows_contiguous(t: FlexTensor) -> FlexTensor {
    let strides = t.layout().strides();
    if strides.last() == Some(&1) && strides.iter().all(|&s| s >= 0) {
        t
    } else {
        t.to_contiguous()
    }
}

/// `t` with its elements in row-major order from offset 0, like burn-flex's `to_contiguous`.
/// An f32 or bf16 view whose last axis is contiguous (e.g. after `swap_dims` of two other
/// axes) is copied a row at a time, in parallel: burn-flex walks views that keep more than
/// two axes after merging one element at a time, on one thread.
pub(crate) fn flex_contiguous(t: &FlexTensor) -> FlexTensor {
    let layout = t.layout();
    let whole = t.is_contiguous()
        && layout.start_offset() == 0
        && t.bytes().len() == layout.num_elements() * t.dtype().size();
    if whole {
        return t.clone();
    }
    let strides = layout.strides();
    let dims = layout.shape().to_vec();
    if strides.last() != Some(&1) || strides.iter().any(|&s| s < 0) || dims.contains(&0) {
        return t.to_contiguous();
    }
    let strides: Vec<usize> = strides.iter().map(|&s| s as usize).collect();
    let offset = layout.start_offset();
    fn copy_rows<T: Copy + Default + Send + Sync>(src: &[T], dims: &[usize], strides: &[usize], offset: usize) -> Vec<T> {
        let d = *dims.last().expect("a view has at least one axis");
        let rows_per_task = (1 << 14) / d + 1;
        let mut out = vec![T::default(); dims.iter().product()];
        out.par_chunks_mut(d * rows_per_task).enumerate().for_each(|(task, rows)| {
            for (r, dst) in rows.chunks_exact_mut(d).enumerate() {
                let (mut rest, mut start) = (task * rows_per_task + r, offset);
                for (&n, &stride) in dims[..dims.len() - 1].iter().zip(strides).rev() {
                    start += (rest % n) * stride;
                    rest /= n;
                }
                dst.copy_from_slice(&src[start..start + d]);
            }
        });
        out
    }
    let bytes = match t.dtype() {
        DType::F32 => Bytes::from_elems(copy_rows(t.storage::<f32>(), &dims, &strides, offset)),
        DType::BF16 => Bytes::from_elems(copy_rows(t.storage::<bf16>(), &dims, &strides, offset)),
        _ => return t.to_contiguous(),
    };
    FlexTensor::new(bytes, Layout::contiguous(Shape::from(dims)), t.dtype())
}

/// A contiguous burn-flex result as a tensor of `B` (which is burn-flex when this is reached).
pub(crate) fn flex_output<B: Backend, const D: usize>(
    bytes: Bytes,
    dims: [usize; D],
    dtype: DType,
) -> Option<Tensor<B, D>> {
    let out = FlexTensor::new(bytes, Layout::contiguous(Shape::from(dims.to_vec())), dtype);
    from_flex::<B>(out).map(|p| Tensor::from_primitive(TensorPrimitive::Float(p)))
}

/// `values` rounded to bf16 (to nearest, ties to even), in parallel.
pub(crate) fn narrow_all(kernels: Kernels, values: &[f32]) -> Vec<bf16> {
    map_all(kernels, values, bf16_bits::narrow)
}

/// `f` of every value, in parallel chunks, each loop vectorised as wide as `kernels` allow.
pub(crate) fn map_all<S: Copy + Sync, T: Copy + Default + Send>(kernels: Kernels, values: &[S], f: impl Fn(S) -> T + Sync) -> Vec<T> {
    let mut out = vec![T::default(); values.len()];
    out.par_chunks_mut(1 << 16)
        .zip(values.par_chunks(1 << 16))
        .for_each(|(out, x)| wide_simd!(kernels, for (o, &x) in out.iter_mut().zip(x) {
            *o = f(x);
        }));
    out
}

/// The `len` ids of a burn-flex integer tensor, when all are below `vocab`.
pub(crate) fn token_ids<B: Backend, const D: usize>(
    ids: &Tensor<B, D, Int>,
    len: usize,
    vocab: usize,
) -> Option<Vec<usize>> {
    let ids = to_flex_int(ids.clone())?.to_contiguous();
    let ids: Vec<usize> = match ids.dtype() {
        DType::I64 => ids.as_slice::<i64>()?.iter().map(|&t| t as usize).collect(),
        DType::I32 => ids.as_slice::<i32>()?.iter().map(|&t| t as usize).collect(),
        _ => return None,
    };
    (ids.len() == len && ids.iter().all(|&t| t < vocab)).then_some(ids)
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex};

    use super::is_flex_backend;

    #[test]
    fn flex_is_recognised_with_and_without_autodiff() {
        assert!(is_flex_backend::<Flex>());
        assert!(is_flex_backend::<Autodiff<Flex>>());
    }
}
