//! A process-wide lock around autodiff work. burn-autodiff 0.21 keeps its graph bookkeeping in
//! shared state, and a `backward()` on one thread can free autodiff steps another thread is
//! still building, silently losing a gradient (tracel-ai/burn#5573, fixed after 0.21). The
//! trainer trains on one thread, but a library must not rely on that: [`crate::grpo::learn_step`]
//! holds this lock, and so must any other code that runs `backward()` while another thread may.

use std::sync::{Mutex, MutexGuard};

static AUTODIFF: Mutex<()> = Mutex::new(());

/// Waits until no other thread holds the autodiff lock and takes it until the guard drops.
pub fn exclusive_autodiff() -> MutexGuard<'static, ()> {
    AUTODIFF.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_is_exclusive_and_survives_a_panicking_holder() {
        let handle = std::thread::spawn(|| {
            let _guard = exclusive_autodiff();
            panic!("a holder that panics poisons a std Mutex");
        });
        assert!(handle.join().is_err());
        // Taking it again works despite the poisoning, and it is held while the guard lives.
        let _guard = exclusive_autodiff();
        assert!(AUTODIFF.try_lock().is_err());
    }
}
