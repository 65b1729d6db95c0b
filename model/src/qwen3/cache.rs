//! The KV cache: a value owned by the caller, not state inside the model. It is paged, as
//! vLLM's: each layer's keys and values live in a pool of blocks of [`BLOCK_SIZE`] positions
//! (`[kv_heads, slots, head_dim]`: a block of one head is contiguous), a sequence's positions
//! in blocks of its own wherever they
//! are in the pool, so memory follows the positions in use, whatever the sequences' lengths. A
//! pass names, before it runs ([`KvCache::set_slots`]), the slot each new position goes to and
//! the slots each row of the batch attends to; each layer writes its new keys and values there,
//! and its attention reads the rows' slots (in place with the CPU kernels and a GPU backend's
//! paged-attention kernel, else gathered as `[rows, kv_heads, width, head_dim]`, one layer at
//! a time). Slot [`SCRATCH_SLOT`] is scratch: padding is written and read there,
//! masked out.
//! [`crate::decode::Decoder`] keeps the sequences' block tables.

use std::sync::{Arc, OnceLock};

use burn::tensor::{backend::Backend, DType, IndexingUpdateOp, Int, Tensor, TensorData};

use super::mask::AttentionMask;
use crate::device_kernels::{DeviceKernelChoice, PagedAttention, RaggedRows, RowLens};
use crate::kernels;
use cpu_kernels::Kernels;

/// Positions per block of the pool.
pub const BLOCK_SIZE: usize = 16;

/// The slot padding is written to and read from (masked out): no sequence's block holds it.
pub const SCRATCH_SLOT: usize = 0;

/// The smallest growth of a pool, in positions (see [`grown_capacity`]).
pub const GROWTH_STEP: usize = 32;

/// The positions a pool that must hold `needed` grows to: an eighth more, at least
/// [`GROWTH_STEP`] more, rounded up to a multiple of [`GROWTH_STEP`] (a whole number of blocks).
pub fn grown_capacity(needed: usize) -> usize {
    (needed + (needed / 8).max(GROWTH_STEP)).div_ceil(GROWTH_STEP) * GROWTH_STEP
}

/// Where one pass writes and reads: new position `j` of row `r` goes to slot
/// `write[r * new + j]` (of every head), and column `c` of row `r`'s keys comes from slot
/// `read[r * width + c]`.
#[derive(Debug, Clone)]
struct PassSlots<B: Backend> {
    write: Arc<[usize]>,
    read: Arc<[usize]>,
    rows: usize,
    /// The positions each layer's pools hold for this pass (grown when they hold fewer).
    pool: usize,
    /// `write` on the device, built when a layer first needs it and shared by the pass's layers:
    /// as `[n · kv_heads, 2]` (head, slot) indices for `scatter_nd` (the values' order: row,
    /// position, head), or as it is, `[n]`, for a kernel that writes the pools itself.
    write_index: Arc<OnceLock<Tensor<B, 2, Int>>>,
    write_slots: Arc<OnceLock<Tensor<B, 1, Int>>>,
    kv_heads: usize,
    device: B::Device,
    /// `read` as indices for `select`.
    read_index: Tensor<B, 1, Int>,
    /// A ragged pass's rows ([`KvCache::set_ragged_slots`]).
    ragged: Option<RaggedPass<B>>,
}

/// The rows of a ragged pass: their queries one row after another, and which columns are keys.
#[derive(Debug, Clone)]
struct RaggedPass<B: Backend> {
    rows: RaggedRows<B>,
    /// `[rows, width]`, f32: 1 where a column reads a key, 0 where it reads the scratch slot.
    valid: Tensor<B, 2>,
}

/// One layer's pools of keys and values, `[kv_heads, slots, head_dim]` each, allocated by the
/// first pass that writes them, and the slots of the pass under way.
#[derive(Debug)]
pub struct LayerKvCache<B: Backend> {
    keys: Option<Tensor<B, 3>>,
    values: Option<Tensor<B, 3>>,
    pass: Option<PassSlots<B>>,
}

impl<B: Backend> Default for LayerKvCache<B> {
    fn default() -> Self {
        Self {
            keys: None,
            values: None,
            pass: None,
        }
    }
}

