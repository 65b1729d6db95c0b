//! The kernels on a fused CubeCL backend: each is one custom operation of the fusion stream,
//! which runs the unfused backend's kernel on the operands' handles when the stream reaches it.

use std::fmt;

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::Shape;
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, OperationOutput, TensorIr};

use crate::{DeviceKernels, GateUp, QkNormRopeWrite, Qkv};

impl<B: FusionBackend + DeviceKernels> DeviceKernels for Fusion<B> {
    fn paged_attention(
        query: FloatTensor<Self>,
        shape: [usize; 4],
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        read: IntTensor<Self>,
        valid: FloatTensor<Self>,
        ragged: Option<(IntTensor<Self>, crate::RowLens)>,
        scale: f32,
        spans: crate::Spans,
        decoding: crate::DecodingKernel,
        products: crate::Products,
    ) -> FloatTensor<Self> {
        let client = query.client.clone();
        let (starts, lens) = ragged.map_or((None, None), |(starts, lens)| (Some(starts), Some(lens)));
        let mut operands = vec![&query, &keys, &values, &read, &valid];
        operands.extend(starts.as_ref());
        let streams = OperationStreams::with_inputs(operands);
        let output = TensorIr::uninit(client.create_empty_handle(), Shape::new(query.shape.dims::<2>()), query.dtype);
        let mut inputs = vec![query.into_ir(), keys.into_ir(), values.into_ir(), read.into_ir(), valid.into_ir()];
        inputs.extend(starts.map(|s| s.into_ir()));
        let desc = CustomOpIr::new("paged_attention", &inputs, &[output]);
        let op = KernelOp::<B>::new(&desc, move |desc, handles| {
            let inputs = &desc.inputs;
            // A ragged pass's row starts are the sixth input.
            let ragged = lens.map(|lens| (handles.get_int_tensor::<B>(&inputs[5]), lens));
            let result = B::paged_attention(
                handles.get_float_tensor::<B>(&inputs[0]),
                shape,
                handles.get_float_tensor::<B>(&inputs[1]),
                handles.get_float_tensor::<B>(&inputs[2]),
                handles.get_int_tensor::<B>(&inputs[3]),
                handles.get_float_tensor::<B>(&inputs[4]),
                ragged,
                scale,
                spans,
                decoding,
                products,
            );
            handles.register_float_tensor::<B>(&desc.outputs[0].id, result);
        });
        client.register(streams, OperationIr::Custom(desc), op).output()
    }

    fn fresh_attention(
        query: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        valid: FloatTensor<Self>,
        scale: f32,
        products: crate::Products,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let client = query.client.clone();
        let streams = OperationStreams::with_inputs([&query, &keys, &values, &valid]);
        let [rows, queries, heads, head_dim] = query.shape.dims::<4>();
        let output = TensorIr::uninit(client.create_empty_handle(), Shape::new([rows, queries, heads, head_dim]), query.dtype);
        let lse = TensorIr::uninit(client.create_empty_handle(), Shape::new([rows * queries, heads]), burn::tensor::DType::F32);
        let desc = CustomOpIr::new("fresh_attention", &[query.into_ir(), keys.into_ir(), values.into_ir(), valid.into_ir()], &[output, lse]);
        let op = KernelOp::<B>::new(&desc, move |desc, handles| {
            let ([query, keys, values, valid], [output, lse]) = desc.as_fixed();
            let (output_result, lse_result) = B::fresh_attention(
                handles.get_float_tensor::<B>(query),
                handles.get_float_tensor::<B>(keys),
                handles.get_float_tensor::<B>(values),
                handles.get_float_tensor::<B>(valid),
                scale,
                products,
            );
            handles.register_float_tensor::<B>(&output.id, output_result);
            handles.register_float_tensor::<B>(&lse.id, lse_result);
        });
        let [output, lse] = client.register(streams, OperationIr::Custom(desc), op).outputs();
        (output, lse)
    }

    fn choose_tokens(logits: FloatTensor<Self>, temperatures: FloatTensor<Self>, uniforms: FloatTensor<Self>) -> FloatTensor<Self> {
        let client = logits.client.clone();
        let streams = OperationStreams::with_inputs([&logits, &temperatures, &uniforms]);
        let rows = logits.shape.dims::<2>()[0];
        let output = TensorIr::uninit(client.create_empty_handle(), Shape::new([rows, 2]), burn::tensor::DType::F32);
        let desc = CustomOpIr::new("choose_tokens", &[logits.into_ir(), temperatures.into_ir(), uniforms.into_ir()], &[output]);
        let op = KernelOp::<B>::new(&desc, |desc, handles| {
            let ([logits, temperatures, uniforms], [output]) = desc.as_fixed();
            let result = B::choose_tokens(
                handles.get_float_tensor::<B>(logits),
                handles.get_float_tensor::<B>(temperatures),
                handles.get_float_tensor::<B>(uniforms),
            );
            handles.register_float_tensor::<B>(&output.id, result);
        });
        client.register(streams, OperationIr::Custom(desc), op).output()
    }

