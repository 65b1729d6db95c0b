#!/usr/bin/env bash
# The machine code of one of our CubeCL kernels as a GPU would run it, without a GPU: CubeCL's
# CUDA C++ of the kernel (as `tests/gpu_path/cuda_source.rs` generates it), compiled by NVRTC to a
# cubin for ARCH and disassembled by `cuobjdump -sass`; NVRTC, the CUDA headers, cuobjdump and
# nvdisasm come from PyPI's NVIDIA wheels, in a virtual environment under target/. For reading
# what a kernel change did to its loads, stores and registers between GPU leases.
#
#   scripts/sass.sh NAME [ARCH]
#
# NAME is a kernel source's name as the test names it, e.g.
# `paged_attention_bf16_uniform_groups_2_queries_1` (no NAME: the list); ARCH is 70, 75, 80, 90
# (sm_90a, the default: H100, H200) or 100. Prints ptxas's registers and spills, then the SASS.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:-}
arch=${2:-90}
source tests/python/venvs.sh
VENV_SASS=("${VENV_NVRTC[@]}" nvidia-cuda-cuobjdump==13.5.37 nvidia-cuda-nvdisasm==13.5.37)
make_venv "${VENV_SASS[@]}"
sources="$target/cuda-sources"
# Generated anew each time (seconds once the test is built), so an edited kernel is never read
# from an old source.
rm -rf "$sources"
unset PROMPT_R1_CPU_ISA
PROMPT_R1_CUDA_SOURCES="$sources" cargo test --release --workspace --test gpu_path -- cuda_source::every_kernel_compiles_for_cuda > /dev/null
if [ -z "$name" ]; then
    ls "$sources" | sed -n "s/\.sm_$arch\.cu$//p"
    exit 0
fi
source_file="$sources/$name.sm_$arch.cu"
[ -f "$source_file" ] || { echo "error: no kernel source $name for sm_$arch (scripts/sass.sh with no name lists them)" >&2; exit 1; }
cubin="$target/cuda-sources/$name.sm_$arch.cubin"
suffix=""
[ "$arch" -ge 90 ] && suffix=a
"$venv/bin/python" - "$source_file" "$cubin" "sm_$arch$suffix" << 'PY'
import ctypes, glob, os, sys
source, cubin, arch = sys.argv[1:]
nvidia = os.path.join(sys.prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "site-packages", "nvidia")
nvrtc = ctypes.CDLL(glob.glob(os.path.join(nvidia, "cuda_nvrtc", "lib", "libnvrtc.so.*"))[0])
# The runtime's headers, and nvcc's `crt/` (the tensor cores' `mma.h`).
includes = [os.path.join(nvidia, "cuda_runtime", "include"), os.path.join(nvidia, "cuda_nvcc", "include")]
program = ctypes.c_void_p()
if nvrtc.nvrtcCreateProgram(ctypes.byref(program), open(source, "rb").read(), b"kernel.cu", 0, None, None):
    sys.exit("nvrtcCreateProgram failed")
options = [f"--gpu-architecture={arch}".encode(), b"--ptxas-options=-v"] + [f"--include-path={include}".encode() for include in includes]
status = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
size = ctypes.c_size_t()
nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
log = ctypes.create_string_buffer(size.value)
nvrtc.nvrtcGetProgramLog(program, log)
print("\n".join(l for l in log.value.decode().splitlines() if "registers" in l or "spill" in l))
if status:
    sys.exit(f"NVRTC failed:\n{log.value.decode()}")
nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size))
binary = ctypes.create_string_buffer(size.value)
nvrtc.nvrtcGetCUBIN(program, binary)
open(cubin, "wb").write(binary.raw)
PY
bin_dir=$(dirname "$(find "$venv" -name nvdisasm -type f | head -n 1)")
PATH="$bin_dir:$PATH" "$(find "$venv" -name cuobjdump -type f | head -n 1)" -sass "$cubin"
