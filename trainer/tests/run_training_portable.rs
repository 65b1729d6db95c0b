//! A whole training run with the fused CPU kernels and the optimiser's CPU loops switched off
//! (`model::cpu_kernels::set_portable_ops`): rollouts, scoring, the GRPO loss, its gradients and AdamW all
//! run through burn's portable tensor ops, the path a CUDA host trains on. The policy learns as
//! it does with the kernels (see `run_training.rs` for the threshold).

mod common;

use common::{first_last_gap, setup, train};

#[test]
fn the_policy_learns_through_the_portable_ops() {
    model::cpu_kernels::set_portable_ops(true);
    let dir = tempfile::tempdir().unwrap();
    let mut config = setup(dir.path());
    config.grpo.loss.kl_coef = 0.001;
    let (_, records) = train(config, 40, false);
    let (first, last) = first_last_gap(&records);
    println!("portable ops: first 5 steps {first:.3}, last 5 steps {last:.3}, final kl {:?}", records[39].kl);
    assert!(last - first > 0.15, "first {first}, last {last}");
    assert!(records.iter().all(|r| r.skipped_steps == 0 && r.kl.is_some_and(f32::is_finite)));
}
