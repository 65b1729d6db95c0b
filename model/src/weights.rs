//! Weight import and export: the map between HF tensor names (`model.layers.0.self_attn.q_proj.
//! weight`, ...) and the parameters of [`Qwen3ForCausalLM`]. Linear weights are `[out, in]` in
//! HF files and `[in, out]` in burn; the transpose happens here, once, on the host.

use std::borrow::Cow;
use std::path::Path;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::nn::{Embedding, Linear};
use burn::tensor::{backend::Backend, Bytes, DType, Tensor, TensorData};
use rayon::prelude::*;

use crate::checkpoint::{Checkpoint, HostTensor, RawTensor, StorageDtype};
use crate::kernels::transpose_into;
use crate::config::Qwen3Config;
use crate::error::ModelError;
use crate::qwen3::{
    Compute, Qwen3Attention, Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3MLP, Qwen3Model, Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
};

/// How a checkpoint is placed on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    /// The dtype the weights (and so the activations) use on the device. f32 by default; bf16
    /// halves memory and, on GPUs, doubles matmul speed.
    pub dtype: DType,
    /// How the model computes (attention implementation, precision of products, CPU and GPU
    /// kernels), kept in the model; see [`Compute`].
    pub compute: Compute,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self { dtype: DType::F32, compute: Compute::default() }
    }
}

/// What kind of parameter an HF tensor is, which fixes its layout conversion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    /// A `Linear` weight: HF `[out, in]`, burn `[in, out]`.
    Linear,
    /// The embedding table `[vocab, hidden]`, same in both.
    Embedding,
    /// A norm weight `[n]`.
    Norm,
}

/// One HF tensor of a Qwen3 checkpoint with its shape in the HF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: ParamKind,
}

/// Every tensor a checkpoint of this config holds, in HF names and shapes.
pub fn parameter_specs(config: &Qwen3Config) -> Vec<ParamSpec> {
    let (h, i, d) = (config.hidden_size, config.intermediate_size, config.head_dim);
    let (q, kv) = (config.num_attention_heads * d, config.num_key_value_heads * d);
    let spec = |name: String, shape: Vec<usize>, kind| ParamSpec { name, shape, kind };
    let mut specs = vec![spec(
        "model.embed_tokens.weight".into(),
        vec![config.vocab_size, h],
        ParamKind::Embedding,
    )];
    for l in 0..config.num_hidden_layers {
        let p = format!("model.layers.{l}");
        specs.extend([
            spec(format!("{p}.input_layernorm.weight"), vec![h], ParamKind::Norm),
            spec(format!("{p}.self_attn.q_proj.weight"), vec![q, h], ParamKind::Linear),
            spec(format!("{p}.self_attn.k_proj.weight"), vec![kv, h], ParamKind::Linear),
            spec(format!("{p}.self_attn.v_proj.weight"), vec![kv, h], ParamKind::Linear),
            spec(format!("{p}.self_attn.o_proj.weight"), vec![h, q], ParamKind::Linear),
            spec(format!("{p}.self_attn.q_norm.weight"), vec![d], ParamKind::Norm),
            spec(format!("{p}.self_attn.k_norm.weight"), vec![d], ParamKind::Norm),
            spec(format!("{p}.post_attention_layernorm.weight"), vec![h], ParamKind::Norm),
            spec(format!("{p}.mlp.gate_proj.weight"), vec![i, h], ParamKind::Linear),
            spec(format!("{p}.mlp.up_proj.weight"), vec![i, h], ParamKind::Linear),
            spec(format!("{p}.mlp.down_proj.weight"), vec![h, i], ParamKind::Linear),
        ]);
    }
    specs.push(spec("model.norm.weight".into(), vec![h], ParamKind::Norm));
    if !config.tie_word_embeddings {
        specs.push(spec(
            "lm_head.weight".into(),
            vec![config.vocab_size, h],
            ParamKind::Linear,
        ));
    }
    specs
}

