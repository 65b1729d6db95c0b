//! Fused element-wise kernels over contiguous rows: one pass over memory where burn's ops take
//! several (and run single-threaded on burn-flex). Rows are spread over the rayon pool. Rounding
//! follows PyTorch's half-precision semantics step by step, so bf16 results equal HF's.

use half::bf16;
use rayon::prelude::*;

use super::bf16_bits::{narrow, round, widen};
use crate::Kernels;

/// Rows per rayon task: enough work per task to amortise scheduling.
fn rows_per_task(row_len: usize) -> usize {
    (16 * 1024 / row_len.max(1)).max(1)
}

/// HF's `Qwen3RMSNorm` over rows of `weight.len()` elements, in f32:
/// `weight * (x * rsqrt(mean(x²) + eps))`.
pub fn rms_norm_f32(kernels: Kernels, x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let d = weight.len();
    let mut out = vec![0.0f32; x.len()];
    out.par_chunks_mut(d * rows_per_task(d))
        .zip(x.par_chunks(d * rows_per_task(d)))
        .for_each(|(out, x)| {
            wide_simd!(kernels, for (out, x) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
                let r = inverse_rms(x, |&v| v, eps);
                for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
                    *o = w * (v * r);
                }
            })
        });
    out
}

/// The same for bf16 input and weight: statistics and scaling in f32, the normalised row rounded
/// to bf16, then the bf16 product with the weight (an f32 product rounded once, as PyTorch does).
pub fn rms_norm_bf16(kernels: Kernels, x: &[bf16], weight: &[bf16], eps: f32) -> Vec<bf16> {
    let d = weight.len();
    let weight: Vec<f32> = weight.iter().map(|&w| widen(w)).collect();
    let mut out = vec![bf16::ZERO; x.len()];
    out.par_chunks_mut(d * rows_per_task(d))
        .zip(x.par_chunks(d * rows_per_task(d)))
        .for_each(|(out, x)| {
            wide_simd!(kernels, for (out, x) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
                let r = inverse_rms(x, |&v| widen(v), eps);
                for ((o, &v), &w) in out.iter_mut().zip(x).zip(&weight) {
                    let normed = widen(narrow(widen(v) * r));
                    *o = narrow(w * normed);
                }
            })
        });
    out
}

/// The gradients of [`rms_norm_f32`] with respect to `x` and `weight`, given the gradient
/// `grad` of its output. Per row, with `r = 1 / sqrt(mean(x²) + eps)` and `gw = grad ⊙ weight`:
/// `dx = r · gw − x · r³ · mean(gw ⊙ x)`, and `dweight` sums `grad ⊙ x · r` over the rows.
/// Rows in parallel, each task summing its own `dweight` before the tasks' sums are added.
pub fn rms_norm_backward_f32(kernels: Kernels, x: &[f32], weight: &[f32], grad: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let d = weight.len();
    let chunk = d * rows_per_task(d);
    let mut dx = vec![0.0f32; x.len()];
    let dweight = dx
        .par_chunks_mut(chunk)
        .zip(x.par_chunks(chunk).zip(grad.par_chunks(chunk)))
        .map(|(dx, (x, grad))| {
            let mut dweight = vec![0.0f32; d];
            wide_simd!(kernels, for ((dx, x), grad) in dx.chunks_exact_mut(d).zip(x.chunks_exact(d)).zip(grad.chunks_exact(d)) {
                let r = inverse_rms(x, |&v| v, eps);
                let c = triple_dot(grad, weight, x) * r * r * r / d as f32;
                for ((((dx, dw), &g), &w), &v) in dx.iter_mut().zip(&mut dweight).zip(grad).zip(weight).zip(x) {
                    *dx = r * (g * w) - v * c;
                    *dw += g * (v * r);
                }
            });
            dweight
        })
        .reduce(
            || vec![0.0f32; d],
            |mut sum, part| {
                sum.iter_mut().zip(&part).for_each(|(s, p)| *s += p);
                sum
            },
        );
    (dx, dweight)
}