impl<B: Backend> LayerKvCache<B> {
    /// Writes the pass's new `[b, kv_heads, new, d]` keys and values to their slots and returns
    /// the keys and values its rows attend to (to be dropped before the next pass writes).
    ///
    /// Panics if no pass was set ([`KvCache::set_slots`]) or its slots do not match `k`.
    pub fn append(&mut self, k: Tensor<B, 4>, v: Tensor<B, 4>) -> CachedKv<B> {
        let pass = self.pass.clone().expect("KvCache::set_slots names a pass's slots before it runs");
        let [b, _, new, _] = k.dims();
        let rows = if pass.ragged.is_some() { 1 } else { pass.rows };
        assert_eq!((b, b * new), (rows, pass.write.len()), "a pass of {b} rows × {new} positions, slots set for another");
        let keys = write(self.keys.take(), k, &pass);
        let values = write(self.values.take(), v, &pass);
        self.keys = Some(keys.clone());
        self.values = Some(values.clone());
        CachedKv { keys, values, pass }
    }

    /// [`Self::append`] by a kernel that writes the pools itself (a GPU backend's, see
    /// `device_kernels::NormKernels::qk_norm_rope_write`) from the pass's projections, described
    /// by `like` (their tokens, one row a token in the order of the pass's slots: row, position;
    /// a new pool takes their dtype and device): `write` is given the layer's pools of
    /// `head_dim`, grown to the pass's size, and each token's slot; it returns what else it
    /// computed and the pools written.
    ///
    /// Panics if no pass was set or its slots do not match `like`'s tokens.
    pub fn append_with<T>(&mut self, like: PoolLike<B>, head_dim: usize, write: impl FnOnce(KvWrite<B>) -> (T, Tensor<B, 3>, Tensor<B, 3>)) -> (T, CachedKv<B>) {
        let pass = self.pass.clone().expect("KvCache::set_slots names a pass's slots before it runs");
        let tokens = like.tokens;
        assert_eq!(tokens, pass.write.len(), "a pass of {tokens} tokens, slots set for {} positions", pass.write.len());
        let keys = grown(self.keys.take(), head_dim, (like.dtype, &like.device), &pass);
        let values = grown(self.values.take(), head_dim, (like.dtype, &like.device), &pass);
        let (computed, keys, values) = write(KvWrite { keys, values, slots: pass.write_slots() });
        self.keys = Some(keys.clone());
        self.values = Some(values.clone());
        (computed, CachedKv { keys, values, pass })
    }
}

/// What [`LayerKvCache::append_with`] needs of a pass's projections, so that the kernel can
/// take them without a clone (each clone of a fused tensor left alive costs the fusion stream a
/// `Drop` operation): their tokens, dtype and device.
#[derive(Debug, Clone)]
pub struct PoolLike<B: Backend> {
    pub tokens: usize,
    pub dtype: DType,
    pub device: B::Device,
}

impl<B: Backend> PoolLike<B> {
    /// What `projection` (`[tokens, ..]`) gives a pool.
    pub fn of(projection: &Tensor<B, 2>) -> Self {
        Self { tokens: projection.dims()[0], dtype: projection.dtype(), device: projection.device() }
    }
}

/// What a kernel writing a pass's keys and values to a layer's pools is given
/// ([`LayerKvCache::append_with`]).
#[derive(Debug)]
pub struct KvWrite<B: Backend> {
    /// The layer's pools, `[kv_heads, slots, head_dim]`.
    pub keys: Tensor<B, 3>,
    pub values: Tensor<B, 3>,
    /// `[tokens]`: the slot each token's key and value go to.
    pub slots: Tensor<B, 1, Int>,
}

impl<B: Backend> PassSlots<B> {
    /// `write` as `scatter_nd`'s (head, slot) pairs (see the field).
    fn write_index(&self) -> Tensor<B, 2, Int> {
        let h = self.kv_heads;
        self.write_index
            .get_or_init(|| {
                let pairs: Vec<i64> = self.write.iter().flat_map(|&s| (0..h).flat_map(move |head| [head as i64, s as i64])).collect();
                Tensor::from_data(TensorData::new(pairs, [self.write.len() * h, 2]), &self.device)
            })
            .clone()
    }