/// Loads `dir/config.json` and the weights next to it onto `device`, after finishing a write of
/// the directory that was killed between its renames ([`crate::publish`]).
pub fn load_pretrained<B: Backend>(
    dir: &Path,
    device: &B::Device,
    options: LoadOptions,
) -> Result<Qwen3ForCausalLM<B>, ModelError> {
    crate::publish::finish_interrupted(dir)?;
    let config = Qwen3Config::from_file(&dir.join("config.json"))?;
    let checkpoint = Checkpoint::open(dir)?;
    from_checkpoint(config, &checkpoint, device, options)
}

/// Builds the model from an opened checkpoint, checking every tensor's presence and shape.
/// A tied config ignores a stray `lm_head.weight`; an untied one requires it.
pub fn from_checkpoint<B: Backend>(
    config: Qwen3Config,
    checkpoint: &Checkpoint,
    device: &B::Device,
    options: LoadOptions,
) -> Result<Qwen3ForCausalLM<B>, ModelError> {
    let dtype = options.dtype;
    if !B::supports_dtype(device, dtype) {
        return Err(ModelError::Input(format!("the {} backend cannot hold {dtype:?} weights: use f32", B::name(device))));
    }
    if cpu_kernels::is_flex_backend::<B>() {
        check_weights_fit(&config, dtype, crate::host_memory::total_ram_bytes())?;
    }
    check_every_tensor_is_used(&config, checkpoint)?;
    assemble(config, device, options, |spec| {
        checkpoint.with_raw(&spec.name, &spec.shape, |raw| device_data(raw, spec.kind, dtype))
    })
}

/// Refuses weights that alone take more than the `ram` of the machine they would be loaded into
/// as `dtype` (the CPU backend's), which would otherwise end in a failed allocation part of the
/// way through; unknown RAM lets them through.
fn check_weights_fit(config: &Qwen3Config, dtype: DType, ram: Option<u64>) -> Result<(), ModelError> {
    let needed = config.num_parameters() as u64 * dtype.size() as u64;
    match ram {
        Some(ram) if needed > ram => {
            Err(ModelError::TooLarge { needed_gib: needed as f64 / GIB, dtype, ram_gib: ram as f64 / GIB })
        }
        _ => Ok(()),
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// Refuses a checkpoint that holds tensors `config` does not use (a `config.json` that does not
/// match its weights, such as fewer layers than they have), which loading would otherwise leave
/// out unseen. A tied config's `lm_head.weight` and the RoPE `inv_freq` buffers older
/// checkpoints carry are no weights of the model.
fn check_every_tensor_is_used(config: &Qwen3Config, checkpoint: &Checkpoint) -> Result<(), ModelError> {
    let used: std::collections::HashSet<String> = parameter_specs(config).into_iter().map(|s| s.name).collect();
    let unused: Vec<String> = checkpoint
        .names()
        .into_iter()
        .filter(|n| !used.contains(n) && n != "lm_head.weight" && !n.ends_with("rotary_emb.inv_freq"))
        .collect();
    if unused.is_empty() {
        return Ok(());
    }
    Err(ModelError::UnusedTensors {
        dir: checkpoint.dir().to_path_buf(),
        count: unused.len(),
        layers: config.num_hidden_layers,
        examples: unused.iter().take(3).map(|n| format!("\"{n}\"")).collect::<Vec<_>>().join(", "),
    })
}

/// `model` with every weight cast to `dtype` (activations follow the weights' dtype), as
/// [`load_pretrained`] with that dtype would have placed them (f32 to bf16 rounds to nearest,
/// ties to even): e.g. a bf16 copy of an f32 policy for rollouts. Parameter ids are kept.
pub fn with_dtype<B: Backend>(model: Qwen3ForCausalLM<B>, dtype: DType) -> Qwen3ForCausalLM<B> {
    struct Cast(DType, cpu_kernels::Kernels);
    impl<B: Backend> ModuleMapper<B> for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            Param::from_mapped_value(id, crate::kernels::cast(self.1, tensor, self.0), mapper)
        }
    }
    let cpu_kernels = model.model.compute.cpu_kernels;
    model.restacked_after(|model| model.map(&mut Cast(dtype, cpu_kernels)))
}

