//! Which of the kernels a GPU backend lends a model runs is the model's own
//! (`model::DeviceKernelChoice` in its `Compute`, chosen at load), not the process's: six
//! models of one process on wgpu, their decoding steps interleaved, each with another choice,
//! agree on their logits. That each runs the kernels its choice names (and no other model's) is
//! counted by the model crate's unit test `each_model_runs_the_kernels_its_choice_names`, with a
//! counting kernel; here the real kernels run, which cannot be counted from outside.

use burn::tensor::DType;
use burn_wgpu::{Vulkan, WgpuDevice};
use model::checkpoint::StorageDtype;
use model::cpu_kernels::Kernels;
use model::device_kernels::{Decoding, DecodingKernel, DeviceKernelChoice, KernelPasses};
use model::init::write_random_checkpoint;
use model::{load_pretrained, Compute, Decoder, DecoderLimits, LoadOptions, Preset, Qwen3ForCausalLM};

use crate::common::{backend_ready, max_abs_diff, synthetic_prompt};

const VOCAB: usize = 512;
const PROMPT: u32 = 40;
const STEPS: usize = 4;

/// Off: every pass attends through burn's ops. Decoding steps: only those through the
/// paged-attention kernel (split where the device would idle, through the kernel made for them;
/// and whole, through the general kernel, as `--split-decoding off --decoding-kernel general`
/// choose); and decoding steps with the projections through burn's matmul rather than the
/// skinny-matmul kernel (`--skinny-matmul off`). Every pass: the prefill too, both ways. All are fed off's greedy token at each
/// step; the logits of every step agree within 1e-3 (kernels and burn's ops sum in different orders, in
/// f32).
#[test]
fn models_with_other_kernel_choices_agree_side_by_side() {
    if !backend_ready::<Vulkan>() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(&Preset::Tiny.config(VOCAB, vec![2]), dir.path(), 11, StorageDtype::F32).unwrap();
    let device = WgpuDevice::DefaultDevice;
    let load = |choice: DeviceKernelChoice| {
        let compute = Compute::default().with_cpu_kernels(Kernels::off()).with_device_kernels(choice);
        load_pretrained::<Vulkan>(dir.path(), &device, LoadOptions { dtype: DType::F32, compute }).unwrap().for_inference()
    };
    let whole = Decoding { split: false, kernel: DecodingKernel::General };
    let choices = [
        DeviceKernelChoice::OFF,
        DeviceKernelChoice::with_passes(Some(KernelPasses::Decode)),
        DeviceKernelChoice { passes: Some(KernelPasses::Decode), decoding: whole, skinny_matmul: true, tensor_cores: false },
        DeviceKernelChoice { skinny_matmul: false, ..DeviceKernelChoice::with_passes(Some(KernelPasses::Decode)) },
        DeviceKernelChoice::with_passes(Some(KernelPasses::All)),
        DeviceKernelChoice { passes: Some(KernelPasses::All), decoding: whole, skinny_matmul: true, tensor_cores: false },
    ];
    let models: Vec<Qwen3ForCausalLM<Vulkan>> = choices.iter().map(|&choice| load(choice)).collect();
    let mut decoders: Vec<Decoder<Vulkan>> = models.iter().map(|_| Decoder::new(DecoderLimits::default())).collect();
    for (decoder, model) in decoders.iter_mut().zip(&models) {
        decoder.add(model, 0, synthetic_prompt(VOCAB as u32, 3, PROMPT)).unwrap();
    }
    let mut logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(); models.len()];
    for _ in 0..STEPS {
        let mut ids = Vec::new();
        for ((decoder, model), seen) in decoders.iter_mut().zip(&models).zip(&mut logits) {
            let out = decoder.step(model).unwrap().expect("a running row");
            ids.push(out.ids[0]);
            seen.push(out.logits.into_data().convert::<f32>().to_vec::<f32>().unwrap());
        }
        // Every model takes off's greedy token, so that a near tie cannot part their histories.
        let row = logits[0].last().unwrap();
        let token = (0..VOCAB).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap() as u32;
        for (decoder, id) in decoders.iter_mut().zip(ids) {
            decoder.accept(id, token).unwrap();
        }
    }
    let logits: Vec<Vec<f32>> = logits.into_iter().map(|steps| steps.concat()).collect();
    for (k, seen) in logits.iter().enumerate().skip(1) {
        let worst = max_abs_diff(seen, &logits[0]);
        println!("{:?} against off: max |Δ logit| {worst:.2e}", choices[k]);
        assert!(worst < 1e-3, "{:?}: max |Δ logit| {worst}", choices[k]);
    }
}
