//! `bench --workloads chained`: what a decoding step costs when the host does not wait for it.
//!
//! Every step of the decoder (`model::decode`) ends with its tokens read back to the host, which
//! chooses what the next step runs: the read waits until the device has run every kernel queued
//! so far, so each step starts with the host's and CubeCL's queues empty and the device idle
//! while the host prepares it. The same greedy steps are timed here twice on one KV cache of
//! fixed slots: with the tokens read back and uploaded again at every step as the decoder does,
//! and chained on the device (each step's argmax is the next step's input, the tokens read once
//! at the end), so that the host's work on a step overlaps the device's on the steps before.
//! Their ratio bounds what a decoder that reads its tokens a step late could gain.

use std::time::Instant;

use anyhow::{ensure, Result};
use burn::tensor::{backend::Backend, Int, Tensor, TensorData};
use model::CausalLm;

/// How the tokens of a step reach the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Feed {
    /// Read back to the host and uploaded again at every step, as the decoder does.
    ReadBack,
    /// Left on the device: each step's argmax is the next step's input.
    Chained,
}

/// The greedy tokens of `steps` decoding steps after `prompts` (all of one length), and the
/// seconds from the end of the prompts' prefill to the last step's tokens on the host.
pub(super) fn decode<B: Backend>(model: &impl CausalLm<B>, prompts: &[Vec<u32>], steps: usize, feed: Feed) -> Result<(Vec<Vec<u32>>, f64)> {
    let rows = prompts.len();
    let len = prompts.first().map_or(0, Vec::len);
    ensure!(rows > 0 && len > 0 && prompts.iter().all(|p| p.len() == len), "chained decoding takes prompts of one length");
    let base = model.base();
    let device = base.device();
    let capacity = len + steps;
    // Row `r`'s position `p` lies in slot `1 + r · capacity + p` (slot 0 is the cache's scratch
    // slot, `model::qwen3::SCRATCH_SLOT`).
    let slot = |r: usize, p: usize| 1 + r * capacity + p;
    let mut cache = base.new_cache();
    cache.reserve(1 + rows * capacity);
    let ints = |values: Vec<i64>, width: usize| Tensor::<B, 2, Int>::from_data(TensorData::new(values, [rows, width]), &device);
    let prefill_slots: Vec<usize> = (0..rows).flat_map(|r| (0..len).map(move |p| slot(r, p))).collect();
    cache.set_slots(prefill_slots.clone(), prefill_slots, rows, &device);
    let ids = ints(prompts.iter().flatten().map(|&t| i64::from(t)).collect(), len);
    let positions = ints((0..rows).flat_map(|_| 0..len as i64).collect(), len);
    let hidden = base.model.forward_with_adapters(ids, positions, None, Some(&mut cache), false, model.adapters()).last_hidden_state;
    let hidden = hidden.slice([0..rows, len - 1..len]);
    let mut tokens = argmax(base.logits(hidden), rows);
    // The prefill's tokens on the host: the steps timed start from an idle device.
    tokens = Tensor::from_data(tokens.into_data(), &device);

    let start = Instant::now();
    let mut chosen = vec![tokens.clone()];
    for step in 0..steps {
        let position = len + step;
        let write: Vec<usize> = (0..rows).map(|r| slot(r, position)).collect();
        let read: Vec<usize> = (0..rows).flat_map(|r| (0..=position).map(move |p| slot(r, p))).collect();
        cache.set_slots(write, read, rows, &device);
        let positions = ints(vec![position as i64; rows], 1);
        let hidden = base.model.forward_with_adapters(tokens, positions, None, Some(&mut cache), false, model.adapters()).last_hidden_state;
        tokens = argmax(base.logits(hidden), rows);
        if feed == Feed::ReadBack {
            let host = tokens.into_data();
            tokens = Tensor::from_data(host, &device);
        }
        chosen.push(tokens.clone());
    }
    let all = Tensor::cat(chosen, 1).into_data();
    let seconds = start.elapsed().as_secs_f64();
    let all: Vec<i64> = all.convert::<i64>().to_vec().map_err(|e| anyhow::anyhow!("the chosen tokens: {e:?}"))?;
    let sequences = all.chunks(steps + 1).map(|row| row.iter().map(|&t| t as u32).collect()).collect();
    Ok((sequences, seconds))
}

/// Each row's most likely next token (`logits` `[rows, 1, vocab]`), as `[rows, 1]`.
fn argmax<B: Backend>(logits: Tensor<B, 3>, rows: usize) -> Tensor<B, 2, Int> {
    logits.argmax(2).reshape([rows, 1])
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use model::checkpoint::StorageDtype;
    use model::{generate, load_pretrained, LoadOptions, LoraModel, Preset, Qwen3ForCausalLM, SamplingConfig};

    use super::{decode, Feed};

    fn tiny() -> Qwen3ForCausalLM<Flex> {
        let config = Preset::Tiny.config(300, vec![299]);
        let dir = tempfile::tempdir().unwrap();
        model::init::write_random_checkpoint(&config, dir.path(), 11, StorageDtype::F32).unwrap();
        load_pretrained::<Flex>(dir.path(), &Default::default(), LoadOptions::default()).unwrap()
    }

    #[test]
    fn both_feeds_choose_the_decoders_greedy_tokens() {
        let model = tiny();
        let policy = LoraModel::new(&model, None);
        let prompts = vec![vec![3, 17, 250, 8, 41], vec![9, 9, 120, 7, 2], vec![1, 2, 3, 4, 5]];
        let steps = 6;
        let config = SamplingConfig { max_new_tokens: steps + 1, ..Default::default() };
        let expected: Vec<Vec<u32>> = generate(&policy, &prompts, &config).unwrap().into_iter().map(|s| s.tokens).collect();
        assert!(expected.iter().all(|tokens| tokens.len() == steps + 1));
        for feed in [Feed::ReadBack, Feed::Chained] {
            let (tokens, seconds) = decode(&policy, &prompts, steps, feed).unwrap();
            assert_eq!(tokens, expected, "{feed:?}");
            assert!(seconds > 0.0);
        }
    }

    #[test]
    fn prompts_of_different_lengths_are_refused() {
        let model = tiny();
        let policy = LoraModel::new(&model, None);
        let error = decode(&policy, &[vec![1, 2], vec![3]], 2, Feed::Chained).unwrap_err();
        assert!(error.to_string().contains("one length"), "{error}");
    }
}
