//! The terms of each phase of a step, as the code runs it: what lives throughout, the rollouts
//! (the rollout weights, the KV cache, a chunked prefill pass), scoring, and the update's
//! moments; with the largest tensors of each, whose whole pages CubeCL reserves on CUDA.

use burn::tensor::DType;
use model::logprobs::LOGITS_CHUNK_ELEMENTS;
use model::lora::LoraTarget;

use super::activations;
use super::attention::AttentionPath;
use super::{
    dtype_bytes, dtype_name, format_size, kv_position_bytes, ComputePath, CudaPages, Phase, PlanDevice, PlanSettings,
    TensorGroup, Term, TooLarge, F32, HOST_BYTES_PER_EPISODE_TOKEN,
};

/// Weights, adapters, AdamW's moments, the KL reference and the runtime.
pub(super) fn persistent_terms(s: &PlanSettings) -> Vec<Term> {
    let params = s.model.num_parameters() as f64;
    let trainable = s.trainable_parameters() as f64;
    let mut terms = Vec::new();
    match &s.lora {
        None => terms.push(Term::new("policy weights (f32, trained)", params * F32)),
        Some(lora) => {
            let base = format!("base weights ({}, frozen)", dtype_name(s.base_dtype));
            terms.push(Term::new(base, params * dtype_bytes(s.base_dtype)));
            terms.push(Term::new(
                format!("LoRA adapters (f32, rank {})", lora.rank),
                trainable * F32,
            ));
        }
    }
    terms.push(Term::new("AdamW moments (2 × f32)", trainable * 2.0 * F32));
    if s.kl && s.lora.is_none() {
        let name = format!(
            "KL reference (the initial policy in {})",
            dtype_name(s.rollout_dtype)
        );
        terms.push(Term::new(name, params * dtype_bytes(s.rollout_dtype)));
    }
    terms.push(Term::new("runtime", s.device.runtime() as f64));
    terms
}

/// The rollouts as `model::Decoder` runs them (see the module docs): the rollout copy (or the
/// merged adapted weights), the KV
/// cache of the episodes decoding at once at the full context (or the KV budget), and one
/// chunked prefill pass. None of them with rollouts on workers: the phase then only names them.
pub(super) fn rollout_phase(s: &PlanSettings) -> Phase {
    if let Some(workers) = s.rollout.workers {
        return Phase {
            name: format!(
                "rollouts: on {workers} worker{} ([rollout.servers]); their memory is the workers' \
                 (plan them with `plan --config` of a local run, or the server's own limits)",
                if workers == 1 { "" } else { "s" }
            ),
            terms: Vec::new(),
        };
    }
    let mut terms = rollout_weight_terms(s);
    terms.extend(decoder_terms(s));
    Phase {
        name: "rollouts".into(),
        terms,
    }
}

/// The weights the rollouts sample from beside the policy's: a bf16 copy, or the adapted
/// weights with the LoRA merged.
fn rollout_weight_terms(s: &PlanSettings) -> Vec<Term> {
    let params = s.model.num_parameters() as f64;
    let mut terms = Vec::new();
    // `rollout.dtype = "bf16"` samples from a bf16 copy of the weights made for the rollouts
    // (none when they are bf16 already); "f32" from the policy's weights as they are.
    let bf16_copy = s.rollout_dtype == DType::BF16 && s.weights_dtype() != DType::BF16;
    if bf16_copy {
        terms.push(Term::new(
            "rollout copy of the weights (bf16)",
            params * 2.0,
        ));
    }
    // `rollout.merge_lora` merges the adapters into new weights of the base's dtype, which live
    // beside the base while the rollouts run. Where a bf16 copy is made, the merged weights are
    // part of it (merged in f32, then cast with the rest, before any KV cache is taken).
    if let Some(adapted) = s.adapted_parameters().filter(|_| s.merge_lora && !bf16_copy) {
        let dtype = s.weights_dtype();
        terms.push(Term::new(
            format!("adapted weights with the LoRA merged ({})", dtype_name(dtype)),
            adapted as f64 * dtype_bytes(dtype),
        ));
    }
    terms
}