/// `Σ a ⊙ b ⊙ c`, accumulated in f32 over 8 lanes.
#[inline(always)]
fn triple_dot(a: &[f32], b: &[f32], c: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let split = a.len() / 8 * 8;
    for ((a, b), c) in a[..split].chunks_exact(8).zip(b[..split].chunks_exact(8)).zip(c[..split].chunks_exact(8)) {
        for k in 0..8 {
            lanes[k] += a[k] * b[k] * c[k];
        }
    }
    let tail: f32 = a[split..].iter().zip(&b[split..]).zip(&c[split..]).map(|((a, b), c)| a * b * c).sum();
    lanes.iter().sum::<f32>() + tail
}

/// `1 / sqrt(mean(x²) + eps)` of one row, accumulated in f32 over 8 lanes.
#[inline(always)]
fn inverse_rms<T>(x: &[T], widen: impl Fn(&T) -> f32, eps: f32) -> f32 {
    let mut lanes = [0.0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, v) in lanes.iter_mut().zip(chunk) {
            let v = widen(v);
            *lane += v * v;
        }
    }
    for (lane, v) in lanes.iter_mut().zip(tail) {
        let v = widen(v);
        *lane += v * v;
    }
    1.0 / (lanes.iter().sum::<f32>() / x.len() as f32 + eps).sqrt()
}

/// HF's `apply_rotary_pos_emb` for rows of `d` values in f32, with the sign of `rotate_half` in
/// the table (see `qwen3::rotary`): `y = x ⊙ cos + swap_halves(x) ⊙ signed_sin`, where
/// `swap_halves` exchanges the two halves of a row. `cos` and `signed_sin` are `x`'s shape.
pub fn rotary_f32(kernels: Kernels, x: &[f32], cos: &[f32], signed_sin: &[f32], d: usize) -> Vec<f32> {
    rotate(kernels, x, cos, signed_sin, d, |x, c, other, s| x * c + other * s)
}

/// The same in bf16, rounding as PyTorch does: each product rounded to bf16, then their sum
/// (the negation `rotate_half` applies is exact, so the signed table gives the same bits).
pub fn rotary_bf16(kernels: Kernels, x: &[bf16], cos: &[bf16], signed_sin: &[bf16], d: usize) -> Vec<bf16> {
    rotate(kernels, x, cos, signed_sin, d, |x, c, other, s| {
        narrow(round(widen(x) * widen(c)) + round(widen(other) * widen(s)))
    })
}

/// The gradient of [`rotary_f32`] with respect to `x`, given the gradient `grad` of its output.
/// RoPE turns each pair `(x[j], x[j + d/2])` by an angle; the transpose of a rotation is the
/// turn by the opposite angle, i.e. the same formula with `-signed_sin`. (This uses HF's
/// tables, whose two halves hold the same angles.)
pub fn rotary_backward_f32(kernels: Kernels, grad: &[f32], cos: &[f32], signed_sin: &[f32], d: usize) -> Vec<f32> {
    rotate(kernels, grad, cos, signed_sin, d, |x, c, other, s| x * c + other * -s)
}

/// `turn(x[j], cos[j], swap_halves(x)[j], signed_sin[j])` for every element, over rows of `d`,
/// rows in parallel.
fn rotate<T: Copy + Default + Send + Sync>(
    kernels: Kernels,
    x: &[T],
    cos: &[T],
    signed_sin: &[T],
    d: usize,
    turn: impl Fn(T, T, T, T) -> T + Sync,
) -> Vec<T> {
    let half = d / 2;
    let mut out = vec![T::default(); x.len()];
    let chunk = d * rows_per_task(d);
    out.par_chunks_mut(chunk)
        .zip(x.par_chunks(chunk).zip(cos.par_chunks(chunk)).zip(signed_sin.par_chunks(chunk)))
        .for_each(|(out, ((x, cos), sin))| {
            wide_simd!(kernels, for (((o, x), c), s) in out
                .chunks_exact_mut(d)
                .zip(x.chunks_exact(d))
                .zip(cos.chunks_exact(d))
                .zip(sin.chunks_exact(d))
            {
                let (x1, x2) = x.split_at(half);
                let (o1, o2) = o.split_at_mut(half);
                for j in 0..half {
                    o1[j] = turn(x1[j], c[j], x2[j], s[j]);
                    o2[j] = turn(x2[j], c[half + j], x1[j], s[half + j]);
                }
            })
        });
    out
}

