//! The process's global allocator: the system allocator for ordinary allocations, and, for the
//! large buffers tensors live in, anonymous mappings that are kept for reuse when freed.
//!
//! A training step on the CPU backend frees and re-allocates the same few hundred large tensor
//! buffers (activations, logits, gradients) on every step. The system allocator hands buffers
//! above its mmap threshold back to the kernel on free, so each new one is page-faulted and
//! zeroed by the kernel again: millions of page faults, a fifth of a step's time. Here a freed
//! large buffer goes into a small cache keyed by its mapped length and is handed out again for
//! the next request of that length. Buffers from 2 MiB up are mapped in whole 2 MiB units, so
//! that where transparent huge pages are on for all memory they can be backed by them. They are
//! not marked `MADV_HUGEPAGE`: under the common `defrag = madvise` setting that makes each fault
//! compact memory synchronously when no free huge page is at hand, which makes loading the 0.6B
//! model several times slower (BENCHMARKS.md, "the huge-page hint removed"); once the cache
//! serves a workload's buffers there are few faults left for huge pages to save.
//!
//! Two bounds keep the cache from costing memory:
//! - it raises the process's peak by at most a quarter: cached plus in-use large buffers stay
//!   within 1.25 × the most the process has had in use at once (with no headroom at all, a
//!   training step's gradients found no room among its freed activations and were mapped afresh
//!   every step). A request that needs a fresh mapping first unmaps the least recently freed
//!   cached buffers until the total fits, so buffers of lengths a workload stopped asking for (a
//!   finished prefill's, say) make way;
//! - it holds at most [`cache_limit`] bytes (set once at start-up by [`configure`]: the binary
//!   passes its `--alloc-cache-mb` / `PROMPT_R1_ALLOC_CACHE_MB`; default half of physical
//!   memory; 0 turns caching off), also by unmapping the least
//!   recently freed buffers first.
//!
//! When a new mapping still fails, the cache is emptied and the mapping tried again.

use std::alloc::{GlobalAlloc, Layout, System};
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Allocations of at least this many bytes are mapped and cached; smaller ones go to `System`.
const LARGE: usize = 1 << 20;
/// Page-sized granularity for large buffers below [`HUGE`].
const SMALL_UNIT: usize = 64 << 10;
/// From this size on, buffers are mapped in whole units of this size (a huge page's).
const HUGE: usize = 2 << 20;
/// Cached buffers kept at most (a fixed table: the allocator may not allocate for itself).
const SLOTS: usize = 4096;
/// Alignment every mapping has.
const PAGE: usize = 4096;
/// Cached plus in-use large buffers stay within the most in use at once plus 1/`PEAK_HEADROOM`
/// of it.
const PEAK_HEADROOM: usize = 4;
/// Not yet configured: [`configure`] has not run.
const UNSET: usize = usize::MAX;

static LIMIT: AtomicUsize = AtomicUsize::new(UNSET);
static CACHE: Mutex<Cache> = Mutex::new(Cache::EMPTY);

/// The allocator; install with `#[global_allocator]`.
pub struct CachingAllocator;

/// Free buffers, oldest first, and the bytes of large buffers in use.
struct Cache {
    /// `(address, mapped length)` of free buffers; the first `len` entries are used.
    blocks: [(*mut u8, usize); SLOTS],
    len: usize,
    /// Mapped bytes of the free buffers.
    bytes: usize,
    /// Mapped bytes handed out and not yet freed.
    live: usize,
    /// The most `live` has been.
    peak: usize,
}

// SAFETY: the raw pointers are owned mappings that no one else refers to while cached.
unsafe impl Send for Cache {}

impl Cache {
    const EMPTY: Cache = Cache { blocks: [(ptr::null_mut(), 0); SLOTS], len: 0, bytes: 0, live: 0, peak: 0 };

