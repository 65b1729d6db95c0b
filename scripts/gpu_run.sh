#!/usr/bin/env bash
# The GPU measurements of issue 6 in one go, for a CUDA host that has no Rust toolchain and no
# network: it needs only a `prompt-r1` built here with `cargo build --release --features cuda`.
#   scripts/gpu_run.sh [BIN=target/release/prompt-r1] [OUT=gpu-results]
# Writes to OUT: check-device tables (random tiny and 0.6B-shaped models), `bench --json` for
# bf16 and f32 weights (decode at batch 1 and 64) and for a training step in each precision,
# and peak-memory.txt: for each bench the device's peak memory in use, polled by nvidia-smi every 50 ms (it
# includes the CUDA context, ~0.5 GB). Every step runs even when one before it failed; the exit
# status says whether any did.
set -uo pipefail
bin=${1:-target/release/prompt-r1}
out=${2:-gpu-results}
mkdir -p "$out"
failed=0

step() {
  local name=$1
  shift
  echo "== $name: $*" | tee -a "$out/log.txt"
  if ! "$@" > "$out/$name.txt" 2>> "$out/log.txt"; then
    echo "   FAILED" | tee -a "$out/log.txt"
    failed=1
  fi
}

# Runs a bench with nvidia-smi polling the memory in use, and adds its peak to peak-memory.txt.
bench() {
  local name=$1
  shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 50 > "$out/$name.mem" &
  local poller=$!
  step "$name" "$bin" bench --device cuda --json "$@"
  kill "$poller" 2> /dev/null
  wait "$poller" 2> /dev/null
  echo "$name: $(sort -n "$out/$name.mem" | tail -1) MiB" >> "$out/peak-memory.txt"
  rm -f "$out/$name.mem"
}

nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || { echo "no NVIDIA driver: nvidia-smi failed"; exit 1; }
# cubecl compiles its kernels with NVRTC at run time. Where the toolkit is not installed system-
# wide, the NVIDIA wheels of a Python environment (nvidia-cuda-nvrtc, nvidia-cuda-runtime) carry
# the library and headers: put them on the search paths.
nvidia=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2> /dev/null || true)
if [ -n "$nvidia" ] && ! ldconfig -p | grep -q libnvrtc; then
  LD_LIBRARY_PATH=$(ls -d "$nvidia"/*/lib 2> /dev/null | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export LD_LIBRARY_PATH
fi
if [ -n "$nvidia" ] && [ -z "${CUDA_PATH:-}" ] && [ ! -d /usr/local/cuda ]; then
  for include in "$nvidia"/cuda_runtime/include "$nvidia"/cu*/include; do
    if [ -f "$include/cuda_runtime.h" ]; then
      export CUDA_PATH=${include%/include}
      break
    fi
  done
fi
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-} CUDA_PATH=${CUDA_PATH:-}" >> "$out/log.txt"
step check-device-tiny "$bin" check-device --device cuda
step check-device-0.6b "$bin" check-device --device cuda --preset qwen3-0.6b --atol 5e-3
bench bench-bf16 --dtype bf16 --decode-batch 1,64
bench bench-f32 --dtype f32 --decode-batch 1,64
bench train-f32 --dtype f32 --decode-batch 1 --decode-tokens 2 --train-step
bench train-bf16-products --dtype f32 --matmul bf16 --decode-batch 1 --decode-tokens 2 --train-step
cat "$out/peak-memory.txt"
exit $failed