/// `silu(gate) * up`, the SwiGLU product, in f32.
pub fn silu_mul_f32(kernels: Kernels, gate: &[f32], up: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0f32; gate.len()];
    out.par_chunks_mut(16 * 1024)
        .zip(gate.par_chunks(16 * 1024).zip(up.par_chunks(16 * 1024)))
        .for_each(|(out, (gate, up))| {
            wide_simd!(kernels, for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = silu(g) * u;
            })
        });
    out
}

/// The gradients of [`silu_mul_f32`] with respect to `gate` and `up`, given the gradient
/// `grad` of its output: `dgate = grad · up · σ(g) · (1 + g · (1 − σ(g)))`,
/// `dup = grad · silu(g)`. One parallel pass.
pub fn silu_mul_backward_f32(kernels: Kernels, gate: &[f32], up: &[f32], grad: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (mut dgate, mut dup) = (vec![0.0f32; gate.len()], vec![0.0f32; gate.len()]);
    const CHUNK: usize = 16 * 1024;
    dgate
        .par_chunks_mut(CHUNK)
        .zip(dup.par_chunks_mut(CHUNK))
        .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)).zip(grad.par_chunks(CHUNK)))
        .for_each(|((dgate, dup), ((gate, up), grad))| {
            wide_simd!(kernels, for ((((dg, du), &g), &u), &y) in dgate.iter_mut().zip(dup.iter_mut()).zip(gate).zip(up).zip(grad) {
                let sigmoid = 1.0 / (1.0 + exp(-g));
                *dg = y * u * sigmoid * (1.0 + g * (1.0 - sigmoid));
                *du = y * (g * sigmoid);
            })
        });
    (dgate, dup)
}

/// The same in bf16: `silu(gate)` rounded to bf16, then the bf16 product with `up`.
pub fn silu_mul_bf16(kernels: Kernels, gate: &[bf16], up: &[bf16]) -> Vec<bf16> {
    let mut out = vec![bf16::ZERO; gate.len()];
    out.par_chunks_mut(16 * 1024)
        .zip(gate.par_chunks(16 * 1024).zip(up.par_chunks(16 * 1024)))
        .for_each(|(out, (gate, up))| {
            wide_simd!(kernels, for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                let activated = widen(narrow(silu(widen(g))));
                *o = narrow(activated * widen(u));
            })
        });
    out
}

/// `row[target] - logsumexp(row)` in f32 for each row of `vocab` logits (the log-probability
/// of the target token), rows spread over the pool: one pass for the maximum and one for the
/// sum of exponentials, where the tensor formula takes six passes and five temporaries.
/// Returns the log-probabilities and each row's `logsumexp`.
pub fn chosen_logprobs<T: Copy + Sync>(
    kernels: Kernels,
    logits: &[T],
    vocab: usize,
    targets: &[usize],
    widen: impl Fn(T) -> f32 + Sync,
) -> (Vec<f32>, Vec<f32>) {
    logits
        .par_chunks(vocab)
        .zip(targets.par_iter())
        .map(|(row, &target)| {
            wide_simd!(kernels, {
                let max = row_max(row, &widen);
                let sum: f32 = lanes(row, 0.0, |lane, x| lane + exp(widen(x) - max)).iter().sum();
                let lse = sum.ln() + max;
                (widen(row[target]) - lse, lse)
            })
        })
        .unzip()
}

/// The largest element of `row` as f32 (NaNs ignored, as `f32::max` does), over 16 lanes.
#[inline(always)]
pub(super) fn row_max<T: Copy>(row: &[T], widen: impl Fn(T) -> f32) -> f32 {
    lanes(row, f32::NEG_INFINITY, |lane, x| lane.max(widen(x)))
        .into_iter()
        .fold(f32::NEG_INFINITY, f32::max)
}

/// `row` folded into 16 running values, element `i` into value `i % 16`, so that the fold
/// vectorises (a single f32 accumulator fixes the order of the additions and does not).
#[inline(always)]
pub(super) fn lanes<T: Copy>(row: &[T], init: f32, step: impl Fn(f32, T) -> f32) -> [f32; 16] {
    let mut lanes = [init; 16];
    let chunks = row.chunks_exact(16);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = step(*lane, x);
        }
    }
    for (lane, &x) in lanes.iter_mut().zip(tail) {
        *lane = step(*lane, x);
    }
    lanes
}

