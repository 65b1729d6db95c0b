"""Checks `prompt-r1 export` of a LoRA run against PEFT (and transformers).

Usage: test_export_peft.py PROMPT_R1_BIN WORK_DIR

Trains LoRA adapters on a tiny random model for two steps (`prompt-r1 train` with `[lora]`; the
environment is the base model under `prompt-r1 serve`, which `train` probes once at its start:
a random agent makes no well-formed call, so every episode scores -1 and the entropy bonus is
what moves the adapters), exports the checkpoint as a PEFT adapter directory and with `--merge`, then:
the adapter directory loads with `peft.PeftModel.from_pretrained` on the base and gives the
log-probabilities of `prompt-r1 score --adapter`; the merged directory loads with
`AutoModelForCausalLM` and gives them too; the files hold what PEFT and vLLM read.
"""

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM

# Both sides compute in f32 from the same stored weights (the adapters in f32, the merged
# weights exported in f32), so they differ only by the order of f32 operations.
TOLERANCE = 1e-4
# Trained adapters must move the log-probabilities by more than this (else the test is vacuous).
MIN_CHANGE = 1e-3

PROMPT = [3, 17, 250, 41, 9, 388, 120, 77, 5, 301]
COMPLETION = [64, 2, 499, 310, 18, 200, 45, 7]

RUN_TOML = """
model = "base"
[lora]
rank = 4
alpha = 8
[environment]
base_url = "http://127.0.0.1:{port}/v1"
model = "base"
[environment.retry]
max_attempts = 1
[data]
train = ["train.jsonl"]
[episode]
max_turns = 1
max_turn_tokens = 8
max_response_tokens = 64
[rollout]
batch_size = 2
n = 4
generation_batch = 8
[grpo]
mini_batch_size = 8
micro_batch_size = 8
[grpo.loss]
kl_coef = 0.001
entropy_coef = 0.01
[grpo.optimizer]
lr = 0.05
[run]
out_dir = "run"
steps = 2
save_every = 2
validate_every = 0
validate_before_train = false
"""

results = []


def check(condition, message):
    print(f"{'ok' if condition else 'FAILED'}: {message}")
    results.append(condition)


def run(*args, cwd=None):
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd)
    if done.returncode != 0:
        sys.exit(f"{' '.join(map(str, args))} failed:\n{done.stderr}")
    return done.stdout


def serving(binary, model_dir):
    """Starts `prompt-r1 serve` on a free port; gives the process and the port once it answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([str(binary), "serve", "--model", str(model_dir), "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return server, port
        except OSError:
            if server.poll() is not None:
                sys.exit(f"prompt-r1 serve --model {model_dir} exited with {server.returncode}")
            time.sleep(0.1)
    server.kill()
    sys.exit(f"prompt-r1 serve --model {model_dir} did not answer on port {port}")


def ours(binary, model_dir, adapter=None):
    extra = ["--adapter", adapter] if adapter else []
    out = run(
        binary, "score", "--model", model_dir, "--json", *extra,
        "--prompt-ids", ",".join(map(str, PROMPT)),
        "--completion-ids", ",".join(map(str, COMPLETION)),
    )
    return torch.tensor(json.loads(out)["token_logprobs"], dtype=torch.float64)


def logprobs(model):
    model.eval()
    ids = torch.tensor([PROMPT + COMPLETION])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    positions = torch.arange(len(PROMPT) - 1, len(PROMPT) + len(COMPLETION) - 1)
    return torch.log_softmax(logits, dim=-1)[positions, torch.tensor(COMPLETION)]


def main():
    binary, work = sys.argv[1], Path(sys.argv[2])
    run(binary, "init-model", "--preset", "tiny", "--out", work / "base")
    rows = "".join(
        json.dumps({"id": f"q{i}", "data_source": "toy", "question": q, "answers": ["x"]}) + "\n"
        for i, q in enumerate(["Paris?", "Rome?", "Oslo?", "Lima?"])
    )
    (work / "train.jsonl").write_text(rows)
    server, port = serving(binary, work / "base")
    try:
        (work / "run.toml").write_text(RUN_TOML.format(port=port))
        run(binary, "train", "--config", work / "run.toml", cwd=work)
    finally:
        server.kill()
        server.wait()

    adapter, merged = work / "adapter", work / "merged"
    run(binary, "export", work / "run", "--out", adapter)
    run(binary, "export", work / "run", "--out", merged, "--merge", "--dtype", "f32")

    config = json.loads((adapter / "adapter_config.json").read_text())
    check(config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM", "adapter_config: LORA, CAUSAL_LM")
    check((config["r"], config["lora_alpha"]) == (4, 8), f"adapter_config: r {config['r']}, lora_alpha {config['lora_alpha']}")
    check(sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
          "adapter_config: all-linear targets named")
    check(Path(config["base_model_name_or_path"]).resolve() == (work / "base").resolve(), "adapter_config names the base")
    with safe_open(adapter / "adapter_model.safetensors", framework="pt") as f:
        check(f.metadata().get("format") == "pt", "the adapter file says format pt")
        key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        check(key in f.keys() and list(f.get_tensor(key).shape) == [4, 64], f"{key} is [r, in]")
        check(not any(".default." in k for k in f.keys()), "PEFT's saved names (no adapter name inside)")

    base = AutoModelForCausalLM.from_pretrained(work / "base", dtype=torch.float32)
    plain = logprobs(base)
    theirs = logprobs(PeftModel.from_pretrained(base, adapter))
    mine = ours(binary, work / "base", adapter)
    change = (theirs - plain).abs().max().item()
    check(change > MIN_CHANGE, f"the trained adapters move the log-probabilities by {change:.2e} (> {MIN_CHANGE})")
    diff = (mine - theirs).abs().max().item()
    check(diff <= TOLERANCE, f"adapter: max |ours - PEFT| = {diff:.2e} (<= {TOLERANCE})")

    merged_theirs = logprobs(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32))
    diff = (merged_theirs - theirs).abs().max().item()
    check(diff <= TOLERANCE, f"merged: max |transformers(merged) - PEFT| = {diff:.2e} (<= {TOLERANCE})")
    diff = (ours(binary, merged) - theirs).abs().max().item()
    check(diff <= TOLERANCE, f"merged: max |ours(merged) - PEFT| = {diff:.2e} (<= {TOLERANCE})")

    failed = results.count(False)
    print(f"{len(results) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
