# Sourced by common.sh and prepare.sh: the virtual environments of the Python client tests, one
# per package list, kept under the target directory. Sets `root`, `target` and (make_venv)
# `venv`.

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"

# The package lists of the scripts beside this one and of scripts/nvrtc_check.sh (NVRTC and the
# CUDA headers: the runtime's, and nvcc's `crt/` for the tensor cores' `mma.h`); prepare.sh makes
# them all.
VENV_OPENAI=(openai)
VENV_TRANSFORMERS=(torch transformers safetensors peft)
VENV_NVRTC=(nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79 nvidia-cuda-nvcc-cu12==12.9.86)

# Sets `venv` to a virtual environment holding the named PyPI packages. One environment per
# package list is kept under the target directory, so the scripts that name the same packages
# (run_export.sh and run_peft.sh: torch from PyPI is several GB) install them once; one whose
# install did not finish is made anew.
make_venv() {
    mkdir -p "$target/python-venvs"
    venv="$target/python-venvs/$(printf '%s-' "$@")"
    if [ ! -f "$venv/.installed" ]; then
        rm -rf "$venv"
        python3 -m venv "$venv"
        "$venv/bin/pip" install --quiet --disable-pip-version-check "$@"
        touch "$venv/.installed"
    fi
}
