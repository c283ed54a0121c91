"""The EXL2 phase of the device check: what it carries, what it proves before the GPU, and the
rehearsal that keeps it from rotting while no GPU is lent.

    python3 scripts/device_exl2.py prepare [--python 3.12]     # here, with an index: .device-exl2/
    python3 scripts/device_exl2.py run --out DIR [--rehearse]  # on the device (or here, rehearsed)

``prepare`` fills ``.device-exl2/`` (ignored by git; ``run``'s ``carry``): TabbyAPI at the pinned
commit (the staged archive), exllamav2 0.3.2 (its wheel is its source: the extension is compiled
from it by the build step), and a wheelhouse of binary wheels for ONE Python version: TabbyAPI's
dependencies and ExLlamaV2's, without torch (the device's own) and without numpy (every torch
install we may meet carries it; its absence is a reason the phase saves). Measured with pip
download for manylinux x86_64, 2026-12-03: those wheels for 3.12 are 65.5 MiB with numpy, 50.5
without; for 3.10-3.13 together 216 MiB. A call carries 64 MiB with the working tree, so the
four versions cannot travel together: the payload is for the device's Python as the facts of a
lent device recorded it (``--python``, default 3.12), and a device with another Python stops
at ``install`` with that reason saved, naming the ``prepare`` to run for the next call.

``run`` writes each phase's result as ``DIR/exl2-<phase>.json`` as it goes (facts first, so a
later failure still returns them) and packs ``DIR/results.tgz`` after every phase:

  facts    Python, torch and torch.version.cuda, nvcc, the driver (nvidia-smi), the payload
  install  a clean venv (seeing the device's torch: --system-site-packages) and the wheelhouse
           installed offline into it (pip --no-index)
  ext      ExLlamaV2's extension built by the build step's own operation for the device's arch,
           TORCH_EXTENSIONS_DIR under .device-exl2/ (carried by the next call: no recompile)

Each phase that needs the GPU asks for it first and, without one, stops with "needs a GPU" and
what it would have run: the rehearsal's proof that it got that far. Not written yet (the next
session's, issue 37 item 2): converting a generated model at 3.3 and 4.0 bpw with the quantize
step, the planner's sizes against the files, TabbyAPI deployed and asked through the openai
client, the bench. The rehearsal says so in its results rather than passing them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from playbooks.steps.build import wheelhouse  # noqa: E402
from playbooks.steps.build.tabbyapi import staged_archive  # noqa: E402

PAYLOAD = ROOT / ".device-exl2"
CARRY_LIMIT = 64 * 2**20  # what one device call carries, working tree included
EXLLAMAV2 = "exllamav2==0.3.2"
# ExLlamaV2 0.3.2's requirements (its wheel's METADATA) but torch, which is the device's
# and tokenizers, which it imports without declaring it (steps/build/exllamav2.py)
EXLLAMAV2_DEPS = (
    *("pandas", "ninja", "fastparquet", "safetensors>=0.3.2", "pygments", "websockets", "regex", "rich"),
    *("pillow>=9.1.0", "tokenizers"),
)
DEVICE_PROVIDES = {"numpy": "every torch install carries it; 15 MiB a Python version"}
PHASES = ("facts", "install", "ext")
NOT_WRITTEN = ("convert", "plan-vs-real", "tabbyapi", "bench")


class NeedsGPU(Exception):
    """The phase reached its first GPU call and there is no GPU."""


def sh(cmd: list[str] | str, timeout: float = 300, env: dict[str, str] | None = None) -> tuple[int, str]:
    r = subprocess.run(
        cmd, shell=isinstance(cmd, str), capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    return r.returncode, (r.stdout + r.stderr).strip()


def tree_bytes() -> int:
    """The working tree a call carries: tracked files and untracked ones git does not ignore."""
    code, out = sh(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"])
    if code != 0:
        return sum(f.stat().st_size for f in ROOT.rglob("*") if f.is_file() and ".device" not in f.parts)
    return sum((ROOT / p).stat().st_size for p in out.split("\0") if p and (ROOT / p).is_file())


def payload_bytes(payload: Path) -> int:
    return sum(f.stat().st_size for f in payload.rglob("*") if f.is_file() and "torch_extensions" not in f.parts)


# ------------------------------------------------------------------------------------------
# prepare (here, with an index)
# ------------------------------------------------------------------------------------------


def prepare(python: str, tabbyapi: Path, payload: Path = PAYLOAD) -> dict[str, Any]:
    tag = wheelhouse.python_tag(python)
    wheels = payload / "wheels" / tag
    wheels.mkdir(parents=True, exist_ok=True)
    shutil.copy(tabbyapi, payload / tabbyapi.name)
    reqs = wheelhouse.requirements(tabbyapi) + list(EXLLAMAV2_DEPS)
    code, out = sh(wheelhouse.download_argv(reqs, python, wheels), timeout=600)
    if code != 0:
        raise SystemExit(f"prepare: pip download for Python {python} failed: {out[-400:]}")
    code, out = sh(wheelhouse.download_argv([EXLLAMAV2], python, wheels, "--no-deps"), timeout=300)
    if code != 0:
        raise SystemExit(f"prepare: pip download {EXLLAMAV2} failed: {out[-400:]}")
    for name in DEVICE_PROVIDES:
        for w in wheels.glob(f"{name}-*.whl"):
            w.unlink()
    manifest = {
        "python": python,
        "wheels": sorted(w.name for w in wheels.glob("*.whl")),
        "tabbyapi": tabbyapi.name,
        "left_to_the_device": DEVICE_PROVIDES,
        "payload_bytes": payload_bytes(payload),
        "tree_bytes": tree_bytes(),
    }
    (payload / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# ------------------------------------------------------------------------------------------
# run (on the device; here with --rehearse)
# ------------------------------------------------------------------------------------------


def gpu_or_stop(what: str) -> str:
    """The GPU's name, or NeedsGPU saying what the phase would run on it."""
    code, out = sh("nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader", timeout=30)
    if code != 0 or not out:
        raise NeedsGPU(f"needs a GPU: {what} (nvidia-smi: {out.splitlines()[-1] if out else 'not found'})")
    return out.splitlines()[0]


