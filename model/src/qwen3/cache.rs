//! The KV cache: a value owned by the caller, not state inside the model. It is paged, as
//! vLLM's: each layer's keys and values live in a pool of blocks of [`BLOCK_SIZE`] positions
//! (`[slots, kv_heads, head_dim]`), a sequence's positions in blocks of its own wherever they
//! are in the pool, so memory follows the positions in use, whatever the sequences' lengths. A
//! pass names, before it runs ([`KvCache::set_slots`]), the slot each new position goes to and
//! the slots each row of the batch attends to; each layer writes its new keys and values there
//! and gathers the rows' keys and values (`[rows, kv_heads, width, head_dim]`, one layer at a
//! time) for the attention. Slot 0 is scratch: padding is written and read there, masked out.
//! [`crate::decode::Decoder`] keeps the sequences' block tables.

use std::sync::Arc;

use burn::tensor::{backend::Backend, IndexingUpdateOp, Int, Tensor, TensorData};

use crate::kernels;

/// Positions per block of the pool.
pub const BLOCK_SIZE: usize = 16;

/// The smallest growth of a pool, in positions (see [`grown_capacity`]).
pub const GROWTH_STEP: usize = 32;

/// The positions a pool that must hold `needed` grows to: an eighth more, at least
/// [`GROWTH_STEP`] more, rounded up to a multiple of [`GROWTH_STEP`] (a whole number of blocks).
pub fn grown_capacity(needed: usize) -> usize {
    (needed + (needed / 8).max(GROWTH_STEP)).div_ceil(GROWTH_STEP) * GROWTH_STEP
}

/// Where one pass writes and reads: new position `j` of row `r` goes to slot
/// `write[r * new + j]`, and column `c` of row `r`'s keys comes from slot `read[r * width + c]`.
#[derive(Debug, Clone)]
struct PassSlots<B: Backend> {
    write: Arc<[usize]>,
    read: Arc<[usize]>,
    rows: usize,
    /// `write` as `[n, 1]` indices for `scatter_nd`, `read` as indices for `select`.
    write_index: Tensor<B, 2, Int>,
    read_index: Tensor<B, 1, Int>,
}

/// One layer's pools of keys and values, `[slots, kv_heads, head_dim]` each, allocated by the
/// first pass that writes them, and the slots of the pass under way.
#[derive(Debug, Clone)]
pub struct LayerKvCache<B: Backend> {
    keys: Option<Tensor<B, 3>>,
    values: Option<Tensor<B, 3>>,
    /// The slots the pools must have (the cache's, set with the pass).
    slots: usize,
    pass: Option<PassSlots<B>>,
}

impl<B: Backend> Default for LayerKvCache<B> {
    fn default() -> Self {
        Self {
            keys: None,
            values: None,
            slots: 0,
            pass: None,
        }
    }
}

impl<B: Backend> LayerKvCache<B> {
    /// Writes the pass's new `[b, kv_heads, new, d]` keys and values to their slots and returns
    /// the keys and values its rows attend to, `[b, kv_heads, width, d]`.
    ///
    /// Panics if no pass was set ([`KvCache::set_slots`]) or its slots do not match `k`.
    pub fn append(&mut self, k: Tensor<B, 4>, v: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let pass = self.pass.as_ref().expect("KvCache::set_slots names a pass's slots before it runs");
        let [b, _, new, _] = k.dims();
        assert_eq!((b, b * new), (pass.rows, pass.write.len()), "a pass of {b} rows × {new} positions, slots set for another");
        let keys = write(self.keys.take(), k, pass, self.slots);
        let values = write(self.values.take(), v, pass, self.slots);
        let out = (gather(&keys, pass), gather(&values, pass));
        self.keys = Some(keys);
        self.values = Some(values);
        out
    }

    /// Slots its pools have (0 before the first pass).
    fn allocated(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.dims()[0])
    }
}

