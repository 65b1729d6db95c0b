# Sourced by the Python client scripts beside it: finds the built `prompt-r1` binary and makes
# a throwaway work directory under the target directory, and a virtual environment holding the
# PyPI packages given as arguments. Sets `here`, `bin`, `work` and (make_venv) `venv`; the caller
# removes `work`.

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

# Sets `venv` to a virtual environment holding the named PyPI packages. One environment per
# package list is kept under the target directory, so the scripts that name the same packages
# (run_export.sh and run_peft.sh: torch from PyPI is several GB) install them once; one whose
# install did not finish is made anew.
make_venv() {
    venv="$target/python-venvs/$(printf '%s-' "$@")"
    if [ ! -f "$venv/.installed" ]; then
        rm -rf "$venv"
        python3 -m venv "$venv"
        "$venv/bin/pip" install --quiet --disable-pip-version-check "$@"
        touch "$venv/.installed"
    fi
}