    /// Hands out the most recently freed block of this mapped length, if one is cached.
    fn take(&mut self, mapped: usize) -> Option<*mut u8> {
        let i = self.blocks[..self.len].iter().rposition(|&(_, l)| l == mapped)?;
        let (block, _) = self.blocks[i];
        self.blocks.copy_within(i + 1..self.len, i);
        self.len -= 1;
        self.bytes -= mapped;
        self.live += mapped;
        Some(block)
    }

    /// Counts a fresh mapping of `mapped` bytes as handed out; returns the least recently freed
    /// block to unmap first while cached plus live bytes would pass the peak before it plus
    /// its headroom.
    fn grow(&mut self, mapped: usize) -> Option<(*mut u8, usize)> {
        let bound = self.peak + self.peak / PEAK_HEADROOM;
        if self.len > 0 && self.bytes + self.live + mapped > bound {
            return Some(self.evict_oldest());
        }
        self.live += mapped;
        self.peak = self.peak.max(self.live);
        None
    }

    /// Takes a freed block back (`Ok`), or `Err` with the least recently freed block to unmap
    /// first while keeping it would pass `limit` or use more than every slot. `Err` with the
    /// block itself when it alone passes `limit`: it is unmapped, not cached.
    fn free(&mut self, block: *mut u8, mapped: usize, limit: usize) -> Result<(), (*mut u8, usize)> {
        if mapped > limit {
            self.live -= mapped;
            return Err((block, mapped));
        }
        if self.len == SLOTS || self.bytes + mapped > limit {
            return Err(self.evict_oldest());
        }
        self.live -= mapped;
        self.blocks[self.len] = (block, mapped);
        self.len += 1;
        self.bytes += mapped;
        Ok(())
    }

    fn evict_oldest(&mut self) -> (*mut u8, usize) {
        let oldest = self.blocks[0];
        self.blocks.copy_within(1..self.len, 0);
        self.len -= 1;
        self.bytes -= oldest.1;
        oldest
    }

    fn drain(&mut self) -> impl Iterator<Item = (*mut u8, usize)> + '_ {
        self.bytes = 0;
        let len = std::mem::take(&mut self.len);
        self.blocks[..len].iter().copied()
    }
}

/// Sets how many megabytes the cache of freed large buffers may hold (`None`: half of physical
/// memory; 0 turns it off). Call once, early in `main`; until then nothing is cached.
pub fn configure(limit_mb: Option<usize>) {
    let limit = limit_mb.map_or_else(default_limit, |mb| mb.saturating_mul(1 << 20));
    LIMIT.store(limit, Ordering::Relaxed);
}

/// Bytes the cache may hold (0 before [`configure`]).
pub fn cache_limit() -> usize {
    match LIMIT.load(Ordering::Relaxed) {
        UNSET => 0,
        limit => limit,
    }
}

/// Half of physical memory.
fn default_limit() -> usize {
    // SAFETY: sysconf has no preconditions.
    let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    let physical = (pages.max(0) as usize).saturating_mul(page.max(0) as usize);
    physical / 2
}

/// Whether a layout is served by mappings (a pure function of the layout, so `dealloc` agrees
/// with `alloc`).
fn is_large(layout: Layout) -> bool {
    layout.size() >= LARGE && layout.align() <= PAGE
}

/// The mapped length for a large request.
fn mapped_len(size: usize) -> usize {
    let unit = if size >= HUGE { HUGE } else { SMALL_UNIT };
    size.div_ceil(unit) * unit
}