/// What the rollouts' decoder holds beside the weights: the KV cache (every episode in flight
/// at the full context, or the budget), one layer's keys and values gathered where burn's ops
/// attend, and one chunked prefill pass.
fn decoder_terms(s: &PlanSettings) -> Vec<Term> {
    let per_position = kv_position_bytes(&s.model, s.rollout_cache_dtype()) as f64;
    let (positions, budgeted) = s.rollout_kv_positions();
    let name = match s.rollout.kv_budget {
        Some(budget) if budgeted => format!("KV cache (budget {})", format_size(budget)),
        _ => format!(
            "KV cache ({} episodes × {} positions, the pool grown by an eighth)",
            s.generation_batch.max(1),
            grouped(s.episode_kv_positions())
        ),
    };
    let mut terms = vec![Term::new(name, positions as f64 * per_position)];
    terms.extend(decoder_step_terms(s));
    terms
}

/// What a step of the rollouts' decoder holds beside its KV cache: one layer's keys and values
/// gathered where burn's ops attend, and one chunked prefill pass.
pub(super) fn decoder_step_terms(s: &PlanSettings) -> Vec<Term> {
    let m = &s.model;
    let mut terms = Vec::new();
    let cache_dtype = s.rollout_cache_dtype();
    let act = dtype_bytes(cache_dtype);
    let per_position = kv_position_bytes(m, cache_dtype) as f64;
    let rows = s.rollout_rows();
    // Burn's ops gather a pass's rows' keys and values one layer at a time (it has no paged
    // attention), and a GPU's prefill passes take them unless `--device-kernels all`; the CPU
    // kernels and the GPU's paged-attention kernel read them where they lie.
    let paged_kernel = s.paged_attention_kernel();
    if s.device != PlanDevice::CpuKernels && !paged_kernel {
        terms.push(Term::new(
            format!("keys and values of one layer gathered for {rows} × {} positions", grouped(s.context)),
            (rows * s.context) as f64 * per_position / m.num_hidden_layers.max(1) as f64,
        ));
    }
    // The decoder cuts a prefill into chunks of `max_batched_tokens / rows` new positions a row;
    // the last chunk of the longest turn attends over the whole context. The GPU's kernel
    // (`--device-kernels all`) holds no scores and no mask beyond a row of valid keys.
    let chunk = (s.rollout.max_batched_tokens / rows).clamp(1, s.context.max(1));
    let (rows_f, chunk_f) = (rows as f64, chunk as f64);
    let prefill = if paged_kernel {
        forward_activations(s, rows_f, chunk_f, act)
    } else {
        inference_forward(s, rows_f, chunk_f, s.context as f64, act)
    };
    terms.push(Term::new(
        format!(
            "prefill pass of {rows} × {} new tokens over {} positions",
            grouped(chunk),
            grouped(s.context)
        ),
        prefill,
    ));
    terms
}

/// The rollouts' largest tensors alive at once, for [`CudaPages`]: each layer's pools of keys
/// and of values at the plan's KV positions, and a prefill pass's three intermediate-wide
/// temporaries ([`activations::layer_transient`]). None with rollouts on workers.
pub(super) fn rollout_tensors(s: &PlanSettings) -> Vec<TensorGroup> {
    if s.rollout.workers.is_some() {
        return Vec::new();
    }
    decoder_tensors(s, s.rollout_kv_positions().0)
}

/// [`rollout_tensors`] with a KV pool of `positions`.
pub(super) fn decoder_tensors(s: &PlanSettings, positions: usize) -> Vec<TensorGroup> {
    let m = &s.model;
    let dtype = s.rollout_cache_dtype();
    let pool = positions * m.num_key_value_heads * m.head_dim * dtype.size();
    let rows = s.rollout_rows();
    let pass = rows * (s.rollout.max_batched_tokens / rows).clamp(1, s.context.max(1));
    vec![
        TensorGroup { bytes: pool as u64, count: 2 * m.num_hidden_layers as u64 },
        TensorGroup { bytes: (pass * m.intermediate_size * dtype.size()) as u64, count: 3 },
    ]
}

