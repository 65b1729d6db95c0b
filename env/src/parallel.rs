//! Running many blocking calls on a bounded number of threads.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::throttle::RateLimiter;

/// Runs blocking work items on at most `max_threads` scoped threads, optionally spacing the
/// starts with a [`RateLimiter`].
#[derive(Debug)]
pub struct ParallelRunner {
    max_threads: usize,
    limiter: Option<RateLimiter>,
}

impl ParallelRunner {
    /// A runner with `max_threads` workers (at least one) and no rate cap.
    pub fn new(max_threads: usize) -> Self {
        Self {
            max_threads: max_threads.max(1),
            limiter: None,
        }
    }

    /// Also caps starts at `per_minute` per minute.
    pub fn with_requests_per_minute(mut self, per_minute: u32) -> Self {
        self.limiter = Some(RateLimiter::per_minute(per_minute));
        self
    }

    /// Applies `work` to every item and returns the results in item order. Items are taken from
    /// a shared queue, so a slow item does not hold up the others' workers.
    pub fn map<T, R, F>(&self, items: &[T], work: F) -> Vec<R>
    where
        T: Sync,
        R: Send,
        F: Fn(usize, &T) -> R + Sync,
    {
        let run = |index: usize, item: &T| {
            if let Some(limiter) = &self.limiter {
                limiter.wait();
            }
            work(index, item)
        };
        let threads = self.max_threads.min(items.len());
        if threads <= 1 {
            return items
                .iter()
                .enumerate()
                .map(|(i, item)| run(i, item))
                .collect();
        }
        let next = AtomicUsize::new(0);
        let mut slots: Vec<Option<R>> = std::iter::repeat_with(|| None).take(items.len()).collect();
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut done = Vec::new();
                        loop {
                            let index = next.fetch_add(1, Ordering::Relaxed);
                            let Some(item) = items.get(index) else { break };
                            done.push((index, run(index, item)));
                        }
                        done
                    })
                })
                .collect();
            for worker in workers {
                match worker.join() {
                    Ok(done) => {
                        for (index, result) in done {
                            slots[index] = Some(result);
                        }
                    }
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
        });
        slots.into_iter().flatten().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_keep_item_order_and_threads_stay_capped() {
        let running = AtomicUsize::new(0);
        let peak = AtomicUsize::new(0);
        let items: Vec<u32> = (0..40).collect();
        let out = ParallelRunner::new(3).map(&items, |index, item| {
            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(now, Ordering::SeqCst);
            std::thread::yield_now();
            running.fetch_sub(1, Ordering::SeqCst);
            (index, item * 2)
        });
        assert_eq!(
            out,
            (0..40).map(|i| (i as usize, i * 2)).collect::<Vec<_>>()
        );
        assert!(peak.load(Ordering::SeqCst) <= 3);
    }

    #[test]
    fn empty_and_single_inputs() {
        let runner = ParallelRunner::new(8).with_requests_per_minute(6000);
        assert!(runner.map(&[] as &[u8], |_, x| *x).is_empty());
        assert_eq!(runner.map(&[5u8], |_, x| *x + 1), vec![6]);
    }
}