    /// `write` on the device, `[n]`.
    fn write_slots(&self) -> Tensor<B, 1, Int> {
        self.write_slots
            .get_or_init(|| {
                let slots: Vec<i64> = self.write.iter().map(|&s| s as i64).collect();
                Tensor::from_data(TensorData::new(slots, [self.write.len()]), &self.device)
            })
            .clone()
    }
}

/// The keys and values one pass's rows attend to: a layer's pools and the rows' slots. The
/// CPU kernels attend to them where they lie ([`Self::attention`]), and so does a GPU
/// backend's kernel ([`Self::paged_attention`]); otherwise [`Self::gather`] lays them out for
/// burn's ops.
#[derive(Debug)]
pub struct CachedKv<B: Backend> {
    keys: Tensor<B, 3>,
    values: Tensor<B, 3>,
    pass: PassSlots<B>,
}

impl<B: Backend> CachedKv<B> {
    /// The rows' keys and values, `[rows, kv_heads, width, head_dim]` each.
    pub fn gather(self) -> (Tensor<B, 4>, Tensor<B, 4>) {
        (gather(&self.keys, &self.pass), gather(&self.values, &self.pass))
    }

    /// `softmax(Q Kᵀ · scale + bias) V` for `query` (`[b, q, heads, d]`) and `bias`
    /// (`[b, 1, q, width]`) read straight from the pools by a CPU kernel of `cpu_kernels`
    /// ([`kernels::grouped_attention_paged`]), `[b, q, heads · d]`; `None` where none applies.
    pub fn attention(&self, cpu_kernels: Kernels, query: &Tensor<B, 4>, bias: &Tensor<B, 4>, scale: f32) -> Option<Tensor<B, 3>> {
        kernels::grouped_attention_paged(cpu_kernels, query, &self.keys, &self.values, &self.pass.read, Some(SCRATCH_SLOT), bias, scale)
    }

    /// The pass's attention (`query` a token a row, `[b · q, heads · d]`, of `shape`
    /// `[b, q, heads, d]`: a decoding step's one query a row or a prefill chunk's `q`, its rows'
    /// last columns) under `mask`, read straight from the pools by the device kernel registered
    /// for `B` where `choice` hands it such passes ([`DeviceKernelChoice::paged_attention`]), a
    /// token a row, `[b · q, heads · d]`; the query back where it does not.
    ///
    /// A ragged pass ([`KvCache::set_ragged_slots`]; `shape` `[1, tokens, heads, d]`) takes
    /// its rows' lengths and padding from its slots, not from `mask`.
    pub fn paged_attention(&self, choice: DeviceKernelChoice, query: Tensor<B, 2>, shape: [usize; 4], mask: &AttentionMask<B>, scale: f32) -> Result<Tensor<B, 2>, Tensor<B, 2>> {
        let [b, q_len, heads, d] = shape;
        assert_eq!(query.dims(), [b * q_len, heads * d], "a query of {shape:?} a token a row");
        let width = self.pass.read.len() / self.pass.rows;
        // A ragged pass has prefill rows: only a kernel that takes prefills computes it.
        let Some(kernel) = choice.paged_attention::<B>(if self.is_ragged() { usize::MAX } else { q_len }) else {
            return Err(query);
        };
        let (valid, ragged) = match &self.pass.ragged {
            Some(ragged) => (ragged.valid.clone(), Some(ragged.rows.clone())),
            None => {
                let valid = mask.valid_keys();
                assert_eq!(valid.dims(), [b, width], "the mask's keys are the pass's columns");
                assert_eq!(mask.past(), width - q_len, "the pass's queries are its rows' last columns");
                (valid, None)
            }
        };
        let pass = PagedAttention {
            query,
            shape,
            keys: self.keys.clone(),
            values: self.values.clone(),
            read: self.pass.read_index.clone(),
            valid,
            scale,
            ragged,
            decoding: choice.decoding,
            tensor_cores: choice.tensor_cores,
        };
        Ok(kernel(pass))
    }

    /// Whether a device kernel registered for `B` computes this pass's attention
    /// ([`Self::paged_attention`]) with `queries` queries a row, as `choice` says.
    pub fn takes_paged_attention(&self, choice: DeviceKernelChoice, queries: usize) -> bool {
        choice.paged_attention::<B>(if self.is_ragged() { usize::MAX } else { queries }).is_some()
    }

