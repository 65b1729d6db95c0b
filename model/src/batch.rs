//! Padded batches of token sequences: ids, attention mask and positions as device tensors.

use burn::tensor::{backend::Backend, Int, Tensor, TensorData};

use crate::error::ModelError;

/// Which side padding goes on. Generation pads on the left (so every row's next token is at the
/// same column); scoring and training pad on the right.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Padding {
    Left,
    Right,
}

/// A rectangular batch built from sequences of different lengths.
#[derive(Debug, Clone)]
pub struct TokenBatch<B: Backend> {
    /// `[b, len]` token ids, `pad_id` in padding.
    pub input_ids: Tensor<B, 2, Int>,
    /// `[b, len]`, 1 for real tokens and 0 for padding.
    pub attention_mask: Tensor<B, 2, Int>,
    /// `[b, len]`: `cumsum(mask) - 1` (0 at padding), so a left-padded row starts at position 0.
    pub position_ids: Tensor<B, 2, Int>,
    /// The real length of every row.
    pub lengths: Vec<usize>,
    /// The padded length.
    pub len: usize,
    pub padding: Padding,
}

impl<B: Backend> TokenBatch<B> {
    /// Pads `sequences` to the longest one. Empty input or an empty sequence is an error.
    pub fn new(
        sequences: &[Vec<u32>],
        padding: Padding,
        pad_id: u32,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        if sequences.is_empty() {
            return Err(ModelError::Input("an empty batch".into()));
        }
        if let Some(i) = sequences.iter().position(Vec::is_empty) {
            return Err(ModelError::Input(format!("sequence {i} of the batch is empty")));
        }
        let b = sequences.len();
        let len = sequences.iter().map(Vec::len).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(b * len);
        let mut mask = Vec::with_capacity(b * len);
        let mut positions = Vec::with_capacity(b * len);
        for seq in sequences {
            let pad = len - seq.len();
            let row_mask: Vec<i64> = match padding {
                Padding::Left => (0..len).map(|j| i64::from(j >= pad)).collect(),
                Padding::Right => (0..len).map(|j| i64::from(j < seq.len())).collect(),
            };
            let row_ids: Vec<i64> = match padding {
                Padding::Left => std::iter::repeat_n(pad_id, pad).chain(seq.iter().copied()).map(i64::from).collect(),
                Padding::Right => seq.iter().copied().chain(std::iter::repeat_n(pad_id, pad)).map(i64::from).collect(),
            };
            let mut seen = 0i64;
            for &m in &row_mask {
                seen += m;
                positions.push((seen - 1).max(0));
            }
            ids.extend(row_ids);
            mask.extend(row_mask);
        }
        let tensor = |v: Vec<i64>| Tensor::<B, 2, Int>::from_data(TensorData::new(v, [b, len]), device);
        Ok(Self {
            input_ids: tensor(ids),
            attention_mask: tensor(mask),
            position_ids: tensor(positions),
            lengths: sequences.iter().map(Vec::len).collect(),
            len,
            padding,
        })
    }

    /// Number of rows.
    pub fn batch_size(&self) -> usize {
        self.lengths.len()
    }

    /// Whether any row is padded (if not, the mask can be left out of the forward pass).
    pub fn is_padded(&self) -> bool {
        self.lengths.iter().any(|&l| l != self.len)
    }

    /// The mask to pass to the model: `None` when nothing is padded.
    pub fn mask(&self) -> Option<&Tensor<B, 2, Int>> {
        self.is_padded().then_some(&self.attention_mask)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    fn rows(t: &Tensor<Flex, 2, Int>) -> Vec<i64> {
        t.to_data().convert::<i64>().to_vec().unwrap()
    }

    #[test]
    fn left_and_right_padding() {
        let seqs = vec![vec![5, 6, 7], vec![8]];
        let left = TokenBatch::<Flex>::new(&seqs, Padding::Left, 0, &Default::default()).unwrap();
        assert_eq!(rows(&left.input_ids), vec![5, 6, 7, 0, 0, 8]);
        assert_eq!(rows(&left.attention_mask), vec![1, 1, 1, 0, 0, 1]);
        assert_eq!(rows(&left.position_ids), vec![0, 1, 2, 0, 0, 0]);
        let right = TokenBatch::<Flex>::new(&seqs, Padding::Right, 0, &Default::default()).unwrap();
        assert_eq!(rows(&right.input_ids), vec![5, 6, 7, 8, 0, 0]);
        assert_eq!(rows(&right.position_ids), vec![0, 1, 2, 0, 0, 0]);
        assert!(right.is_padded());
    }

    #[test]
    fn empty_inputs_are_errors() {
        assert!(TokenBatch::<Flex>::new(&[], Padding::Left, 0, &Default::default()).is_err());
        let err = TokenBatch::<Flex>::new(&[vec![1], vec![]], Padding::Left, 0, &Default::default())
            .unwrap_err();
        assert!(err.to_string().contains("sequence 1"));
    }
}