/// The gradient of [`chosen_logprobs`] with respect to f32 logits, given the gradient `grad` of
/// each row's log-probability and the rows' `logsumexp`:
/// `grad[r] · (onehot(target[r]) - softmax(row r))`, one parallel pass.
pub fn chosen_logprobs_backward(
    kernels: Kernels,
    logits: &[f32],
    vocab: usize,
    targets: &[usize],
    lse: &[f32],
    grad: &[f32],
) -> Vec<f32> {
    let mut out = vec![0.0f32; logits.len()];
    out.par_chunks_mut(vocab)
        .zip(logits.par_chunks(vocab))
        .zip(targets.par_iter().zip(lse).zip(grad))
        .for_each(|((out, row), ((&target, &lse), &g))| {
            wide_simd!(kernels, for (o, &x) in out.iter_mut().zip(row) {
                *o = -g * exp(x - lse);
            });
            out[target] += g;
        });
    out
}

/// The entropy `logsumexp(z) − Σ_v softmax(z)_v · z_v` of each row of `vocab` f32 logits (with
/// `z` shifted by the row maximum, which leaves it unchanged), rows in parallel: one pass for
/// the maximum and one for the exponentials and their weighted sum, over 16 lanes.
pub fn row_entropy(kernels: Kernels, logits: &[f32], vocab: usize) -> Vec<f32> {
    logits
        .par_chunks(vocab)
        .map(|row| {
            wide_simd!(kernels, {
                let max = row_max(row, |x| x);
                let (mut sum, mut weighted) = ([0.0f32; 16], [0.0f32; 16]);
                let chunks = row.chunks_exact(16);
                let tail = chunks.remainder();
                for chunk in chunks {
                    for ((s, w), &x) in sum.iter_mut().zip(&mut weighted).zip(chunk) {
                        let z = x - max;
                        let e = exp(z);
                        *s += e;
                        *w += e * z;
                    }
                }
                for (i, &x) in tail.iter().enumerate() {
                    let z = x - max;
                    let e = exp(z);
                    sum[i] += e;
                    weighted[i] += e * z;
                }
                let (sum, weighted): (f32, f32) = (sum.iter().sum(), weighted.iter().sum());
                sum.ln() - weighted / sum
            })
        })
        .collect()
}

#[inline(always)]
fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// `e^x` in f32 without branches or calls, so that loops using it vectorise: Cody–Waite range
/// reduction `x = n ln 2 + r` and Cephes' degree-7 polynomial for `e^r` (within 2 ulp of the
/// correctly rounded result). Overflows to infinity above ~88.72, returns 0 below ~-87.33
/// (where the true value is subnormal, < 1.2e-38) and keeps NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let clamped = x.clamp(-87.33, 88.72);
    let n = (clamped * LOG2E).round_ties_even();
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4_f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 5.000_000_1e-1;
    let p = p * r * r + r + 1.0;
    // 2^n as two normal factors: n reaches 128 near the top of the range.
    let n = n as i32;
    let (n1, n2) = (n >> 1, n - (n >> 1));
    let power = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
    let scaled = p * power(n1) * power(n2);
    if x.is_nan() {
        x
    } else if x > 88.72 {
        f32::INFINITY
    } else if x < -87.33 {
        0.0
    } else {
        scaled
    }
}

#[cfg(test)]
mod tests {
    use crate::Kernels;
    use super::*;

    #[test]
    fn rms_norm_matches_the_formula() {
        let x: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let w: Vec<f32> = (0..8).map(|i| 0.5 + i as f32 * 0.1).collect();
        let y = rms_norm_f32(Kernels::default(), &x, &w, 1e-6);
        for (row, out) in x.chunks(8).zip(y.chunks(8)) {
            let rms = (row.iter().map(|v| v * v).sum::<f32>() / 8.0 + 1e-6).sqrt();
            for i in 0..8 {
                assert!((out[i] - w[i] * row[i] / rms).abs() < 1e-5);
            }
        }
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let yb = rms_norm_bf16(Kernels::default(), &xb, &wb, 1e-6);
        for (a, b) in yb.iter().zip(&y) {
            assert!((a.to_f32() - b).abs() <= b.abs() / 64.0 + 1e-3);
        }
    }

