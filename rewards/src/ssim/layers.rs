//! The two parameterised building blocks of BERT: `nn.Linear` and `nn.LayerNorm`.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use super::error::SsimError;
use super::weights::WeightReader;

/// `nn.Linear`: `x · weight + bias`, with the weight held as `[in, out]`.
pub struct Linear<B: Backend> {
    weight: Tensor<B, 2>,
    bias: Tensor<B, 1>,
}

impl<B: Backend> Linear<B> {
    /// Loads `{prefix}.weight` (`[d_out, d_in]` in the file) and `{prefix}.bias`.
    pub fn load(
        weights: &WeightReader,
        prefix: &str,
        d_in: usize,
        d_out: usize,
        device: &B::Device,
    ) -> Result<Self, SsimError> {
        Ok(Self {
            weight: weights.linear_weight(&format!("{prefix}.weight"), d_out, d_in, device)?,
            bias: weights.tensor(&format!("{prefix}.bias"), [d_out], device)?,
        })
    }

    /// Applies the layer to the last dimension of `x`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        burn::tensor::module::linear(x, self.weight.clone(), Some(self.bias.clone()))
    }
}

/// `nn.LayerNorm` over the last dimension (biased variance, as PyTorch).
pub struct LayerNorm<B: Backend> {
    weight: Tensor<B, 1>,
    bias: Tensor<B, 1>,
    eps: f64,
}

impl<B: Backend> LayerNorm<B> {
    /// Loads `{prefix}.weight` and `{prefix}.bias`, both `[width]`.
    pub fn load(
        weights: &WeightReader,
        prefix: &str,
        width: usize,
        eps: f64,
        device: &B::Device,
    ) -> Result<Self, SsimError> {
        Ok(Self {
            weight: weights.tensor(&format!("{prefix}.weight"), [width], device)?,
            bias: weights.tensor(&format!("{prefix}.bias"), [width], device)?,
            eps,
        })
    }

    /// Normalises `x` (`[batch, seq, width]`) over its last dimension.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let mean = x.clone().mean_dim(2);
        let centered = x - mean;
        let variance = centered.clone().powi_scalar(2).mean_dim(2);
        let normalised = centered / variance.add_scalar(self.eps).sqrt();
        normalised * self.weight.clone().unsqueeze::<3>() + self.bias.clone().unsqueeze::<3>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    type B = burn::backend::Flex;

    #[test]
    fn layer_norm_matches_hand_computation() {
        let device = Default::default();
        let norm = LayerNorm::<B> {
            weight: Tensor::from_data([2.0, 2.0, 2.0, 2.0], &device),
            bias: Tensor::from_data([1.0, 1.0, 1.0, 1.0], &device),
            eps: 0.0,
        };
        // mean 2.5, biased variance 1.25
        let x = Tensor::<B, 3>::from_data(
            TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0], [1, 1, 4]),
            &device,
        );
        let out = norm
            .forward(x)
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .unwrap();
        let std = 1.25f32.sqrt();
        for (got, x) in out.iter().zip([1.0f32, 2.0, 3.0, 4.0]) {
            let want = 2.0 * (x - 2.5) / std + 1.0;
            assert!((got - want).abs() < 1e-5, "{got} vs {want}");
        }
    }

    #[test]
    fn linear_applies_in_out_weight_and_bias() {
        let device = Default::default();
        let linear = Linear::<B> {
            weight: Tensor::from_data([[1.0, 0.0, 2.0], [0.0, 1.0, 3.0]], &device),
            bias: Tensor::from_data([0.5, -0.5, 0.0], &device),
        };
        let x = Tensor::<B, 3>::from_data(TensorData::new(vec![1.0f32, 2.0], [1, 1, 2]), &device);
        let out = linear
            .forward(x)
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .unwrap();
        assert_eq!(out, vec![1.5, 1.5, 8.0]);
    }
}