/// `pool` (grown to `slots`, or new) with `value`'s positions written to the pass's slots: in
/// place on the CPU ([`kernels::write_slots`]), else by `scatter_nd`, in place where the pool
/// is held once (CubeCL).
fn write<B: Backend>(pool: Option<Tensor<B, 3>>, value: Tensor<B, 4>, pass: &PassSlots<B>, slots: usize) -> Tensor<B, 3> {
    let [b, h, new, d] = value.dims();
    let pool = match pool {
        Some(pool) if pool.dims()[0] >= slots => pool,
        Some(pool) => {
            let extra = slots - pool.dims()[0];
            let zeros = Tensor::<B, 3>::zeros([extra, h, d], (&pool.device(), pool.dtype()));
            Tensor::cat(vec![pool, zeros], 0)
        }
        None => Tensor::<B, 3>::zeros([slots, h, d], (&value.device(), value.dtype())),
    };
    kernels::write_slots(pool, &pass.write, &value).unwrap_or_else(|pool| {
        // `[b, h, new, d]` is usually a view of `[b, new, h, d]`: swapped back, it reshapes freely.
        let rows = value.swap_dims(1, 2).reshape([b * new, h, d]);
        pool.scatter_nd(pass.write_index.clone(), rows, IndexingUpdateOp::Assign)
    })
}

/// The pass's rows' slots of `pool`, `[rows, h, width, d]`.
fn gather<B: Backend>(pool: &Tensor<B, 3>, pass: &PassSlots<B>) -> Tensor<B, 4> {
    kernels::gather_slots(pool, &pass.read, pass.rows).unwrap_or_else(|| {
        let [_, h, d] = pool.dims();
        let width = pass.read.len() / pass.rows;
        pool.clone().select(0, pass.read_index.clone()).reshape([pass.rows, width, h, d]).swap_dims(1, 2)
    })
}

/// The cache of every layer of a model: pools of `slots` positions (whole blocks).
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    pub layers: Vec<LayerKvCache<B>>,
    slots: usize,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for a model with `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: (0..num_layers).map(|_| LayerKvCache::default()).collect(),
            slots: 0,
        }
    }

    /// Positions its pools hold (or will, once a pass has written them), each layer.
    pub fn capacity(&self) -> usize {
        self.slots
    }

    /// Makes the pools hold `slots` positions from the next pass on (never fewer than now):
    /// each layer's pools grow (a copy) when that pass writes them.
    pub fn reserve(&mut self, slots: usize) {
        self.slots = self.slots.max(slots);
    }

    /// Names the next pass's slots (see [`PassSlots`]): `write` holds `rows × new` slots and
    /// `read` `rows × width`, each below [`Self::capacity`].
    ///
    /// Panics when a slot is past the capacity or the tables do not split into `rows`.
    pub fn set_slots(&mut self, write: Vec<usize>, read: Vec<usize>, rows: usize, device: &B::Device) {
        assert!(rows > 0 && write.len() % rows == 0 && read.len() % rows == 0, "slot tables for {rows} rows");
        assert!(write.iter().chain(&read).all(|&s| s < self.slots), "a slot past the cache's {} positions", self.slots);
        let index = |slots: &[usize]| slots.iter().map(|&s| s as i64).collect::<Vec<_>>();
        let pass = PassSlots {
            write_index: Tensor::from_data(TensorData::new(index(&write), [write.len(), 1]), device),
            read_index: Tensor::from_data(TensorData::new(index(&read), [read.len()]), device),
            write: write.into(),
            read: read.into(),
            rows,
        };
        for layer in &mut self.layers {
            layer.slots = self.slots;
            layer.pass = Some(pass.clone());
        }
    }

    /// Positions each row of the pass set attends to before its new ones (0 without a pass).
    pub fn past(&self) -> usize {
        self.layers.first().and_then(|l| l.pass.as_ref()).map_or(0, |p| (p.read.len() - p.write.len()) / p.rows)
    }

    /// Positions allocated on the device so far (the first layer's pools).
    pub fn allocated(&self) -> usize {
        self.layers.first().map_or(0, LayerKvCache::allocated)
    }
}
