//! DAPO-style dynamic sampling: a group whose episodes all got the same reward has zero
//! advantages, so it teaches nothing and only costs the update's time. Early in training the
//! format gate makes many groups score −1 throughout.

use std::collections::BTreeSet;

/// The groups whose rewards are all equal (bit for bit), a group of one included.
/// `rewards[i]` belongs to group `groups[i]`.
pub fn groups_without_signal(rewards: &[f32], groups: &[usize]) -> BTreeSet<usize> {
    let mut first: Vec<(usize, f32)> = Vec::new();
    let mut mixed = BTreeSet::new();
    for (&reward, &group) in rewards.iter().zip(groups) {
        match first.iter().find(|(g, _)| *g == group) {
            Some(&(_, seen)) if seen.to_bits() != reward.to_bits() => {
                mixed.insert(group);
            }
            Some(_) => {}
            None => first.push((group, reward)),
        }
    }
    first
        .into_iter()
        .map(|(group, _)| group)
        .filter(|group| !mixed.contains(group))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_rewards_mark_a_group() {
        // Group 0: all −1 (the format gate failed everywhere); group 1: mixed; group 2: one
        // episode left (the others failed); group 3: all 0.5.
        let rewards = [-1.0, -1.0, -1.0, 0.5, -1.0, 0.2, 0.5, 0.5];
        let groups = [0, 0, 0, 1, 1, 2, 3, 3];
        let none: Vec<usize> = groups_without_signal(&rewards, &groups)
            .into_iter()
            .collect();
        assert_eq!(none, [0, 2, 3]);
        assert!(groups_without_signal(&[], &[]).is_empty());
        // Rewards that differ in the last bit still carry a signal.
        let close = [0.6, f32::from_bits(0.6f32.to_bits() + 1)];
        assert!(groups_without_signal(&close, &[7, 7]).is_empty());
    }
}