    fn silu_mul(operands: GateUp<FloatTensor<Self>>) -> FloatTensor<Self> {
        let (inputs, dims) = match operands {
            GateUp::Stacked(gate_up) => {
                let [rows, both] = gate_up.shape.dims::<2>();
                assert!(both % 2 == 0, "silu mul: a gate and an up of one width, not {both} columns");
                (vec![gate_up], [rows, both / 2])
            }
            GateUp::Separate(gate, up) => {
                let dims = gate.shape.dims::<2>();
                (vec![gate, up], dims)
            }
        };
        let client = inputs[0].client.clone();
        let streams = OperationStreams::with_inputs(inputs.iter());
        let output = TensorIr::uninit(client.create_empty_handle(), Shape::new(dims), inputs[0].dtype);
        let inputs: Vec<TensorIr> = inputs.into_iter().map(|t| t.into_ir()).collect();
        let desc = CustomOpIr::new("silu_mul", &inputs, &[output]);
        let op = KernelOp::<B>::new(&desc, |desc, handles| {
            let get = |handles: &mut Handles<B>, i: usize| handles.get_float_tensor::<B>(&desc.inputs[i]);
            let operands = match desc.inputs.len() {
                1 => GateUp::Stacked(get(handles, 0)),
                _ => {
                    let gate = get(handles, 0);
                    GateUp::Separate(gate, get(handles, 1))
                }
            };
            let result = B::silu_mul(operands);
            handles.register_float_tensor::<B>(&desc.outputs[0].id, result);
        });
        client.register(streams, OperationIr::Custom(desc), op).output()
    }

    fn skinny_matmul(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        let client = x.client.clone();
        let streams = OperationStreams::with_inputs([&x, &weight]);
        let (rows, columns) = (x.shape.dims::<2>()[0], weight.shape.dims::<2>()[1]);
        let output = TensorIr::uninit(client.create_empty_handle(), Shape::new([rows, columns]), x.dtype);
        let desc = CustomOpIr::new("skinny_matmul", &[x.into_ir(), weight.into_ir()], &[output]);
        let op = KernelOp::<B>::new(&desc, |desc, handles| {
            let ([x, weight], [output]) = desc.as_fixed();
            let result = B::skinny_matmul(handles.get_float_tensor::<B>(x), handles.get_float_tensor::<B>(weight));
            handles.register_float_tensor::<B>(&output.id, result);
        });
        client.register(streams, OperationIr::Custom(desc), op).output()
    }

    fn rms_norm(input: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        let client = input.client.clone();
        let streams = OperationStreams::with_inputs([&input, &weight]);
        let output = TensorIr::uninit(client.create_empty_handle(), Shape::new(input.shape.dims::<2>()), input.dtype);
        let desc = CustomOpIr::new("rms_norm", &[input.into_ir(), weight.into_ir()], &[output]);
        let op = KernelOp::<B>::new(&desc, move |desc, handles| {
            let ([input, weight], [output]) = desc.as_fixed();
            let result = B::rms_norm(handles.get_float_tensor::<B>(input), handles.get_float_tensor::<B>(weight), eps);
            handles.register_float_tensor::<B>(&output.id, result);
        });
        client.register(streams, OperationIr::Custom(desc), op).output()
    }

    fn add_rms_norm(
        residual: FloatTensor<Self>,
        delta: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let client = residual.client.clone();
        let streams = OperationStreams::with_inputs([&residual, &delta, &weight]);
        let shape = Shape::new(residual.shape.dims::<2>());
        let outputs = [(); 2].map(|_| TensorIr::uninit(client.create_empty_handle(), shape.clone(), residual.dtype));
        let desc = CustomOpIr::new("add_rms_norm", &[residual.into_ir(), delta.into_ir(), weight.into_ir()], &outputs);
        let op = KernelOp::<B>::new(&desc, move |desc, handles| {
            let ([residual, delta, weight], [sum, normed]) = desc.as_fixed();
            let (sum_result, normed_result) = B::add_rms_norm(
                handles.get_float_tensor::<B>(residual),
                handles.get_float_tensor::<B>(delta),
                handles.get_float_tensor::<B>(weight),
                eps,
            );
            handles.register_float_tensor::<B>(&sum.id, sum_result);
            handles.register_float_tensor::<B>(&normed.id, normed_result);
        });
        let [sum, normed] = client.register(streams, OperationIr::Custom(desc), op).outputs();
        (sum, normed)
    }