/// Builds the model from host tensors supplied in HF layout by `fetch`.
pub fn build<B: Backend>(
    config: Qwen3Config,
    device: &B::Device,
    options: LoadOptions,
    mut fetch: impl FnMut(&ParamSpec) -> Result<HostTensor, ModelError>,
) -> Result<Qwen3ForCausalLM<B>, ModelError> {
    assemble(config, device, options, |spec| {
        let host = fetch(spec)?;
        let host = match spec.kind {
            ParamKind::Linear => transpose(host),
            ParamKind::Embedding | ParamKind::Norm => host,
        };
        Ok(TensorData::new(host.values, host.shape))
    })
}

/// Assembles the model from `data`, which gives each tensor of [`parameter_specs`] in burn
/// layout and any float dtype (`from_data` converts it to `dtype`).
fn assemble<B: Backend>(
    config: Qwen3Config,
    device: &B::Device,
    LoadOptions { dtype, compute }: LoadOptions,
    mut data: impl FnMut(&ParamSpec) -> Result<TensorData, ModelError>,
) -> Result<Qwen3ForCausalLM<B>, ModelError> {
    let specs = parameter_specs(&config);
    let mut specs = specs.iter();
    // Each tensor travels with the id of its parameter, derived from its HF name.
    let mut next = |expected: ParamKind| -> Result<(ParamId, TensorData), ModelError> {
        let spec = specs.next().expect("specs cover every parameter");
        debug_assert_eq!(spec.kind, expected);
        Ok((param_id(&spec.name), data(spec)?))
    };
    let matrix = |(id, data): (ParamId, TensorData)| -> Param<Tensor<B, 2>> {
        Param::initialized(id, Tensor::from_data(data, (device, dtype)).require_grad())
    };
    let vector = |(id, data): (ParamId, TensorData)| -> Param<Tensor<B, 1>> {
        Param::initialized(id, Tensor::from_data(data, (device, dtype)).require_grad())
    };
    let linear = |t| Linear {
        weight: matrix(t),
        bias: None,
    };
    let eps = config.rms_norm_eps;
    let norm = |t| Qwen3RMSNorm {
        weight: vector(t),
        variance_epsilon: eps,
    };

    let embed_tokens = Embedding {
        weight: matrix(next(ParamKind::Embedding)?),
    };
    let mut layers = Vec::with_capacity(config.num_hidden_layers);
    for _ in 0..config.num_hidden_layers {
        let input_layernorm = norm(next(ParamKind::Norm)?);
        let q_proj = linear(next(ParamKind::Linear)?);
        let k_proj = linear(next(ParamKind::Linear)?);
        let v_proj = linear(next(ParamKind::Linear)?);
        let o_proj = linear(next(ParamKind::Linear)?);
        let q_norm = norm(next(ParamKind::Norm)?);
        let k_norm = norm(next(ParamKind::Norm)?);
        let post_attention_layernorm = norm(next(ParamKind::Norm)?);
        let mlp = Qwen3MLP {
            gate_proj: linear(next(ParamKind::Linear)?),
            up_proj: linear(next(ParamKind::Linear)?),
            down_proj: linear(next(ParamKind::Linear)?),
            gate_up_proj: None,
        };
        layers.push(Qwen3DecoderLayer {
            self_attn: Qwen3Attention {
                q_proj,
                k_proj,
                v_proj,
                o_proj,
                q_norm,
                k_norm,
                num_heads: config.num_attention_heads,
                num_key_value_heads: config.num_key_value_heads,
                head_dim: config.head_dim,
                qkv_proj: None,
            },
            mlp,
            input_layernorm,
            post_attention_layernorm,
        });
    }
    let final_norm = norm(next(ParamKind::Norm)?);
    let lm_head = if config.tie_word_embeddings {
        None
    } else {
        Some(matrix(next(ParamKind::Linear)?))
    };
    Ok(Qwen3ForCausalLM {
        model: Qwen3Model {
            embed_tokens,
            layers,
            norm: final_norm,
            rotary_emb: Qwen3RotaryEmbedding::new(config.head_dim, config.rope_theta),
            compute,
        },
        lm_head,
        config,
    })
}