def phase_facts(out: Path, payload: Path, rehearse: bool) -> dict[str, Any]:
    probe = (
        "import sys, json\n"
        "d = {'python': '%d.%d.%d' % sys.version_info[:3]}\n"
        "try:\n import torch; d.update(torch=torch.__version__, torch_cuda=torch.version.cuda, "
        "cuda_available=torch.cuda.is_available())\n"
        "except Exception as e: d.update(torch=None, torch_error=repr(e)[:200])\n"
        "try:\n import numpy; d['numpy'] = numpy.__version__\n"
        "except Exception: d['numpy'] = None\n"
        "print(json.dumps(d))"
    )
    code, py = sh([sys.executable, "-c", probe])
    facts: dict[str, Any] = json.loads(py.splitlines()[-1]) if code == 0 else {"python_error": py[-300:]}
    facts["nvcc"] = sh("ls -d /usr/local/cuda*/bin/nvcc 2>/dev/null; nvcc --version 2>/dev/null | tail -1")[1]
    facts["driver"] = sh("nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader")[1]
    manifest = payload / "manifest.json"
    facts["payload"] = json.loads(manifest.read_text()) if manifest.is_file() else None
    return facts


def phase_install(out: Path, payload: Path, rehearse: bool) -> dict[str, Any]:
    manifest = json.loads((payload / "manifest.json").read_text())
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if manifest["python"] != here:
        raise SystemExit(
            f"blocked: the wheelhouse is for Python {manifest['python']}, this Python is {here}: "
            f"run `python3 scripts/device_exl2.py prepare --python {here}` for the next call"
        )
    venv = out / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    # the device's torch (and numpy) seen from the venv; here, a clean venv with no site packages
    flags = [] if rehearse else ["--system-site-packages"]
    code, text = sh([sys.executable, "-m", "venv", *flags, str(venv)])
    if code != 0:
        raise SystemExit(f"venv: {text[-300:]}")
    links = [str(payload / "wheels" / wheelhouse.python_tag(here))]
    if rehearse:  # what the device is expected to hold itself (DEVICE_PROVIDES), fetched for the rehearsal
        extra = out / "device-provides"
        code, text = sh(wheelhouse.download_argv(list(DEVICE_PROVIDES), here, extra, build=False), timeout=300)
        links.append(str(extra))
    tabby = out / "tabbyAPI"
    shutil.rmtree(tabby, ignore_errors=True)
    tabby.mkdir()
    with tarfile.open(payload / manifest["tabbyapi"]) as tar:
        tar.extractall(tabby, filter="data")
    argv = [str(venv / "bin/pip"), "install", "--disable-pip-version-check", "--no-index"]
    for link in links:
        argv += ["--find-links", link]
    t0 = time.monotonic()
    code, text = sh([*argv, str(tabby), *EXLLAMAV2_DEPS], timeout=600)
    if code == 0:  # exllamav2 itself without its torch requirement: torch is the device's
        code, more = sh([*argv, "--no-deps", EXLLAMAV2], timeout=300)
        text += "\n" + more
    (out / "exl2-install.log").write_text(text + "\n")
    if code != 0:
        missing = [ln for ln in text.splitlines() if "No matching distribution" in ln]
        raise SystemExit(f"blocked: the offline install failed: {(missing or text.splitlines()[-1:])[0][-300:]}")
    _, freeze = sh([str(venv / "bin/pip"), "freeze"])
    return {"install_s": round(time.monotonic() - t0, 1), "installed": len(freeze.splitlines()), "offline": True}


