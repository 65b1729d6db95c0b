//! The whole pages CubeCL's memory pool reserves on CUDA. CubeCL 0.10 configures cubecl-cuda's
//! pool one way (`cubecl-runtime`'s `MemoryConfiguration::SubSlices`, pages of at most a quarter
//! of the GPU's memory, slices aligned to 512 bytes) and keeps a freed slice for later tensors of
//! its page's class. A tensor goes to the first class whose slices are large enough, or whose
//! page it fills to within a fifth; each class reserves whole pages of its size, and a page holds
//! as many of a class's tensors as fit one after the other. On an 80 GiB GPU: pages of 20 MiB
//! (tensors up to 640 KiB), 80 MiB (5 MiB), 320 MiB (40 MiB), 1.25 GiB (320 MiB), 5 GiB
//! (2.5 GiB) and 20 GiB (anything larger, up to 20 GiB: a larger tensor cannot be allocated).
//! The weights take slices of these pages too (the loader does not ask burn for persistent
//! memory); the rest of a class's last page holds that class's later tensors, so they are left
//! to the plan's margin with the holes frees leave.

/// Bytes every slice of a page is aligned to (cubecl-cuda's `mem_alignment`).
const ALIGNMENT: u64 = 512;

/// Page sizes at and above which the pool adds a smaller class (cubecl-runtime's `32 MB`).
const SMALLEST_SPLIT: u64 = 32 << 20;

/// One size class: its pages and the largest tensor it takes without filling a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PageClass {
    page: u64,
    max_slice: u64,
}

impl PageClass {
    /// Whether a tensor of `bytes` goes to this class: its slices are large enough, or it fills
    /// a page to within a fifth.
    fn accepts(self, bytes: u64) -> bool {
        self.max_slice >= bytes || self.page.checked_sub(bytes).is_some_and(|unused| unused * 5 < self.page)
    }
}

/// CubeCL's page classes on a CUDA GPU of a given memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaPages {
    /// Smallest first, as the pool tries them.
    classes: Vec<PageClass>,
}

/// Tensors of one size alive at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorGroup {
    pub bytes: u64,
    pub count: u64,
}

/// A tensor no class takes: larger than a quarter of the GPU's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooLarge {
    pub bytes: u64,
    /// The largest page, a quarter of the GPU's memory.
    pub largest_page: u64,
}

impl CudaPages {
    /// The classes of a GPU with `device_memory` bytes: the largest page a quarter of it, then
    /// a quarter of the one before while that is at least 32 MiB, the n-th smaller one taking
    /// tensors up to 1/2ⁿ of its page.
    pub fn new(device_memory: u64) -> Self {
        let largest = device_memory / 4 / ALIGNMENT * ALIGNMENT;
        let mut classes = Vec::new();
        let mut page = largest;
        let mut shift = 1;
        while page >= SMALLEST_SPLIT {
            page = (page / 4).next_multiple_of(ALIGNMENT);
            classes.push(PageClass { page, max_slice: page >> shift });
            shift += 1;
        }
        classes.reverse();
        classes.push(PageClass { page: largest, max_slice: largest });
        Self { classes }
    }

    /// The page a tensor of `bytes` takes a slice of, or `None` when no class takes it.
    pub fn page_for(&self, bytes: u64) -> Option<u64> {
        self.classes.iter().find(|c| c.accepts(bytes)).map(|c| c.page)
    }

    /// Bytes of the pages `groups` of tensors alive at once take: each class's tensors packed
    /// into its pages first fit, largest first. That is the pool at its best (no page left with
    /// holes by the order of frees), so a lower bound of what it reserves for them.
    pub fn reserved(&self, groups: &[TensorGroup]) -> Result<u64, TooLarge> {
        let mut slices: Vec<(u64, u64)> = Vec::new();
        for group in groups.iter().filter(|g| g.count > 0 && g.bytes > 0) {
            let page = self.page_for(group.bytes).ok_or(TooLarge {
                bytes: group.bytes,
                largest_page: self.classes.last().map_or(0, |c| c.page),
            })?;
            let slice = group.bytes.next_multiple_of(ALIGNMENT);
            slices.extend(std::iter::repeat_n((page, slice), group.count as usize));
        }
        slices.sort_unstable_by(|a, b| b.cmp(a));
        // The free bytes of each page reserved so far, with its size.
        let mut pages: Vec<(u64, u64)> = Vec::new();
        for (page, slice) in slices {
            match pages.iter_mut().find(|(size, free)| *size == page && *free >= slice) {
                Some((_, free)) => *free -= slice,
                None => pages.push((page, page - slice)),
            }
        }
        Ok(pages.iter().map(|(size, _)| size).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    #[test]
    fn an_80_gib_gpu_has_six_classes_up_to_a_quarter_of_it() {
        let pages = CudaPages::new(80 * GIB);
        let classes: Vec<(u64, u64)> = pages.classes.iter().map(|c| (c.page, c.max_slice)).collect();
        assert_eq!(
            classes,
            vec![
                (20 * MIB, 640 * 1024),
                (80 * MIB, 5 * MIB),
                (320 * MIB, 40 * MIB),
                (1280 * MIB, 320 * MIB),
                (5 * GIB, 5 * GIB / 2),
                (20 * GIB, 20 * GIB),
            ]
        );
        // A tensor that fills a page to within a fifth takes that page.
        assert_eq!(pages.page_for(300 * MIB), Some(320 * MIB));
        assert_eq!(pages.page_for(2 * GIB), Some(5 * GIB));
        assert_eq!(pages.page_for(3 * GIB), Some(20 * GIB));
        assert_eq!(pages.page_for(20 * GIB + 1), None);
    }

    #[test]
    fn tensors_share_their_class_pages_and_a_large_one_takes_a_quarter() {
        let pages = CudaPages::new(80 * GIB);
        // 72 key and value pools of 640 MiB: 8 to a 5 GiB page, 9 pages.
        let kv = TensorGroup { bytes: 640 * MIB, count: 72 };
        assert_eq!(pages.reserved(&[kv]), Ok(45 * GIB));
        // 700 MiB ones: 7 to a page, 11 pages.
        assert_eq!(pages.reserved(&[TensorGroup { bytes: 700 * MIB, count: 72 }]), Ok(55 * GIB));
        // One tensor above 2.5 GiB reserves 20 GiB; beside the pools it shares no page with them.
        let large = TensorGroup { bytes: 2700 * MIB, count: 1 };
        assert_eq!(pages.reserved(&[kv, large]), Ok(65 * GIB));
        // Seven of them share that page; an eighth needs another.
        assert_eq!(pages.reserved(&[TensorGroup { bytes: 2700 * MIB, count: 7 }]), Ok(20 * GIB));
        assert_eq!(pages.reserved(&[TensorGroup { bytes: 2700 * MIB, count: 8 }]), Ok(40 * GIB));
        let too_large = TensorGroup { bytes: 21 * GIB, count: 1 };
        assert_eq!(pages.reserved(&[kv, too_large]), Err(TooLarge { bytes: 21 * GIB, largest_page: 20 * GIB }));
        assert_eq!(pages.reserved(&[]), Ok(0));
    }
}
