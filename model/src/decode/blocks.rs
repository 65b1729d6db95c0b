//! The paged pool's blocks ([`BlockPool`]: which are free, how many sequences hold each) and
//! the index of full blocks by their tokens ([`PrefixIndex`]), for sequences to share prefixes.

use std::collections::HashMap;

use crate::qwen3::{grown_capacity, BLOCK_SIZE};

/// Which blocks of the pool are free, and how many sequences hold each of the others. Block 0
/// holds the scratch slot; it is never handed out.
#[derive(Debug, Default)]
pub(super) struct BlockPool {
    /// Blocks the pool has (0 before the first sequence, else at least the scratch block).
    pub(super) total: usize,
    pub(super) free: Vec<usize>,
    /// Holders of each block (0 for free blocks and the scratch block).
    pub(super) holders: Vec<u32>,
}

impl BlockPool {
    /// Blocks in use, the scratch block included.
    pub(super) fn used(&self) -> usize {
        self.total - self.free.len()
    }

    /// `n` blocks, the pool grown (by [`grown_capacity`], within `cap` blocks) when too few are
    /// free; `None` when even `cap` blocks would not hold them.
    pub(super) fn take(&mut self, n: usize, cap: Option<usize>) -> Option<Vec<usize>> {
        if self.free.len() < n {
            let needed = self.total.max(1) + n - self.free.len();
            let grown = grown_capacity(needed * BLOCK_SIZE) / BLOCK_SIZE;
            let total = cap.map_or(grown, |cap| grown.min(cap));
            if total < needed {
                return None;
            }
            // Taken from the end: the lowest new blocks first.
            self.free.extend((self.total.max(1)..total).rev());
            self.total = total;
            self.holders.resize(total, 0);
        }
        let blocks: Vec<usize> = (0..n).map(|_| self.free.pop().expect("checked above")).collect();
        for &b in &blocks {
            self.holders[b] = 1;
        }
        Some(blocks)
    }

    /// One more holder of `block`.
    pub(super) fn share(&mut self, block: usize) {
        self.holders[block] += 1;
    }

    /// Lets go of `blocks`; those with no holder left are freed and returned. The next `take`
    /// hands freed blocks out again in their order (consecutive blocks stay consecutive, one
    /// run for the attention).
    pub(super) fn give_back(&mut self, blocks: Vec<usize>) -> Vec<usize> {
        let freed: Vec<usize> = blocks
            .into_iter()
            .filter(|&b| {
                self.holders[b] -= 1;
                self.holders[b] == 0
            })
            .collect();
        self.free.extend(freed.iter().rev());
        freed
    }
}

/// A full block as the prefix index knows it: the block before it ([`NO_PARENT`] for a
/// sequence's first) and its tokens. The block before stands for the whole prefix: an indexed
/// block is only ever held with the blocks before it, so it is freed (and leaves the index)
/// no later than they are.
type BlockKey = (usize, [u32; BLOCK_SIZE]);

/// The parent of a sequence's first block in a [`BlockKey`].
pub(super) const NO_PARENT: usize = usize::MAX;

/// The full blocks sequences computed, by what they hold (see
/// [`DecoderLimits::share_prefixes`](super::DecoderLimits::share_prefixes)).
#[derive(Debug, Default)]
pub(super) struct PrefixIndex {
    blocks: HashMap<BlockKey, usize>,
    pub(super) keys: HashMap<usize, BlockKey>,
}

impl PrefixIndex {
    /// The key of block `k` of a sequence of `tokens` held in `blocks`.
    pub(super) fn key(tokens: &[u32], blocks: &[usize], k: usize) -> BlockKey {
        let parent = if k == 0 { NO_PARENT } else { blocks[k - 1] };
        let held: [u32; BLOCK_SIZE] = tokens[k * BLOCK_SIZE..(k + 1) * BLOCK_SIZE].try_into().expect("a full block");
        (parent, held)
    }

    /// Indexes `block` as `key`, unless another block already holds that prefix; whether it is
    /// indexed now.
    pub(super) fn insert(&mut self, key: BlockKey, block: usize) -> bool {
        if self.keys.contains_key(&block) {
            return true;
        }
        if self.blocks.contains_key(&key) {
            return false;
        }
        self.blocks.insert(key, block);
        self.keys.insert(block, key);
        true
    }

    /// Forgets freed `blocks`.
    pub(super) fn remove(&mut self, blocks: &[usize]) {
        for b in blocks {
            if let Some(key) = self.keys.remove(b) {
                self.blocks.remove(&key);
            }
        }
    }

    /// The indexed blocks `tokens` begin with, leaving at least one token after them (a
    /// sequence must prefill a token to get its next-token logits).
    pub(super) fn lookup(&self, tokens: &[u32]) -> Vec<usize> {
        let mut found: Vec<usize> = Vec::new();
        while (found.len() + 1) * BLOCK_SIZE < tokens.len() {
            match self.blocks.get(&Self::key(tokens, &found, found.len())) {
                Some(&b) => found.push(b),
                None => break,
            }
        }
        found
    }
}