    /// Whether this is a ragged pass's ([`KvCache::set_ragged_slots`]): only a paged-attention
    /// kernel that takes prefills computes its attention.
    pub fn is_ragged(&self) -> bool {
        self.pass.ragged.is_some()
    }
}

/// `pool` grown to the pass's size, or a new pool of `dtype` on `device`, of positions of
/// `head_dim` (for `pass.kv_heads` heads).
fn grown<B: Backend>(pool: Option<Tensor<B, 3>>, head_dim: usize, (dtype, device): (DType, &B::Device), pass: &PassSlots<B>) -> Tensor<B, 3> {
    let (h, slots) = (pass.kv_heads, pass.pool);
    match pool {
        Some(pool) if pool.dims()[1] >= slots => pool,
        Some(pool) => {
            let extra = slots - pool.dims()[1];
            let zeros = Tensor::<B, 3>::zeros([h, extra, head_dim], (&pool.device(), pool.dtype()));
            Tensor::cat(vec![pool, zeros], 1)
        }
        None => Tensor::<B, 3>::zeros([h, slots, head_dim], (device, dtype)),
    }
}

/// `pool` (grown to the pass's size, or new) with `value`'s positions written to the pass's
/// slots: in place on the CPU ([`kernels::write_slots`]), else by `scatter_nd`, in place where
/// the pool is held once (CubeCL).
fn write<B: Backend>(pool: Option<Tensor<B, 3>>, value: Tensor<B, 4>, pass: &PassSlots<B>) -> Tensor<B, 3> {
    let [b, h, new, d] = value.dims();
    assert_eq!(h, pass.kv_heads, "a pass's keys and values of the cache's {} heads", pass.kv_heads);
    let pool = grown(pool, d, (value.dtype(), &value.device()), pass);
    kernels::write_slots(pool, &pass.write, &value).unwrap_or_else(|pool| {
        // The rows go in (row, position, head) order. A decoding step's `[b, h, 1, d]` is
        // already in it: reshaped, not swapped, it stays a view (a swapped view is copied first,
        // a kernel per layer and pool on a GPU). A prefill's `[b, h, new, d]` is usually a view
        // of `[b, new, h, d]`: swapped back, it reshapes freely.
        let rows = match new {
            1 => value.reshape([b * h, d]),
            _ => value.swap_dims(1, 2).reshape([b * new * h, d]),
        };
        pool.scatter_nd(pass.write_index(), rows, IndexingUpdateOp::Assign)
    })
}

/// The pass's rows' slots of `pool`, `[rows, h, width, d]`.
fn gather<B: Backend>(pool: &Tensor<B, 3>, pass: &PassSlots<B>) -> Tensor<B, 4> {
    kernels::gather_slots(pool, &pass.read, pass.rows, Some(SCRATCH_SLOT)).unwrap_or_else(|| {
        let [h, _, d] = pool.dims();
        let width = pass.read.len() / pass.rows;
        pool.clone().select(1, pass.read_index.clone()).reshape([h, pass.rows, width, d]).swap_dims(0, 1)
    })
}

/// The cache of every layer of a model: pools of `slots` positions (whole blocks).
#[derive(Debug)]
pub struct KvCache<B: Backend> {
    pub layers: Vec<LayerKvCache<B>>,
    kv_heads: usize,
    slots: usize,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for a model with `num_layers` layers of `kv_heads` key-value heads.
    pub fn new(num_layers: usize, kv_heads: usize) -> Self {
        Self {
            layers: (0..num_layers).map(|_| LayerKvCache::default()).collect(),
            kv_heads,
            slots: 0,
        }
    }

    /// Makes the pools hold `slots` positions from the next pass on (never fewer than now):
    /// each layer's pools grow (a copy) when that pass writes them.
    pub fn reserve(&mut self, slots: usize) {
        self.slots = self.slots.max(slots);
    }