fn lin<B: Backend>(l: &Linear<B>) -> NamedParam<'_, B> {
    NamedParam::Matrix(&l.weight, ParamKind::Linear)
}

/// The parameter id of an HF tensor name (FNV-1a of the name): the same on every load, so that
/// optimiser state saved with a checkpoint finds its parameters again after a reload.
pub fn param_id(name: &str) -> ParamId {
    let hash = name
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    ParamId::from(hash)
}

/// A row-major `[rows, cols]` matrix laid out as `[cols, rows]`.
pub(crate) fn transpose_values(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    relayout(values, rows, cols, true, |v| v)
}

/// `[rows, cols]` → `[cols, rows]`.
fn transpose(t: HostTensor) -> HostTensor {
    let (rows, cols) = (t.shape[0], t.shape[1]);
    HostTensor {
        shape: vec![cols, rows],
        values: relayout(&t.values, rows, cols, true, |v| v),
    }
}

/// An element type the loader builds device tensors in, straight from checkpoint storage, with
/// the same rounding as converting through f32 (`half`'s, round to nearest even).
trait LoadElem: Copy + Send + Sync + bytemuck::NoUninit {
    /// The dtype of a buffer of these.
    const DTYPE: DType;
    /// All-zero bits, so that a fresh buffer comes zeroed from the allocator.
    const ZERO: Self;
    fn from_bf16(bits: u16) -> Self;
    fn from_f16(bits: u16) -> Self;
    fn from_f32(value: f32) -> Self;
}

impl LoadElem for f32 {
    const DTYPE: DType = DType::F32;
    const ZERO: Self = 0.0;
    fn from_bf16(bits: u16) -> Self {
        half::bf16::from_bits(bits).to_f32()
    }
    fn from_f16(bits: u16) -> Self {
        half::f16::from_bits(bits).to_f32()
    }
    fn from_f32(value: f32) -> Self {
        value
    }
}

/// bf16 held as its bit pattern.
impl LoadElem for u16 {
    const DTYPE: DType = DType::BF16;
    const ZERO: Self = 0;
    /// The bits unchanged, except that a NaN gets its quiet bit, as a round trip through f32
    /// (`half`'s) gives it.
    fn from_bf16(bits: u16) -> Self {
        if bits & 0x7FFF > 0x7F80 {
            bits | 0x0040
        } else {
            bits
        }
    }
    fn from_f16(bits: u16) -> Self {
        half::bf16::from_f32(half::f16::from_bits(bits).to_f32()).to_bits()
    }
    fn from_f32(value: f32) -> Self {
        half::bf16::from_f32(value).to_bits()
    }
}

/// One stored tensor in burn layout (Linear weights transposed): in bf16 or f32 when `dtype`
/// is one of those, else in f32 for `from_data` to convert.
fn device_data(raw: RawTensor<'_>, kind: ParamKind, dtype: DType) -> TensorData {
    match dtype {
        DType::BF16 => relayout_raw::<u16>(raw, kind),
        _ => relayout_raw::<f32>(raw, kind),
    }
}

fn relayout_raw<T: LoadElem>(raw: RawTensor<'_>, kind: ParamKind) -> TensorData {
    let (rows, cols, shape) = match (kind, raw.shape) {
        (ParamKind::Linear, &[rows, cols]) => (rows, cols, vec![cols, rows]),
        _ => (1, raw.shape.iter().product(), raw.shape.to_vec()),
    };
    let transpose = kind == ParamKind::Linear;
    let values: Vec<T> = match raw.dtype {
        StorageDtype::BF16 => relayout(&words(raw.bytes), rows, cols, transpose, |b: u16| {
            T::from_bf16(u16::from_le(b))
        }),
        StorageDtype::F16 => relayout(&words(raw.bytes), rows, cols, transpose, |b: u16| {
            T::from_f16(u16::from_le(b))
        }),
        StorageDtype::F32 => relayout(&words(raw.bytes), rows, cols, transpose, |w: u32| {
            T::from_f32(f32::from_bits(u32::from_le(w)))
        }),
    };
    TensorData::from_bytes(Bytes::from_elems(values), shape, T::DTYPE)
}

