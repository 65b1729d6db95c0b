//! Blocking limits on how many requests run at once and how many start per minute.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A counting semaphore: at most `permits` holders at once.
#[derive(Debug)]
pub struct Semaphore {
    free: Mutex<usize>,
    released: Condvar,
}

/// A held permit; dropping it frees the slot.
#[derive(Debug)]
pub struct Permit<'a> {
    semaphore: &'a Semaphore,
}

impl Semaphore {
    /// A semaphore with `permits` slots (at least one).
    pub fn new(permits: usize) -> Self {
        Self {
            free: Mutex::new(permits.max(1)),
            released: Condvar::new(),
        }
    }

    /// Blocks until a slot is free and takes it.
    #[cfg(test)]
    pub fn acquire(&self) -> Permit<'_> {
        let mut free = lock(&self.free);
        while *free == 0 {
            free = self
                .released
                .wait(free)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        *free -= 1;
        Permit { semaphore: self }
    }

    /// Blocks until a slot is free and takes it, or gives `None` at `deadline`.
    pub fn acquire_until(&self, deadline: Instant) -> Option<Permit<'_>> {
        let mut free = lock(&self.free);
        while *free == 0 {
            let left = deadline.checked_duration_since(Instant::now())?;
            free = self
                .released
                .wait_timeout(free, left)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
        *free -= 1;
        Some(Permit { semaphore: self })
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        *lock(&self.semaphore.free) += 1;
        self.semaphore.released.notify_one();
    }
}

/// Spaces request starts evenly so that at most `per_minute` start in any minute (no bursts).
#[derive(Debug)]
pub struct RateLimiter {
    interval: Duration,
    next_slot: Mutex<Option<Instant>>,
}

impl RateLimiter {
    /// A limiter for `per_minute` starts per minute (at least one).
    pub fn per_minute(per_minute: u32) -> Self {
        Self {
            interval: Duration::from_secs(60) / per_minute.max(1),
            next_slot: Mutex::new(None),
        }
    }

    /// Reserves the next start time at or after `now`.
    pub fn reserve(&self, now: Instant) -> Instant {
        let mut next = lock(&self.next_slot);
        let slot = next.map_or(now, |next| next.max(now));
        *next = Some(slot + self.interval);
        slot
    }

    /// Blocks until this caller may start a request.
    pub fn wait(&self) {
        let now = Instant::now();
        let slot = self.reserve(now);
        if slot > now {
            std::thread::sleep(slot - now);
        }
    }

    /// Blocks until this caller may start a request and gives `true`, or gives `false` at once
    /// when its turn would come after `deadline` (the reserved turn then goes unused).
    pub fn wait_until(&self, deadline: Instant) -> bool {
        let now = Instant::now();
        let slot = self.reserve(now);
        if slot > deadline {
            return false;
        }
        if slot > now {
            std::thread::sleep(slot - now);
        }
        true
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_semaphore_gives_up_at_the_deadline() {
        let semaphore = Semaphore::new(1);
        let held = semaphore.acquire();
        let t0 = Instant::now();
        assert!(semaphore
            .acquire_until(t0 + Duration::from_millis(50))
            .is_none());
        assert!(t0.elapsed() >= Duration::from_millis(50));
        drop(held);
        assert!(semaphore
            .acquire_until(Instant::now() + Duration::from_millis(50))
            .is_some());
    }

    #[test]
    fn a_rate_limited_turn_past_the_deadline_is_refused_at_once() {
        let limiter = RateLimiter::per_minute(1);
        assert!(limiter.wait_until(Instant::now() + Duration::from_secs(1)));
        let t0 = Instant::now();
        assert!(!limiter.wait_until(t0 + Duration::from_secs(1)));
        assert!(t0.elapsed() < Duration::from_millis(500));
    }

    #[test]
    fn rate_limiter_spaces_reservations() {
        let limiter = RateLimiter::per_minute(120);
        let t0 = Instant::now();
        assert_eq!(limiter.reserve(t0), t0);
        assert_eq!(limiter.reserve(t0), t0 + Duration::from_millis(500));
        assert_eq!(limiter.reserve(t0), t0 + Duration::from_millis(1000));
        let later = t0 + Duration::from_secs(10);
        assert_eq!(limiter.reserve(later), later);
    }

    #[test]
    fn semaphore_hands_back_permits() {
        let semaphore = Semaphore::new(2);
        let a = semaphore.acquire();
        let _b = semaphore.acquire();
        assert_eq!(*lock(&semaphore.free), 0);
        drop(a);
        assert_eq!(*lock(&semaphore.free), 1);
        let _c = semaphore.acquire();
        assert_eq!(*lock(&semaphore.free), 0);
    }
}