    /// Names the next pass's slots (see `PassSlots`): `write` holds `rows × new` slots and
    /// `read` `rows × width`, each below the positions reserved ([`Self::reserve`]).
    ///
    /// Panics when a slot is past the capacity or the tables do not split into `rows`.
    pub fn set_slots(&mut self, write: Vec<usize>, read: Vec<usize>, rows: usize, device: &B::Device) {
        assert!(rows > 0 && write.len() % rows == 0 && read.len() % rows == 0, "slot tables for {rows} rows");
        self.set_pass(write, read, rows, None, device);
    }

    /// Names the next pass's slots for a ragged pass: its input is `[1, tokens]`, rows one after
    /// another, row `r` `lens[r]` tokens, whose new positions go to `write` (`tokens` slots, in
    /// that order); column `c` of row `r` reads slot `read[r · width + c]`, a row's new positions
    /// its last `lens[r]` columns, [`SCRATCH_SLOT`] its padding. Only a GPU backend's
    /// paged-attention kernel that takes prefills computes such a pass
    /// ([`crate::Qwen3ForCausalLM::takes_ragged_passes`]).
    pub fn set_ragged_slots(&mut self, write: Vec<usize>, read: Vec<usize>, lens: &[usize], device: &B::Device) {
        let rows = lens.len();
        assert!(rows > 0 && read.len() % rows == 0, "slot tables for {rows} rows");
        assert_eq!(lens.iter().sum::<usize>(), write.len(), "a ragged pass writes each of its tokens once");
        let width = read.len() / rows;
        let row_lens = RowLens::of(lens);
        assert!(lens.iter().all(|&n| n >= 1) && row_lens.longest <= width, "rows of 1 to {width} tokens");
        let starts: Vec<i64> = std::iter::once(0).chain(lens.iter().scan(0i64, |end, &n| {
            *end += n as i64;
            Some(*end)
        })).collect();
        let valid: Vec<f32> = read.iter().map(|&slot| f32::from(u8::from(slot != SCRATCH_SLOT))).collect();
        let ragged = RaggedPass {
            rows: RaggedRows { starts: Tensor::from_data(TensorData::new(starts, [rows + 1]), device), lens: row_lens },
            valid: Tensor::from_data(TensorData::new(valid, [rows, width]), (device, DType::F32)),
        };
        self.set_pass(write, read, rows, Some(ragged), device);
    }

    fn set_pass(&mut self, write: Vec<usize>, read: Vec<usize>, rows: usize, ragged: Option<RaggedPass<B>>, device: &B::Device) {
        assert!(write.iter().chain(&read).all(|&s| s < self.slots), "a slot past the cache's {} positions", self.slots);
        let read_index: Vec<i64> = read.iter().map(|&s| s as i64).collect();
        let pass = PassSlots {
            write_index: Arc::default(),
            write_slots: Arc::default(),
            kv_heads: self.kv_heads,
            device: device.clone(),
            read_index: Tensor::from_data(TensorData::new(read_index, [read.len()]), device),
            write: write.into(),
            read: read.into(),
            rows,
            pool: self.slots,
            ragged,
        };
        for layer in &mut self.layers {
            layer.pass = Some(pass.clone());
        }
    }

    /// Positions each row of the pass set attends to before its new ones (0 without a pass, and
    /// in a ragged pass, whose rows differ).
    pub fn past(&self) -> usize {
        let pass = self.layers.first().and_then(|l| l.pass.as_ref()).filter(|p| p.ragged.is_none());
        pass.map_or(0, |p| (p.read.len() - p.write.len()) / p.rows)
    }

    /// Keeps only the positions `slots` of every layer's pools, in that order, in pools of
    /// exactly that size (a copy): the cache compacted to the blocks still held.
    pub fn keep_slots(&mut self, slots: &[usize]) {
        let positions: Vec<i64> = slots.iter().map(|&s| s as i64).collect();
        let mut index = None;
        for layer in &mut self.layers {
            for pool in [&mut layer.keys, &mut layer.values] {
                if let Some(t) = pool.take() {
                    let index = index.get_or_insert_with(|| Tensor::<B, 1, Int>::from_data(TensorData::new(positions.clone(), [slots.len()]), &t.device()));
                    *pool = Some(t.select(1, index.clone()));
                }
            }
            layer.pass = None;
        }
        self.slots = slots.len();
    }
}