/// Stored bytes as words, borrowed where aligned (copied where not).
fn words<W: bytemuck::Pod>(bytes: &[u8]) -> Cow<'_, [W]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(words) => Cow::Borrowed(words),
        Err(_) => Cow::Owned(
            bytes
                .chunks_exact(size_of::<W>())
                .map(bytemuck::pod_read_unaligned)
                .collect(),
        ),
    }
}

/// The row-major `[rows, cols]` matrix `src` converted by `conv`, laid out as `[cols, rows]`
/// when `transpose`; in parallel.
fn relayout<S: Copy + Sync, T: LoadElem>(
    src: &[S],
    rows: usize,
    cols: usize,
    transpose: bool,
    conv: impl Fn(S) -> T + Sync,
) -> Vec<T> {
    const CHUNK: usize = 1 << 16;
    assert_eq!(src.len(), rows * cols, "matrix size");
    let mut out = vec![T::ZERO; src.len()];
    if transpose {
        transpose_into(src, rows, cols, &mut out, conv);
    } else {
        out.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(out, src)| {
            for (o, s) in out.iter_mut().zip(src) {
                *o = conv(*s);
            }
        });
    }
    out
}

/// A parameter of the model under its HF name, in burn layout (see [`ParamKind`]).
pub enum NamedParam<'a, B: Backend> {
    Matrix(&'a Param<Tensor<B, 2>>, ParamKind),
    Vector(&'a Param<Tensor<B, 1>>),
}

/// Every parameter of the model with its HF name, in [`parameter_specs`] order (tied heads are
/// not listed twice).
pub fn named_parameters<B: Backend>(model: &Qwen3ForCausalLM<B>) -> Vec<(String, NamedParam<'_, B>)> {
    let mut out = vec![(
        "model.embed_tokens.weight".to_owned(),
        NamedParam::Matrix(&model.model.embed_tokens.weight, ParamKind::Embedding),
    )];
    for (i, layer) in model.model.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let a = &layer.self_attn;
        out.extend([
            (format!("{p}.input_layernorm.weight"), NamedParam::Vector(&layer.input_layernorm.weight)),
            (format!("{p}.self_attn.q_proj.weight"), lin(&a.q_proj)),
            (format!("{p}.self_attn.k_proj.weight"), lin(&a.k_proj)),
            (format!("{p}.self_attn.v_proj.weight"), lin(&a.v_proj)),
            (format!("{p}.self_attn.o_proj.weight"), lin(&a.o_proj)),
            (format!("{p}.self_attn.q_norm.weight"), NamedParam::Vector(&a.q_norm.weight)),
            (format!("{p}.self_attn.k_norm.weight"), NamedParam::Vector(&a.k_norm.weight)),
            (
                format!("{p}.post_attention_layernorm.weight"),
                NamedParam::Vector(&layer.post_attention_layernorm.weight),
            ),
            (format!("{p}.mlp.gate_proj.weight"), lin(&layer.mlp.gate_proj)),
            (format!("{p}.mlp.up_proj.weight"), lin(&layer.mlp.up_proj)),
            (format!("{p}.mlp.down_proj.weight"), lin(&layer.mlp.down_proj)),
        ]);
    }
    out.push(("model.norm.weight".to_owned(), NamedParam::Vector(&model.model.norm.weight)));
    if let Some(head) = &model.lm_head {
        out.push(("lm_head.weight".to_owned(), NamedParam::Matrix(head, ParamKind::Linear)));
    }
    out
}

/// Converts a burn-layout tensor of the given kind back to HF layout on the host.
pub fn to_hf_layout<B: Backend, const D: usize>(tensor: Tensor<B, D>, kind: ParamKind) -> HostTensor {
    let shape = tensor.dims().to_vec();
    let values: Vec<f32> = tensor
        .cast(DType::F32)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .expect("f32 data after conversion");
    let host = HostTensor { shape, values };
    match kind {
        ParamKind::Linear => transpose(host),
        ParamKind::Embedding | ParamKind::Norm => host,
    }
}