    fn qk_norm_rope_write(pass: QkNormRopeWrite<FloatTensor<Self>, IntTensor<Self>>) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let QkNormRopeWrite { qkv, heads, q_weight, k_weight, cos, signed_sin, slots, keys, values, eps } = pass;
        let projections = match qkv {
            Qkv::Stacked(qkv) => vec![qkv],
            Qkv::Separate(each) => each.to_vec(),
        };
        let client = q_weight.client.clone();
        let tokens = projections[0].shape.dims::<2>()[0];
        let head_dim = q_weight.shape.dims::<1>()[0];
        let rotated = TensorIr::uninit(client.create_empty_handle(), Shape::new([tokens, heads * head_dim]), q_weight.dtype);
        let output = |tensor: &FloatTensor<Self>| TensorIr::uninit(client.create_empty_handle(), tensor.shape.clone(), tensor.dtype);
        let outputs = [rotated, output(&keys), output(&values)];
        let stacked = projections.len() == 1;
        // The projections first (one stacked product, or three), then the other operands.
        let operands: Vec<FloatTensor<Self>> = projections.into_iter().chain([q_weight, k_weight, cos, signed_sin]).collect();
        let streams = OperationStreams::with_inputs(operands.iter().chain([&slots, &keys, &values]));
        let mut inputs: Vec<TensorIr> = operands.into_iter().map(|t| t.into_ir()).collect();
        inputs.extend([slots, keys, values].map(|t| t.into_ir()));
        let desc = CustomOpIr::new("qk_norm_rope_write", &inputs, &outputs);
        // The pools' handles come out of the stream's container where nothing else reads them
        // (the KV cache passes them on), so the kernel writes them in place.
        let op = KernelOp::<B>::new(&desc, move |desc, handles| {
            let inputs = &desc.inputs;
            let first = if stacked { 1 } else { 3 };
            let qkv = match stacked {
                true => Qkv::Stacked(handles.get_float_tensor::<B>(&inputs[0])),
                false => Qkv::Separate([0, 1, 2].map(|i| handles.get_float_tensor::<B>(&inputs[i]))),
            };
            let float = |handles: &mut Handles<B>, i: usize| handles.get_float_tensor::<B>(&inputs[first + i]);
            let (q_weight, k_weight, cos, signed_sin) = (float(handles, 0), float(handles, 1), float(handles, 2), float(handles, 3));
            let slots = handles.get_int_tensor::<B>(&inputs[first + 4]);
            let (keys, values) = (float(handles, 5), float(handles, 6));
            let (rotated_result, keys_result, values_result) =
                B::qk_norm_rope_write(QkNormRopeWrite { qkv, heads, q_weight, k_weight, cos, signed_sin, slots, keys, values, eps });
            let [rotated, keys_out, values_out] = [0, 1, 2].map(|i| &desc.outputs[i]);
            handles.register_float_tensor::<B>(&rotated.id, rotated_result);
            handles.register_float_tensor::<B>(&keys_out.id, keys_result);
            handles.register_float_tensor::<B>(&values_out.id, values_result);
        });
        let [query, keys, values] = client.register(streams, OperationIr::Custom(desc), op).outputs();
        (query, keys, values)
    }
}

/// The handles of a fusion stream of backend `B`.
type Handles<B> = HandleContainer<<<B as FusionBackend>::FusionRuntime as FusionRuntime>::FusionHandle>;

/// One of this crate's kernels waiting in the fusion stream: when the stream reaches it, `run`
/// computes it on the unfused backend's handles its description names, with the settings it
/// captured (an eps, a scale).
struct KernelOp<B: FusionBackend> {
    desc: CustomOpIr,
    run: Box<dyn Fn(&CustomOpIr, &mut Handles<B>) + Send + Sync>,
}

impl<B: FusionBackend> KernelOp<B> {
    fn new(desc: &CustomOpIr, run: impl Fn(&CustomOpIr, &mut Handles<B>) + Send + Sync + 'static) -> Self {
        Self { desc: desc.clone(), run: Box::new(run) }
    }
}

impl<B: FusionBackend> fmt::Debug for KernelOp<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KernelOp").field("desc", &self.desc).finish_non_exhaustive()
    }
}

impl<B: FusionBackend> Operation<B::FusionRuntime> for KernelOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        (self.run)(&self.desc, handles)
    }
}
