#!/usr/bin/env bash
# Compiles every CubeCL kernel of prompt-r1-device-kernels as the CUDA backend would, without a
# GPU: CubeCL's CUDA C++ of each kernel (f32, f16, bf16; the Qwen3 shapes) through NVIDIA's
# runtime compiler, NVRTC, for sm_70, sm_75, sm_80, sm_90a and sm_100a
# (tests/gpu_path/cuda_source.rs).
#
# NVRTC and the CUDA headers come from PyPI's NVIDIA wheels (nvidia-cuda-nvrtc-cu12,
# nvidia-cuda-runtime-cu12 and, for `crt/mma.h`, nvidia-cuda-nvcc-cu12; about 135 MB), installed
# once into a virtual environment under the target directory. Needs a Vulkan adapter (lavapipe will do) for the kernels' definitions.
# PROMPT_R1_CUDA_SOURCES=DIR also writes each source to DIR. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
# The wheels' environment, made as the Python client tests make theirs (tests/python/venvs.sh).
source tests/python/venvs.sh
make_venv "${VENV_NVRTC[@]}"
nvrtc="$(find "$venv" -path '*/nvidia/cuda_nvrtc/lib/libnvrtc.so.12' | head -n 1)"
include="$(find "$venv" -path '*/nvidia/cuda_runtime/include' -type d | head -n 1)"
crt="$(find "$venv" -path '*/nvidia/cuda_nvcc/include' -type d | head -n 1)"
if [ -z "$nvrtc" ] || [ -z "$include" ] || [ -z "$crt" ]; then
    echo "error: the NVIDIA wheels in $venv hold no libnvrtc.so.12, CUDA runtime headers or nvcc's crt headers" >&2
    exit 1
fi
include="$include:$crt"
# The whole workspace, so that features unify as in `cargo test --release --workspace` and its
# build is reused. An instruction-set cap would make the GPU-path tests skip.
unset PROMPT_R1_CPU_ISA
PROMPT_R1_NVRTC="$nvrtc" PROMPT_R1_CUDA_INCLUDE="$include" \
    cargo test --release --workspace --test gpu_path -- cuda_source --nocapture
