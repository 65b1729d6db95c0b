# Sourced by the Python client scripts beside it: finds the built `prompt-r1` binary and makes
# a throwaway work directory under the target directory, with a virtual environment holding the
# PyPI packages given as arguments. Sets `here`, `bin` and `work`; the caller removes `work`.

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
bin="${PROMPT_R1_BIN:-$target/release/prompt-r1}"
if [ ! -x "$bin" ]; then
    echo "error: no prompt-r1 binary at $bin (run: cargo build --release -p prompt-r1)" >&2
    exit 1
fi

mkdir -p "$target"
work="$(mktemp -d "$target/python-test.XXXXXX")"

# Installs the named PyPI packages into a fresh virtual environment at "$work/venv".
make_venv() {
    python3 -m venv "$work/venv"
    "$work/venv/bin/pip" install --quiet --disable-pip-version-check "$@"
}
