#!/usr/bin/env bash
# The test command: installs what the tests need (Debian packages, a venv with voltaforge
# and its test extras) and runs the whole suite. .ci/run calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -eq 0 ]; then bash ci/install-system-deps.sh; else sudo bash ci/install-system-deps.sh; fi
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e '.[test]'
exec .venv/bin/invoke test
