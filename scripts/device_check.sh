#!/usr/bin/env bash
# The GPU check in one call: bash scripts/device_check.sh OUT
#
# For a GPU machine lent for minutes with no network (the workplace's `device`): our Python
# dependencies that its image lacks travel as wheels in .device/wheels, the llama.cpp tree as
# .device/llama_cpp_python-0.3.36.tar.gz (the sdist's vendor/llama.cpp without models, docs,
# tests and benches). Each phase has its own time limit so one slow phase never eats the
# others'; everything lands in OUT/results.tgz. scripts/device_check.py says what each does.
# Each phase's figures are also result files (playbooks/results.py) in OUT/reports/<gpu>/:
# copy them into the repository with `cp -r OUT/reports/. reports/` and update the README's
# marked figures (tests/test_readme_figures.py says which differ).
set -u
if [ "${1:-}" = "--rehearse" ]; then
  # The EXL2 phase rehearsed on a machine without a GPU (CI runs this): the payload made for
  # this Python and measured against what a call carries, the wheelhouse installed offline into
  # a clean venv, each phase run to its first GPU call, the results archive written.
  # scripts/device_exl2.py says what each phase does and what is not written yet.
  set -e
  # voltaforge's venv (bash ci/test.sh or scripts/install.sh makes it): prepare imports our code
  PY=${PYTHON:-.venv/bin/python}
  [ -x "$PY" ] || { echo "no $PY: run bash scripts/install.sh first, or set PYTHON" >&2; exit 2; }
  R=$(mktemp -d /tmp/vf-rehearse-XXXXXX)
  TABBY=${VF_TABBYAPI:-../shared/vendor/tabbyAPI-79126f904c2e00aece026b36bb70bbb87e4892b2.tar.gz}
  HERE=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  "$PY" scripts/device_exl2.py prepare --python "$HERE" --tabbyapi "$TABBY" --payload "$R/payload"
  "$PY" scripts/device_exl2.py run --rehearse --out "$R/out" --payload "$R/payload" --prefix "$R/prefix"
  test -s "$R/out/results.tgz"
  tar -tzf "$R/out/results.tgz"
  # a second call on a warm device: a fresh results directory, the same prefix
  echo "== again"
  "$PY" scripts/device_exl2.py run --rehearse --out "$R/again" --payload "$R/payload" --prefix "$R/prefix"
  # the rehearsal's venv is clean (it proves the wheelhouse complete); what the device's needs,
  # seeing the packages of a venv's interpreter, is proven apart, from this venv's interpreter
  echo "== venv-check"
  "$PY" scripts/device_exl2.py venv-check
  # VF_REHEARSE_KEEP=DIR: the results archives kept there (the rehearsal's test reads them)
  if [ -n "${VF_REHEARSE_KEEP:-}" ]; then
    cp "$R/out/results.tgz" "$VF_REHEARSE_KEEP/"
    cp "$R/again/results.tgz" "$VF_REHEARSE_KEEP/results-again.tgz"
  fi
  rm -rf "$R"
  exit 0
fi
OUT=${1:?usage: device_check.sh OUT | --rehearse}
R="$OUT/r"
mkdir -p "$R"
T0=$(date +%s)
if ls .device/wheels/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/wheels/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
{ command -v nvcc gcc g++ make ninja cmake; ls -d /usr/local/cuda*; nproc; } > "$R/tools.txt" 2>&1
phase() { # phase SECONDS NAME [ARGS...]
  local limit=$1 name=$2
  shift 2
  echo "== $name (limit ${limit}s, at $(($(date +%s) - T0))s)"
  timeout -k 10 "$limit" python3 scripts/device_check.py "$name" --out "$R" "$@" 2>&1 | tail -n 40
  # after every phase: a call cut short still returns what was done
  tar -czf "$OUT/results.tgz" -C "$OUT" r $(cd "$OUT" && ls -d reports 2>/dev/null)
}
# VF_PHASES: the phases to run (all by default), e.g. "facts build gate" for a second call
want() { case " ${VF_PHASES:-facts build gate moe} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
want facts && phase 40 facts
want build && phase "${VF_BUILD_LIMIT:-330}" build
want gate && phase 100 gate
want moe && phase 120 moe
# issue 57: our GPU exporter against nvidia-smi (a call of its own: VF_PHASES=exporter, about 30 s)
want exporter && phase 60 exporter
# the EXL2 phase (a call of its own: VF_PHASES=exl2, carry .device-exl2 made by
# `python3 scripts/device_exl2.py prepare`); its results are files in $R too
if want exl2; then
  echo "== exl2 (limit 280s, at $(($(date +%s) - T0))s)"
  timeout -k 10 280 python3 scripts/device_exl2.py run --out "$R" 2>&1 | tail -n 40
  tar -czf "$OUT/results.tgz" -C "$OUT" r $(cd "$OUT" && ls -d reports 2>/dev/null)
fi
echo "== done at $(($(date +%s) - T0))s"
