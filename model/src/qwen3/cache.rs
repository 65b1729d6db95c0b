//! The KV cache: a value owned by the caller (one per batch of sequences being generated), not
//! state inside the model. Keys and values live in preallocated buffers that grow by doubling.

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
        let keys = keys.slice_assign([0..b, 0..h, self.len..end, 0..d], k);
        let values = values.slice_assign([0..b, 0..h, self.len..end, 0..d], v);
        self.len = end;
        let out = (
            keys.clone().slice([0..b, 0..h, 0..end, 0..d]),
            values.clone().slice([0..b, 0..h, 0..end, 0..d]),
        );
        self.keys = Some(keys);
        self.values = Some(values);
        out
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
}

/// Returns a buffer with room for `needed` positions holding the old buffer's contents.
fn grow<B: Backend>(buffer: Option<Tensor<B, 4>>, like: &Tensor<B, 4>, needed: usize) -> Tensor<B, 4> {
    let [b, h, _, d] = like.dims();
    match buffer {
        Some(buf) if buf.dims()[2] >= needed => buf,
        old => {
            let capacity = needed.next_power_of_two().max(16);
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

    /// Keeps only the batch rows in `rows`, in that order.
    pub fn select_rows(&mut self, rows: &[usize]) {
        for layer in &mut self.layers {
            layer.select_rows(rows);
        }
    }
}
