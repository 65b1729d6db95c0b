//! The KV cache: a value owned by the caller (one per batch of sequences being generated), not
//! state inside the model. Keys and values live in preallocated buffers that grow by an eighth
//! (at least [`GROWTH_STEP`] positions) when full, so what is held stays within an eighth of what
//! is used. A row can be taken out (one sequence, only the positions it uses), and a batch can be
//! assembled from blocks of rows of other caches, each kept position copied once, which is what
//! [`crate::decode::Decoder`] does as sequences leave and join a batch.

use burn::tensor::{backend::Backend, Tensor};

use crate::kernels;

/// Cached keys and values of one layer, `[b, kv_heads, capacity, head_dim]`, first `len` valid.
#[derive(Debug, Clone)]
pub struct LayerKvCache<B: Backend> {
    keys: Option<Tensor<B, 4>>,
    values: Option<Tensor<B, 4>>,
    len: usize,
}

impl<B: Backend> Default for LayerKvCache<B> {
    fn default() -> Self {
        Self {
            keys: None,
            values: None,
            len: 0,
        }
    }
}

impl<B: Backend> LayerKvCache<B> {
    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `[b, kv_heads, new, d]` keys/values and returns all cached ones so far.
    pub fn append(&mut self, k: Tensor<B, 4>, v: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let [b, h, new, d] = k.dims();
        let end = self.len + new;
        // Usually views of `[b, new, kv_heads, d]` tensors; copied here in parallel on the CPU.
        let (k, v) = (kernels::contiguous(k), kernels::contiguous(v));
        let keys = grow(self.keys.take(), &k, end);
        let values = grow(self.values.take(), &v, end);
        let write = |buffer: Tensor<B, 4>, new: Tensor<B, 4>| {
            kernels::write_positions(buffer, self.len, &new).unwrap_or_else(|buffer| buffer.slice_assign([0..b, 0..h, self.len..end, 0..d], new))
        };
        let (keys, values) = (write(keys, k), write(values, v));
        self.len = end;
        let out = (
            keys.clone().slice([0..b, 0..h, 0..end, 0..d]),
            values.clone().slice([0..b, 0..h, 0..end, 0..d]),
        );
        self.keys = Some(keys);
        self.values = Some(values);
        out
    }

    /// Positions the buffers have room for (allocated), at least [`Self::len`].
    pub fn capacity(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.dims()[2])
    }

    /// Batch row `row` alone, with only the cached positions `slots` (in that order), in
    /// buffers of exactly that size.
    fn take_row(&self, row: usize, slots: &[usize]) -> Self {
        let pick = |t: &Option<Tensor<B, 4>>| {
            t.as_ref().map(|t| {
                let device = t.device();
                t.clone()
                    .select(0, crate::batch::row_index(&[row], &device))
                    .select(2, crate::batch::row_index(slots, &device))
            })
        };
        Self {
            keys: pick(&self.keys),
            values: pick(&self.values),
            len: slots.len(),
        }
    }

    /// A cache of `rows` rows holding `len` positions in buffers of `capacity`, zero but for
    /// `blocks` of `sources` (which it consumes): each copied position is copied once.
    fn assemble(sources: Vec<Self>, blocks: &[RowBlock], rows: usize, len: usize, capacity: usize) -> Self {
        let Some(like) = sources.iter().find_map(|s| s.keys.clone()) else {
            return Self::default();
        };
        let [_, h, _, d] = like.dims();
        let (device, dtype) = (like.device(), like.dtype());
        drop(like);
        let build = |pick: fn(&Self) -> Option<&Tensor<B, 4>>| {
            let mut buffer = Tensor::<B, 4>::zeros([rows, h, capacity, d], (&device, dtype));
            for block in blocks.iter().filter(|b| !b.rows.is_empty() && !b.positions.is_empty()) {
                let Some(source) = pick(&sources[block.source]) else { continue };
                buffer = copy_rows(buffer, source, block);
            }
            buffer
        };
        let keys = build(|s| s.keys.as_ref());
        let values = build(|s| s.values.as_ref());
        Self {
            keys: Some(keys),
            values: Some(values),
            len,
        }
    }

    /// Copies `blocks` of `source` (their `source` field unused) into this cache, which first
    /// grows to hold `needed` positions (if it has room for fewer), its positions moved `shift`
    /// columns on (into a new buffer), and then holds `len` positions (if it held fewer): rows
    /// joining a batch in places other rows left, each joined position copied once, the others
    /// moved only to make room in front for a joining row longer than the batch.
    fn place(&mut self, source: Self, blocks: &[RowBlock], shift: usize, len: usize, needed: usize) {
        let (Some(source_keys), Some(source_values)) = (source.keys, source.values) else { return };
        let (Some(keys), Some(values)) = (self.keys.take(), self.values.take()) else {
            unreachable!("rows placed into a cache without buffers (a batch always has them)");
        };
        let held = self.len;
        let build = |buffer: Tensor<B, 4>, source: &Tensor<B, 4>| {
            let grown = if shift == 0 { grow(Some(buffer), source, needed) } else { shifted(buffer, held, shift, needed) };
            blocks.iter().filter(|b| !b.rows.is_empty() && !b.positions.is_empty()).fold(grown, |buffer, block| copy_rows(buffer, source, block))
        };
        self.keys = Some(build(keys, &source_keys));
        self.values = Some(build(values, &source_values));
        self.len = self.len.max(len);
    }
}

