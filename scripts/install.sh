#!/usr/bin/env bash
# The quick start's set-up command: voltaforge into .venv in this checkout, with what the
# built-in demo needs (sentencepiece, to generate the tiny model's tokenizer). Needs python3
# >= 3.10; Debian and Ubuntu ship the venv module apart (python3-venv), so it is installed
# first when missing (with sudo unless root). Everything else a host needs (compilers, cmake,
# ccache, CUDA for a GPU recipe) is installed by `invoke provision`'s toolchain step.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv
fi
# pip's and setuptools' chatter goes to a log, shown whole only when something fails
log=$(mktemp -t voltaforge-install.XXXXXX)
quiet() {
    if ! "$@" >>"$log" 2>&1; then
        cat "$log" >&2
        echo "install failed: $* (the output above is kept in $log)" >&2
        exit 1
    fi
}
echo "voltaforge: a venv in $(pwd)/.venv"
quiet python3 -m venv .venv
quiet .venv/bin/pip install --upgrade pip
echo "voltaforge: installing the package and the tiny recipe's extras"
quiet .venv/bin/pip install -e '.[tiny]'
rm -f "$log"
echo "installed: .venv/bin/invoke provision (or .venv/bin/voltaforge provision)"
