//! Every kernel of this crate as CubeCL defines it for a compiler, at the shapes of the Qwen3
//! models, for compile checks of backends the tests cannot run (CUDA's code generator and NVRTC
//! need no GPU; `tests/gpu_path/cuda_source.rs`). The definitions take the settings, compile-time
//! arguments and revisions the launches take.

use cubecl::ir::{ElemType, FloatKind, IntKind};
use cubecl::prelude::*;

/// The address type of every kernel of this crate.
pub const ADDRESS: AddressType = AddressType::U32;

/// The settings each kernel of this crate launches with: `units` a cube along x, addresses of
/// [`ADDRESS`].
pub(crate) fn settings(units: u32) -> KernelSettings {
    KernelSettings::default().cube_dim(CubeDim::new_1d(units)).address_type(ADDRESS)
}

/// The hidden sizes of Qwen3-0.6B, 1.7B, 4B and 8B.
const HIDDEN: [u32; 4] = [1024, 2048, 2560, 4096];

/// Every Qwen3's `head_dim`.
const HEAD_DIM: u32 = 128;

/// Query heads a key-value head: Qwen3-0.6B's and 1.7B's 2, 4B's and 8B's 4.
const GROUPS: [usize; 2] = [2, 4];

/// Queries a row of a pass: past [`crate::paged_attention::blocks_for`]'s largest block of
/// queries, so that every block it picks is among them.
const QUERIES: [usize; 5] = [1, 2, 4, 8, 16];

/// A compile-time tensor argument as a launch registers it (not aliased to an input).
pub(crate) fn arg() -> TensorCompilationArg {
    TensorCompilationArg { inplace: None }
}

/// Every kernel of this crate, each with a name that says which and at what shape, over floats
/// of `dtype` and indices of the CUDA backend's `i32` (the attention's mask of valid columns in
/// f32, as the model builds it), defined on `client`.
pub fn definitions<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType) -> Vec<(String, KernelDefinition)> {
    let index = StorageType::Scalar(ElemType::Int(IntKind::I32));
    let mask = StorageType::Scalar(ElemType::Float(FloatKind::F32));
    let mut out = vec![
        (format!("silu_mul {dtype}"), crate::swiglu::definition(client, dtype)),
    ];
    // Token choice with vectors of CUDA's widest load (16 bytes), as for Qwen3's vocabulary.
    let [segments, draw] = crate::sampling::definitions(client, dtype, 16 / dtype.size());
    out.push((format!("segment_maxima {dtype}"), segments));
    out.push((format!("draw_token {dtype}"), draw));
    for hidden in HIDDEN {
        let [rms_norm, add_rms_norm] = crate::rms_norm::definitions(client, dtype, hidden);
        out.push((format!("rms_norm {dtype} hidden {hidden}"), rms_norm));
        out.push((format!("add_rms_norm {dtype} hidden {hidden}"), add_rms_norm));
    }
    let qk_norm_rope_write = crate::rms_norm::qk_norm_rope_write_definition(client, [dtype, index], HEAD_DIM);
    out.push((format!("qk_norm_rope_write {dtype} head_dim {HEAD_DIM}"), qk_norm_rope_write));
    // CUDA's widest load (16 bytes; the client defining them may load less).
    let most_vector = 16 / dtype.size();
    // The attention as each pass takes it (a decoding step, prefill chunks, ragged passes; whole
    // or split into spans of columns), once for each block of queries it may pick, its keys and
    // values read in vectors of CUDA's widest load.
    for groups in GROUPS {
        let mut seen = Vec::new();
        for queries in QUERIES {
            let blocks = crate::paged_attention::blocks_for(HEAD_DIM as usize, groups, queries);
            if seen.contains(&blocks) {
                continue;
            }
            seen.push(blocks);
            for ragged in [false, true] {
                // Only a decoding step is split (`paged_attention::Spans::Auto`).
                let splits: &[bool] = if queries == 1 && !ragged { &[false, true] } else { &[false] };
                for &split in splits {
                    let definition = crate::paged_attention::definition(client, [dtype, index, mask], most_vector, HEAD_DIM as usize, groups, queries, ragged, split, false);
                    let pass = if ragged { "ragged" } else { "uniform" };
                    let spans = if split { " split" } else { "" };
                    out.push((format!("paged_attention {dtype} {pass}{spans} groups {groups} queries {}", blocks.queries), definition));
                }
            }
            // A pass without a cache (`paged_attention::fresh_attention`): its read table in the
            // mask's dtype.
            let definition = crate::paged_attention::definition(client, [dtype, mask, mask], most_vector, HEAD_DIM as usize, groups, queries, false, false, true);
            out.push((format!("paged_attention {dtype} fresh groups {groups} queries {}", blocks.queries), definition));
        }
    }
    // A decoding step's own kernel, whole and split, and over a ragged pass's rows of one query
    // (whole: `Spans::Auto` splits no ragged pass), with vectors of CUDA's widest load (16
    // bytes; the client defining them may load less).
    for groups in GROUPS {
        for (ragged, split) in [(false, false), (false, true), (true, false)] {
            if let Some(definition) = crate::paged_decode::definition(client, [dtype, index, mask], HEAD_DIM as usize, groups, most_vector, ragged, split) {
                let pass = if ragged { " ragged" } else { "" };
                let spans = if split { " split" } else { "" };
                out.push((format!("paged_decode {dtype}{pass}{spans} groups {groups}"), definition));
            }
        }
    }
    out.push((format!("combine_splits {dtype} head_dim {HEAD_DIM}"), crate::paged_attention::combine_definition(client, dtype, HEAD_DIM as usize)));
    // The attention's blocks of queries on the tensor cores, which take 16-bit floats only:
    // passes over the cache (uniform and ragged) and without one, for each of Qwen3's groups.
    if matches!(dtype, StorageType::Scalar(ElemType::Float(FloatKind::F16 | FloatKind::BF16))) {
        for groups in GROUPS {
            for (pass, ragged, fresh) in [("uniform", false, false), ("ragged", true, false), ("fresh", false, true)] {
                let dtypes = if fresh { [dtype, mask, mask] } else { [dtype, index, mask] };
                let definition = crate::tensor_core_attention::definition(client, dtypes, most_vector, HEAD_DIM as usize, groups, ragged, fresh);
                out.push((format!("tensor_core_attention {dtype} {pass} groups {groups}"), definition));
            }
        }
    }
    // The products of few rows: each tile of rows a product may take, with CUDA's widest
    // vectors, whole and split; then the sum of the spans.
    for tile_rows in [1, 2, 4, crate::skinny_matmul::TILE_ROWS] {
        for split in [false, true] {
            let spans = if split { " split" } else { "" };
            let definition = crate::skinny_matmul::definition(client, dtype, most_vector, tile_rows, split);
            out.push((format!("skinny_matmul {dtype} rows {tile_rows}{spans}"), definition));
        }
    }
    out.push((format!("sum_spans {dtype}"), crate::skinny_matmul::sum_definition(client, dtype)));
    out
}
