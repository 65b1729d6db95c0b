//! The BERT encoder (HF `BertModel` without the pooler), module names as in `modeling_bert.py`.

use burn::tensor::activation::gelu;
use burn::tensor::backend::Backend;
use burn::tensor::module::{attention, embedding};
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Int, Tensor};

use super::config::BertConfig;
use super::error::SsimError;
use super::layers::{LayerNorm, Linear};
use super::weights::WeightReader;

/// `BertModel`: embeddings followed by the stack of encoder layers.
pub struct BertModel<B: Backend> {
    embeddings: BertEmbeddings<B>,
    encoder: Vec<BertLayer<B>>,
    num_heads: usize,
}

impl<B: Backend> BertModel<B> {
    /// Loads every tensor the encoder uses (`embeddings.*`, `encoder.layer.{i}.*`).
    pub fn load(
        weights: &WeightReader,
        config: &BertConfig,
        device: &B::Device,
    ) -> Result<Self, SsimError> {
        let embeddings = BertEmbeddings::load(weights, config, device)?;
        let encoder = (0..config.num_hidden_layers)
            .map(|i| BertLayer::load(weights, &format!("encoder.layer.{i}"), config, device))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            embeddings,
            encoder,
            num_heads: config.num_attention_heads,
        })
    }

    /// `last_hidden_state` `[batch, seq, hidden]` for `input_ids` `[batch, seq]`;
    /// `padding` is true at padded positions, which no token attends to.
    /// The sequence must not exceed `max_position_embeddings`; token type ids are all 0.
    pub fn forward(
        &self,
        input_ids: Tensor<B, 2, Int>,
        padding: Tensor<B, 2, Bool>,
    ) -> Tensor<B, 3> {
        let [batch, seq] = input_ids.dims();
        let key_mask =
            padding
                .reshape([batch, 1, 1, seq])
                .expand([batch, self.num_heads, seq, seq]);
        let mut hidden = self.embeddings.forward(input_ids);
        for layer in &self.encoder {
            hidden = layer.forward(hidden, key_mask.clone());
        }
        hidden
    }
}

/// `BertEmbeddings`: word + token type (0) + absolute position, then LayerNorm.
struct BertEmbeddings<B: Backend> {
    word_embeddings: Tensor<B, 2>,
    position_embeddings: Tensor<B, 2>,
    token_type_embeddings: Tensor<B, 2>,
    layer_norm: LayerNorm<B>,
}

impl<B: Backend> BertEmbeddings<B> {
    fn load(
        weights: &WeightReader,
        config: &BertConfig,
        device: &B::Device,
    ) -> Result<Self, SsimError> {
        let hidden = config.hidden_size;
        Ok(Self {
            word_embeddings: weights.tensor(
                "embeddings.word_embeddings.weight",
                [config.vocab_size, hidden],
                device,
            )?,
            position_embeddings: weights.tensor(
                "embeddings.position_embeddings.weight",
                [config.max_position_embeddings, hidden],
                device,
            )?,
            token_type_embeddings: weights.tensor(
                "embeddings.token_type_embeddings.weight",
                [config.type_vocab_size, hidden],
                device,
            )?,
            layer_norm: LayerNorm::load(
                weights,
                "embeddings.LayerNorm",
                hidden,
                config.layer_norm_eps,
                device,
            )?,
        })
    }

    fn forward(&self, input_ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [_, seq] = input_ids.dims();
        let words = embedding(self.word_embeddings.clone(), input_ids);
        let token_type = self
            .token_type_embeddings
            .clone()
            .narrow(0, 0, 1)
            .unsqueeze::<3>();
        let positions = self
            .position_embeddings
            .clone()
            .narrow(0, 0, seq)
            .unsqueeze::<3>();
        self.layer_norm.forward(words + token_type + positions)
    }
}

/// `BertLayer`: self-attention block, then the feed-forward block.
struct BertLayer<B: Backend> {
    attention: BertAttention<B>,
    intermediate: Linear<B>,
    output: BertOutput<B>,
}

