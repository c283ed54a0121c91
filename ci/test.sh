#!/usr/bin/env bash
# The test command: installs what the tests need (Debian packages, a venv with voltaforge
# and its test extras, a CUDA 13 nvcc from PyPI for the mixed-toolkit tests) and runs the
# whole suite in strict mode. .ci/run calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -eq 0 ]; then bash ci/install-system-deps.sh; else sudo bash ci/install-system-deps.sh; fi
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e '.[test]'
bash ci/install-cuda13-nvcc.sh .venv/bin/python
# Strict mode (tests/strict.py): every skip is a failure, so a proof that cannot run here
# (a toolkit, wheel or host missing) turns CI red instead of silently not running.
export VOLTAFORGE_STRICT=1
exec .venv/bin/invoke test