/// Writes `config.json` and `model.safetensors` for the model into `dir` (created if needed),
/// one tensor at a time.
pub fn save_pretrained<B: Backend>(
    model: &Qwen3ForCausalLM<B>,
    dir: &Path,
    dtype: StorageDtype,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|source| ModelError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let params = named_parameters(model);
    let entries: Vec<(String, Vec<usize>)> = params
        .iter()
        .map(|(name, p)| {
            let shape = match p {
                NamedParam::Matrix(t, ParamKind::Linear) => {
                    let [i, o] = t.val().dims();
                    vec![o, i]
                }
                NamedParam::Matrix(t, _) => t.val().dims().to_vec(),
                NamedParam::Vector(t) => t.val().dims().to_vec(),
            };
            (name.clone(), shape)
        })
        .collect();
    crate::checkpoint::write_safetensors_with(dir, &entries, dtype, |name| {
        let (_, param) = params.iter().find(|(n, _)| n == name).expect("named above");
        Ok(match param {
            NamedParam::Matrix(p, kind) => to_hf_layout(p.val(), *kind).values,
            NamedParam::Vector(p) => to_hf_layout(p.val(), ParamKind::Norm).values,
        })
    })?;
    write_config(&model.config, dir, dtype)
}

/// Writes `config.json` (both transformers key styles) with the storage dtype recorded.
pub fn write_config(config: &Qwen3Config, dir: &Path, dtype: StorageDtype) -> Result<(), ModelError> {
    let mut config = config.clone();
    config.dtype = Some(
        match dtype {
            StorageDtype::F32 => "float32",
            StorageDtype::BF16 => "bfloat16",
            StorageDtype::F16 => "float16",
        }
        .to_owned(),
    );
    let json = serde_json::to_string_pretty(&config.to_hf_json()).expect("config serialises");
    crate::checkpoint::write_atomic(&dir.join("config.json"), json.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive_transpose<T: Copy>(src: &[T], rows: usize, cols: usize) -> Vec<T> {
        (0..rows * cols).map(|k| src[(k % rows) * cols + k / rows]).collect()
    }

    /// Deterministic bit patterns covering every exponent, NaNs and infinities included, led by
    /// special cases: signalling NaNs, ties to even and subnormals, as f32 and as 16 bits.
    fn bits(n: usize, seed: u64) -> Vec<u32> {
        let special = [0x7F81, 0x7F80_0001, 0x3F80_8000, 0x3F81_8000, 0xFFC1, 0xFC01, u32::MAX];
        let mut x = seed;
        let random = std::iter::repeat_with(move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u32
        });
        special.into_iter().chain(random).take(n).collect()
    }

    /// Weights larger than the machine's memory are refused with their size and the machine's,
    /// before any is read; those that fit, or where the memory is unknown, pass.
    #[test]
    fn weights_larger_than_the_machine_are_refused() {
        let qwen3_8b = crate::Preset::Qwen3_8B.config(0, vec![]);
        let err = check_weights_fit(&qwen3_8b, DType::F32, Some(16 << 30)).unwrap_err().to_string();
        assert!(err.contains("the weights take 30.5 GiB as F32") && err.contains("16.0 GiB") && err.contains("bf16 takes half"), "{err}");
        check_weights_fit(&qwen3_8b, DType::BF16, Some(32 << 30)).unwrap();
        check_weights_fit(&qwen3_8b, DType::F32, None).unwrap();
    }

    #[test]
    fn parallel_transpose_matches_naive() {
        let shapes = [(37, 91), (91, 37), (8, 8), (1, 300), (300, 1), (7, 129), (16, 257)];
        for (rows, cols) in shapes.into_iter().chain([(129, 300), (0, 5)]) {
            let src: Vec<u32> = bits(rows * cols, 7);
            let expected: Vec<u16> =
                naive_transpose(&src, rows, cols).iter().map(|&w| w as u16).collect();
            assert_eq!(relayout(&src, rows, cols, true, |w| w as u16), expected, "{rows}x{cols}");
            let host = HostTensor {
                shape: vec![rows, cols],
                values: src.iter().map(|&w| f32::from_bits(w)).collect(),
            };
            let t = transpose(host.clone());
            assert_eq!(t.shape, vec![cols, rows]);
            let expected = naive_transpose(&host.values, rows, cols);
            assert!(t.values.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    /// The loader before direct conversion: f32 values in HF layout, transposed, then converted
    /// to the device dtype by `TensorData`.
    fn through_f32(raw: RawTensor<'_>, kind: ParamKind, dtype: DType) -> TensorData {
        let (b, s) = (raw.bytes, raw.shape);
        let values: Vec<f32> = match raw.dtype {
            StorageDtype::F32 => {
                b.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
            }
            StorageDtype::BF16 => {
                b.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
            }
            StorageDtype::F16 => {
                b.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
            }
        };
        let (values, shape) = match (kind, s) {
            (ParamKind::Linear, &[r, c]) => (naive_transpose(&values, r, c), vec![c, r]),
            _ => (values, s.to_vec()),
        };
        TensorData::new(values, shape).convert_dtype(dtype)
    }

    #[test]
    fn direct_conversion_is_bit_identical_to_going_through_f32() {
        for storage in [StorageDtype::F32, StorageDtype::BF16, StorageDtype::F16] {
            let kinds = [
                (ParamKind::Linear, vec![37, 91]),
                (ParamKind::Embedding, vec![13, 21]),
                (ParamKind::Norm, vec![91]),
            ];
            for (kind, shape) in kinds {
                let mut payload = Vec::new();
                for w in bits(shape.iter().product(), 11) {
                    match storage {
                        StorageDtype::F32 => payload.extend_from_slice(&w.to_le_bytes()),
                        _ => payload.extend_from_slice(&(w as u16).to_le_bytes()),
                    }
                }
                // The payload at a 4-aligned offset, then at an odd one (copied as words).
                for offset in [4, 1] {
                    let mut backing = vec![0u32; payload.len() / 4 + 2];
                    let buffer: &mut [u8] = bytemuck::cast_slice_mut(&mut backing);
                    let bytes = &mut buffer[offset..offset + payload.len()];
                    bytes.copy_from_slice(&payload);
                    let raw = RawTensor { dtype: storage, shape: &shape, bytes: &*bytes };
                    for dtype in [DType::F32, DType::BF16, DType::F16] {
                        let got = device_data(raw, kind, dtype).convert_dtype(dtype);
                        let expected = through_f32(raw, kind, dtype);
                        let case = format!("{storage:?} {kind:?} {dtype:?} at offset {offset}");
                        assert_eq!(got.dtype, expected.dtype, "{case}");
                        assert_eq!(got.shape, expected.shape, "{case}");
                        assert_eq!(got.as_bytes(), expected.as_bytes(), "{case}");
                    }
                }
            }
        }
    }

    /// An f32 model cast to bf16 holds the same weights and computes the same logits as the
    /// checkpoint loaded in bf16.
    #[test]
    fn with_dtype_equals_loading_in_that_dtype() {
        use burn::backend::Flex;
        use burn::tensor::Int;
        let config = crate::config::Preset::Tiny.config(300, vec![299]);
        let dir = tempfile::tempdir().unwrap();
        crate::init::write_random_checkpoint(&config, dir.path(), 3, StorageDtype::F32).unwrap();
        let device = Default::default();
        let f32_model = load_pretrained::<Flex>(dir.path(), &device, LoadOptions::default()).unwrap();
        let cast = with_dtype(f32_model, DType::BF16);
        let loaded = load_pretrained::<Flex>(dir.path(), &device, LoadOptions { dtype: DType::BF16, ..Default::default() }).unwrap();
        let ids = Tensor::<Flex, 2, Int>::from_ints([[1, 5, 9, 200, 7]], &device);
        let positions = Tensor::<Flex, 2, Int>::from_ints([[0, 1, 2, 3, 4]], &device);
        let logits = |m: &Qwen3ForCausalLM<Flex>| {
            let out = m.forward(ids.clone(), positions.clone(), None, None);
            assert_eq!(out.dtype(), DType::BF16);
            out.into_data().convert::<f32>().to_vec::<f32>().unwrap()
        };
        assert_eq!(logits(&cast), logits(&loaded));
    }
}