impl<B: Backend> BertLayer<B> {
    fn load(
        weights: &WeightReader,
        prefix: &str,
        config: &BertConfig,
        device: &B::Device,
    ) -> Result<Self, SsimError> {
        let (hidden, inner) = (config.hidden_size, config.intermediate_size);
        Ok(Self {
            attention: BertAttention::load(
                weights,
                &format!("{prefix}.attention"),
                config,
                device,
            )?,
            intermediate: Linear::load(
                weights,
                &format!("{prefix}.intermediate.dense"),
                hidden,
                inner,
                device,
            )?,
            output: BertOutput::load(weights, &format!("{prefix}.output"), inner, config, device)?,
        })
    }

    fn forward(&self, hidden: Tensor<B, 3>, key_mask: Tensor<B, 4, Bool>) -> Tensor<B, 3> {
        let attended = self.attention.forward(hidden, key_mask);
        let inner = gelu(self.intermediate.forward(attended.clone()));
        self.output.forward(inner, attended)
    }
}

/// `BertAttention`: `BertSelfAttention` followed by `BertSelfOutput`.
struct BertAttention<B: Backend> {
    self_attention: BertSelfAttention<B>,
    output: BertOutput<B>,
}

impl<B: Backend> BertAttention<B> {
    fn load(
        weights: &WeightReader,
        prefix: &str,
        config: &BertConfig,
        device: &B::Device,
    ) -> Result<Self, SsimError> {
        let hidden = config.hidden_size;
        let linear =
            |name: &str| Linear::load(weights, &format!("{prefix}.{name}"), hidden, hidden, device);
        Ok(Self {
            self_attention: BertSelfAttention {
                query: linear("self.query")?,
                key: linear("self.key")?,
                value: linear("self.value")?,
                num_heads: config.num_attention_heads,
            },
            output: BertOutput::load(weights, &format!("{prefix}.output"), hidden, config, device)?,
        })
    }

    fn forward(&self, hidden: Tensor<B, 3>, key_mask: Tensor<B, 4, Bool>) -> Tensor<B, 3> {
        let context = self.self_attention.forward(hidden.clone(), key_mask);
        self.output.forward(context, hidden)
    }
}

/// `BertSelfAttention`: multi-head scaled dot-product attention, scale `1/sqrt(head_dim)`.
struct BertSelfAttention<B: Backend> {
    query: Linear<B>,
    key: Linear<B>,
    value: Linear<B>,
    num_heads: usize,
}

impl<B: Backend> BertSelfAttention<B> {
    fn forward(&self, hidden: Tensor<B, 3>, key_mask: Tensor<B, 4, Bool>) -> Tensor<B, 3> {
        let [batch, seq, width] = hidden.dims();
        let head_dim = width / self.num_heads;
        let split = |x: Tensor<B, 3>| {
            x.reshape([batch, seq, self.num_heads, head_dim])
                .swap_dims(1, 2)
        };
        let query = split(self.query.forward(hidden.clone()));
        let key = split(self.key.forward(hidden.clone()));
        let value = split(self.value.forward(hidden));
        let context = attention(
            query,
            key,
            value,
            Some(key_mask),
            None,
            AttentionModuleOptions::default(),
        );
        context.swap_dims(1, 2).reshape([batch, seq, width])
    }
}

/// `BertSelfOutput` / `BertOutput`: dense, then LayerNorm of the residual sum.
struct BertOutput<B: Backend> {
    dense: Linear<B>,
    layer_norm: LayerNorm<B>,
}

impl<B: Backend> BertOutput<B> {
    /// `{prefix}.dense` (`input` → hidden) and `{prefix}.LayerNorm`: the shape shared by
    /// `BertSelfOutput` and `BertOutput`.
    fn load(
        weights: &WeightReader,
        prefix: &str,
        input: usize,
        config: &BertConfig,
        device: &B::Device,
    ) -> Result<Self, SsimError> {
        let hidden = config.hidden_size;
        Ok(Self {
            dense: Linear::load(weights, &format!("{prefix}.dense"), input, hidden, device)?,
            layer_norm: LayerNorm::load(
                weights,
                &format!("{prefix}.LayerNorm"),
                hidden,
                config.layer_norm_eps,
                device,
            )?,
        })
    }

    fn forward(&self, x: Tensor<B, 3>, residual: Tensor<B, 3>) -> Tensor<B, 3> {
        self.layer_norm.forward(self.dense.forward(x) + residual)
    }
}
