# Sourced by the Python client scripts beside it: finds the built `prompt-r1` binary and makes
# a throwaway work directory under the target directory; make_venv (venvs.sh) gives the virtual
# environment of a package list. Sets `here`, `bin`, `work` and (make_venv) `venv`; the caller
# removes `work`.

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/venvs.sh"
bin="${PROMPT_R1_BIN:-$target/release/prompt-r1}"
if [ ! -x "$bin" ]; then
    echo "error: no prompt-r1 binary at $bin (run: cargo build --release -p prompt-r1)" >&2
    exit 1
fi

mkdir -p "$target"
work="$(mktemp -d "$target/python-test.XXXXXX")"
