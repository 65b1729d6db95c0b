//! The KV cache: a value owned by the caller (one per batch of sequences being generated), not
//! state inside the model. Keys and values live in preallocated buffers that grow by an eighth
//! (at least [`GROWTH_STEP`] positions) when full, so what is held stays within an eighth of what
//! is used. Rows can be taken out (one sequence, only the positions it uses), padded at the front
//! and joined, which is what [`crate::decode::Decoder`] does as sequences leave and join a batch.

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

    /// Keeps only the batch rows in `rows` (episodes that are still generating).
    pub fn select_rows(&mut self, rows: &[usize]) {
        for buffer in [&mut self.keys, &mut self.values] {
            if let Some(t) = buffer.take() {
                let idx = crate::batch::row_index(rows, &t.device());
                *buffer = Some(t.select(0, idx));
            }
        }
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

    /// `rows` rows of `len` zero positions, with `like`'s heads, head size, dtype and device.
    fn zeros_like(like: &Self, rows: usize, len: usize) -> Self {
        let make = |t: &Option<Tensor<B, 4>>| {
            t.as_ref().map(|t| {
                let [_, h, _, d] = t.dims();
                Tensor::<B, 4>::zeros([rows, h, len, d], (&t.device(), t.dtype()))
            })
        };
        Self {
            keys: make(&like.keys),
            values: make(&like.values),
            len,
        }
    }

    /// `n` empty positions before the cached ones (masked out by whoever uses them).
    fn pad_front(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        let len = self.len;
        for buffer in [&mut self.keys, &mut self.values] {
            if let Some(t) = buffer.take() {
                let [b, h, _, d] = t.dims();
                let fresh = Tensor::<B, 4>::zeros([b, h, n + len, d], (&t.device(), t.dtype()));
                *buffer = Some(fresh.slice_assign([0..b, 0..h, n..n + len, 0..d], t.slice([0..b, 0..h, 0..len, 0..d])));
            }
        }
        self.len += n;
    }

    /// Drops the first `n` cached positions, copying the rest into buffers of their size.
    fn trim_front(&mut self, n: usize) {
        let len = self.len;
        for buffer in [&mut self.keys, &mut self.values] {
            if let Some(t) = buffer.take() {
                let [b, h, _, d] = t.dims();
                let fresh = Tensor::<B, 4>::zeros([b, h, len - n, d], (&t.device(), t.dtype()));
                *buffer = Some(fresh.slice_assign([0..b, 0..h, 0..len - n, 0..d], t.slice([0..b, 0..h, n..len, 0..d])));
            }
        }
        self.len = len - n;
    }

    /// The rows of `parts` (each of the same length) in one cache, in order.
    fn concat_rows(parts: Vec<Self>) -> Self {
        let len = parts.first().map_or(0, |p| p.len);
        debug_assert!(parts.iter().all(|p| p.len == len), "joined caches differ in length");
        let used = |t: Tensor<B, 4>| {
            let [b, h, _, d] = t.dims();
            t.slice([0..b, 0..h, 0..len, 0..d])
        };
        let (keys, values): (Vec<_>, Vec<_>) = parts
            .into_iter()
            .filter_map(|p| p.keys.zip(p.values))
            .map(|(k, v)| (used(k), used(v)))
            .unzip();
        let join = |t: Vec<Tensor<B, 4>>| (!t.is_empty()).then(|| Tensor::cat(t, 0));
        Self {
            keys: join(keys),
            values: join(values),
            len,
        }
    }
}

/// The capacity a buffer gets when it must hold `needed` positions: an eighth more, at least
/// [`GROWTH_STEP`] more, rounded up to a multiple of [`GROWTH_STEP`].
pub fn grown_capacity(needed: usize) -> usize {
    (needed + (needed / 8).max(GROWTH_STEP)).div_ceil(GROWTH_STEP) * GROWTH_STEP
}

/// The smallest growth of a cache buffer, in positions.
pub const GROWTH_STEP: usize = 32;

/// Returns a buffer with room for `needed` positions holding the old buffer's contents.
fn grow<B: Backend>(buffer: Option<Tensor<B, 4>>, like: &Tensor<B, 4>, needed: usize) -> Tensor<B, 4> {
    let [b, h, _, d] = like.dims();
    match buffer {
        Some(buf) if buf.dims()[2] >= needed => buf,
        old => {
            let capacity = grown_capacity(needed);
            let fresh = Tensor::<B, 4>::zeros([b, h, capacity, d], (&like.device(), like.dtype()));
            match old {
                Some(old) => {
                    let used = old.dims()[2];
                    fresh.slice_assign([0..b, 0..h, 0..used, 0..d], old)
                }
                None => fresh,
            }
        }
    }
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

    /// Keeps only the batch rows in `rows`, in that order.
    pub fn select_rows(&mut self, rows: &[usize]) {
        for layer in &mut self.layers {
            layer.select_rows(rows);
        }
    }

    /// Batch row `row` alone as a cache of one row, holding only the positions `slots` (in
    /// that order) in buffers of exactly that size: a sequence leaving a batch, its padding
    /// dropped.
    pub fn take_row(&self, row: usize, slots: &[usize]) -> Self {
        Self {
            layers: self.layers.iter().map(|l| l.take_row(row, slots)).collect(),
        }
    }

    /// `rows` rows of `len` zero positions (to be masked out), shaped as `like`'s.
    pub fn zeros_like(like: &Self, rows: usize, len: usize) -> Self {
        Self {
            layers: like.layers.iter().map(|l| LayerKvCache::zeros_like(l, rows, len)).collect(),
        }
    }

    /// Puts `n` empty positions before the cached ones in every row (to be masked out).
    pub fn pad_front(&mut self, n: usize) {
        for layer in &mut self.layers {
            layer.pad_front(n);
        }
    }

    /// Drops the first `n` cached positions of every row (padding no row uses any more), freeing
    /// their memory.
    pub fn trim_front(&mut self, n: usize) {
        for layer in &mut self.layers {
            layer.trim_front(n.min(layer.len));
        }
    }

    /// The rows of `parts`, all of one length and with the same number of layers, as one cache.
    pub fn concat_rows(parts: Vec<Self>) -> Self {
        let layers = parts.first().map_or(0, |p| p.layers.len());
        let mut per_layer: Vec<Vec<LayerKvCache<B>>> = (0..layers).map(|_| Vec::with_capacity(parts.len())).collect();
        for part in parts {
            for (i, layer) in part.layers.into_iter().enumerate() {
                per_layer[i].push(layer);
            }
        }
        Self {
            layers: per_layer.into_iter().map(LayerKvCache::concat_rows).collect(),
        }
    }
}
