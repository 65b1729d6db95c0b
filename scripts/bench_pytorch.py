"""The workloads of `prompt-r1 bench`, run with PyTorch + transformers on the same checkpoint.

Prints one JSON list of {"workload", "seconds", "tokens_per_second", "peak_rss_mb"} in the same
order and with the same names as `prompt-r1 bench --json --train-step`, so the two can be
divided line by line (scripts/bench_compare.sh does that). With `--device cuda` every workload
runs on the GPU (timed after `torch.cuda.synchronize()`), and each figure adds
"peak_gpu_mb", PyTorch's peak of allocated GPU memory. Not a CI dependency.
"""
import argparse
import json
import resource
import time

import torch
from transformers import AutoModelForCausalLM


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


DEVICE = torch.device("cpu")


def now():
    """Wall-clock seconds, after the GPU's queued work is done."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def figure(name, seconds, tokens=None):
    out = {
        "workload": name,
        "seconds": seconds,
        "tokens_per_second": None if tokens is None else tokens / seconds,
        "peak_rss_mb": peak_rss_mb(),
    }
    if DEVICE.type == "cuda":
        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def median(run, runs=3):
    """The median of `runs` calls of `run` (each returns seconds), as `prompt-r1 bench` times
    every workload after load."""
    return sorted(run() for _ in range(runs))[runs // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--decode-batch", default="1,8")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--matmul", default="f32", choices=["f32", "bf16"],
                    help="bf16: every workload under torch.autocast(device, bfloat16), as `prompt-r1 bench --matmul bf16`")
    args = ap.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "f32" else torch.bfloat16

    def tensor(rows):
        return torch.tensor(rows, device=DEVICE)

    figures = []
    start = now()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="eager").to(DEVICE)
    model.eval()
    figures.append(figure("load", now() - start))
    vocab = model.config.vocab_size
    prompt = [(i * 7919 + 13) % vocab for i in range(args.prompt_len)]

    autocast = torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=args.matmul == "bf16")
    with torch.no_grad(), autocast:
        model.generate(tensor([prompt[:8]]), max_new_tokens=2, do_sample=False)

        def prefill():
            start = now()
            model.generate(tensor([prompt]), max_new_tokens=1, do_sample=False)
            return now() - start

        figures.append(figure(f"prefill {args.prompt_len} tokens", median(prefill), args.prompt_len))

        for batch in [int(b) for b in args.decode_batch.split(",")]:
            ids = tensor([prompt[b % 8 : b % 8 + 16] for b in range(batch)])
            kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)

            def decode():
                start = now()
                model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
                prefill = now() - start
                start = now()
                model.generate(ids, max_new_tokens=args.decode_tokens, min_new_tokens=args.decode_tokens, **kwargs)
                return max(now() - start - prefill, 1e-9)

            figures.append(figure(f"decode batch {batch}", median(decode), batch * (args.decode_tokens - 1)))

        half = args.prompt_len // 2
        ids = tensor([prompt, prompt])

        def score():
            start = now()
            logits = model(ids).logits[:, half - 1 : -1].float()
            torch.log_softmax(logits, -1).gather(-1, ids[:, half:, None])
            return now() - start

        figures.append(figure(f"score 2 x {args.prompt_len} tokens", median(score), 2 * args.prompt_len))

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, eps=1e-8)
    ids = tensor([prompt, prompt])
    advantages = tensor([1.0, -1.0])

    def step():
        with autocast:
            logits = model(ids).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(advantages[:, None] * logp).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    def timed_step():
        start = now()
        step()
        return now() - start

    # One warm-up step, then the median of three (as `prompt-r1 bench --train-step`).
    step()
    figures.append(figure(f"train step 2 x {args.prompt_len}", median(timed_step), 2 * args.prompt_len))
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
