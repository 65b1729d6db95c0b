//! The GRPO objective of one batch of tokens: clipped policy loss, plus the KL penalty to the
//! reference policy, minus the entropy bonus, each aggregated over the agent tokens.

use burn::tensor::{backend::Backend, Tensor};
use serde::{Deserialize, Serialize};

use super::aggregate::{agg_loss, AggMode};
use super::error::GrpoError;
use super::kl::{kl_penalty, KlEstimator};
use super::policy_loss::{policy_loss, PolicyLossStats, PpoClip};

/// Loss settings; the defaults are the reference run's (trainer/README.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpoLossConfig {
    /// The ratio is clipped below at `1 − clip_low`.
    pub clip_low: f32,
    /// The ratio is clipped above at `1 + clip_high`.
    pub clip_high: f32,
    /// Dual-clip bound `c` (> 1) on the loss of tokens with a negative advantage.
    pub dual_clip: f32,
    /// Weight of the KL penalty to the reference policy (0 turns it off and the reference
    /// log-probs are then not needed).
    pub kl_coef: f32,
    pub kl_estimator: KlEstimator,
    /// Weight of the entropy bonus (0: off).
    pub entropy_coef: f32,
    pub agg_mode: AggMode,
}

impl Default for GrpoLossConfig {
    fn default() -> Self {
        Self {
            clip_low: 0.2,
            clip_high: 0.2,
            dual_clip: 3.0,
            kl_coef: 0.001,
            kl_estimator: KlEstimator::K3,
            entropy_coef: 0.0,
            agg_mode: AggMode::TokenMean,
        }
    }
}

impl GrpoLossConfig {
    /// Checks the ranges: `0 ≤ clip_low < 1`, `clip_high ≥ 0`, `dual_clip > 1`, `kl_coef ≥ 0`,
    /// every value finite.
    pub fn validate(&self) -> Result<(), GrpoError> {
        let bad = |what: String| Err(GrpoError::Config(what));
        let values = [
            ("clip_low", self.clip_low),
            ("clip_high", self.clip_high),
            ("dual_clip", self.dual_clip),
            ("kl_coef", self.kl_coef),
            ("entropy_coef", self.entropy_coef),
        ];
        if let Some((name, v)) = values.iter().find(|(_, v)| !v.is_finite()) {
            return bad(format!("{name} = {v} is not finite"));
        }
        if !(0.0..1.0).contains(&self.clip_low) {
            return bad(format!("clip_low = {} must be in [0, 1)", self.clip_low));
        }
        if self.clip_high < 0.0 {
            return bad(format!("clip_high = {} must be ≥ 0", self.clip_high));
        }
        if self.dual_clip <= 1.0 {
            return bad(format!("dual_clip = {} must be > 1", self.dual_clip));
        }
        if self.kl_coef < 0.0 {
            return bad(format!("kl_coef = {} must be ≥ 0", self.kl_coef));
        }
        Ok(())
    }

    /// The clip range of [`policy_loss`].
    pub fn clip(&self) -> PpoClip {
        PpoClip {
            low: self.clip_low,
            high: self.clip_high,
            dual: self.dual_clip,
        }
    }

    /// Whether the loss has a KL term (and so needs reference log-probs).
    pub fn uses_kl(&self) -> bool {
        self.kl_coef != 0.0
    }

    /// Whether the loss has an entropy term (and so needs the entropy with gradients).
    pub fn uses_entropy(&self) -> bool {
        self.entropy_coef != 0.0
    }
}

/// The per-token tensors of one batch, all `[b, t]` and aligned (column `j` = the same token
/// everywhere).
#[derive(Debug, Clone)]
pub struct LossInputs<B: Backend> {
    /// Current log-probs (with gradients).
    pub logp: Tensor<B, 2>,
    /// Log-probs of the policy that sampled the tokens.
    pub old_logp: Tensor<B, 2>,
    /// Log-probs of the frozen reference; required when the KL term is on.
    pub ref_logp: Option<Tensor<B, 2>>,
    /// The sequence's advantage at each of its tokens.
    pub advantages: Tensor<B, 2>,
    /// 1 for agent-sampled tokens, 0 for prompt, environment and padding tokens.
    pub mask: Tensor<B, 2>,
    /// Per-token entropy of the policy; required when the entropy term is on, reported when
    /// given.
    pub entropy: Option<Tensor<B, 2>>,
}

