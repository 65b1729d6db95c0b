//! Weight import and export: the map between HF tensor names (`model.layers.0.self_attn.q_proj.
//! weight`, ...) and the parameters of [`Qwen3ForCausalLM`]. Linear weights are `[out, in]` in
//! HF files and `[in, out]` in burn; the transpose happens here, once, on the host.

use std::path::Path;

use burn::module::{Param, ParamId};
use burn::nn::{Embedding, Linear};
use burn::tensor::{backend::Backend, DType, Tensor, TensorData};

use crate::checkpoint::{Checkpoint, HostTensor, StorageDtype};
use crate::config::Qwen3Config;
use crate::error::ModelError;
use crate::qwen3::{
    Qwen3Attention, Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3MLP, Qwen3Model, Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
};

/// How a checkpoint is placed on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    /// The dtype the weights (and so the activations) use on the device. f32 by default; bf16
    /// halves memory and, on GPUs, doubles matmul speed.
    pub dtype: DType,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self { dtype: DType::F32 }
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

/// Loads `dir/config.json` and the weights next to it onto `device`.
pub fn load_pretrained<B: Backend>(
    dir: &Path,
    device: &B::Device,
    options: LoadOptions,
) -> Result<Qwen3ForCausalLM<B>, ModelError> {
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
    build(config, device, options, |spec| {
        checkpoint.read(&spec.name, &spec.shape)
    })
}

/// Builds the model from host tensors supplied in HF layout by `fetch`.
pub fn build<B: Backend>(
    config: Qwen3Config,
    device: &B::Device,
    options: LoadOptions,
    mut fetch: impl FnMut(&ParamSpec) -> Result<HostTensor, ModelError>,
) -> Result<Qwen3ForCausalLM<B>, ModelError> {
    let specs = parameter_specs(&config);
    let mut specs = specs.iter();
    // Each host tensor travels with the id of its parameter, derived from its HF name.
    let mut next = |expected: ParamKind| -> Result<(ParamId, HostTensor), ModelError> {
        let spec = specs.next().expect("specs cover every parameter");
        debug_assert_eq!(spec.kind, expected);
        let host = fetch(spec)?;
        let host = match spec.kind {
            ParamKind::Linear => transpose(host),
            ParamKind::Embedding | ParamKind::Norm => host,
        };
        Ok((param_id(&spec.name), host))
    };
    let dtype = options.dtype;
    let matrix = |(id, t): (ParamId, HostTensor)| -> Param<Tensor<B, 2>> {
        let tensor = Tensor::from_data(TensorData::new(t.values, t.shape), (device, dtype));
        Param::initialized(id, tensor.require_grad())
    };
    let vector = |(id, t): (ParamId, HostTensor)| -> Param<Tensor<B, 1>> {
        let tensor = Tensor::from_data(TensorData::new(t.values, t.shape), (device, dtype));
        Param::initialized(id, tensor.require_grad())
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

/// `[rows, cols]` → `[cols, rows]`, in cache-sized tiles.
fn transpose(t: HostTensor) -> HostTensor {
    const TILE: usize = 64;
    let (rows, cols) = (t.shape[0], t.shape[1]);
    let mut values = vec![0.0f32; rows * cols];
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for c in c0..(c0 + TILE).min(cols) {
                    values[c * rows + r] = t.values[r * cols + c];
                }
            }
        }
    }
    HostTensor {
        shape: vec![cols, rows],
        values,
    }
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