fn map(mapped: usize) -> *mut u8 {
    // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
    let attempt = || unsafe {
        libc::mmap(
            ptr::null_mut(),
            mapped,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    let mut block = attempt();
    if block == libc::MAP_FAILED {
        release_cache();
        block = attempt();
        if block == libc::MAP_FAILED {
            return ptr::null_mut();
        }
    }
    block.cast()
}

fn unmap(block: *mut u8, mapped: usize) {
    // SAFETY: `block` is a mapping of `mapped` bytes made by `map` and no longer referenced.
    unsafe { libc::munmap(block.cast(), mapped) };
}

/// Unmaps every cached buffer.
fn release_cache() {
    let mut drained = [(ptr::null_mut(), 0); SLOTS];
    let n = {
        let mut cache = lock_cache();
        let mut n = 0;
        for block in cache.drain() {
            drained[n] = block;
            n += 1;
        }
        n
    };
    for &(block, mapped) in &drained[..n] {
        unmap(block, mapped);
    }
}

/// A large buffer: from the cache when one of the same mapped length is free (`Ok`, contents
/// arbitrary), else a fresh zeroed mapping (`Err`, null when the system has no memory left).
fn large_block(mapped: usize) -> Result<*mut u8, *mut u8> {
    loop {
        let mut cache = lock_cache();
        if let Some(block) = cache.take(mapped) {
            return Ok(block);
        }
        match cache.grow(mapped) {
            Some((oldest, length)) => {
                drop(cache);
                unmap(oldest, length);
            }
            None => break,
        }
    }
    let block = map(mapped);
    if block.is_null() {
        lock_cache().live -= mapped;
    }
    Err(block)
}

fn lock_cache() -> std::sync::MutexGuard<'static, Cache> {
    CACHE.lock().unwrap_or_else(|e| e.into_inner())
}

unsafe impl GlobalAlloc for CachingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !is_large(layout) {
            // SAFETY: forwarded with the caller's guarantees.
            return unsafe { System.alloc(layout) };
        }
        large_block(mapped_len(layout.size())).unwrap_or_else(|fresh| fresh)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !is_large(layout) {
            // SAFETY: forwarded with the caller's guarantees.
            return unsafe { System.alloc_zeroed(layout) };
        }
        match large_block(mapped_len(layout.size())) {
            Ok(reused) => {
                // SAFETY: the block is at least `layout.size()` bytes and ours.
                unsafe { ptr::write_bytes(reused, 0, layout.size()) };
                reused
            }
            Err(fresh) => fresh,
        }
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        if !is_large(layout) {
            // SAFETY: forwarded with the caller's guarantees.
            return unsafe { System.dealloc(block, layout) };
        }
        let (mapped, limit) = (mapped_len(layout.size()), cache_limit());
        loop {
            let kept = lock_cache().free(block, mapped, limit);
            match kept {
                Ok(()) => return,
                Err((unkept, length)) => {
                    unmap(unkept, length);
                    if unkept == block {
                        return;
                    }
                }
            }
        }
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller guarantees `new_size` forms a valid layout with this alignment.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        if !is_large(layout) && !is_large(new_layout) {
            // SAFETY: forwarded with the caller's guarantees.
            return unsafe { System.realloc(block, layout, new_size) };
        }
        if is_large(layout) && is_large(new_layout) && mapped_len(layout.size()) == mapped_len(new_size) {
            return block;
        }
        // SAFETY: a new block of the new layout, the overlap copied, the old one freed.
        unsafe {
            let moved = self.alloc(new_layout);
            if !moved.is_null() {
                ptr::copy_nonoverlapping(block, moved, layout.size().min(new_size));
                self.dealloc(block, layout);
            }
            moved
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapped_lengths_round_to_their_unit() {
        assert_eq!(mapped_len(LARGE), LARGE);
        assert_eq!(mapped_len(LARGE + 1), LARGE + SMALL_UNIT);
        assert_eq!(mapped_len(HUGE), HUGE);
        assert_eq!(mapped_len(HUGE + 1), 2 * HUGE);
        assert!(!is_large(Layout::from_size_align(LARGE - 1, 8).unwrap()));
        assert!(is_large(Layout::from_size_align(LARGE, 64).unwrap()));
        assert!(!is_large(Layout::from_size_align(LARGE, 2 * PAGE).unwrap()));
    }

    #[test]
    fn cache_reuses_the_latest_block_of_a_length_and_unmaps_the_oldest_first() {
        let mut cache = Cache::EMPTY;
        let [a, b, c, d] = [0x1000, 0x2000, 0x3000, 0x4000].map(|p| p as *mut u8);
        let limit = 4 * HUGE;
        for mapped in [HUGE, 2 * HUGE, HUGE] {
            assert_eq!(cache.grow(mapped), None, "nothing cached to give up");
        }
        assert_eq!((cache.live, cache.peak), (4 * HUGE, 4 * HUGE));
        for (block, mapped) in [(a, HUGE), (b, 2 * HUGE), (c, HUGE)] {
            assert_eq!(cache.free(block, mapped, limit), Ok(()));
        }
        assert_eq!((cache.live, cache.bytes), (0, 4 * HUGE));
        assert_eq!(cache.take(HUGE), Some(c), "the most recent of two of one length");
        assert_eq!(cache.free(c, HUGE, limit), Ok(()));

        // A length not cached: the oldest buffers are given up until cached + live fit the peak
        // plus its headroom, 4 + 1 units here.
        assert_eq!(4 * HUGE / PEAK_HEADROOM, HUGE, "the figures below assume a quarter");
        assert_eq!(cache.grow(2 * HUGE), Some((a, HUGE)));
        assert_eq!(cache.grow(2 * HUGE), None);
        assert_eq!((cache.live, cache.bytes, cache.peak), (2 * HUGE, 3 * HUGE, 4 * HUGE));

        // Past the limit: the oldest cached buffers go first, a buffer over the limit itself.
        assert_eq!(cache.free(d, 2 * HUGE, 2 * HUGE), Err((b, 2 * HUGE)));
        assert_eq!(cache.free(d, 2 * HUGE, 2 * HUGE), Err((c, HUGE)));
        assert_eq!(cache.free(d, 2 * HUGE, 2 * HUGE), Ok(()));
        assert_eq!(cache.take(2 * HUGE), Some(d));
        assert_eq!(cache.free(d, 2 * HUGE, HUGE), Err((d, 2 * HUGE)));
        assert_eq!((cache.live, cache.bytes, cache.len), (0, 0, 0));

        assert_eq!(cache.grow(HUGE), None);
        assert_eq!(cache.free(a, HUGE, limit), Ok(()));
        assert_eq!(cache.drain().count(), 1);
        assert_eq!((cache.len, cache.bytes), (0, 0));
    }

    #[test]
    fn large_blocks_are_usable_zeroed_reused_and_reallocated() {
        let a = CachingAllocator;
        LIMIT.store(64 << 20, Ordering::Relaxed);
        // An odd length no other test in this binary asks for, so the freed block is still
        // cached when it is asked for again.
        let layout = Layout::from_size_align(13 * HUGE + 5, 64).unwrap();
        // SAFETY: every block is used within its layout and freed with it.
        unsafe {
            let p = a.alloc_zeroed(layout);
            assert!(!p.is_null() && p as usize % 64 == 0);
            let s = std::slice::from_raw_parts_mut(p, layout.size());
            assert!(s.iter().all(|&x| x == 0));
            s.fill(7);
            a.dealloc(p, layout);
            let q = a.alloc_zeroed(layout);
            assert_eq!(q, p, "the freed block is handed out again");
            let s = std::slice::from_raw_parts_mut(q, layout.size());
            assert!(s.iter().all(|&x| x == 0), "a reused block is zeroed on request");
            s[..16].copy_from_slice(&[9; 16]);
            let r = a.realloc(q, layout, 8 * HUGE);
            assert_eq!(std::slice::from_raw_parts(r, 16), &[9; 16]);
            let r2 = a.realloc(r, Layout::from_size_align(8 * HUGE, 64).unwrap(), 100);
            assert_eq!(std::slice::from_raw_parts(r2, 16), &[9; 16]);
            a.dealloc(r2, Layout::from_size_align(100, 64).unwrap());
        }
    }
}
