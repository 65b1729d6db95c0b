"""Checks `prompt-r1 export` against Hugging Face transformers.

Usage: test_export_transformers.py PROMPT_R1_BIN WORK_DIR

Makes a tiny random checkpoint, exports it in f32 and in bf16, loads each export with
`transformers.AutoModelForCausalLM.from_pretrained`, and compares the log-probabilities that
transformers gives a fixed completion with those of `prompt-r1 score` on the same export.
"""

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

# Both sides compute in f32 from the same stored weights, so they differ only by the order of
# f32 operations: far below this bound, which is far below the spread of the log-probabilities.
TOLERANCE = 1e-4
MIN_SPREAD = 0.05

PROMPT = [3, 17, 250, 41, 9, 388, 120, 77, 5, 301]
COMPLETION = [64, 2, 499, 310, 18, 200, 45, 7]

results = []


def check(condition, message):
    print(f"{'ok' if condition else 'FAILED'}: {message}")
    results.append(condition)


def run(*args):
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(map(str, args))} failed:\n{done.stderr}")
    return done.stdout


def ours(binary, model_dir):
    out = run(
        binary, "score", "--model", model_dir, "--json",
        "--prompt-ids", ",".join(map(str, PROMPT)),
        "--completion-ids", ",".join(map(str, COMPLETION)),
    )
    return torch.tensor(json.loads(out)["token_logprobs"], dtype=torch.float64)


def theirs(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    ids = torch.tensor([PROMPT + COMPLETION])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(PROMPT) - 1, len(PROMPT) + len(COMPLETION) - 1)
    return logprobs[positions, torch.tensor(COMPLETION)]


def main():
    binary, work = sys.argv[1], Path(sys.argv[2])
    source = work / "tiny"
    run(binary, "init-model", "--preset", "tiny", "--out", source)
    for dtype in ["f32", "bf16"]:
        exported = work / f"export-{dtype}"
        run(binary, "export", source, "--out", exported, "--dtype", dtype)
        with safe_open(exported / "model.safetensors", framework="pt") as f:
            check(f.metadata().get("format") == "pt", f"{dtype}: the file says format pt")
        a, b = ours(binary, exported), theirs(exported)
        diff = (a - b).abs().max().item()
        spread = (b.max() - b.min()).item()
        check(spread > MIN_SPREAD, f"{dtype}: log-probabilities spread {spread:.3f} (> {MIN_SPREAD})")
        check(diff <= TOLERANCE, f"{dtype}: max |ours - transformers| = {diff:.2e} (<= {TOLERANCE})")
    failed = results.count(False)
    print(f"{len(results) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
