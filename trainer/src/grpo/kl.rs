//! Per-token estimators of KL(π ‖ π_ref) from the log-probs of the sampled tokens (verl's
//! `kl_penalty`; J. Schulman, "Approximating KL divergence", 2020).

use burn::tensor::{backend::Backend, Tensor};
use serde::{Deserialize, Serialize};

/// `x = logπ_ref − logπ` is clamped to `±K3_LOG_RATIO_CLAMP` before `exp` (as verl does).
pub const K3_LOG_RATIO_CLAMP: f32 = 20.0;
/// The k3 estimate is clamped to `±K3_CLAMP`.
pub const K3_CLAMP: f32 = 10.0;

/// Which estimator [`kl_penalty`] uses; the serde names are verl's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum KlEstimator {
    /// [`kl_k1`].
    #[serde(rename = "k1", alias = "kl")]
    K1,
    /// [`kl_k2`].
    #[serde(rename = "k2", alias = "mse")]
    K2,
    /// [`kl_k3`], verl's "low_var_kl" (the reference run's choice).
    #[default]
    #[serde(rename = "k3", alias = "low_var_kl")]
    K3,
}

/// The per-token KL estimate `[b, t]` of the chosen estimator.
pub fn kl_penalty<B: Backend>(
    logp: Tensor<B, 2>,
    ref_logp: Tensor<B, 2>,
    estimator: KlEstimator,
) -> Tensor<B, 2> {
    match estimator {
        KlEstimator::K1 => kl_k1(logp, ref_logp),
        KlEstimator::K2 => kl_k2(logp, ref_logp),
        KlEstimator::K3 => kl_k3(logp, ref_logp),
    }
}

/// k1 = `logπ − logπ_ref` (unbiased, high variance, can be negative).
pub fn kl_k1<B: Backend>(logp: Tensor<B, 2>, ref_logp: Tensor<B, 2>) -> Tensor<B, 2> {
    logp - ref_logp
}

/// k2 = `½ (logπ − logπ_ref)²`.
pub fn kl_k2<B: Backend>(logp: Tensor<B, 2>, ref_logp: Tensor<B, 2>) -> Tensor<B, 2> {
    (logp - ref_logp).square().mul_scalar(0.5)
}

/// k3 ("low_var_kl"): with `x = clamp(logπ_ref − logπ, ±20)`, `kl = clamp(eˣ − x − 1, ±10)`
/// (non-negative, unbiased for KL(π ‖ π_ref) before the clamps).
pub fn kl_k3<B: Backend>(logp: Tensor<B, 2>, ref_logp: Tensor<B, 2>) -> Tensor<B, 2> {
    let x = (ref_logp - logp).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP);
    (x.clone().exp() - x)
        .sub_scalar(1.0)
        .clamp(-K3_CLAMP, K3_CLAMP)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::TensorData;

    type B = Autodiff<Flex>;

    fn row(values: &[f32]) -> Tensor<B, 2> {
        Tensor::from_data(
            TensorData::new(values.to_vec(), [1, values.len()]),
            &Default::default(),
        )
    }

    fn assert_values<const D: usize, K: Backend>(t: Tensor<K, D>, want: &[f32]) {
        let got: Vec<f32> = t.into_data().convert::<f32>().into_vec().unwrap();
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-5, "got {got:?}, want {want:?}");
        }
    }

    // logπ = [−1, −2], logπ_ref = [−1.5, −1]: logπ − logπ_ref = [0.5, −1].
    const LOGP: [f32; 2] = [-1.0, -2.0];
    const REF: [f32; 2] = [-1.5, -1.0];

    #[test]
    fn k1() {
        assert_values(
            kl_penalty(row(&LOGP), row(&REF), KlEstimator::K1),
            &[0.5, -1.0],
        );
    }

    #[test]
    fn k2() {
        // ½·0.25 = 0.125, ½·1 = 0.5
        assert_values(
            kl_penalty(row(&LOGP), row(&REF), KlEstimator::K2),
            &[0.125, 0.5],
        );
    }

    #[test]
    fn k3_values_and_gradient() {
        let _autodiff = crate::autodiff_lock::exclusive_autodiff();
        // x = [−0.5, 1]: e^−0.5 + 0.5 − 1 = 0.106531, e − 1 − 1 = 0.718282.
        let logp = row(&LOGP).require_grad();
        let kl = kl_penalty(logp.clone(), row(&REF), KlEstimator::K3);
        assert_values(kl.clone(), &[0.106531, 0.718282]);
        // d/dlogπ (eˣ − x − 1) = 1 − eˣ: [1 − 0.606531, 1 − 2.718282] = [0.393469, −1.718282].
        let grads = kl.sum().backward();
        assert_values(logp.grad(&grads).unwrap(), &[0.393469, -1.718282]);
    }

    #[test]
    fn k3_is_clamped() {
        let _autodiff = crate::autodiff_lock::exclusive_autodiff();
        // x = 5: e⁵ − 6 = 142.41 → 10; x = 100: clamped to 20 first, still → 10 (no inf);
        // x = −100 → x = −20: e^−20 + 20 − 1 = 19.000000002 → 10. Clamped tokens pass no
        // gradient.
        let logp = row(&[0.0, 0.0, 0.0]).require_grad();
        let kl = kl_k3(logp.clone(), row(&[5.0, 100.0, -100.0]));
        assert_values(kl.clone(), &[10.0, 10.0, 10.0]);
        let grads = kl.sum().backward();
        assert_values(logp.grad(&grads).unwrap(), &[0.0, 0.0, 0.0]);
    }

    #[test]
    fn serde_names_follow_verl() {
        let parse = |s: &str| serde_json::from_str::<KlEstimator>(s).unwrap();
        assert_eq!(parse("\"low_var_kl\""), KlEstimator::K3);
        assert_eq!(parse("\"k3\""), KlEstimator::K3);
        assert_eq!(parse("\"mse\""), KlEstimator::K2);
        assert_eq!(parse("\"kl\""), KlEstimator::K1);
        assert!(serde_json::from_str::<KlEstimator>("\"k4\"").is_err());
    }
}
