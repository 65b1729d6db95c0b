#!/usr/bin/env bash
# Runs `prompt-r1 bench` and the same workloads in PyTorch + transformers on one random
# checkpoint of the given shape, on this machine, and prints ours/PyTorch for each figure.
# PyTorch goes into a throwaway virtualenv under target/ (from PyPI; not a CI dependency).
#   scripts/bench_compare.sh [preset=qwen3-0.6b] [dtype=f32] [matmul=f32]
# matmul=bf16: f32 weights with bf16 products (ours `--matmul bf16`, PyTorch's bf16 autocast).
# WITH_CANDLE=1 also runs candle's Qwen3 (scripts/bench_candle, built from crates.io under
# target/; inference workloads only, and not with matmul=bf16, which candle has no mode for)
# and adds ours/candle.
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-qwen3-0.6b}
dtype=${2:-f32}
matmul=${3:-f32}
venv=target/bench-venv
work=target/bench-work
mkdir -p "$work"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch transformers
fi
cargo build --release -p prompt-r1
bin=target/release/prompt-r1
model="$work/$preset"
[ -f "$model/model.safetensors" ] || "$bin" init-model --preset "$preset" --out "$model"
# Every side starts warm: it reads the checkpoint once first (otherwise the first to run reads
# it from disk and the next from memory), and 6 GiB of memory is touched and freed before it
# runs. On a VM that hands idle memory back to its host, the first process to fault in gigabytes
# after a pause waits on the host for each page: the first load after a minute's idle took
# 10.3 s where the same one took 1.4 s right after.
warm() {
  cat "$model"/*.safetensors > /dev/null
  python3 -c 'b = bytearray(6 << 30); b[::4096] = bytes(len(range(0, len(b), 4096)))'
}
warm
"$bin" bench --model "$model" --dtype "$dtype" --matmul "$matmul" --train-step --json > "$work/ours.json"
warm
OMP_NUM_THREADS=$(nproc) "$venv/bin/python" scripts/bench_pytorch.py --model "$model" --dtype "$dtype" \
  --threads "$(nproc)" --matmul "$matmul" > "$work/pytorch.json"
echo '[]' > "$work/candle.json"
if [ "${WITH_CANDLE:-0}" = 1 ] && [ "$matmul" = f32 ]; then
  cargo build --release --manifest-path scripts/bench_candle/Cargo.toml --target-dir target/bench-candle
  warm
  target/bench-candle/release/bench-candle "$model" "$dtype" > "$work/candle.json"
fi
python3 - "$work/ours.json" "$work/pytorch.json" "$work/candle.json" <<'PY'
import json, sys
ours, torch, candle = (json.load(open(p)) for p in sys.argv[1:4])
candle = {f["workload"]: f for f in candle}
rate = lambda f: f["tokens_per_second"]
ratio = lambda a, b: (rate(a) / rate(b)) if rate(a) and rate(b) else b["seconds"] / a["seconds"]
fmt = lambda v: "-" if v is None else f"{v:.1f}"
extra = f"{'candle tok/s':>13}{'/candle':>9}" if candle else ""
print(f"{'workload':<26}{'ours tok/s':>12}{'torch tok/s':>12}{'ratio':>8}{'ours s':>9}{'torch s':>9}{'ours MB':>9}{'torch MB':>9}" + extra)
for a, b in zip(ours, torch):
    assert a["workload"] == b["workload"], (a["workload"], b["workload"])
    line = (f"{a['workload']:<26}{fmt(rate(a)):>12}{fmt(rate(b)):>12}{ratio(a, b):>8.2f}"
            f"{a['seconds']:>9.2f}{b['seconds']:>9.2f}{a['peak_rss_mb']:>9.0f}{b['peak_rss_mb']:>9.0f}")
    c = candle.get(a["workload"])
    if c:
        line += f"{fmt(rate(c)) if rate(c) else format(c['seconds'], '.2f') + ' s':>13}{ratio(a, c):>9.2f}"
    print(line)
PY
