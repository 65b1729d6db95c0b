//! Access to burn-flex's tensor primitive from code generic over the backend, for the
//! optimiser's loops that read and update parameter-sized buffers without allocating.

use std::any::Any;

use burn::tensor::backend::Backend;
use burn::tensor::{Bytes, DType, Tensor, TensorPrimitive};
use burn_flex::{FlexTensor, Layout};

/// Elements per rayon task in the optimiser's loops.
pub(crate) const CHUNK: usize = 64 * 1024;

/// Whether `B`'s float tensors are burn-flex tensors (not under autodiff): then the optimiser
/// updates them in place on the host, whatever CPU kernels the model runs (the loops belong to
/// the optimiser, not to the model's computation; the memory plan counts no temporaries for
/// the update on either CPU path).
pub(crate) use model::cpu_kernels::is_plain_flex as is_flex;

/// The burn-flex tensor behind `t`, or `t` back when `B` is another backend or `t` is quantized.
pub(crate) fn into_flex<B: Backend, const D: usize>(
    t: Tensor<B, D>,
) -> Result<FlexTensor, Tensor<B, D>> {
    match t.into_primitive() {
        TensorPrimitive::Float(primitive) if is_flex::<B>() => {
            let primitive: Box<dyn Any> = Box::new(primitive);
            Ok(*primitive
                .downcast::<FlexTensor>()
                .expect("is_flex checked the type"))
        }
        primitive => Err(Tensor::from_primitive(primitive)),
    }
}

/// `t` as a tensor of `B`, which must be burn-flex (`t` came from [`into_flex`]).
pub(crate) fn from_flex<B: Backend, const D: usize>(t: FlexTensor) -> Tensor<B, D> {
    let primitive: Box<dyn Any> = Box::new(t);
    let primitive = primitive
        .downcast::<B::FloatTensorPrimitive>()
        .expect("B is burn-flex");
    Tensor::from_primitive(TensorPrimitive::Float(*primitive))
}

/// An f32 tensor that owns its buffer and is contiguous, so that it can be updated in place:
/// `t` itself when it is so, else a contiguous copy.
pub(crate) fn owned_f32(t: FlexTensor) -> FlexTensor {
    debug_assert_eq!(t.dtype(), DType::F32);
    if t.is_unique() && t.is_contiguous() {
        return t;
    }
    match t.as_slice::<f32>() {
        Some(values) => FlexTensor::new(
            Bytes::from_elems(values.to_vec()),
            Layout::contiguous(t.layout().shape().clone()),
            DType::F32,
        ),
        None => t.to_contiguous(),
    }
}

/// A zero-filled contiguous f32 tensor (pages are only touched when written).
pub(crate) fn zeros_f32(shape: burn::tensor::Shape) -> FlexTensor {
    let n = shape.num_elements();
    FlexTensor::new(
        Bytes::from_elems(vec![0.0f32; n]),
        Layout::contiguous(shape),
        DType::F32,
    )
}

/// The elements of a tensor made by [`owned_f32`] (or [`zeros_f32`]), writable.
pub(crate) fn values_mut(t: &mut FlexTensor) -> &mut [f32] {
    let (start, end) = t
        .layout()
        .contiguous_offsets()
        .expect("owned_f32 made it contiguous");
    let storage = t
        .try_storage_mut::<f32>()
        .expect("owned_f32 made it unique");
    &mut storage[start..end]
}
