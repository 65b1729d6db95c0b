#!/usr/bin/env bash
# The GPU proof in a few short commands, for a CUDA host that has no Rust toolchain and no
# network (such as the lent machines: CUDA 13, driver 580, python3 with torch + transformers).
#
#   scripts/gpu_run.sh build     # here, no GPU needed: the CUDA 13 binary, gzipped, in .gpu/
#                                # (FEATURES=cuda-fusion-autotune: a variant, see the build step)
#   scripts/gpu_run.sh STAGE     # on the GPU host, one stage per command (each well under 10 min)
#
# A lease of 15 minutes of device time (the machine's start included) holds about two such
# commands on one warm machine (`first` took 230 s on an H100 with CUDA built without autotune):
# run `first`, then another stage.
#
# Stages (each also records nvidia-smi, the NVRTC it found and the environment in its log):
#   compile    where the CUDA path's host time goes: one `check-device` with an empty kernel
#              cache and CubeCL's compilation log (CUBECL_DEBUG_LOG), the kernels compiled every
#              5 s, then the same command again on the filled cache (does it hit?), and the kernel
#              names counted
#   first      the most telling steps of the others, most important first, within one command:
#              check-device on the tiny model (f32, then bf16 weights), the trainer on the device
#              (`demo --device cuda --steps 2`), then ours and PyTorch on the 0.6B shape, bf16
#              weights (prefill, decode at batch 1 and 64), our decode again under CubeCL's
#              profiler (as the third to fifth leases timed everything), then each long pass of ours under
#              CubeCL's profiler (a 2,048-token prefill, a decoding step of 8 rows over 2,048
#              positions, scoring 2 x 2,048 tokens: kernels and GPU time by name, beside the
#              wall time); steps the time does not reach say NOT RUN
#   lease      for a 15-minute lease, in one command of about 9 minutes: what the open issue needs
#              first. check-device on the tiny model (f32, bf16: every kernel since the last lease
#              against the CPU), issue 32's rollout workload on the small shape (batch 8 and 64)
#              and the 0.6B shape (as in `rollout`), the small one at 64 again with separate
#              passes rather than ragged ones, ours and PyTorch on the 0.6B shape (bf16:
#              prefill, decode at batch 1 and 64, scoring), the long-context decode with the
#              decoding steps' own kernel against the general one, then `demo --device cuda`
#   lease-more what `lease` leaves for a second command on the warm machine: the long-context
#              decode with every decoding step whole, LoRA decoding apart and merged, continuous
#              admission of 64 episodes of 1 to 5 turns (each as in `rollout`)
#   compare    two builds' kernels in one run (BIN, and BIN_B: another build's binary, e.g. a
#              branch's, built with GPU_DIR=.gpu-b and carried beside .gpu): check-device with
#              BIN_B, then each one's 2,048-token prefill and scoring and 0.6B rollout at 64,
#              alternating, twice
#   lease-compare  a lease after a kernel change (BIN_B as for compare): check-device, one round
#              of compare, issue 32's rollouts with BIN (small at 8 and 64, 0.6B at 8), then
#              compare's second round
#   skinny     the skinny-matmul kernel of decoding steps' projections: check-device, its
#              products against burn's matmul and the token-choice kernel against burn's ops
#              (bench --products at 1 and 64 rows), the 0.6B
#              decode and rollout at 64 with --skinny-matmul on and off, the small rollouts and
#              the 0.6B rollout at 8 with it, a decoding step's kernels under CubeCL's profiler
#   tensor-cores  the attention's blocks of queries on the tensor cores (--tensor-core-attention,
#              never yet run on a GPU): check-device with it on (tiny and 0.6B shapes, bf16),
#              then the 0.6B prefill and scoring of 2,048 tokens and the 0.6B rollout at 64 with
#              it on and off alternating, twice, then the prefill and scoring under CubeCL's
#              profiler with it on (the attention kernels' GPU time by name)
#   pending    for a lease of one command: the two kernels no GPU has run (skinny matmul, on by
#              default on CUDA; the tensor-core attention, opt-in): check-device with them (tiny
#              bf16 with the tensor cores, tiny f32, the 0.6B shape in bf16 with the tensor
#              cores), each on and off once (prefill and scoring; decode at 1 and 64 rows; their
#              products against burn's), the 0.6B rollout at 64 with both against neither, the
#              small rollouts, the on/off pairs again, the prefill under CubeCL's profiler,
#              then (where time is left) the 0.6B rollout of 80 episodes on 64 rows
#   profile-compare  two builds (BIN_B as for compare) under CubeCL's profiler: the 0.6B prefill
#              and scoring of 2,048 tokens, then the small rollout at 64 with ragged and separate
#              passes alternating, then the 0.6B rollout at 64 of each build
#   host       where a decode step's time goes (the H100 ran the 0.6B shape at 0.2x PyTorch,
#              host-bound): first a decode at batch 1 with every thread's stack sampled by
#              cuda-gdb about once a second (scripts/stack_profile.py sums them up: the functions
#              each busy thread is in), then bench at batch 1 and 64 with fusion on and off, each with the
#              busiest threads sampled by top (main, CubeCL's DSU fusion and DSD device threads),
#              then a short decode of each under CubeCL's profiler (CUBECL_DEBUG_OPTION=
#              profile-medium: every kernel timed on the GPU): kernels and GPU time by name
#   check      check-device against the CPU on a tiny random model: f32 and bf16 weights, and
#              f32 again with fusion off (PROMPT_R1_FUSION=0)
#   check-0.6b the same for a 0.6B-shaped random model, f32 and bf16 weights
#   train      the trainer on the device: `demo --device cuda` (serve, GRPO steps, checkpoint)
#   bench      ours and PyTorch on the same 0.6B-shaped checkpoint on the same GPU, bf16 weights:
#              prefill, decode at batch 1 and 64, one training step (f32 weights, bf16 products);
#              each of ours with its peak GPU memory polled by nvidia-smi
#   bench-f32  the same with f32 weights (PyTorch's f32 products may use TF32, as CubeCL's do)
#   memory     a Qwen3-4B-shaped LoRA training step (random weights, bf16 base, 1 x 1024 tokens),
#              with and without activation checkpointing: peak GPU memory (nvidia-smi) beside
#              the memory plan's prediction that `bench` prints against what CubeCL's pool
#              reserved over the timed steps (the plan with CubeCL's CUDA pages); then `serve` on
#              the 0.6B shape (bf16): two bursts of 32 concurrent requests without a KV budget,
#              within `--kv-cache-memory 1GiB` and within `auto` (scripts/serve_burst.py), with its GET /metrics
#              (the KV pool's peak, preemptions, CubeCL's pool) and its log of the pool before and
#              after the idle worker gave pages back
#   autotune   for a variant build (BIN=...): check-device's kernels compiled, decode on the
#              0.6B shape (bf16, batch 1 and 64) and the small rollout at batch 8
#   rollout    issue 32's rollout workload on the device (`bench --rollout`: 5 turns of 128
#              tokens, 300-token replies after 200 ms): re-prefilling against the kept-KV decoder
#              and the rollout's speed as a fraction of pure decode, on the small shape (f32,
#              batch 8 and 64) and the 0.6B shape (bf16 weights, batch 8 and 64, 3 turns of 32
#              tokens and 100-token replies); each with its peak GPU memory beside the
#              decoder's peak KV, CubeCL's pool (in use / reserved) per mode, and the time of its
#              decode-only and prefill steps against pure decode's step; then a 2,048-token
#              prefill and decode at 8 and 64 rows over 2,048 positions with our paged-attention
#              kernel in every pass (all, CUDA's default; decoding steps through its own
#              kernel, paged_decode, since the thirtieth session: the fifth lease's
#              figures are the general kernel's), its decoding steps split into
#              spans (--split-decoding, the default) and whole, and the prefill and scoring
#              of 2 x 2,048 tokens through burn's ops (--device-kernels decode) beside the
#              kernel's; LoRA adapters apart and merged;
#              continuous admission of 64 episodes of 1 to 5 turns; last the fifth lease's
#              comparisons: the small rollout at 64 with --device-kernels decode, and with all
#              but no ragged passes, and the long-context decode with the kernel in decoding
#              steps only (decode) and nowhere (off: burn's ops over gathered keys and values)
#
# Each stage leaves at most 2 files in OUT ($OUT, else gpu-results/STAGE): STAGE.tar.gz with
# every output and STAGE-log.txt, within the device tool's 8-file limit. Every step runs even when
# one before it failed, each under `timeout` (STEP_TIMEOUT seconds, default 240, 150 in `first`) and all within
# the stage's STAGE_SECONDS (default 540, so the tar is written inside the tool's 10 minutes);
# the exit status says whether any failed. BIN overrides the binary (default .gpu/prompt-r1, unpacked from
# .gpu/prompt-r1.gz where only that was carried).
# CubeCL keeps compiled kernels and autotune results in ~/.cache/prompt-r1/cubecl, so within a
# stage only the first process compiles each kernel (PROMPT_R1_KERNEL_CACHE moves it).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?usage: scripts/gpu_run.sh build|compile|lease|lease-more|compare|lease-compare|profile-compare|skinny|tensor-cores|pending|first|host|autotune|check|check-0.6b|train|bench|bench-f32|memory|rollout}

