#!/usr/bin/env python3
"""Wall time of `prompt-r1 serve` answering 8 concurrent greedy /v1/completions of 1,000 and
4,000 tokens on a random tiny model, for two builds side by side (the builds alternate within
each of 3 rounds; medians printed). Standard library only.

    scripts/bench_serve_replies.py BEFORE_BINARY AFTER_BINARY [WORK_DIR]
"""
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request


def ask(port, tokens):
    body = json.dumps({"prompt": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                       "max_tokens": tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=600))["usage"]["completion_tokens"]


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    builds = {"before": sys.argv[1], "after": sys.argv[2]}
    work = sys.argv[3] if len(sys.argv) > 3 else "/tmp/bench_serve_replies"
    model = os.path.join(work, "tiny")
    if not os.path.exists(model):
        subprocess.run([builds["after"], "init-model", "--preset", "tiny", "--out", model], check=True)
    times = {}
    for round_ in range(3):
        for name, binary in builds.items():
            server = subprocess.Popen([binary, "serve", "--model", model, "--port", "0", "--quiet", "--max-batch", "8"],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            port = int(server.stdout.readline().split("http://")[1].split("/")[0].rsplit(":", 1)[1])
            for tokens in (1000, 4000):
                started = time.time()
                with concurrent.futures.ThreadPoolExecutor(8) as pool:
                    made = sum(pool.map(lambda _: ask(port, tokens), range(8)))
                seconds = time.time() - started
                times.setdefault((name, tokens), []).append(seconds)
                print(f"round {round_ + 1}: {name} 8 x {tokens}: {made} tokens in {seconds:.2f} s", flush=True)
            server.send_signal(signal.SIGINT)
            server.wait()
    for tokens in (1000, 4000):
        medians = {name: sorted(times[(name, tokens)])[1] for name in builds}
        print(f"8 x {tokens}: before {medians['before']:.2f} s, after {medians['after']:.2f} s, "
              f"after/before {medians['after'] / medians['before']:.2f}")


if __name__ == "__main__":
    main()