    /// Within 2 ulp of the correctly rounded value (f64 `exp` rounded to f32) across the whole
    /// range, and the edge cases exact.
    #[test]
    fn exp_is_accurate() {
        let ulps = |x: f32| {
            let want = (x as f64).exp() as f32;
            (exp(x).to_bits() as i64 - want.to_bits() as i64).abs()
        };
        let worst = (0..2_000_000)
            .map(|i| -87.0 + 175.5 * i as f32 / 2_000_000.0)
            .chain((0..100_000).map(|i| (i as f32 - 50_000.0) * 1e-5))
            .map(ulps)
            .max()
            .unwrap();
        assert!(worst <= 2, "{worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-1.0e9), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn chosen_logprobs_match_the_formula() {
        let vocab = 1000;
        let logits: Vec<f32> = (0..3 * vocab).map(|i| (i as f32 * 0.731).sin() * 8.0).collect();
        let targets = [0, 517, 999];
        let (got, lse) = chosen_logprobs(Kernels::default(), &logits, vocab, &targets, |x| x);
        for (((row, &t), got), lse_got) in logits.chunks(vocab).zip(&targets).zip(got).zip(lse) {
            let lse = row.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
            assert!((lse_got as f64 - lse).abs() < 1e-5);
            assert!((got as f64 - (row[t] as f64 - lse)).abs() < 1e-5);
        }
        let halves: Vec<bf16> = logits.iter().map(|&x| bf16::from_f32(x)).collect();
        let widened: Vec<f32> = halves.iter().map(|x| x.to_f32()).collect();
        assert_eq!(
            chosen_logprobs(Kernels::default(), &halves, vocab, &targets, |x| x.to_f32()),
            chosen_logprobs(Kernels::default(), &widened, vocab, &targets, |x| x)
        );
    }

    /// Against central differences of the forward pass, in f64 from the f32 results.
    #[test]
    fn chosen_logprobs_backward_matches_finite_differences() {
        let vocab = 37;
        let logits: Vec<f32> = (0..2 * vocab).map(|i| (i as f32 * 1.37).cos() * 3.0).collect();
        let targets = [5, 36];
        let grad = [0.7f32, -1.3];
        let (_, lse) = chosen_logprobs(Kernels::default(), &logits, vocab, &targets, |x| x);
        let got = chosen_logprobs_backward(Kernels::default(), &logits, vocab, &targets, &lse, &grad);
        let loss = |l: &[f32]| -> f64 {
            let (lp, _) = chosen_logprobs(Kernels::default(), l, vocab, &targets, |x| x);
            lp.iter().zip(&grad).map(|(&p, &g)| p as f64 * g as f64).sum()
        };
        for i in 0..logits.len() {
            let (mut up, mut down) = (logits.clone(), logits.clone());
            up[i] += 1e-2;
            down[i] -= 1e-2;
            let want = (loss(&up) - loss(&down)) / 2e-2;
            assert!((got[i] as f64 - want).abs() < 2e-3, "logit {i}: {} vs {want}", got[i]);
        }
    }

    #[test]
    fn row_entropy_matches_the_formula() {
        let vocab = 1003;
        let logits: Vec<f32> = (0..3 * vocab).map(|i| (i as f32 * 0.0731).sin() * 6.0).collect();
        for (row, got) in logits.chunks(vocab).zip(row_entropy(Kernels::default(), &logits, vocab)) {
            let lse = row.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
            let want: f64 = -row.iter().map(|&x| { let lp = x as f64 - lse; lp.exp() * lp }).sum::<f64>();
            assert!((got as f64 - want).abs() < 1e-4, "{got} vs {want}");
        }
        assert!(row_entropy(Kernels::default(), &[1000.0, 0.0], 2)[0].abs() < 1e-6);
        assert!((row_entropy(Kernels::default(), &[7.0, 7.0], 2)[0] - std::f32::consts::LN_2).abs() < 1e-6);
    }

    /// Central differences of `Σ c ⊙ f(inputs)` (in f64 from the f32 forward kernels) against
    /// the backward kernels' gradients.
    fn assert_matches_finite_differences(
        inputs: &[f32],
        forward: impl Fn(&[f32]) -> Vec<f32>,
        cotangent: &[f32],
        gradient: &[f32],
        tolerance: f64,
    ) {
        let loss = |v: &[f32]| -> f64 { forward(v).iter().zip(cotangent).map(|(&y, &c)| y as f64 * c as f64).sum() };
        for i in 0..inputs.len() {
            let (mut up, mut down) = (inputs.to_vec(), inputs.to_vec());
            up[i] += 1e-2;
            down[i] -= 1e-2;
            let want = (loss(&up) - loss(&down)) / 2e-2;
            assert!((gradient[i] as f64 - want).abs() < tolerance, "input {i}: {} vs {want}", gradient[i]);
        }
    }

    #[test]
    fn rms_norm_backward_matches_finite_differences() {
        let d = 20;
        let x: Vec<f32> = (0..3 * d).map(|i| (i as f32 * 0.37).sin() * 2.0).collect();
        let w: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 * 0.05).collect();
        let grad: Vec<f32> = (0..3 * d).map(|i| (i as f32 * 0.91).cos()).collect();
        let (dx, dw) = rms_norm_backward_f32(Kernels::default(), &x, &w, &grad, 1e-6);
        assert_matches_finite_differences(&x, |x| rms_norm_f32(Kernels::default(), x, &w, 1e-6), &grad, &dx, 2e-3);
        assert_matches_finite_differences(&w, |w| rms_norm_f32(Kernels::default(), &x, w, 1e-6), &grad, &dw, 2e-3);
    }

