//! Group-relative advantages: every episode's reward compared with the other episodes sampled
//! for the same question (verl's `compute_grpo_outcome_advantage`).
//!
//! Episodes that failed (environment errors) must be dropped by the caller before this point:
//! they are neither rewarded nor part of their group's mean and standard deviation.

use std::collections::HashMap;
use std::hash::Hash;

use serde::{Deserialize, Serialize};

use super::error::GrpoError;

/// Added to the group's standard deviation before dividing, as in the reference.
pub const ADVANTAGE_EPS: f64 = 1e-6;

/// How rewards become advantages within a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AdvantageMode {
    /// `A = (R − mean) / (std + 1e-6)` with the unbiased (n − 1) standard deviation.
    #[default]
    Grpo,
    /// Dr. GRPO: `A = R − mean`, no division by the standard deviation.
    DrGrpo,
}

/// The advantage of every episode; `group_ids[i]` names the group (question) of `rewards[i]`.
/// Groups may be interleaved. A group of one episode gets `A = 0` (nothing to compare with).
/// Errors on a length mismatch or a non-finite reward.
pub fn group_advantages<G: Eq + Hash>(
    rewards: &[f32],
    group_ids: &[G],
    mode: AdvantageMode,
) -> Result<Vec<f32>, GrpoError> {
    if rewards.len() != group_ids.len() {
        return Err(GrpoError::Input(format!(
            "{} rewards but {} group ids",
            rewards.len(),
            group_ids.len()
        )));
    }
    if let Some(i) = rewards.iter().position(|r| !r.is_finite()) {
        return Err(GrpoError::Input(format!("reward {i} is {}", rewards[i])));
    }
    let mut groups: HashMap<&G, Vec<usize>> = HashMap::new();
    for (i, id) in group_ids.iter().enumerate() {
        groups.entry(id).or_default().push(i);
    }
    let mut advantages = vec![0.0f32; rewards.len()];
    for members in groups.values() {
        let values: Vec<f64> = members.iter().map(|&i| f64::from(rewards[i])).collect();
        for (&i, a) in members.iter().zip(group_advantage(&values, mode)) {
            advantages[i] = a as f32;
        }
    }
    Ok(advantages)
}

/// The advantages of one group's rewards (see [`AdvantageMode`]); all zero for a group of one.
fn group_advantage(rewards: &[f64], mode: AdvantageMode) -> Vec<f64> {
    let n = rewards.len();
    if n < 2 {
        return vec![0.0; n];
    }
    let mean = rewards.iter().sum::<f64>() / n as f64;
    match mode {
        AdvantageMode::DrGrpo => rewards.iter().map(|r| r - mean).collect(),
        AdvantageMode::Grpo => {
            let std = unbiased_std(rewards, mean);
            rewards
                .iter()
                .map(|r| (r - mean) / (std + ADVANTAGE_EPS))
                .collect()
        }
    }
}

/// `sqrt(Σ (x − mean)² / (n − 1))`, for `n ≥ 2`.
fn unbiased_std(values: &[f64], mean: f64) -> f64 {
    let ss: f64 = values.iter().map(|x| (x - mean).powi(2)).sum();
    (ss / (values.len() - 1) as f64).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() < 1e-5
    }

    #[test]
    fn grpo_uses_unbiased_std_per_group() {
        // Group 0 = {1, 0, 0, 1, 1}: mean 0.6, squared deviations 0.16+0.36+0.36+0.16+0.16 = 1.2,
        // unbiased var 1.2/4 = 0.3, std 0.5477226 → A(1) = 0.4/0.5477236 = 0.730296,
        // A(0) = −0.6/0.5477236 = −1.095444. (The biased std 0.4899 would give 0.8165.)
        // Group 7 = {5, 3}: mean 4, var (1+1)/1 = 2, std 1.4142136 → A = ±0.7071065.
        // Group 9 = {2}: alone → 0.
        let rewards = [1.0, 5.0, 0.0, 0.0, 2.0, 1.0, 3.0, 1.0];
        let ids = [0, 7, 0, 0, 9, 0, 7, 0];
        let a = group_advantages(&rewards, &ids, AdvantageMode::Grpo).unwrap();
        let expected = [
            0.730296, 0.7071065, -1.095444, -1.095444, 0.0, 0.730296, -0.7071065, 0.730296,
        ];
        for (got, want) in a.iter().zip(expected) {
            assert!(close(*got, want), "{a:?}");
        }
    }

    #[test]
    fn dr_grpo_is_mean_only() {
        // Group 0 = {1, 0, 0, 1, 1}: mean 0.6 → A = 0.4 or −0.6. Group 1 = {4}: alone → 0.
        let rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 4.0];
        let ids = ["q0", "q0", "q0", "q0", "q0", "q1"];
        let a = group_advantages(&rewards, &ids, AdvantageMode::DrGrpo).unwrap();
        let expected = [0.4, -0.6, -0.6, 0.4, 0.4, 0.0];
        for (got, want) in a.iter().zip(expected) {
            assert!(close(*got, want), "{a:?}");
        }
    }

    #[test]
    fn single_and_uniform_groups_get_zero() {
        // {3} alone; {2, 2, 2}: std 0 → 0 / 1e-6 = 0.
        let a =
            group_advantages(&[3.0, 2.0, 2.0, 2.0], &[1, 2, 2, 2], AdvantageMode::Grpo).unwrap();
        assert_eq!(a, vec![0.0; 4]);
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert!(group_advantages(&[1.0, 2.0], &[0], AdvantageMode::Grpo).is_err());
        let err = group_advantages(&[1.0, f32::NAN], &[0, 0], AdvantageMode::Grpo).unwrap_err();
        assert!(err.to_string().contains("reward 1"), "{err}");
        assert!(group_advantages::<u32>(&[], &[], AdvantageMode::Grpo)
            .unwrap()
            .is_empty());
    }
}
