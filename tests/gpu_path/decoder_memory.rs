//! The decoder gives back, in the step that grows them, the pages of the KV pools it copied into
//! larger ones: CubeCL's pool keeps a freed slice for later tensors of its page's class, and a
//! grown pool fits none of its predecessors' slices.

use burn_wgpu::{Vulkan, WgpuDevice, WgpuRuntime};
use cubecl::Runtime;
use model::checkpoint::StorageDtype;
use model::init::write_random_checkpoint;
use model::{load_pretrained, Decoder, DecoderLimits, LoadOptions, Preset};
use trainer::run::release_unused_device_memory;

use crate::common::{backend_ready, synthetic_prompt};

/// Bytes CubeCL's wgpu pool of this thread has reserved.
fn reserved() -> u64 {
    WgpuRuntime::client(&WgpuDevice::DefaultDevice).memory_usage().unwrap().bytes_reserved
}

/// One layer of 8 key-value heads of 128 (4 KiB a position in f32, per pool): two 300-token
/// prompts grow each pool past 2 MiB, out of lavapipe's pages of 8 MiB (tensors up to 2 MiB)
/// into its pages of 32 MiB. After a step that grew the pools a cleanup frees nothing: the step
/// gave their old pages back itself (without it, a cleanup then frees them). After the others
/// it may (the prefill's activations), as the trainer's cleanups between phases do.
#[test]
fn a_step_that_grows_the_kv_pools_gives_their_old_pages_back() {
    if !backend_ready::<Vulkan>() {
        return;
    }
    let mut config = Preset::Tiny.config(512, vec![2]);
    config.num_hidden_layers = 1;
    config.num_attention_heads = 8;
    config.num_key_value_heads = 8;
    config.head_dim = 128;
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(&config, dir.path(), 7, StorageDtype::F32).unwrap();
    let device = WgpuDevice::DefaultDevice;
    let model = load_pretrained::<Vulkan>(dir.path(), &device, LoadOptions::default()).unwrap();
    let mut decoder = Decoder::<Vulkan>::new(DecoderLimits::default());
    let (mut positions, mut growths) = (Vec::new(), 0);
    for id in 0..2u64 {
        decoder.add(&model, id, synthetic_prompt(512, id as u32 + 1, 300)).unwrap();
        for _ in 0..3 {
            let out = decoder.step(&model).unwrap().expect("a running row");
            let logits: Vec<f32> = out.logits.into_data().convert::<f32>().to_vec().unwrap();
            for (row, &id) in out.ids.iter().enumerate() {
                let row = &logits[row * 512..(row + 1) * 512];
                let token = (0..512).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap() as u32;
                decoder.accept(id, token).unwrap();
            }
            let grew = positions.last().is_some_and(|&last| last < decoder.kv_positions());
            positions.push(decoder.kv_positions());
            let before = reserved();
            release_unused_device_memory::<Vulkan>(&device).unwrap();
            if grew {
                growths += 1;
                assert_eq!(reserved(), before, "a cleanup after the step that grew the pools to {} positions freed pages", decoder.kv_positions());
            }
        }
    }
    assert!(growths > 0, "the pools grew: {positions:?}");
    assert!(positions.last().unwrap() * 4096 > 2 << 20, "past 2 MiB a pool: {positions:?}");
}
