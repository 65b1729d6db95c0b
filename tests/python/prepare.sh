#!/usr/bin/env bash
# Installs every virtual environment the Python client tests use (run.sh, run_export.sh,
# run_peft.sh) and the NVIDIA wheels of scripts/nvrtc_check.sh, without building or running
# anything: CI starts it beside the Rust build, so that the downloads (torch alone is several
# GB) overlap the compile instead of following it. Environments already installed are kept.
# Exits non-zero if an install failed (the scripts then try again themselves).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venvs.sh"
make_venv "${VENV_OPENAI[@]}"
make_venv "${VENV_TRANSFORMERS[@]}"
make_venv "${VENV_NVRTC[@]}"
