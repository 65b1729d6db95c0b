#!/usr/bin/env bash
# Kernels per decode step on the GPU path, by name: how many operations a step costs the host
# where the GPU is idle between them (on an H100 a 0.6B decode step is host-bound, BENCHMARKS.md).
#
#   scripts/kernel_census.sh BIN [bench options...]
#
# BIN is a prompt-r1 built with `--features wgpu` (runs here on Mesa's lavapipe) or `cuda`
# (set DEVICE=cuda). It runs `bench` twice under CubeCL's profiler (CUBECL_DEBUG_OPTION=
# profile-medium logs every kernel), decoding 8 and then 40 tokens at batch 1 from a 16-token
# prompt, and prints the difference per decoded token: prefill, scoring and start-up cancel out.
# Extra options go to both runs (`--fusion off`, `--device-kernels off`). PRESET=qwen3-0.6b
# counts that shape (the default is `small`, 4 layers) where the device holds it (lavapipe does
# not: its largest buffer is smaller than the 0.6B shape's f32 embedding, 594 MiB).
set -euo pipefail
bin=${1:?usage: scripts/kernel_census.sh BIN [bench options...]}
shift
device=${DEVICE:-wgpu}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# bench times each decode workload 3 times (TIMED_RUNS in bin/src/cmd/bench.rs).
runs=3
count() {
  local tokens=$1
  shift
  CUBECL_DEBUG_OPTION=profile-medium CUBECL_DEBUG_LOG="$work/$tokens.log" \
    "$bin" bench --device "$device" --preset "${PRESET:-small}" --decode-batch 1 --decode-tokens "$tokens" --prompt-len 16 "$@" \
    > "$work/$tokens.out" 2>&1 || { cat "$work/$tokens.out" >&2; exit 1; }
  # Profiler lines look like "| 12.3µs | KernelBinop | MulOp | WgpuRuntime |".
  awk -F'|' '/^\| *[0-9.]+(ns|µs|ms|s) *\|/ { k = $3 "|" $4; gsub(/  +/, " ", k); n[k]++ }
    END { for (k in n) print k "\t" n[k] }' "$work/$tokens.log" | sort > "$work/$tokens.counts"
}
count 8 "$@"
count 40 "$@"
steps=$((32 * runs))
join -t$'\t' -a1 -a2 -e0 -o 0,1.2,2.2 "$work/8.counts" "$work/40.counts" |
  awk -F'\t' -v steps="$steps" '{ d = ($3 - $2) / steps; if (d != 0) printf "%7.1f  %s\n", d, $1; total += d }
    END { printf "%7.1f  kernels per decoded token in all\n", total }' | sort -rn
