#!/usr/bin/env bash
# Tests `prompt-r1 serve` with the official `openai` Python client from PyPI.
#
# Builds nothing: run `cargo build --release -p prompt-r1` first (or point PROMPT_R1_BIN at a
# binary). Installs `openai` into a virtual environment under the target directory, starts
# `serve` on a fresh tiny random model on a free port, runs test_serve_openai.py, and removes the
# work directory it made. Exits non-zero on any failure.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
server=""
cleanup() {
    if [ -n "$server" ]; then
        kill "$server" 2>/dev/null || true
        wait "$server" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

make_venv "${VENV_OPENAI[@]}"

if ! "$bin" init-model --preset tiny --out "$work/tiny" >"$work/init.log" 2>&1; then
    cat "$work/init.log" >&2
    exit 1
fi
"$bin" serve --model "$work/tiny" --port 0 --served-model-name tiny --quiet \
    >"$work/serve.out" 2>"$work/serve.err" &
server=$!

url=""
for _ in $(seq 1 600); do
    url="$(grep -o 'http://[^ ]*' "$work/serve.out" 2>/dev/null || true)"
    [ -n "$url" ] && break
    if ! kill -0 "$server" 2>/dev/null; then
        echo "error: prompt-r1 serve exited:" >&2
        cat "$work/serve.err" >&2
        exit 1
    fi
    sleep 0.1
done
if [ -z "$url" ]; then
    echo "error: prompt-r1 serve printed no URL within 60 s" >&2
    exit 1
fi

"$venv/bin/python" "$here/test_serve_openai.py" "$url" tiny