if [ "$stage" = build ]; then
  # cudarc's CUDA API version is fixed at build time: 13.0 matches the hosts' driver 580.
  set -e
  # FEATURES=cuda-fusion-autotune builds the variant with autotune for fused kernels only, into
  # GPU_DIR (default .gpu-cuda-fusion-autotune), to carry in a second command on the same warm
  # machine (each command carries its own 64 MiB) and run with BIN=GPU_DIR/prompt-r1.
  features=${FEATURES:-cuda}
  dir=${GPU_DIR:-.gpu}
  [ "$features" = cuda ] || dir=${GPU_DIR:-.gpu-$features}
  CUDARC_CUDA_VERSION=13000 cargo build --release -p prompt-r1 --features "$features"
  mkdir -p "$dir"
  exclude=$(git rev-parse --git-path info/exclude)
  grep -qx "/$dir/" "$exclude" 2> /dev/null || echo "/$dir/" >> "$exclude"
  # The binary keeps its symbol table (function names for the `host` stage's stack samples and
  # for backtraces), gzipped: about 20 MiB where the stripped binary is 54. Stages unpack it.
  rm -f "$dir/prompt-r1"
  gzip -6 -c target/release/prompt-r1 > "$dir/prompt-r1.gz"
  # Which sources the binary is from, for a session that finds it built by an earlier one.
  echo "$(git describe --always --dirty) built $(date -u +%Y-%m-%dT%H:%MZ) --features $features" > "$dir/BUILT_FROM"
  # The real Qwen3 tokenizer (about 2 MiB gzipped) for the `memory` stage's `serve` on the 0.6B
  # shape: `init-model` writes none for the real shapes, and `serve` needs one.
  tokenizer=../shared/tokenizer/qwen3/tokenizer.json
  if [ -f "$tokenizer" ]; then
    gzip -6 -c "$tokenizer" > "$dir/qwen3-tokenizer.json.gz"
  else
    echo "note: no $tokenizer here: the memory stage's serve steps will run the small shape instead" >&2
  fi
  size=$(du -cm "$dir"/*.gz | tail -1 | cut -f1)
  # What the device tool carries: the tracked files and the untracked ones git does not ignore.
  tree=$(git ls-files -z -co --exclude-standard | du -cm --files0-from=- | tail -1 | cut -f1)
  echo "built $dir/prompt-r1.gz (--features $features; with the tokenizer ${size} MiB, gzipped, the binary with its symbols); the working tree ${tree} MiB; carry $dir (limit 64 MiB in all)"
  [ $((size + tree)) -le 60 ] || { echo "error: over the device tool's 64 MiB" >&2; exit 1; }
  exit 0
fi

bin=${BIN:-.gpu/prompt-r1}
# `build` leaves the binary gzipped beside where it runs from.
if [ ! -x "$bin" ] && [ -f "$bin.gz" ]; then
  gzip -dc "$bin.gz" > "$bin" && chmod +x "$bin"
fi
out=${OUT:-gpu-results/$stage}
default_timeout=240
[ "$stage" = first ] && default_timeout=150
[ "$stage" = compile ] && default_timeout=200
step_timeout=${STEP_TIMEOUT:-$default_timeout}
deadline=$((SECONDS + ${STAGE_SECONDS:-540}))
work=$(mktemp -d)
log="$out/$stage-log.txt"
mkdir -p "$out"
failed=0

say() { echo "$*" | tee -a "$log"; }

step() {
  local name=$1
  shift
  say "== $name: $*"
  local start=$SECONDS left=$((deadline - SECONDS))
  if [ "$left" -lt 20 ]; then
    say "   NOT RUN: the stage's time is up"
    failed=1
    return
  fi
  # CubeCL's compilation log (unless the stage keeps its own, KERNEL_LOG): the kernels this step
  # compiled. Through PROMPT_R1_KERNEL_LOG, not CUBECL_DEBUG_LOG: that one also turns CubeCL's
  # profiler on, which made every kernel of the third to fifth leases' timed runs wait for the GPU
  # before and after it ran (BENCHMARKS.md, thirty-seventh session).
  local klog=${KERNEL_LOG:-$work/$name.klog} kernels
  if ! PROMPT_R1_KERNEL_LOG=$klog timeout "$((left < step_timeout ? left : step_timeout))" "$@" > "$work/$name.txt" 2>> "$work/stderr.txt"; then
    say "   FAILED after $((SECONDS - start)) s (stderr.txt has its messages)"
    tail -5 "$work/$name.txt" | tee -a "$log"
    failed=1
  else
    say "   ok in $((SECONDS - start)) s"
  fi
  if [ -z "${KERNEL_LOG:-}" ]; then
    # `--kernel-log` logs "[Compiling kernel] NAME" a kernel (CubeCL's basic level). Where the
    # step set CUBECL_DEBUG_LOG (the profiles), CubeCL's `full` log goes there instead, a
    # START_KERNEL_COMPILATION block a kernel, and the kernel log stays empty.
    kernels=$(grep -c '^\[Compiling kernel\]' "$klog" 2> /dev/null)
    if [ "${kernels:-0}" = 0 ] && [ -n "${CUBECL_DEBUG_LOG:-}" ]; then
      kernels=$(grep -c START_KERNEL_COMPILATION "$CUBECL_DEBUG_LOG" 2> /dev/null)
    fi
    say "   kernels compiled: ${kernels:-0}"
    grep '^\[Compiling kernel\]' "$klog" 2> /dev/null | sed -e 's/^\[Compiling kernel\] //' -e 's/.*:://' | sort | uniq -c | sort -rn \
      | head -6 | sed 's/^/     /' | tee -a "$log"
    rm -f "$klog"
  fi
}

# Runs one of our benches with nvidia-smi polling the memory in use; adds the peak to
# peak-memory.txt (it includes the CUDA context, about 0.5 GB).
# Every 3 s it also records the busiest threads of the process (top -H): which of our main
# thread, CubeCL's fusion thread (DSU-*) and its device thread (DSD-*) is the bottleneck.
bench() {
  local name=$1
  shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 50 > "$work/$name.mem" &
  local poller=$!
  (
    while sleep 3; do
      pid=$(pgrep -n -f "$bin bench") || continue
      echo "-- $(date +%T) utilisation $(nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader)"
      top -b -H -n1 -p "$pid" 2> /dev/null | sed -n '8,12p'
    done
  ) > "$work/$name.threads" 2> /dev/null &
  local sampler=$!
  step "$name" "$bin" bench --device cuda --json "$@"
  kill "$poller" "$sampler" 2> /dev/null
  wait "$poller" "$sampler" 2> /dev/null
  echo "$name: $(sort -n "$work/$name.mem" | tail -1) MiB" >> "$work/peak-memory.txt"
  rm -f "$work/$name.mem"
}

# Stack samples of one of our benches, a poor man's profiler (the lent hosts have no perf, but
# cuda-gdb attaches to a running process): from $2 seconds in, every thread's stack about every
# second (STACK_SAMPLES of them, default 40; each attach stops the process for a moment), summed
# up per thread by scripts/stack_profile.py: which functions the busy threads are in.
stacks() {
  local name=$1 delay=$2 gdb
  shift 2
  gdb=$(command -v gdb || command -v cuda-gdb || ls /usr/local/cuda/bin/cuda-gdb 2> /dev/null | head -1)
  if [ -z "$gdb" ]; then
    say "== $name: NOT RUN: neither gdb nor cuda-gdb is installed"
    failed=1
    return
  fi
  mkdir -p "$work/$name.stacks"
  (
    sleep "$delay"
    i=0
    while [ "$i" -lt "${STACK_SAMPLES:-40}" ] && pid=$(pgrep -n -f "$bin bench"); do
      timeout 30 "$gdb" -q -batch -p "$pid" -ex "set pagination off" -ex "thread apply all bt 80" \
        > "$work/$name.stacks/$i.bt" 2>&1
      # An attach that shows no thread (ptrace refused, say) will not do better next time.
      grep -q '^Thread ' "$work/$name.stacks/$i.bt" || break
      i=$((i + 1))
      sleep 0.5
    done
  ) &
  local sampler=$!
  bench "$name" "$@"
  kill "$sampler" 2> /dev/null
  wait "$sampler" 2> /dev/null
  say "   stack samples with $gdb: $(grep -l '^Thread ' "$work/$name.stacks"/*.bt 2> /dev/null | wc -l)"
  if ! grep -qs '^Thread ' "$work/$name.stacks"/*.bt; then
    say "   no stack came back; the first attach said:"
    head -8 "$(ls "$work/$name.stacks"/*.bt 2> /dev/null | head -1)" 2> /dev/null | tee -a "$log"
  fi
  python3 scripts/stack_profile.py "$work/$name.stacks"/*.bt > "$work/$name.profile.txt" 2>&1
  head -70 "$work/$name.profile.txt" | tee -a "$log"
  tar czf "$work/$name.stacks.tar.gz" -C "$work" "$name.stacks" && rm -rf "$work/$name.stacks"
}

# CubeCL's profiling log of one bench run (every kernel timed on the GPU, one at a time): the
# kernels' count and the GPU time they take by name, beside the run's wall time (its JSON).
kernel_profile() {
  local name=$1 plog="$work/$1.profile"
  shift
  CUBECL_DEBUG_LOG=$plog step "$name" env CUBECL_DEBUG_OPTION=profile-medium "$bin" bench --device cuda --json "$@"
  [ -f "$plog" ] || { say "   no profiling log"; return; }
  # Lines such as "| 12.3µs | KernelBinop | MulOp | CudaRuntime": count and GPU time per name.
  awk -F'|' '/^\| *[0-9.]+(ns|µs|ms|s) *\|/ {
      d = $2; gsub(/ /, "", d); v = d + 0
      if (d ~ /ns$/) v /= 1000; else if (d ~ /ms$/) v *= 1000; else if (d !~ /µs$/) v *= 1e6
      k = $3 "|" $4; n[k]++; t[k] += v; all += v; count++
    }
    END {
      printf "%d kernels, %.1f ms of GPU time in all\n", count, all / 1000 > "/dev/stderr"
      for (k in n) printf "%8d %12.3f ms  %s\n", n[k], t[k] / 1000, k
    }' "$plog" 2> "$work/$name.kernels" | sort -k2 -rn >> "$work/$name.kernels"
  head -25 "$work/$name.kernels" | tee -a "$log"
  rm -f "$plog"
}

# The GPU time a decoding step's kernels take, by name: CubeCL's profile of two runs of one
# decode bench ($2 then $3 tokens, the rest of the arguments alike), the first's counts and
# times taken from the second's, per step (bench times 3 runs of each): what the two runs share
# (loading, the prompts' prefill, the first token) cancels out.
kernel_profile_steps() {
  local name=$1 few=$2 many=$3
  shift 3
  kernel_profile "$name-$few" --decode-tokens "$few" "$@"
  kernel_profile "$name-$many" --decode-tokens "$many" "$@"
  local a="$work/$name-$few.kernels" b="$work/$name-$many.kernels" steps=$((3 * (many - few)))
  [ -s "$a" ] && [ -s "$b" ] || { say "   no profiles to subtract"; return; }
  # The .kernels files hold "COUNT MS  NAME" lines (their first line is the total).
  awk -v steps="$steps" '
    FNR == 1 { next }
    { k = $0; sub(/^ *[0-9]+ +[0-9.]+ ms  /, "", k); sign = FILENAME == ARGV[1] ? -1 : 1; c[k] += sign * $1; t[k] += sign * $2 }
    END {
      for (k in c) if (c[k] != 0 || t[k] > 0.05) { printf "%8.1f %9.3f ms  %s\n", c[k] / steps, t[k] / steps, k; n += c[k]; all += t[k] }
      printf "%8.1f %9.3f ms  every kernel, per decoding step\n", n / steps, all / steps
    }' "$a" "$b" | sort -k2 -rn > "$work/$name.steps"
  say "   per decoding step ($name, $steps steps' difference):"
  head -20 "$work/$name.steps" | tee -a "$log"
}

finish() {
  cp "$log" "$work/" 2> /dev/null
  tar czf "$out/$stage.tar.gz" -C "$work" .
  rm -rf "$work"
  say "results: $out/$stage.tar.gz"
  exit $failed
}

nvidia-smi > "$work/nvidia-smi.txt" 2>&1 || { say "no NVIDIA driver: nvidia-smi failed"; failed=1; finish; }
head -15 "$work/nvidia-smi.txt" | tee -a "$log"
# cubecl compiles its kernels with NVRTC at run time. Where the toolkit is not installed system-
# wide, the NVIDIA wheels of a Python environment (nvidia-cuda-nvrtc, nvidia-cuda-runtime) carry
# the library and headers: put them on the search paths.
nvidia=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2> /dev/null || true)
if [ -n "$nvidia" ] && ! ldconfig -p | grep -q libnvrtc; then
  LD_LIBRARY_PATH=$(ls -d "$nvidia"/*/lib 2> /dev/null | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export LD_LIBRARY_PATH
fi
if [ -z "${CUDA_PATH:-}" ] && [ ! -d /usr/local/cuda ] && [ -n "$nvidia" ]; then
  for include in "$nvidia"/cuda_runtime/include "$nvidia"/cu*/include; do
    if [ -f "$include/cuda_runtime.h" ]; then
      export CUDA_PATH=${include%/include}
      break
    fi
  done
fi
say "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-} CUDA_PATH=${CUDA_PATH:-} (/usr/local/cuda: $([ -d /usr/local/cuda ] && echo yes || echo no))"
# The NVRTC that the binary will load (cudarc opens libnvrtc.so* by name), with its version.
say "NVRTC: $(python3 - 2>&1 << 'EOF'
import ctypes, ctypes.util, glob, os
names = ["libnvrtc.so"] + [os.path.basename(p) for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d
                            for p in sorted(glob.glob(os.path.join(d, "libnvrtc.so*")))]
names += [n for n in [ctypes.util.find_library("nvrtc")] if n]
for name in names:
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        continue
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    print(f"{name} version {major.value}.{minor.value}")
    break
else:
    print("none found (kernels cannot compile)")
EOF
)"
"$bin" --version >> "$log" 2>&1