/// Rows of one cache to copy into an assembled one (see [`KvCache::assemble`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowBlock {
    /// Which of the sources the rows come from.
    pub source: usize,
    /// The source's rows to copy.
    pub rows: std::ops::Range<usize>,
    /// The source's positions to copy.
    pub positions: std::ops::Range<usize>,
    /// The row and position of the assembled cache the block starts at.
    pub at: [usize; 2],
}

/// The capacity a buffer gets when it must hold `needed` positions: an eighth more, at least
/// [`GROWTH_STEP`] more, rounded up to a multiple of [`GROWTH_STEP`].
pub fn grown_capacity(needed: usize) -> usize {
    (needed + (needed / 8).max(GROWTH_STEP)).div_ceil(GROWTH_STEP) * GROWTH_STEP
}

/// The smallest growth of a cache buffer, in positions.
pub const GROWTH_STEP: usize = 32;

/// Returns a buffer with room for `needed` positions holding the old buffer's contents (as
/// many rows as the old buffer, else as `like`).
fn grow<B: Backend>(buffer: Option<Tensor<B, 4>>, like: &Tensor<B, 4>, needed: usize) -> Tensor<B, 4> {
    match buffer {
        Some(buf) if buf.dims()[2] >= needed => buf,
        Some(old) => {
            let held = old.dims()[2];
            shifted(old, held, 0, needed)
        }
        None => {
            let [b, h, _, d] = like.dims();
            Tensor::<B, 4>::zeros([b, h, grown_capacity(needed), d], (&like.device(), like.dtype()))
        }
    }
}

/// A new buffer with room for `needed` positions (the old buffer's capacity, or more by
/// [`grown_capacity`]) holding the old buffer's first `held` positions `shift` columns on.
fn shifted<B: Backend>(buffer: Tensor<B, 4>, held: usize, shift: usize, needed: usize) -> Tensor<B, 4> {
    let [b, h, capacity, d] = buffer.dims();
    let capacity = if needed > capacity { grown_capacity(needed) } else { capacity };
    assert!(held + shift <= capacity, "{held} positions moved {shift} on in a buffer of {capacity}");
    let fresh = Tensor::<B, 4>::zeros([b, h, capacity, d], (&buffer.device(), buffer.dtype()));
    let all = RowBlock { source: 0, rows: 0..b, positions: 0..held, at: [0, shift] };
    copy_rows(fresh, &buffer, &all)
}

/// `buffer` with `block`'s rows and positions of `source` copied to where the block says: in
/// place on the CPU ([`kernels::copy_block`]), else by `slice_assign`.
fn copy_rows<B: Backend>(buffer: Tensor<B, 4>, source: &Tensor<B, 4>, block: &RowBlock) -> Tensor<B, 4> {
    let [_, h, _, d] = buffer.dims();
    let [row, at] = block.at;
    kernels::copy_block(buffer, block.at, source, block.rows.clone(), block.positions.clone()).unwrap_or_else(|buffer| {
        let value = source.clone().slice([block.rows.clone(), 0..h, block.positions.clone(), 0..d]);
        buffer.slice_assign([row..row + block.rows.len(), 0..h, at..at + block.positions.len(), 0..d], value)
    })
}

/// The cache of every layer of a model, for one batch of sequences.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    pub layers: Vec<LayerKvCache<B>>,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for a model with `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: (0..num_layers).map(|_| LayerKvCache::default()).collect(),
        }
    }

    /// Number of cached positions (the same in every layer).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerKvCache::len)
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Positions allocated per row (the same in every layer).
    pub fn capacity(&self) -> usize {
        self.layers.first().map_or(0, LayerKvCache::capacity)
    }

    /// Batch row `row` alone as a cache of one row, holding only the positions `slots` (in
    /// that order) in buffers of exactly that size: a sequence leaving a batch, its padding
    /// dropped.
    pub fn take_row(&self, row: usize, slots: &[usize]) -> Self {
        Self {
            layers: self.layers.iter().map(|l| l.take_row(row, slots)).collect(),
        }
    }

    /// Copies `blocks` of `source` into this cache's rows (`RowBlock::source` unused), which
    /// grows to hold `needed` positions (by [`grown_capacity`], if it has room for fewer), its
    /// cached positions first moved `shift` columns on (`0`: nothing moved; the columns left in
    /// front are zero), and then holds `len` positions (if it held fewer; the rows' new
    /// positions are theirs to mask): sequences joining a batch in places other rows left, only
    /// their positions copied unless a longer one needs room in front.
    pub fn place(&mut self, mut source: Self, blocks: &[RowBlock], shift: usize, len: usize, needed: usize) {
        assert!(needed >= len, "a cache of {len} positions with room for {needed}");
        for (layer, source) in self.layers.iter_mut().zip(source.layers.iter_mut()) {
            layer.place(std::mem::take(source), blocks, shift, len, needed);
        }
    }

    /// A cache of `rows` rows holding `len` positions in buffers of `capacity` positions, zero
    /// (to be masked out) but for `blocks` copied from `sources`, which it consumes one layer at a
    /// time: a batch that rows leave and join is rebuilt copying each kept position once, and
    /// holds at most one layer twice while it does.
    pub fn assemble(mut sources: Vec<Self>, blocks: &[RowBlock], rows: usize, len: usize, capacity: usize) -> Self {
        assert!(capacity >= len, "a cache of {len} positions in buffers of {capacity}");
        let layers = sources.first().map_or(0, |s| s.layers.len());
        Self {
            layers: (0..layers)
                .map(|i| {
                    let parts = sources.iter_mut().map(|s| std::mem::take(&mut s.layers[i])).collect();
                    LayerKvCache::assemble(parts, blocks, rows, len, capacity)
                })
                .collect(),
        }
    }
}
