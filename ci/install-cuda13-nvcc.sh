#!/usr/bin/env bash
# Installs a CUDA 13.0 nvcc from PyPI wheels into the test cache, for the tests that need a
# toolkit which CANNOT target sm_70 (the mixed-PATH trap in tests/test_buildenv.py, the real
# nvcc in tests/test_facts_cuda.py). Such tests put its bin/ first on PATH themselves, so they
# behave the same on every image, whatever nvcc the image has (or not).
#
#     ${VOLTAFORGE_CACHE:-$HOME/.cache/voltaforge}/cuda13-nvcc-13.0.88/nvidia/cu13/bin/nvcc
#
# Usage: ci/install-cuda13-nvcc.sh [PYTHON]   a python with pip (default: .venv/bin/python of
# the repository, else python3). Idempotent: once installed, nothing is done.
#
# What is installed and why (measured by unpacking the wheels and compiling a kernel):
#   nvidia-cuda-nvcc     nvcc, ptxas, cudafe++, nvlink, fatbinary, bin2c, nvcc.profile
#   nvidia-nvvm          cicc (nvcc's front end: nvvm/bin/cicc) and libdevice
#   nvidia-cuda-crt      crt/host_config.h and the other crt/ headers nvcc includes
#   nvidia-cuda-runtime  cuda_runtime.h. Without it nvcc does NOT fail: it silently takes
#                        /usr/include/cuda_runtime.h, i.e. Debian's CUDA 11.8 headers - a
#                        mixed toolkit of its own. So it is required.
# All four pinned, with --no-deps: nvidia-cuda-nvcc 13.0.88 requires the other three
# unpinned, and pip then picks their newest release (13.5.x), not the 13.0 that matches.
# About 100 MB of wheels, 253 MB installed; 3-5 s from PyPI on this kind of machine.
set -euo pipefail
cd "$(dirname "$0")/.."

version=13.0.88
wheels="nvidia-cuda-nvcc==$version nvidia-cuda-crt==$version nvidia-nvvm==$version nvidia-cuda-runtime==13.0.96"
cache="${VOLTAFORGE_CACHE:-$HOME/.cache/voltaforge}"
dest="$cache/cuda13-nvcc-$version"
nvcc="$dest/nvidia/cu13/bin/nvcc"

py="${1:-}"
if [ -z "$py" ]; then
    if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi

if [ -f "$dest/.installed" ] && [ -x "$nvcc" ]; then
    echo "install-cuda13-nvcc: $nvcc exists, nothing to do"
    exit 0
fi

mkdir -p "$cache"
# One installer at a time (parallel CI jobs sharing a cache wait for the first one).
exec 9>"$cache/.cuda13-nvcc.lock"
flock 9
if [ -f "$dest/.installed" ] && [ -x "$nvcc" ]; then
    echo "install-cuda13-nvcc: $nvcc was installed meanwhile, nothing to do"
    exit 0
fi

start=$(date +%s.%N)
work=$(mktemp -d "$cache/cuda13-nvcc.XXXXXX")
trap 'rm -rf "$work"' EXIT
# shellcheck disable=SC2086
"$py" -m pip install --disable-pip-version-check -q --no-deps --only-binary :all: \
    --target "$work/tree" $wheels
"$work/tree/nvidia/cu13/bin/nvcc" --version | grep -q "release 13.0," || {
    echo "install-cuda13-nvcc: the installed nvcc is not CUDA 13.0:" >&2
    "$work/tree/nvidia/cu13/bin/nvcc" --version >&2 || true
    exit 1
}
rm -rf "$dest"
mv "$work/tree" "$dest"
touch "$dest/.installed"
end=$(date +%s.%N)
echo "install-cuda13-nvcc: $nvcc ($(du -sh "$dest" | cut -f1)) in $(awk "BEGIN { printf \"%.1f\", $end - $start }") s"