/// The terms of one loss evaluation, each aggregated like the loss.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LossStats {
    /// `pg_loss + kl_coef·kl − entropy_coef·entropy`.
    pub loss: f32,
    pub pg_loss: f32,
    /// The aggregated KL estimate (`None` when the KL term is off).
    pub kl: Option<f32>,
    /// The aggregated entropy (`None` when not computed).
    pub entropy: Option<f32>,
    /// The clipping's token means, as [`policy_loss`] gave them.
    pub policy: PolicyLossStats,
    /// Number of agent (mask-1) tokens: the weight of `policy` in a step's means.
    pub n_tokens: usize,
}

/// `agg(l_pg) + kl_coef · agg(kl(logπ, logπ_ref)) − entropy_coef · agg(H)`, with `l_pg` from
/// [`policy_loss`], the KL from [`kl_penalty`] and `agg` = [`agg_loss`] under the config's mode
/// (so, by linearity, the aggregate of the combined per-token loss). Returns the scalar `[1]`
/// and its terms; errors when a term that is on lacks its input.
pub fn grpo_loss<B: Backend>(
    inputs: LossInputs<B>,
    config: &GrpoLossConfig,
) -> Result<(Tensor<B, 1>, LossStats), GrpoError> {
    let LossInputs {
        logp,
        old_logp,
        ref_logp,
        advantages,
        mask,
        entropy,
    } = inputs;
    let agg = |t: Tensor<B, 2>| agg_loss(t, mask.clone(), config.agg_mode);
    let pg = policy_loss(
        logp.clone(),
        old_logp,
        advantages,
        mask.clone(),
        config.clip(),
    );
    let mut loss = agg(pg.per_token);
    let pg_loss = scalar(&loss);
    let mut stats = LossStats {
        loss: 0.0,
        pg_loss,
        kl: None,
        entropy: None,
        policy: pg.stats,
        n_tokens: pg.n_tokens,
    };
    if config.uses_kl() {
        let ref_logp = ref_logp.ok_or_else(|| {
            GrpoError::Input("kl_coef ≠ 0 but no reference log-probs were given".into())
        })?;
        let kl = agg(kl_penalty(logp, ref_logp, config.kl_estimator));
        stats.kl = Some(scalar(&kl));
        loss = loss + kl.mul_scalar(config.kl_coef);
    }
    match entropy {
        Some(entropy) => {
            let entropy = agg(entropy);
            stats.entropy = Some(scalar(&entropy));
            if config.uses_entropy() {
                loss = loss - entropy.mul_scalar(config.entropy_coef);
            }
        }
        None if config.uses_entropy() => {
            return Err(GrpoError::Input(
                "entropy_coef ≠ 0 but no entropy was given".into(),
            ));
        }
        None => {}
    }
    stats.loss = scalar(&loss);
    Ok((loss, stats))
}

