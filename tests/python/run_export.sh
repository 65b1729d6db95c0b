#!/usr/bin/env bash
# Tests `prompt-r1 export` with Hugging Face transformers (PyPI): an exported checkpoint must load
# with AutoModelForCausalLM and give the same log-probabilities as `prompt-r1 score`.
#
# Builds nothing: run `cargo build --release -p prompt-r1` first (or point PROMPT_R1_BIN at a
# binary). Installs torch, transformers, safetensors and peft into a virtual environment under the
# target directory (kept for run_peft.sh, which needs the same packages), runs
# test_export_transformers.py in a throwaway work directory, and removes that. Exits non-zero on
# any failure.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
trap 'rm -rf "$work"' EXIT

make_venv "${VENV_TRANSFORMERS[@]}"

mkdir "$work/models"
HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error \
    "$venv/bin/python" "$here/test_export_transformers.py" "$bin" "$work/models"
