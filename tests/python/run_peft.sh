#!/usr/bin/env bash
# Tests `prompt-r1 export` of a LoRA run with PEFT (PyPI): a two-step LoRA run on a tiny random
# model is exported as a PEFT adapter directory, which must load with peft.PeftModel on the base
# and give the log-probabilities of `prompt-r1 score --adapter`; its `--merge` export must load
# with transformers and give them too.
#
# Builds nothing: run `cargo build --release -p prompt-r1` first (or point PROMPT_R1_BIN at a
# binary). Uses the virtual environment of run_export.sh (torch, transformers, safetensors, peft;
# made here if that script has not run), runs test_export_peft.py in a throwaway work directory,
# and removes that. Exits non-zero on any failure.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
trap 'rm -rf "$work"' EXIT

make_venv "${VENV_TRANSFORMERS[@]}"

HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error \
    "$venv/bin/python" "$here/test_export_peft.py" "$bin" "$work"