/// Scoring's largest tensors: a micro-batch's three intermediate-wide temporaries in a layer,
/// in the weights' dtype.
pub(super) fn scoring_tensors(s: &PlanSettings) -> Vec<TensorGroup> {
    let tokens = s.micro_batch * s.context;
    let bytes = tokens * s.model.intermediate_size * s.weights_dtype().size();
    vec![TensorGroup { bytes: bytes as u64, count: 3 }]
}

/// The update's largest tensors, as [`activations`] reads them: the layer inputs checkpointing
/// keeps, the MLP's four intermediate-wide activations each kept layer holds (f32, or bf16 on a
/// bf16 base with an f32 copy of `down_proj`'s input for its adapter), and the three f32
/// intermediate-wide tensors of a layer's pass in flight.
pub(super) fn update_tensors(s: &PlanSettings) -> Vec<TensorGroup> {
    let m = &s.model;
    let tokens = (s.micro_batch * s.context) as u64;
    let wide = tokens * m.intermediate_size as u64;
    let layers = m.num_hidden_layers as u64;
    let kept_layers = if s.checkpointing { 1 } else { layers };
    let mut groups = vec![TensorGroup { bytes: wide * 4, count: 3 }];
    if s.checkpointing {
        let act = if s.path() == ComputePath::PortableBf16 { 2 } else { 4 };
        groups.push(TensorGroup { bytes: tokens * m.hidden_size as u64 * act, count: layers });
    }
    match (s.path(), &s.lora) {
        (ComputePath::PortableBf16, Some(lora)) => {
            groups.push(TensorGroup { bytes: wide * 2, count: 4 * kept_layers });
            let down = lora.targets.contains(&LoraTarget::DownProj);
            groups.push(TensorGroup { bytes: wide * 4, count: u64::from(down) * kept_layers });
        }
        _ => groups.push(TensorGroup { bytes: wide * 4, count: 4 * kept_layers }),
    }
    groups
}

/// What CubeCL's whole pages add on CUDA to a phase's largest tensors `groups`, as a term; a
/// tensor no page takes makes a term of the whole `memory`, so that the run cannot fit.
pub(super) fn page_term(pages: &CudaPages, memory: u64, groups: &[TensorGroup]) -> Option<Term> {
    // Tensors of one size counted together, largest first.
    let mut counts: Vec<(u64, u64)> = Vec::new();
    for g in groups.iter().filter(|g| g.count > 0) {
        match counts.iter_mut().find(|(bytes, _)| *bytes == g.bytes) {
            Some((_, count)) => *count += g.count,
            None => counts.push((g.bytes, g.count)),
        }
    }
    counts.sort_unstable_by(|a, b| b.cmp(a));
    let sizes = counts.iter().map(|(bytes, count)| format!("{count} × {}", format_size(*bytes))).collect::<Vec<_>>().join(", ");
    match pages.reserved(groups) {
        Ok(reserved) => {
            let tensors: u64 = groups.iter().map(|g| g.bytes * g.count).sum();
            (reserved > tensors).then(|| {
                Term::new(format!("CubeCL's pages on CUDA around {sizes}"), (reserved - tensors) as f64)
            })
        }
        Err(TooLarge { bytes, largest_page }) => Some(Term::new(
            format!(
                "a tensor of {} that CubeCL cannot allocate on CUDA (its largest page, a quarter of the GPU's memory, is {})",
                format_size(bytes),
                format_size(largest_page)
            ),
            memory as f64,
        )),
    }
}