def phase_ext(out: Path, payload: Path, rehearse: bool) -> dict[str, Any]:
    gpu = gpu_or_stop("the build step's EnsureExllamav2 (JIT build of exllamav2_ext for this arch)")
    raise SystemExit(f"not written yet: the extension build on {gpu} (issue 37 item 2)")


def run(out: Path, payload: Path, rehearse: bool) -> int:
    out.mkdir(parents=True, exist_ok=True)
    status: dict[str, str] = {}
    for name in PHASES:
        t0 = time.monotonic()
        try:
            result: dict[str, Any] = {"status": "done", **globals()[f"phase_{name}"](out, payload, rehearse)}
        except NeedsGPU as e:
            result = {"status": "needs a GPU", "why": str(e)}
        except SystemExit as e:
            result = {"status": "stopped", "why": str(e)}
        except Exception as e:  # a phase's bug is its result too: the next phase still runs
            result = {"status": "failed", "why": f"{type(e).__name__}: {e}"[:500]}
        result["seconds"] = round(time.monotonic() - t0, 1)
        (out / f"exl2-{name}.json").write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
        status[name] = result["status"]
        print(f"== exl2 {name}: {result['status']}" + (f" - {result['why']}" if "why" in result else ""), flush=True)
        with tarfile.open(out / "results.tgz", "w:gz") as tar:
            for f in sorted(out.glob("exl2-*")):
                tar.add(f, arcname=f.name)
        if result["status"] == "needs a GPU":
            break  # every later phase needs the GPU too
    for name in NOT_WRITTEN:
        print(f"== exl2 {name}: not written yet (issue 37 item 2)")
    return 0 if all(s in ("done", "needs a GPU") for s in status.values()) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare")
    pp.add_argument("--python", default="3.12")
    pp.add_argument("--tabbyapi", type=Path, default=None, help="the staged archive (default: the controller's)")
    pp.add_argument("--payload", type=Path, default=PAYLOAD)
    pr = sub.add_parser("run")
    pr.add_argument("--out", type=Path, required=True)
    pr.add_argument("--payload", type=Path, default=PAYLOAD)
    pr.add_argument("--rehearse", action="store_true")
    a = p.parse_args()
    if a.cmd == "prepare":
        from playbooks.config.recipe import Toolchain

        archive = a.tabbyapi or staged_archive(Toolchain().tabbyapi_ref)
        m = prepare(a.python, archive, a.payload)
        total = m["payload_bytes"] + m["tree_bytes"]
        print(
            f"payload {m['payload_bytes'] / 2**20:.1f} MiB + tree {m['tree_bytes'] / 2**20:.1f} MiB = "
            f"{total / 2**20:.1f} MiB of {CARRY_LIMIT / 2**20:.0f} ({len(m['wheels'])} wheels, Python {a.python})"
        )
        return 0 if total <= CARRY_LIMIT else 1
    return run(a.out, a.payload, a.rehearse)


if __name__ == "__main__":
    sys.exit(main())
