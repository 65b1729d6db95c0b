#!/usr/bin/env python3
"""Bursts of concurrent requests against one `prompt-r1 serve`, and what its `GET /metrics` says
after each: the KV pool's peak, preemptions, tokens, and on a GPU CubeCL's pool.

    scripts/serve_burst.py BIN MODEL [--requests 32] [--prompt-tokens 512] [--new-tokens 256]
        [--bursts 2] -- [serve flags, e.g. --device cuda --dtype bf16 --kv-cache-memory 1GiB]

Starts `BIN serve --model MODEL --port 0 FLAGS`, sends each burst's requests at once
(`/v1/completions` with random token-id prompts, greedy, `ignore_eos`), waits until the worker
is idle, and prints one line per burst: wall time, generated tokens per second and the
`prompt_r1:` metrics. The server's log (its GPU-memory lines after each burst) goes to
stderr. Standard library only, for hosts with nothing but python3.
"""

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request


def post(url, body, timeout):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.load(reply)


def metrics(base):
    with urllib.request.urlopen(base + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    found = {}
    for line in text.splitlines():
        match = re.match(r"^prompt_r1:(\S+) (\S+)$", line)
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


def idle_metrics(base, deadline=30.0):
    end = time.time() + deadline
    while True:
        found = metrics(base)
        if found.get("num_requests_running", 0) + found.get("num_requests_waiting", 0) == 0 or time.time() > end:
            return found
        time.sleep(0.05)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bin")
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--bursts", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    argv = sys.argv[1:]
    serve_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)

    command = [args.bin, "serve", "--model", args.model, "--port", "0", "--max-batch", str(args.requests)] + serve_flags
    print("$ " + " ".join(command), flush=True)
    # A `timeout` that ends this script (SIGTERM) ends the server too, through the `finally`
    # below, instead of leaving it holding the GPU's memory for the steps after.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("serve_burst.py: terminated"))
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        found = re.search(r"(http://\S+)/v1", line)
        if not found:
            sys.exit(f"serve did not start: {line!r}")
        base = found.group(1)
        vocab = json.load(open(f"{args.model}/config.json"))["vocab_size"]
        rng = random.Random(0)
        for burst in range(1, args.bursts + 1):
            prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
            replies = [None] * args.requests
            errors = []

            def one(i):
                body = {"prompt": prompts[i], "max_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
                try:
                    replies[i] = post(base + "/v1/completions", body, args.timeout)
                except Exception as err:  # reported below, with the burst's figures
                    errors.append(f"request {i}: {err}")

            start = time.time()
            threads = [threading.Thread(target=one, args=(i,)) for i in range(args.requests)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            wall = time.time() - start
            generated = sum(r["usage"]["completion_tokens"] for r in replies if r)
            idle_metrics(base)
            # Once idle the worker gives the device its unused pages back, then records the
            # pool: read after that.
            time.sleep(1.0)
            figures = metrics(base)
            print(
                f"burst {burst}: {args.requests} x ({args.prompt_tokens} prompt + {args.new_tokens} new tokens) "
                f"in {wall:.1f} s, {generated / wall:.0f} generated tok/s, {len(errors)} failed",
                flush=True,
            )
            print("  metrics: " + json.dumps(figures, sort_keys=True), flush=True)
            for error in errors[:5]:
                print("  " + error, flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