    #[test]
    fn rms_norm_backward_sums_the_weight_gradient_over_every_task() {
        let d = 128;
        let rows = 3 * rows_per_task(d) + 5;
        let x: Vec<f32> = (0..rows * d).map(|i| (i as f32 * 0.013).sin()).collect();
        let w = vec![1.0f32; d];
        let grad = vec![1.0f32; rows * d];
        let (_, dw) = rms_norm_backward_f32(Kernels::default(), &x, &w, &grad, 1e-6);
        let normed = rms_norm_f32(Kernels::default(), &x, &w, 1e-6);
        for (j, &got) in dw.iter().enumerate() {
            let want: f64 = normed.iter().skip(j).step_by(d).map(|&v| v as f64).sum();
            assert!((got as f64 - want).abs() < 1e-3, "column {j}: {got} vs {want}");
        }
    }

    #[test]
    fn silu_mul_backward_matches_finite_differences() {
        let n = 40;
        let gate: Vec<f32> = (0..n).map(|i| (i as f32 - 20.0) * 0.4).collect();
        let up: Vec<f32> = (0..n).map(|i| (i as f32 * 0.7).cos() * 2.0).collect();
        let grad: Vec<f32> = (0..n).map(|i| (i as f32 * 0.3).sin()).collect();
        let (dgate, dup) = silu_mul_backward_f32(Kernels::default(), &gate, &up, &grad);
        assert_matches_finite_differences(&gate, |g| silu_mul_f32(Kernels::default(), g, &up), &grad, &dgate, 2e-3);
        assert_matches_finite_differences(&up, |u| silu_mul_f32(Kernels::default(), &gate, u), &grad, &dup, 2e-3);
    }

    #[test]
    fn silu_mul_matches_the_formula() {
        let g: Vec<f32> = (0..40_000).map(|i| (i as f32 * 0.001) - 20.0).collect();
        let u: Vec<f32> = (0..40_000).map(|i| (i as f32 * 0.01).cos()).collect();
        let y = silu_mul_f32(Kernels::default(), &g, &u);
        for i in (0..40_000).step_by(997) {
            let want = g[i] / (1.0 + (-g[i]).exp()) * u[i];
            assert!((y[i] - want).abs() < 1e-5 * want.abs().max(1.0));
        }
        let gb: Vec<bf16> = g.iter().map(|&v| bf16::from_f32(v)).collect();
        let ub: Vec<bf16> = u.iter().map(|&v| bf16::from_f32(v)).collect();
        let yb = silu_mul_bf16(Kernels::default(), &gb, &ub);
        for i in (0..40_000).step_by(997) {
            let activated = bf16::from_f32(silu(gb[i].to_f32())).to_f32();
            assert_eq!(yb[i], bf16::from_f32(activated * ub[i].to_f32()));
        }
    }
}