# check-device on the tiny random model, f32 then bf16 weights.
check_tiny() {
  step check-tiny-f32 "$bin" check-device --device cuda
  step check-tiny-bf16 "$bin" check-device --device cuda --dtype bf16 --rtol 5e-2
}

# The trainer on the device: serve, SFT and GRPO steps, checkpoints. The results keep the
# metrics, curves, configs and serve's log; the models and checkpoints are dropped.
train_demo() {
  step demo "$bin" demo --device cuda --out "$work/demo" --steps "$1"
  rm -rf "$work/demo/agent" "$work/demo/environment-llm" "$work/demo"/*/checkpoints 2> /dev/null
}

# Ours and PyTorch on the 0.6B-shaped checkpoint $1 with weights of dtype $2: prefill, decode at
# batch 1 and 64 and scoring; ours also greedy steps read back and chained (see bench_0_6b).
ours_and_pytorch() {
  local model=$1 dtype=$2
  bench "ours-$dtype" --model "$model" --dtype "$dtype" --decode-batch 1,64 --workloads prefill,decode,score,chained
  step "pytorch-$dtype" python3 scripts/bench_pytorch.py --device cuda --model "$model" --dtype "$dtype" --decode-batch 1,64
}

# Issue 32's rollout workload (`bench --rollout`), named $1, at the generation batches $2: the
# small shape (f32, 5 turns of 128 tokens, 300-token replies after 200 ms), or the 0.6B shape in
# bf16 with shorter episodes (3 turns of 32 tokens, 100-token replies) in groups of 5 episodes a
# question, as GRPO's rollout.n, whose first prompts are shared; further arguments are bench's.
rollout_small() {
  local name=$1 batches=$2
  shift 2
  bench "$name" --preset small --rollout --rollout-batch "$batches" "$@"
}
rollout_0_6b() {
  local name=$1 batches=$2
  shift 2
  bench "$name" --preset qwen3-0.6b --dtype bf16 --rollout --rollout-batch "$batches" \
    --rollout-turns 3 --rollout-turn-tokens 32 --env-reply-tokens 100 --rollout-group-size 5 "$@"
}

# The 0.6B shape's long-context decode (bf16), named $1: a 2,048-token prefill, then 32 tokens
# decoded at the batches $2 over 2,048 positions, and scoring; further arguments are bench's.
long_decode() {
  local name=$1 batches=$2
  shift 2
  bench "$name" --preset qwen3-0.6b --dtype bf16 --prompt-len 2048 --decode-context 2048 --decode-batch "$batches" \
    --decode-tokens 32 "$@"
}

# LoRA decoding (rank 8 on every projection of the 0.6B shape's bf16 base), named $1, after
# 256-token prompts at batch 1 and 64; further arguments are bench's (--merge-lora).
lora_decode() {
  local name=$1
  shift
  bench "$name" --preset qwen3-0.6b --dtype bf16 --prompt-len 256 --decode-batch 1,64 --decode-tokens 32 --lora "$@"
}

# Continuous admission against batches: 64 episodes of 1 to 5 turns of the small shape, 32 in
# flight.
admission() {
  rollout_small rollout-admission 32 --rollout-episodes 64 --rollout-varied-turns
}

# Ours and PyTorch on one 0.6B-shaped random checkpoint with weights of dtype $1: prefill and
# decode at batch 1 and 64; with `train`, also a training step with bf16 products each. Ours
# also times greedy steps with their tokens read back at every step (as the decoder does) and
# chained on the device (`--workloads chained`): whether the host's wait for each step is what
# keeps a decoding step host-bound (the thirty-fifth session's question).
bench_0_6b() {
  local dtype=$1 model="$work/qwen3-0.6b"
  step init-model "$bin" init-model --preset qwen3-0.6b --out "$model"
  ours_and_pytorch "$model" "$dtype"
  # The same decode under CubeCL's profiler, as every timed step of the third to fifth leases ran
  # (CUBECL_DEBUG_LOG, which also times each kernel with a wait for the GPU before and after it):
  # what that cost their figures, beside "ours-$dtype".
  CUBECL_DEBUG_LOG="$work/profiler-cost.log" bench "ours-$dtype-under-profiler" --model "$model" --dtype "$dtype" \
    --decode-batch 1,64 --workloads decode
  rm -f "$work/profiler-cost.log"
  if [ "${2:-}" = train ]; then
    bench ours-train-bf16-products --model "$model" --dtype f32 --matmul bf16 --decode-batch 1 --decode-tokens 2 --train-step
    step pytorch-train-bf16-autocast python3 scripts/bench_pytorch.py --device cuda --model "$model" --dtype f32 \
      --matmul bf16 --decode-batch 1 --decode-tokens 2
  fi
  rm -rf "$model"
  cat "$work/peak-memory.txt" 2> /dev/null | tee -a "$log"
}

# Where the GPU's time goes in the 0.6B shape's long passes (bf16 weights), each workload under
# CubeCL's profiler alone (`bench --workloads`): a 2,048-token prefill (the fifth lease's H200 ran
# it at about 1% of its bf16 peak, and a rollout's prefill steps were half its time), a decoding
# step of 8 rows over 2,048 positions (2.3x a step from short prompts there; per step, from two
# runs whose difference leaves out their prompts' prefill), and the scoring of
# 2 x 2,048 tokens (a training step's forward; 0.28x PyTorch). Each gives the kernels' count and
# GPU time by name beside the bench's wall time, so what is host-bound and which kernels hold the
# GPU are told apart.
profiles_0_6b() {
  local model="$work/qwen3-0.6b-profile"
  step init-model-profile "$bin" init-model --preset qwen3-0.6b --out "$model"
  kernel_profile profile-prefill-2048 --model "$model" --dtype bf16 --prompt-len 2048 --workloads prefill
  kernel_profile_steps profile-decode-8x2048 8 24 --model "$model" --dtype bf16 --decode-batch 8 --decode-context 2048 \
    --workloads decode
  kernel_profile profile-score-2x2048 --model "$model" --dtype bf16 --prompt-len 2048 --workloads score
  grep -h -A2 '"prefill\|"decode batch\|"score' "$work"/profile-*.txt 2> /dev/null | tee -a "$log"
  rm -rf "$model"
}

# `check-device` on the tiny model with CubeCL's compilation log in $work/compile-$1.log and the
# kernel cache in $work/kernel-cache; the number of kernels compiled so far, every 5 s, goes to
# compile-rate.txt.
compile_probe() {
  local klog="$work/compile-$1.log" start=$SECONDS
  echo "== run $1" >> "$work/compile-rate.txt"
  (
    while sleep 5; do
      echo "$((SECONDS - start)) s: $(grep -c START_KERNEL_COMPILATION "$klog" 2> /dev/null) kernels compiled" \
        >> "$work/compile-rate.txt"
    done
  ) &
  local sampler=$!
  # CubeCL's own variable too, for its autotune log (this stage counts compilations, not time).
  KERNEL_LOG="$klog" CUBECL_DEBUG_LOG="$klog" step "compile-$1" env PROMPT_R1_KERNEL_CACHE="$work/kernel-cache" \
    "$bin" check-device --device cuda
  kill "$sampler" 2> /dev/null
  wait "$sampler" 2> /dev/null
  say "   run $1: $(grep -c START_KERNEL_COMPILATION "$klog" 2> /dev/null) kernels compiled," \
    "$(grep -ci autotun "$klog" 2> /dev/null) autotune lines, cache $(du -sk "$work/kernel-cache" 2> /dev/null | cut -f1) KiB"
  grep -A1 START_KERNEL_COMPILATION "$klog" 2> /dev/null | grep '^name:' | cut -c1-80 | sort | uniq -c | sort -rn \
    | head -15 | tee -a "$log"
}

# `serve` on the device with bursts of concurrent requests (scripts/serve_burst.py), without a
# KV budget and within one: its /metrics after each burst, and its lines on CubeCL's pool.
serve_bursts() {
  local model="$work/qwen3-0.6b-serve" tokenizer="$work/qwen3-tokenizer.json"
  # The 0.6B shape with the real tokenizer, which `build` carries beside the binary; without it
  # the small shape, which brings its own.
  if [ -f "$(dirname "$bin")/qwen3-tokenizer.json.gz" ]; then
    gzip -dc "$(dirname "$bin")/qwen3-tokenizer.json.gz" > "$tokenizer"
    step init-model-serve "$bin" init-model --preset qwen3-0.6b --tokenizer "$tokenizer" --out "$model"
  else
    say "no $(dirname "$bin")/qwen3-tokenizer.json.gz: serve runs the small shape (bf16)"
    step init-model-serve "$bin" init-model --preset small --dtype bf16 --out "$model"
  fi
  # Last the budget `auto` gives on this GPU (the plan's arithmetic against its total), under
  # the same bursts: the note it prints beside what the pool then reserved.
  for budget in "" 1GiB auto; do
    step "serve-${budget:-unbounded}" python3 scripts/serve_burst.py "$bin" "$model" --requests 32 --prompt-tokens 512 \
      --new-tokens 256 -- --device cuda --dtype bf16 ${budget:+--kv-cache-memory $budget}
  done
  for run in serve-unbounded serve-1GiB serve-auto; do
    say "$run:"
    grep -h "^burst\|metrics:" "$work/$run.txt" 2> /dev/null | tee -a "$log"
  done
  grep -h "GPU memory after\|kv-cache-memory auto" "$work/stderr.txt" "$work"/serve-*.txt 2> /dev/null | tee -a "$log"
  rm -rf "$model"
}

# The rollout benches' figures (issue 32's) and the decode benches' (prefill and decode lines)
# of the steps named in the arguments, from their JSON reports into the log.
rollout_figures() {
  grep -h '"ragged_passes"\|"passes_per_step"\|"rollout_over_decode"\|"rollout_over_context_decode"\|"shared_prefix_tokens_per_episode"\|"prefill_tokens_per_episode"\|"waiting"\|"speedup_over_reprefill"\|"peak_kv_\|_step_ms"\|"prefill_steps"\|"decode_steps"\|_mib"\|"rows_per_step"\|"over_batches"\|"agent_tokens_per_second"\|"attention_columns_per_token"\|"step_speed"\|"stepping"\|"rows"\|"environment_bound"' "${@/#/$work/}" 2> /dev/null | tee -a "$log"
}
decode_figures() {
  grep -h -A2 '"decode batch\|"prefill\|"score' "${@/#/$work/}" 2> /dev/null | tee -a "$log"
}

case "$stage" in
  compile)
    compile_probe 1
    compile_probe 2
    # The logs hold every kernel's source: keep each kernel's name and id (its shapes and
    # settings), the autotune lines, and the first 2 MB.
    for f in "$work"/compile-*.log; do
      awk '/START_KERNEL_COMPILATION/ {p = 1} /^source:/ {p = 0} p || /[Aa]utotun/' "$f" | head -c 8000000 > "$f.ids"
      head -c 2000000 "$f" > "$f.head" && rm -f "$f"
    done
    rm -rf "$work/kernel-cache"
    ;;
  first)
    check_tiny
    train_demo 2
    bench_0_6b bf16
    profiles_0_6b
    ;;
  lease)
    check_tiny
    rollout_small rollout-small 8,64
    rollout_0_6b rollout-0.6b-bf16 8,64
    # The sixth lease found the small rollout at 64 faster with separate passes than ragged ones
    # (1.12x, two commands apart): the same run's comparison.
    rollout_small rollout-small-separate 64 --ragged-passes off
    rollout_figures rollout-small.txt rollout-0.6b-bf16.txt rollout-small-separate.txt
    model="$work/qwen3-0.6b"
    step init-model "$bin" init-model --preset qwen3-0.6b --out "$model"
    ours_and_pytorch "$model" bf16
    rm -rf "$model"
    decode_figures ours-bf16.txt pytorch-bf16.txt
    long_decode decode-kernel-all 8,64
    long_decode decode-kernel-general 8,64 --decoding-kernel general
    decode_figures decode-kernel-all.txt decode-kernel-general.txt
    train_demo 2
    cat "$work/peak-memory.txt" | tee -a "$log"
    ;;
  lease-more)
    long_decode decode-kernel-whole 8,64 --split-decoding off
    lora_decode decode-lora-apart
    lora_decode decode-lora-merged --merge-lora
    decode_figures decode-kernel-whole.txt decode-lora-apart.txt decode-lora-merged.txt
    admission
    rollout_figures rollout-admission.txt
    cat "$work/peak-memory.txt" | tee -a "$log"
    ;;
  compare)
    bin_b=${BIN_B:?compare needs BIN_B: the binary of the other build, made with GPU_DIR=.gpu-b}
    if [ ! -x "$bin_b" ] && [ -f "$bin_b.gz" ]; then
      gzip -dc "$bin_b.gz" > "$bin_b" && chmod +x "$bin_b"
    fi
    step check-b "$bin_b" check-device --device cuda --dtype bf16 --rtol 5e-2
    for round in 1 2; do
      for which in a b; do
        [ "$which" = a ] && b_or_a=$bin || b_or_a=$bin_b
        bin=$b_or_a bench "long-$which-$round" --preset qwen3-0.6b --dtype bf16 --prompt-len 2048 --workloads prefill,score
        bin=$b_or_a rollout_0_6b "rollout-$which-$round" 64
      done
    done
    decode_figures long-a-1.txt long-b-1.txt long-a-2.txt long-b-2.txt
    rollout_figures rollout-a-1.txt rollout-b-1.txt rollout-a-2.txt rollout-b-2.txt
    cat "$work/peak-memory.txt" | tee -a "$log"
    ;;
  lease-compare)
    # For a lease after a kernel change: check-device with the new kernels, then the change's
    # before and after in one run (as `compare`, one round), issue 32's rollout ratios with the
    # new build, and the second round of the comparison last.
    bin_b=${BIN_B:?lease-compare needs BIN_B: the binary of the build before, made with GPU_DIR=.gpu-b}
    if [ ! -x "$bin_b" ] && [ -f "$bin_b.gz" ]; then
      gzip -dc "$bin_b.gz" > "$bin_b" && chmod +x "$bin_b"
    fi
    check_tiny
    compare_round() {
      for which in a b; do
        [ "$which" = a ] && b_or_a=$bin || b_or_a=$bin_b
        bin=$b_or_a bench "long-$which-$1" --preset qwen3-0.6b --dtype bf16 --prompt-len 2048 --workloads prefill,score
        bin=$b_or_a rollout_0_6b "rollout-$which-$1" 64
      done
    }
    compare_round 1
    rollout_small rollout-small 8,64
    rollout_0_6b rollout-0.6b-bf16 8
    compare_round 2
    decode_figures long-a-1.txt long-b-1.txt long-a-2.txt long-b-2.txt
    rollout_figures rollout-a-1.txt rollout-b-1.txt rollout-small.txt rollout-0.6b-bf16.txt rollout-a-2.txt rollout-b-2.txt
    cat "$work/peak-memory.txt" | tee -a "$log"
    ;;
  skinny)
    # The skinny-matmul kernel of decoding steps' projections (after the seventh lease): check-device
    # with it, its products against burn's matmul at 1 and 64 rows, the 0.6B decode and rollout
    # with it on and off alternating, the small rollouts with it, then a decoding step's kernels
    # under CubeCL's profiler with it.
    check_tiny
    bench products-0.6b --preset qwen3-0.6b --dtype bf16 --workloads decode --decode-batch 1,64 --products
    for round in 1 2; do
      for on in on off; do
        bench "decode-skinny-$on-$round" --preset qwen3-0.6b --dtype bf16 --workloads decode --decode-batch 1,64 --skinny-matmul "$on"
      done
    done
    decode_figures products-0.6b.txt decode-skinny-on-1.txt decode-skinny-off-1.txt decode-skinny-on-2.txt decode-skinny-off-2.txt
    grep -h -A3 -E '"(product|token choice)' "$work/products-0.6b.txt" 2> /dev/null | tee -a "$log"
    for on in on off; do
      rollout_0_6b "rollout-skinny-$on" 64 --skinny-matmul "$on"
    done
    rollout_small rollout-small 8,64
    rollout_0_6b rollout-0.6b-bf16 8
    rollout_figures rollout-skinny-on.txt rollout-skinny-off.txt rollout-small.txt rollout-0.6b-bf16.txt
    kernel_profile_steps profile-decode-64 8 24 --preset qwen3-0.6b --dtype bf16 --decode-batch 64 --workloads decode
    cat "$work/peak-memory.txt" | tee -a "$log"
    ;;
  tensor-cores)
    # The tensor-core attention (the fifty-first session's, unrun on a GPU before this stage):
    # check-device with it first (bf16: its products are 16-bit; the tiny shape's heads of 16,
    # then the 0.6B shape's of 128), then its speed against the CUDA cores' kernel, alternating.
    step check-tc-tiny "$bin" --tensor-core-attention on check-device --device cuda --dtype bf16 --rtol 5e-2
    step check-tc-0.6b "$bin" --tensor-core-attention on check-device --device cuda --preset qwen3-0.6b --dtype bf16 --rtol 5e-2
    for round in 1 2; do
      for on in on off; do
        bench "long-tc-$on-$round" --preset qwen3-0.6b --dtype bf16 --prompt-len 2048 --workloads prefill,score --tensor-core-attention "$on"
        rollout_0_6b "rollout-tc-$on-$round" 64 --tensor-core-attention "$on"
      done
    done
    decode_figures long-tc-on-1.txt long-tc-off-1.txt long-tc-on-2.txt long-tc-off-2.txt
    rollout_figures rollout-tc-on-1.txt rollout-tc-off-1.txt rollout-tc-on-2.txt rollout-tc-off-2.txt
    kernel_profile profile-long-tc --preset qwen3-0.6b --dtype bf16 --prompt-len 2048 --workloads prefill,score --tensor-core-attention on
    cat "$work/peak-memory.txt" | tee -a "$log"
    ;;
  pending)
    # Both kernels no GPU has run yet, in one command, for a lease that holds only one: the
    # skinny-matmul kernel (on by default on CUDA since the fiftieth session) and the tensor-core
    # attention (off until this stage passes). Correctness first (check-device: tiny model in bf16
    # with the tensor cores, in f32 with the skinny kernel's f32 path, the 0.6B shape in bf16 with
    # the tensor cores), then each kernel on and off once (prefill and scoring; decode at 1 and
    # 64 rows; their products against burn's), the 0.6B rollout at 64 with both against neither,
    # the small rollouts, a second round of the on/off pairs, and the prefill profiled last.
    step check-tc-tiny "$bin" --tensor-core-attention on check-device --device cuda --dtype bf16 --rtol 5e-2
    step check-tiny-f32 "$bin" check-device --device cuda
    step check-tc-0.6b "$bin" --tensor-core-attention on check-device --device cuda --preset qwen3-0.6b --dtype bf16 --rtol 5e-2
    pairs() {
      for on in on off; do
        bench "long-tc-$on-$1" --preset qwen3-0.6b --dtype bf16 --prompt-len 2048 --workloads prefill,score --tensor-core-attention "$on"
      done
      for on in on off; do
        bench "decode-skinny-$on-$1" --preset qwen3-0.6b --dtype bf16 --workloads decode --decode-batch 1,64 --skinny-matmul "$on"
      done
    }
    pairs 1
    bench products-0.6b --preset qwen3-0.6b --dtype bf16 --workloads decode --decode-batch 1,64 --products
    rollout_0_6b rollout-both-on 64 --tensor-core-attention on --skinny-matmul on
    rollout_0_6b rollout-both-off 64 --tensor-core-attention off --skinny-matmul off
    rollout_small rollout-small 8,64 --tensor-core-attention on
    pairs 2
    decode_figures long-tc-on-1.txt long-tc-off-1.txt decode-skinny-on-1.txt decode-skinny-off-1.txt products-0.6b.txt \
      long-tc-on-2.txt long-tc-off-2.txt decode-skinny-on-2.txt decode-skinny-off-2.txt
    grep -h -A3 -E '"(product|token choice)' "$work/products-0.6b.txt" 2> /dev/null | tee -a "$log"
    rollout_figures rollout-both-on.txt rollout-both-off.txt rollout-small.txt
    kernel_profile profile-long-tc --preset qwen3-0.6b --dtype bf16 --prompt-len 2048 --workloads prefill,score --tensor-core-attention on
    # Last, where time is left: more episodes in flight than rows, so that episodes waiting on
    # the environment do not leave rows empty (the environment's bound does not apply there).
    rollout_0_6b rollout-oversubscribed 80 --max-num-seqs 64 --tensor-core-attention on
    rollout_figures rollout-oversubscribed.txt
    cat "$work/peak-memory.txt" | tee -a "$log"
    ;;
  profile-compare)
    # Two builds' kernels under CubeCL's profiler (GPU time by name, BIN against BIN_B): the
    # 0.6B shape's 2,048-token prefill and 2 x 2,048 scoring, then the small rollout at 64 with
    # ragged and separate passes alternating (unprofiled, BIN), then the 0.6B rollout at 64 of
    # each build profiled.
    bin_b=${BIN_B:?profile-compare needs BIN_B: the binary of the build before, made with GPU_DIR=.gpu-b}
    if [ ! -x "$bin_b" ] && [ -f "$bin_b.gz" ]; then
      gzip -dc "$bin_b.gz" > "$bin_b" && chmod +x "$bin_b"
    fi
    for which in a b; do
      [ "$which" = a ] && b_or_a=$bin || b_or_a=$bin_b
      bin=$b_or_a kernel_profile "profile-long-$which" --preset qwen3-0.6b --dtype bf16 --prompt-len 2048 --workloads prefill,score
    done
    for round in 1 2; do
      rollout_small "rollout-small-ragged-$round" 64
      rollout_small "rollout-small-separate-$round" 64 --ragged-passes off
    done
    rollout_figures rollout-small-ragged-1.txt rollout-small-separate-1.txt rollout-small-ragged-2.txt rollout-small-separate-2.txt
    for which in a b; do
      [ "$which" = a ] && b_or_a=$bin || b_or_a=$bin_b
      bin=$b_or_a kernel_profile "profile-rollout-$which" --preset qwen3-0.6b --dtype bf16 --rollout --rollout-batch 64 \
        --rollout-turns 3 --rollout-turn-tokens 32 --env-reply-tokens 100 --rollout-group-size 5
    done
    cat "$work/peak-memory.txt" 2> /dev/null | tee -a "$log"
    ;;
  host)
    # Where a decode step's time goes on the host: ours with fusion on and off (each with its
    # threads' CPU use), then one short decode of each with every kernel timed on the GPU.
    model="$work/qwen3-0.6b"
    step init-model "$bin" init-model --preset qwen3-0.6b --out "$model"
    # First the stacks of a decode at batch 1 (about 130 ms a step at the fourth lease: 128 steps
    # per timed run), sampled once loading and compiling are over.
    stacks host-stacks 15 --model "$model" --dtype bf16 --decode-batch 1 --decode-tokens 128 --prompt-len 32
    bench host-fused --model "$model" --dtype bf16 --decode-batch 1,64
    bench host-unfused --model "$model" --dtype bf16 --decode-batch 1,64 --fusion off
    kernel_profile profile-fused --model "$model" --dtype bf16 --decode-batch 1 --decode-tokens 8 --prompt-len 32
    kernel_profile profile-unfused --model "$model" --dtype bf16 --decode-batch 1 --decode-tokens 8 --prompt-len 32 --fusion off
    rm -rf "$model"
    cat "$work/peak-memory.txt" | tee -a "$log"
    ;;
  autotune)
    # A short look at a variant build (BIN=.gpu-cuda-fusion-autotune/prompt-r1): the kernels it
    # compiles for check-device, its decode speed on the 0.6B shape and the small rollout at 8.
    step check-tiny-f32 "$bin" check-device --device cuda
    bench autotune-bf16 --preset qwen3-0.6b --dtype bf16 --decode-batch 1,64
    rollout_small autotune-rollout-small 8
    grep -h '"rollout_over_decode"\|"speedup_over_reprefill"' "$work"/*rollout*.txt 2> /dev/null | tee -a "$log"
    cat "$work/peak-memory.txt" | tee -a "$log"
    ;;
  check)
    check_tiny
    step check-tiny-unfused env PROMPT_R1_FUSION=0 "$bin" check-device --device cuda
    ;;
  check-0.6b)
    step check-0.6b-f32 "$bin" check-device --device cuda --preset qwen3-0.6b
    step check-0.6b-bf16 "$bin" check-device --device cuda --preset qwen3-0.6b --dtype bf16 --rtol 5e-2
    ;;
  train)
    train_demo 4
    ;;
  bench)
    bench_0_6b bf16 train
    ;;
  bench-f32)
    bench_0_6b f32 train
    ;;
  memory)
    for ckpt in "" --activation-checkpointing; do
      bench "lora-4b${ckpt:+-ckpt}" --preset qwen3-4b --dtype bf16 --lora $ckpt --train-step --train-step-only \
        --batch 1 --seq-len 1024
    done
    grep -h "memory plan" "$work"/*.txt 2> /dev/null | tee -a "$log"
    cat "$work/peak-memory.txt" | tee -a "$log"
    serve_bursts
    ;;
  rollout)
    # First issue 32's figures, the rollout against pure decode (a lease rarely has time for
    # every step: the most telling come first). One run each: on the H100 three runs of the
    # small shape at 8 and 64 took 296 s.
    rollout_small rollout-small 8,64
    # The 0.6B shape with shorter episodes, so that the passes (pure decode twice, re-prefilled,
    # kept) finish within the stage.
    rollout_0_6b rollout-0.6b-bf16 8,64
    rollout_figures rollout-small.txt rollout-0.6b-bf16.txt
    # Then the paged-attention kernel (prompt-r1-device-kernels: a pass's attention read in
    # place from the paged KV cache) against burn's ops over the gathered keys and values: a
    # 2,048-token prefill and decode at 64 rows over 2,048-token prompts of the 0.6B shape, where
    # the gather writes and reads again 0.5 GiB per layer and step; with the kernel in every
    # pass (all, CUDA's default: the H200 ran the prefill 1.8x faster so; decode and off, the
    # fifth lease's comparison, come last). check-device (`first`) has checked the kernel's
    # tokens against the CPU.
    # At 8 rows too: 64 cubes a layer unsplit, half the H200's 132 SMs idle. Then the same with
    # every decoding step whole (--split-decoding off): one cube walks a row's 2,048 columns,
    # where by default they are cut into spans of cubes of their own (16 at 8 rows, 3 at 64).
    # Each with the decoding steps' own kernel (paged_decode, the default) and then with the
    # general kernel it replaced for them (--decoding-kernel general): the same run's baseline.
    long_decode decode-kernel-all 8,64
    long_decode decode-kernel-general 8,64 --decoding-kernel general
    long_decode decode-kernel-whole 8,64 --split-decoding off
    # The same run's prefill and scoring (2 x 2,048 tokens) through burn's ops
    # (--device-kernels decode), against decode-kernel-all's through the kernel: scoring has
    # taken it since the thirty-fourth session (the fifth lease's scoring was burn's ops).
    bench score-kernel-decode --preset qwen3-0.6b --dtype bf16 --prompt-len 2048 --workloads prefill,score --device-kernels decode
    decode_figures decode-kernel-all.txt decode-kernel-general.txt decode-kernel-whole.txt score-kernel-decode.txt
    # LoRA rollouts (the paper's run: rank 8 on every projection of a bf16 base) with the
    # adapters beside the base and merged into it (rollout.merge_lora, the default): on lavapipe
    # a decoding step launched 244 kernels a token apart and 155 merged (the base's count).
    lora_decode decode-lora-apart
    lora_decode decode-lora-merged --merge-lora
    decode_figures decode-lora-apart.txt decode-lora-merged.txt
    # Then what continuous admission gains where a decode step costs about the same at any
    # number of rows: 64 episodes of 1 to 5 turns, 32 in flight, in batches and continuously
    # (on 2 CPU cores with the paged KV cache: 0.65x the decoder steps, 0.80x the speed, 1.44x
    # the peak KV; the padded buffer before it took 1.7x).
    admission
    # Last the comparisons the fifth lease measured, for what changed since: the small rollout
    # with the kernel in decoding steps only (`all`, CUDA's default, puts the replies' prefill
    # passes through it too: on the fifth lease's H200 the rollout ran 21% faster so), and with
    # `all` but the episodes joining in prefill passes of their own rather than beside the
    # decoding rows in one ragged pass a step (vLLM's mixed batches; the H200 ran them 2% faster
    # apart, when a ragged pass's decoding rows still went through the general kernel: since the
    # thirty-first session they go through paged_decode); then the long-context decode with the kernel in decoding steps only and nowhere.
    rollout_small rollout-small-decode 64 --device-kernels decode
    rollout_small rollout-small-separate 64 --ragged-passes off
    long_decode decode-kernel-decode 64 --device-kernels decode
    long_decode decode-kernel-off 64 --device-kernels off
    rollout_figures rollout-admission.txt rollout-small-decode.txt rollout-small-separate.txt
    decode_figures decode-kernel-decode.txt decode-kernel-off.txt
    cat "$work/peak-memory.txt" | tee -a "$log"
    ;;
  *)
    say "unknown stage $stage: use build, compile, lease, lease-more, compare, first, host, autotune, check, check-0.6b, train, bench, bench-f32, memory or rollout"
    failed=1
    ;;
esac
finish