fn scalar<B: Backend>(t: &Tensor<B, 1>) -> f32 {
    t.clone()
        .detach()
        .into_data()
        .convert::<f32>()
        .into_vec()
        .map_or(f32::NAN, |v: Vec<f32>| v[0])
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::TensorData;

    type B = Autodiff<Flex>;

    fn t2(rows: &[&[f32]]) -> Tensor<B, 2> {
        let values: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_data(
            TensorData::new(values, [rows.len(), rows[0].len()]),
            &Default::default(),
        )
    }

    fn host(t: Tensor<Flex, 2>) -> Vec<f32> {
        t.into_data().convert::<f32>().into_vec().unwrap()
    }

    #[test]
    fn defaults_are_the_reference_run() {
        let c: GrpoLossConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(c, GrpoLossConfig::default());
        assert_eq!((c.clip_low, c.clip_high, c.dual_clip), (0.2, 0.2, 3.0));
        assert_eq!(
            (c.kl_coef, c.kl_estimator, c.entropy_coef),
            (0.001, KlEstimator::K3, 0.0)
        );
        assert_eq!(c.agg_mode, AggMode::TokenMean);
        let c: GrpoLossConfig = serde_json::from_str(
            r#"{"kl_estimator":"low_var_kl","agg_mode":"seq-mean-token-sum"}"#,
        )
        .unwrap();
        assert_eq!(
            (c.kl_estimator, c.agg_mode),
            (KlEstimator::K3, AggMode::SeqMeanTokenSum)
        );
        assert!(serde_json::from_str::<GrpoLossConfig>(r#"{"clip":0.2}"#).is_err());
    }

    #[test]
    fn validation_rejects_bad_ranges() {
        assert!(GrpoLossConfig::default().validate().is_ok());
        let with = |f: fn(&mut GrpoLossConfig)| {
            let mut c = GrpoLossConfig::default();
            f(&mut c);
            c.validate()
        };
        assert!(with(|c| c.dual_clip = 1.0).is_err());
        assert!(with(|c| c.clip_low = 1.0).is_err());
        assert!(with(|c| c.clip_high = -0.1).is_err());
        assert!(with(|c| c.kl_coef = -1.0).is_err());
        assert!(with(|c| c.entropy_coef = f32::NAN).is_err());
    }

    #[test]
    fn combines_policy_kl_and_entropy() {
        // Two tokens, r = 1, A = [1, −1]: pg = [−1, 1], mean 0.
        // k3 with x = logπ_ref − logπ = [−0.5, 1]: [0.106531, 0.718282], mean 0.412406.
        // Entropy [0.5, 1.5], mean 1. loss = 0 + 0.1·0.412406 − 0.01·1 = 0.0312406.
        let config = GrpoLossConfig {
            kl_coef: 0.1,
            entropy_coef: 0.01,
            ..Default::default()
        };
        let inputs = LossInputs {
            logp: t2(&[&[-1.0, -2.0]]),
            old_logp: t2(&[&[-1.0, -2.0]]),
            ref_logp: Some(t2(&[&[-1.5, -1.0]])),
            advantages: t2(&[&[1.0, -1.0]]),
            mask: t2(&[&[1.0, 1.0]]),
            entropy: Some(t2(&[&[0.5, 1.5]])),
        };
        let (loss, stats) = grpo_loss(inputs, &config).unwrap();
        assert!((loss.into_scalar() - 0.0312406).abs() < 1e-6);
        assert!((stats.loss - 0.0312406).abs() < 1e-6, "{stats:?}");
        assert!(stats.pg_loss.abs() < 1e-6);
        assert!((stats.kl.unwrap() - 0.412406).abs() < 1e-6);
        assert!((stats.entropy.unwrap() - 1.0).abs() < 1e-6);
        assert_eq!(stats.n_tokens, 2);
    }

    #[test]
    fn missing_inputs_of_active_terms_are_errors() {
        let inputs = |ref_logp: Option<Tensor<B, 2>>| LossInputs {
            logp: t2(&[&[-1.0]]),
            old_logp: t2(&[&[-1.0]]),
            ref_logp,
            advantages: t2(&[&[1.0]]),
            mask: t2(&[&[1.0]]),
            entropy: None,
        };
        assert!(grpo_loss(inputs(None), &GrpoLossConfig::default()).is_err());
        let no_kl = GrpoLossConfig {
            kl_coef: 0.0,
            ..Default::default()
        };
        let (_, stats) = grpo_loss(inputs(None), &no_kl).unwrap();
        assert_eq!((stats.kl, stats.entropy), (None, None));
        let with_entropy = GrpoLossConfig {
            entropy_coef: 0.1,
            ..Default::default()
        };
        assert!(grpo_loss(inputs(Some(t2(&[&[-1.0]]))), &with_entropy).is_err());
    }

    /// Loss and gradients with wild values at the mask-0 tokens: the same as with tame ones.
    #[test]
    fn masked_tokens_contribute_nothing() {
        let _autodiff = crate::autodiff_lock::exclusive_autodiff();
        let config = GrpoLossConfig {
            kl_coef: 0.5,
            entropy_coef: 0.1,
            ..Default::default()
        };
        let mask = [1.0, 0.0, 1.0, 0.0];
        let run = |masked_value: f32, masked_adv: f32| {
            let pick = |tame: f32| [tame, masked_value, tame * 0.5, -masked_value];
            let logp = t2(&[&[-1.0, -2.0, -0.7, -3.0]]).require_grad();
            let entropy = t2(&[&pick(0.8)]).require_grad();
            let inputs = LossInputs {
                logp: logp.clone(),
                old_logp: t2(&[&pick(-1.2)]),
                ref_logp: Some(t2(&[&pick(-0.9)])),
                advantages: t2(&[&[1.5, masked_adv, -0.5, masked_adv]]),
                mask: t2(&[&mask]),
                entropy: Some(entropy.clone()),
            };
            let (loss, stats) = grpo_loss(inputs, &config).unwrap();
            let grads = loss.backward();
            (
                stats,
                host(logp.grad(&grads).unwrap()),
                host(entropy.grad(&grads).unwrap()),
            )
        };
        let (tame, g_tame, ge_tame) = run(-1.0, 0.0);
        let (wild, g_wild, ge_wild) = run(1e4, -1e6);
        assert_eq!(tame, wild);
        assert_eq!(g_tame, g_wild);
        assert_eq!(ge_tame, ge_wild);
        assert_eq!(tame.n_tokens, 2);
        assert!(
            g_tame[0] != 0.0 && g_tame[1] == 0.0 && g_tame[3] == 0.0,
            "{g_tame:?}"
        );
    }
}
