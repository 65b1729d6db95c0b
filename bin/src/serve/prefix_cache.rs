//! The prefix cache (vLLM's automatic prefix caching, per sequence): the sequences of ended
//! requests, parked in the worker's decoder with their KV caches, that a later request whose
//! prompt extends one of them takes over, so that only its new tokens are prefilled. A
//! multi-turn episode sends each turn as the previous turn's prompt plus the ids it returned
//! plus the environment's reply: each turn then prefills only what came since.
//!
//! This is the bookkeeping only: which sequence holds which tokens, for which policy variant,
//! within a bound in KV positions, the least recently cached dropped first. The worker parks
//! and finishes the decoder's sequences as it says.

use model::SequenceId;

/// One cached sequence.
#[derive(Debug, Clone)]
struct Entry {
    id: SequenceId,
    /// The LoRA adapter it ran with (`None`: the base alone).
    variant: Option<String>,
    /// Every token its cache holds.
    tokens: Vec<u32>,
    /// When it was cached (larger: more recent).
    cached_at: u64,
}

/// Cached sequences within `capacity` KV positions; a capacity of 0 turns caching off.
#[derive(Debug, Default)]
pub struct PrefixCache {
    capacity: usize,
    /// Positions of a KV block: a sequence holds its tokens rounded up to whole blocks.
    block: usize,
    held: usize,
    clock: u64,
    entries: Vec<Entry>,
}

impl PrefixCache {
    /// A cache of at most `capacity` positions (0: off), in blocks of `block` positions (the
    /// decoder's [`model::qwen3::BLOCK_SIZE`]; a short prompt still holds a whole block).
    pub fn new(capacity: usize, block: usize) -> Self {
        Self {
            capacity,
            block: block.max(1),
            ..Self::default()
        }
    }

    /// Positions `tokens` hold in the decoder's pool: whole blocks.
    fn positions(&self, tokens: &[u32]) -> usize {
        tokens.len().div_ceil(self.block) * self.block
    }

    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    /// Positions held.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.held
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Takes out the sequence of `variant` whose tokens are the longest prefix of `prompt`,
    /// strictly shorter than it (the request needs at least one token to prefill to get its
    /// first logits); returns its id and how many tokens it holds.
    pub fn take(&mut self, variant: Option<&str>, prompt: &[u32]) -> Option<(SequenceId, usize)> {
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| {
                e.variant.as_deref() == variant
                    && e.tokens.len() < prompt.len()
                    && prompt.starts_with(&e.tokens)
            })
            .max_by_key(|(_, e)| (e.tokens.len(), e.cached_at))
            .map(|(at, _)| at)?;
        let entry = self.entries.swap_remove(best);
        self.held -= self.positions(&entry.tokens);
        Some((entry.id, entry.tokens.len()))
    }

    /// Caches sequence `id` of `variant` holding `tokens`; returns the sequences to finish
    /// to stay within the bound, the least recently cached first (`id` itself when it alone
    /// is over it, or when caching is off).
    pub fn insert(
        &mut self,
        id: SequenceId,
        variant: Option<String>,
        tokens: Vec<u32>,
    ) -> Vec<SequenceId> {
        if tokens.is_empty() || self.positions(&tokens) > self.capacity {
            return vec![id];
        }
        self.clock += 1;
        self.held += self.positions(&tokens);
        self.entries.push(Entry {
            id,
            variant,
            tokens,
            cached_at: self.clock,
        });
        let mut evicted = Vec::new();
        while self.held > self.capacity {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.cached_at)
                .map(|(at, _)| at)
                .expect("positions are held by entries");
            let entry = self.entries.remove(oldest);
            self.held -= self.positions(&entry.tokens);
            evicted.push(entry.id);
        }
        evicted
    }

    /// Empties the cache (the policy changed); returns the sequences to finish.
    pub fn clear(&mut self) -> Vec<SequenceId> {
        self.held = 0;
        self.entries.drain(..).map(|e| e.id).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_prefix_of_the_same_variant_is_taken_once() {
        let mut cache = PrefixCache::new(100, 1);
        assert!(cache.insert(1, None, vec![1, 2]).is_empty());
        assert!(cache.insert(2, None, vec![1, 2, 3, 4]).is_empty());
        assert!(cache
            .insert(3, Some("a".into()), vec![1, 2, 3, 4, 5])
            .is_empty());
        assert!(cache.insert(4, None, vec![1, 9, 9]).is_empty());
        assert_eq!(cache.held(), 14);
        // Not a prefix, or not strictly shorter: no hit.
        assert_eq!(cache.take(None, &[7, 1, 2]), None);
        assert_eq!(cache.take(None, &[1]), None);
        assert_eq!(cache.take(Some("b"), &[1, 2, 3, 4, 5, 6]), None);
        // The base's longest prefix, not the adapter's longer one.
        assert_eq!(cache.take(None, &[1, 2, 3, 4, 5, 6]), Some((2, 4)));
        // Taken: the next such request finds the shorter one.
        assert_eq!(cache.take(None, &[1, 2, 3, 4, 5, 6]), Some((1, 2)));
        assert_eq!(cache.take(None, &[1, 2, 3, 4, 5, 6]), None);
        assert_eq!(cache.take(Some("a"), &[1, 2, 3, 4, 5, 6]), Some((3, 5)));
        // An equal-length prompt has nothing to prefill: no hit.
        assert_eq!(cache.take(None, &[1, 9, 9]), None);
        assert_eq!(cache.held(), 3);
        assert_eq!(cache.clear(), vec![4]);
        assert_eq!((cache.held(), cache.len()), (0, 0));
    }

    #[test]
    fn the_least_recently_cached_go_first() {
        let mut cache = PrefixCache::new(10, 1);
        assert!(cache.insert(1, None, vec![1; 4]).is_empty());
        assert!(cache.insert(2, None, vec![2; 4]).is_empty());
        assert_eq!(cache.take(None, &[1; 5]), Some((1, 4)));
        // Taken and cached again (its row ended): now the most recent.
        assert!(cache.insert(1, None, vec![1; 6]).is_empty());
        assert_eq!(cache.insert(3, None, vec![3; 3]), vec![2]);
        assert_eq!(cache.held(), 9);
        assert_eq!(cache.insert(4, None, vec![4; 5]), vec![1]);
        assert_eq!(cache.held(), 8);
        // Over the bound alone, or caching off: finished at once.
        assert_eq!(cache.insert(5, None, vec![5; 11]), vec![5]);
        assert_eq!(PrefixCache::new(0, 1).insert(6, None, vec![6]), vec![6]);
        assert!(!PrefixCache::new(0, 1).enabled());
        assert_eq!(cache.len(), 2);
    }

    /// The bound counts whole blocks, as the decoder holds them: short prompts took a block
    /// each while being counted by their tokens, up to 16 times the bound.
    #[test]
    fn the_bound_counts_whole_blocks() {
        let mut cache = PrefixCache::new(64, 16);
        for id in 0..4 {
            assert!(cache.insert(id, None, vec![id as u32; 3]).is_empty());
        }
        assert_eq!(cache.held(), 64);
        assert_eq!(cache.insert(4, None, vec![9; 17]), vec![0, 1]);
        assert_eq!(cache.held(), 64);
        assert_eq!(cache.insert(5, None, vec![7; 65]), vec![5], "over the bound alone");
    }
}
