//! Seeded batches over epochs, with a cursor that can be saved and restored so that a run
//! resumes mid-epoch exactly where it stopped.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::shuffle::permutation;

/// How batches are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerConfig {
    /// Examples per batch (> 0).
    pub batch_size: usize,
    /// Seed of the per-epoch shuffles.
    pub seed: u64,
    /// Shuffle every epoch (otherwise file order).
    pub shuffle: bool,
    /// Drop an epoch's last batch when it is smaller than `batch_size`.
    pub drop_last: bool,
}

/// Where a sampler stands; serialise it with a checkpoint and give it to
/// [`BatchSampler::resume`] to continue with exactly the batches that would have come next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    /// How batches are drawn.
    pub config: SamplerConfig,
    /// Number of examples the sampler was made for.
    pub dataset_len: usize,
    /// Completed epochs: the epoch the next batch comes from.
    pub epoch: u64,
    /// Position in this epoch's order of the next example to draw.
    pub position: usize,
}

/// One batch: indices into the dataset, and the epoch they belong to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// The epoch (from 0).
    pub epoch: u64,
    /// Dataset indices, in draw order.
    pub indices: Vec<usize>,
}

/// A sampler or a cursor that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SamplerError {
    /// There is nothing to sample.
    #[error("cannot draw batches from an empty dataset")]
    EmptyDataset,
    /// A batch size of zero.
    #[error("batch size must be at least 1")]
    ZeroBatchSize,
    /// With `drop_last`, a batch larger than the dataset would drop every batch.
    #[error("batch size {batch_size} is larger than the dataset ({dataset_len} examples) and drop_last is set")]
    BatchLargerThanDataset {
        batch_size: usize,
        dataset_len: usize,
    },
    /// The cursor was saved for a dataset of another size.
    #[error("cursor was saved for {saved} examples but the dataset has {actual}")]
    DatasetChanged { saved: usize, actual: usize },
    /// The cursor's position is not one the sampler can reach.
    #[error(
        "cursor position {position} is not a batch boundary of an epoch of {dataset_len} examples"
    )]
    BadPosition { position: usize, dataset_len: usize },
}

/// Draws batches of dataset indices, epoch after epoch.
#[derive(Debug, Clone)]
pub struct BatchSampler {
    cursor: Cursor,
    order: Vec<usize>,
}

impl BatchSampler {
    /// A sampler at the start of epoch 0.
    pub fn new(dataset_len: usize, config: SamplerConfig) -> Result<Self, SamplerError> {
        Self::resume(
            Cursor {
                config,
                dataset_len,
                epoch: 0,
                position: 0,
            },
            dataset_len,
        )
    }

    /// A sampler continuing from `cursor`, for a dataset that now has `dataset_len` examples
    /// (which must be the size the cursor was saved for).
    pub fn resume(cursor: Cursor, dataset_len: usize) -> Result<Self, SamplerError> {
        let Cursor {
            config, position, ..
        } = cursor;
        if dataset_len == 0 {
            return Err(SamplerError::EmptyDataset);
        }
        if config.batch_size == 0 {
            return Err(SamplerError::ZeroBatchSize);
        }
        if config.drop_last && config.batch_size > dataset_len {
            return Err(SamplerError::BatchLargerThanDataset {
                batch_size: config.batch_size,
                dataset_len,
            });
        }
        if cursor.dataset_len != dataset_len {
            return Err(SamplerError::DatasetChanged {
                saved: cursor.dataset_len,
                actual: dataset_len,
            });
        }
        if position >= dataset_len || position % config.batch_size != 0 {
            return Err(SamplerError::BadPosition {
                position,
                dataset_len,
            });
        }
        Ok(Self {
            order: epoch_order(&cursor),
            cursor,
        })
    }

    /// Where the sampler stands now (save it to resume later).
    pub fn cursor(&self) -> Cursor {
        self.cursor
    }

    /// The epoch the next batch comes from.
    pub fn epoch(&self) -> u64 {
        self.cursor.epoch
    }

    /// Number of batches in one epoch.
    #[cfg(test)]
    pub fn batches_per_epoch(&self) -> usize {
        let Cursor {
            config,
            dataset_len,
            ..
        } = self.cursor;
        if config.drop_last {
            dataset_len / config.batch_size
        } else {
            dataset_len.div_ceil(config.batch_size)
        }
    }