/// `n` with its thousands grouped: `9,216`.
fn grouped(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The step's episodes on the host, at the full context ([`HOST_BYTES_PER_EPISODE_TOKEN`]).
pub(super) fn host_episodes_term(s: &PlanSettings) -> Term {
    Term::new(
        format!("the step's {} episodes on the host (tokens, log-probs, texts)", grouped(s.step_episodes)),
        s.step_episodes as f64 * s.context as f64 * HOST_BYTES_PER_EPISODE_TOKEN,
    )
}

/// The old and reference log-probs: a micro-batch at a time, without autodiff, on the
/// policy's weights.
pub(super) fn scoring_phase(s: &PlanSettings) -> Phase {
    let (b, c) = (s.micro_batch as f64, s.context as f64);
    let dims = s.dims();
    let act = dtype_bytes(s.weights_dtype());
    let chunk = logits_chunk_rows(s) * dims.vocab * act;
    // The GPU's kernel (`--device-kernels all`) attends without a cache as it does over one,
    // holding no scores and no causal blocks.
    let forward = if s.paged_attention_kernel() {
        forward_activations(s, b, c, act)
    } else {
        inference_forward(s, b, c, c, act)
    };
    let terms = vec![
        Term::new(
            format!(
                "forward of {} × {} tokens without autodiff",
                s.micro_batch, s.context
            ),
            forward,
        ),
        Term::new("a chunk of logits and its copy", 2.0 * chunk),
    ];
    Phase {
        name: "old and reference log-probs".into(),
        terms,
    }
}

/// The transient memory of a forward pass without autodiff over `rows × queries` new tokens
/// attending over `keys` keys (cached and new; `queries = keys` without a cache) with
/// activations of `act` bytes: the masks (built once per pass), the RoPE tables, one layer's
/// temporaries, and attention's transients.
fn inference_forward(s: &PlanSettings, rows: f64, queries: f64, keys: f64, act: f64) -> f64 {
    let path = s.device.path();
    s.masks(path, rows, queries, keys, act)
        + forward_activations(s, rows, queries, act)
        + s.attention_transient(path, rows, queries, keys, 2.0) * F32
}

/// What [`inference_forward`] holds besides attention's masks and transients: the RoPE tables
/// and one layer's temporaries for `rows × queries` new tokens.
pub(super) fn forward_activations(s: &PlanSettings, rows: f64, queries: f64, act: f64) -> f64 {
    let dims = s.dims();
    let tokens = rows * queries;
    let tables = tokens * activations::rotary_tables(dims, s.device == PlanDevice::CpuKernels) * act;
    tables + tokens * activations::layer_transient(dims) * act
}

/// Rows of one chunk of logits (`model::logprobs` forms `LOGITS_CHUNK_ELEMENTS` at most).
fn logits_chunk_rows(s: &PlanSettings) -> f64 {
    let (b, vocab) = (s.micro_batch, s.model.vocab_size);
    let positions = (LOGITS_CHUNK_ELEMENTS / (b * vocab))
        .max(1)
        .min(s.context.saturating_sub(1).max(1));
    (b * positions) as f64
}

/// The pieces of one micro-batch's update, in bytes.
struct UpdateParts {
    /// Every layer's kept activations.
    layers: f64,
    /// One layer's kept activations.
    one_layer: f64,
    /// The RoPE tables, kept for the backward pass.
    shared: f64,
    /// The attention masks of a pass (see [`PlanSettings::masks`]).
    masks: f64,
    /// What the backward pass keeps of them.
    masks_kept: f64,
    /// Kept by the head: the final norm's output, the gradient at it (its chunks and their
    /// concatenation) and the logits-sized tensors of the one chunk whose graph exists.
    head: f64,
    /// Logits-sized tensors of one chunk in flight.
    head_transient: f64,
    /// A layer's gradients and temporaries in flight, attention's included.
    layer_transient: f64,
    /// One hidden-state tensor `[b, len, hidden]`.
    hidden: f64,
    /// Gradients of the head's trained weights (embedding or `lm_head`).
    head_grads: f64,
    /// Gradients of every trained parameter.
    grads: f64,
    /// Gradients accumulated over earlier micro-batches of the mini-batch.
    accumulated: f64,
    /// The embedding's gradient table in flight, when the embedding is trained.
    embedding_grad: f64,
    /// The optimiser's temporaries.
    optimizer: f64,
}

fn update_parts(s: &PlanSettings) -> UpdateParts {
    let m = &s.model;
    let dims = s.dims();
    let path = s.path();
    let (b, len) = (s.micro_batch as f64, s.context as f64);
    let tokens = b * len;
    let layers = m.num_hidden_layers as f64;
    let attention = match s.attention_path(path) {
        AttentionPath::CpuKernel => activations::KeptAttention::CpuKernel,
        AttentionPath::Eager => activations::KeptAttention::Eager,
        AttentionPath::MemoryEfficient => activations::KeptAttention::MemoryEfficient,
    };
    let kept = activations::layer_kept(dims, path, attention, s.matmul, s.lora_activations());
    // A pass that is one block pair of the memory-efficient attention keeps its probabilities.
    let one_pair = attention == activations::KeptAttention::MemoryEfficient && {
        let (q, k) = s.attention_blocks(b, len, len);
        q >= len && k >= len
    };
    let per_token_key = kept.per_token_key + if one_pair { m.num_attention_heads as f64 } else { 0.0 };
    let one_layer = (tokens * kept.per_token + tokens * len * per_token_key) * F32;
    // Hidden states, RoPE tables and masks are in the activations' dtype.
    let act = match path {
        ComputePath::PortableBf16 => 2.0,
        ComputePath::CpuKernels | ComputePath::Portable => F32,
    };
    let table = dims.vocab * dims.hidden * F32;
    let full = s.lora.is_none();
    let grads = s.trainable_parameters() as f64 * F32;
    let largest_trained = if full { table } else { 0.0 };
    UpdateParts {
        layers: layers * one_layer,
        one_layer,
        shared: tokens * activations::rotary_tables(dims, s.device == PlanDevice::CpuKernels) * act,
        masks: s.masks(path, b, len, len, act),
        masks_kept: s.masks_kept(b, len, act),
        head: tokens * activations::head_kept_per_token(dims, path) * F32
            + logits_chunk_rows(s) * activations::head_kept_per_chunk_row(dims, s.entropy_grad) * F32
            + 2.0 * tokens * dims.hidden * act,
        head_transient: activations::head_transient_chunks(path)
            * logits_chunk_rows(s)
            * dims.vocab
            * F32,
        layer_transient: (tokens * activations::layer_transient(dims) + s.attention_transient(path, b, len, len, 1.0)) * F32,
        hidden: tokens * dims.hidden * act,
        head_grads: if full { table } else { 0.0 },
        grads,
        accumulated: if s.mini_batch > s.micro_batch {
            grads
        } else {
            0.0
        },
        embedding_grad: if full {
            embedding_grad_transient(s, table)
        } else {
            0.0
        },
        optimizer: match s.device {
            PlanDevice::Gpu | PlanDevice::GpuPagedPrefill => 5.0 * largest_trained.max(grads / layers.max(1.0)),
            _ => 0.0,
        },
    }
}

/// The embedding's gradient table in flight at the end of the backward pass, beyond the
/// gradients. The CPU kernel's backward adds rows into a fresh zeroed table, whose pages the
/// kernel only maps where it writes (the input tokens' rows); with tied embeddings burn adds
/// the head's gradient into that fresh table, writing all of it, while the checkpointed path
/// adds the fresh table into the head's gradient in place. burn's own backward (the portable
/// path) copies a zeroed table in `select_add`; on a GPU the zeroed table is memory too.
fn embedding_grad_transient(s: &PlanSettings, table: f64) -> f64 {
    match s.device {
        PlanDevice::CpuKernels if s.model.tie_word_embeddings && !s.checkpointing => table,
        PlanDevice::CpuKernels => 0.0,
        PlanDevice::CpuPortable => table,
        PlanDevice::Gpu | PlanDevice::GpuPagedPrefill => 2.0 * table,
    }
}

/// The update's worst moment (see the module docs), as terms.
pub(super) fn update_phase(s: &PlanSettings, checkpointing: bool) -> Phase {
    let (name, terms) = update_moments(s, checkpointing)
        .into_iter()
        .max_by_key(|(_, terms)| terms.iter().map(|t| t.bytes).sum::<u64>())
        .expect("moments");
    Phase { name, terms }
}

/// The update's moments of highest memory, each with what it holds.
fn update_moments(s: &PlanSettings, checkpointing: bool) -> Vec<(String, Vec<Term>)> {
    let p = update_parts(s);
    let layers = s.model.num_hidden_layers as f64;
    let acc = || Term::new("gradients accumulated over the mini-batch", p.accumulated);
    if checkpointing {
        vec![
            (
                "update, head's backward pass (checkpointed)".into(),
                vec![
                    acc(),
                    Term::new(
                        "layer inputs kept by checkpointing",
                        (layers + 1.0) * p.hidden,
                    ),
                    Term::new("head: final norm output, its gradient, one chunk's logits", p.head),
                    Term::new("head: a chunk of logits in flight", p.head_transient),
                    Term::new("head's gradients", p.head_grads),
                ],
            ),
            (
                "update, top layer recomputed (checkpointed)".into(),
                vec![
                    acc(),
                    Term::new("head's gradients", p.head_grads),
                    Term::new("layer inputs kept by checkpointing", layers * p.hidden),
                    Term::new("one layer's activations", p.one_layer),
                    Term::new("RoPE tables and attention masks", p.shared + p.masks),
                    Term::new(
                        "the layer's gradients in flight",
                        p.layer_transient + 2.0 * p.hidden,
                    ),
                ],
            ),
            (
                "update, forward pass without autodiff (checkpointed)".into(),
                vec![
                    acc(),
                    Term::new(
                        "layer inputs kept by checkpointing",
                        (layers + 1.0) * p.hidden,
                    ),
                    Term::new("RoPE tables and attention masks", p.shared + p.masks),
                    Term::new("one layer's temporaries", p.layer_transient),
                ],
            ),
            end_of_backward(&p),
        ]
    } else {
        vec![
            (
                "update, head's backward pass".into(),
                vec![
                    acc(),
                    Term::new("every layer's activations", p.layers),
                    Term::new("RoPE tables and attention masks", p.shared + p.masks_kept),
                    Term::new("head: final norm output, its gradient, one chunk's logits", p.head),
                    Term::new("head: a chunk of logits in flight", p.head_transient),
                    Term::new("head's gradients", p.head_grads),
                ],
            ),
            (
                "update, last layer's forward pass".into(),
                vec![
                    acc(),
                    Term::new("every layer's activations", p.layers),
                    Term::new("RoPE tables and attention masks", p.shared + p.masks),
                    Term::new("one layer's temporaries", p.layer_transient),
                ],
            ),
            end_of_backward(&p),
        ]
    }
}

/// The end of the backward pass, then the optimiser step.
fn end_of_backward(p: &UpdateParts) -> (String, Vec<Term>) {
    (
        "update, end of the backward pass".into(),
        vec![
            Term::new("gradients accumulated over the mini-batch", p.accumulated),
            Term::new("gradients (f32)", p.grads),
            Term::new("the embedding's gradient table in flight", p.embedding_grad),
            Term::new("optimiser step temporaries", p.optimizer),
        ],
    )
}

/// The update's activation memory for one micro-batch: its largest moment, gradients left out.
pub(super) fn update_activations(s: &PlanSettings, checkpointing: bool) -> u64 {
    let gradients = [
        "gradients",
        "head's gradients",
        "the embedding's gradient table",
        "optimiser step",
    ];
    let one_micro_batch = PlanSettings {
        mini_batch: s.micro_batch,
        ..s.clone()
    };
    update_moments(&one_micro_batch, checkpointing)
        .iter()
        .map(|(_, terms)| {
            terms
                .iter()
                .filter(|t| !gradients.iter().any(|g| t.name.starts_with(g)))
                .map(|t| t.bytes)
                .sum()
        })
        .max()
        .unwrap_or(0)
}
