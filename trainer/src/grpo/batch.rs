//! The learning step's input: token sequences with their loss masks, the log-probs the step
//! compares against and the advantage of each sequence, checked once on construction.

use super::error::GrpoError;

/// One episode as the learner sees it. Every vector is indexed by token position `t`; the
/// log-prob at `t` is that of token `t` given tokens `..t`, so position 0 (never an agent
/// token) holds an unused value.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySequence {
    /// The whole conversation: prompt, agent turns and environment replies.
    pub tokens: Vec<u32>,
    /// 1 where the agent sampled the token, 0 for prompt, environment and template tokens.
    pub loss_mask: Vec<u8>,
    /// Log-probs under the policy that sampled the episode; read only where the mask is 1.
    pub old_logprobs: Vec<f32>,
    /// Log-probs under the frozen reference policy; needed when the KL term is on, read only
    /// where the mask is 1.
    pub ref_logprobs: Option<Vec<f32>>,
    /// The episode's advantage, applied to each of its agent tokens.
    pub advantage: f32,
}

impl PolicySequence {
    /// Number of agent tokens.
    pub fn n_agent_tokens(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m == 1).count()
    }

    fn check(&self, i: usize) -> Result<(), GrpoError> {
        let err = |what: String| Err(GrpoError::Input(format!("sequence {i}: {what}")));
        let n = self.tokens.len();
        if n < 2 {
            return err(format!(
                "{n} tokens; at least 2 are needed (a context and a sampled token)"
            ));
        }
        if self.loss_mask.len() != n || self.old_logprobs.len() != n {
            return err(format!(
                "{n} tokens but {} mask entries and {} old log-probs",
                self.loss_mask.len(),
                self.old_logprobs.len()
            ));
        }
        if let Some(r) = &self.ref_logprobs {
            if r.len() != n {
                return err(format!("{n} tokens but {} reference log-probs", r.len()));
            }
        }
        if let Some(t) = self.loss_mask.iter().position(|&m| m > 1) {
            return err(format!(
                "loss mask value {} at {t} (must be 0 or 1)",
                self.loss_mask[t]
            ));
        }
        if self.loss_mask[0] != 0 {
            return err("the first token cannot be an agent token (it has no context)".into());
        }
        if !self.advantage.is_finite() {
            return err(format!("advantage {}", self.advantage));
        }
        let agent = |t: &usize| self.loss_mask[*t] == 1;
        if let Some(t) = (0..n)
            .filter(agent)
            .find(|&t| !self.old_logprobs[t].is_finite())
        {
            return err(format!(
                "old log-prob {} at agent token {t}",
                self.old_logprobs[t]
            ));
        }
        if let Some(r) = &self.ref_logprobs {
            if let Some(t) = (0..n).filter(agent).find(|&t| !r[t].is_finite()) {
                return err(format!("reference log-prob {} at agent token {t}", r[t]));
            }
        }
        Ok(())
    }
}

/// A checked, non-empty list of [`PolicySequence`]s.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyBatch {
    sequences: Vec<PolicySequence>,
}

impl PolicyBatch {
    /// Checks every sequence: at least 2 tokens, equal lengths of all per-token vectors, mask
    /// values 0/1 with 0 at position 0, finite advantage and finite log-probs at agent tokens.
    pub fn new(sequences: Vec<PolicySequence>) -> Result<Self, GrpoError> {
        if sequences.is_empty() {
            return Err(GrpoError::Input("an empty policy batch".into()));
        }
        for (i, s) in sequences.iter().enumerate() {
            s.check(i)?;
        }
        Ok(Self { sequences })
    }

    pub fn sequences(&self) -> &[PolicySequence] {
        &self.sequences
    }

    pub fn len(&self) -> usize {
        self.sequences.len()
    }

    /// Always false (an empty batch is refused); for API symmetry with `len`.
    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }

    /// Whether every sequence carries reference log-probs.
    pub fn has_ref_logprobs(&self) -> bool {
        self.sequences.iter().all(|s| s.ref_logprobs.is_some())
    }

    /// Agent tokens over the whole batch.
    pub fn n_agent_tokens(&self) -> usize {
        self.sequences
            .iter()
            .map(PolicySequence::n_agent_tokens)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq() -> PolicySequence {
        PolicySequence {
            tokens: vec![1, 2, 3],
            loss_mask: vec![0, 1, 1],
            old_logprobs: vec![0.0, -1.0, -2.0],
            ref_logprobs: Some(vec![0.0, -1.5, -2.5]),
            advantage: 0.5,
        }
    }

    #[test]
    fn accepts_a_well_formed_batch() {
        let b = PolicyBatch::new(vec![seq(), seq()]).unwrap();
        assert_eq!((b.len(), b.n_agent_tokens()), (2, 4));
        assert!(b.has_ref_logprobs());
    }

    #[test]
    fn refuses_inconsistent_sequences() {
        let broken: [fn(&mut PolicySequence); 8] = [
            |s| s.tokens = vec![1],
            |s| s.loss_mask.push(0),
            |s| {
                s.old_logprobs.pop();
            },
            |s| s.ref_logprobs = Some(vec![0.0]),
            |s| s.loss_mask[2] = 2,
            |s| s.loss_mask[0] = 1,
            |s| s.advantage = f32::INFINITY,
            |s| s.old_logprobs[1] = f32::NAN,
        ];
        for (k, f) in broken.iter().enumerate() {
            let mut s = seq();
            f(&mut s);
            let err = PolicyBatch::new(vec![seq(), s]).unwrap_err();
            assert!(err.to_string().contains("sequence 1"), "case {k}: {err}");
        }
        assert!(PolicyBatch::new(vec![]).is_err());
    }

    #[test]
    fn log_probs_outside_the_mask_are_not_checked() {
        let mut s = seq();
        s.old_logprobs[0] = f32::NAN;
        s.ref_logprobs.as_mut().unwrap()[0] = f32::NEG_INFINITY;
        assert!(PolicyBatch::new(vec![s]).is_ok());
    }
}