    /// The next batch; moves to the next epoch (reshuffled) when this one is used up.
    pub fn next_batch(&mut self) -> Batch {
        let size = self.cursor.config.batch_size;
        let start = self.cursor.position;
        let end = (start + size).min(self.order.len());
        let batch = Batch {
            epoch: self.cursor.epoch,
            indices: self.order[start..end].to_vec(),
        };
        self.cursor.position = end;
        let remaining = self.order.len() - end;
        if remaining == 0 || (self.cursor.config.drop_last && remaining < size) {
            self.cursor.epoch += 1;
            self.cursor.position = 0;
            self.order = epoch_order(&self.cursor);
        }
        batch
    }
}

fn epoch_order(cursor: &Cursor) -> Vec<usize> {
    if cursor.config.shuffle {
        permutation(cursor.dataset_len, cursor.config.seed, cursor.epoch)
    } else {
        (0..cursor.dataset_len).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(batch_size: usize, shuffle: bool, drop_last: bool) -> SamplerConfig {
        SamplerConfig {
            batch_size,
            seed: 42,
            shuffle,
            drop_last,
        }
    }

    #[test]
    fn in_order_batches_with_a_short_last_one() {
        let mut s = BatchSampler::new(5, config(2, false, false)).unwrap();
        assert_eq!(s.batches_per_epoch(), 3);
        let batches: Vec<Batch> = (0..4).map(|_| s.next_batch()).collect();
        assert_eq!(
            batches[0],
            Batch {
                epoch: 0,
                indices: vec![0, 1]
            }
        );
        assert_eq!(
            batches[2],
            Batch {
                epoch: 0,
                indices: vec![4]
            }
        );
        assert_eq!(
            batches[3],
            Batch {
                epoch: 1,
                indices: vec![0, 1]
            }
        );
    }

    #[test]
    fn drop_last_skips_the_short_batch() {
        let mut s = BatchSampler::new(5, config(2, false, true)).unwrap();
        assert_eq!(s.batches_per_epoch(), 2);
        s.next_batch();
        s.next_batch();
        assert_eq!(s.cursor().epoch, 1);
        assert_eq!(s.next_batch().indices, vec![0, 1]);
    }

    #[test]
    fn each_epoch_is_a_new_permutation_of_everything() {
        let mut s = BatchSampler::new(10, config(5, true, false)).unwrap();
        let mut epoch0: Vec<usize> = [s.next_batch().indices, s.next_batch().indices].concat();
        let epoch1: Vec<usize> = [s.next_batch().indices, s.next_batch().indices].concat();
        assert_ne!(epoch0, epoch1);
        epoch0.sort_unstable();
        assert_eq!(epoch0, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn same_seed_same_batches() {
        let draw = |seed| {
            let mut s = BatchSampler::new(
                50,
                SamplerConfig {
                    seed,
                    ..config(8, true, false)
                },
            )
            .unwrap();
            (0..20).map(|_| s.next_batch().indices).collect::<Vec<_>>()
        };
        assert_eq!(draw(1), draw(1));
        assert_ne!(draw(1), draw(2));
    }

    #[test]
    fn resumes_mid_epoch_exactly_after_a_json_round_trip() {
        let mut original = BatchSampler::new(23, config(4, true, false)).unwrap();
        for _ in 0..9 {
            original.next_batch();
        }
        let saved = serde_json::to_string(&original.cursor()).unwrap();
        let cursor: Cursor = serde_json::from_str(&saved).unwrap();
        assert_eq!((cursor.epoch, cursor.position), (1, 12));
        let mut resumed = BatchSampler::resume(cursor, 23).unwrap();
        for _ in 0..15 {
            assert_eq!(resumed.next_batch(), original.next_batch());
        }
    }

    #[test]
    fn rejects_unusable_settings_and_cursors() {
        assert_eq!(
            BatchSampler::new(0, config(1, true, false)).unwrap_err(),
            SamplerError::EmptyDataset
        );
        assert_eq!(
            BatchSampler::new(3, config(0, true, false)).unwrap_err(),
            SamplerError::ZeroBatchSize
        );
        assert!(matches!(
            BatchSampler::new(3, config(4, true, true)),
            Err(SamplerError::BatchLargerThanDataset { .. })
        ));
        let cursor = BatchSampler::new(10, config(4, true, false))
            .unwrap()
            .cursor();
        assert_eq!(
            BatchSampler::resume(cursor, 11).unwrap_err(),
            SamplerError::DatasetChanged {
                saved: 10,
                actual: 11
            }
        );
        for position in [3, 12] {
            assert!(matches!(
                BatchSampler::resume(Cursor { position, ..cursor }, 10),
                Err(SamplerError::BadPosition { .. })
            ));
        }
    }
}
