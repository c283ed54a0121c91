"""The EXL2 phase of the device check: what it carries, what it proves before the GPU, and the
rehearsal that keeps it from rotting while no GPU is lent.

    python3 scripts/device_exl2.py prepare [--python 3.12]     # here, with an index: .device-exl2/
    python3 scripts/device_exl2.py run --out DIR [--rehearse]  # on the device (or here, rehearsed)

``prepare`` fills ``.device-exl2/`` (ignored by git; ``run``'s ``carry``): TabbyAPI at the pinned
commit (the staged archive), exllamav2 0.3.2 (its wheel is its source: the extension is compiled
from it by the build step), and a wheelhouse of binary wheels for ONE Python version: TabbyAPI's
dependencies and ExLlamaV2's, without torch (the device's own) and without numpy (every torch
install we may meet carries it; its absence is a reason the phase saves). Measured with pip
download for manylinux x86_64, 2026-12-03: TabbyAPI's and ExLlamaV2's wheels for 3.12 are 65.5
MiB with numpy, 50.5 without, 216 MiB for 3.10-3.13 together; with our steps' own (OURS) the
payload is 55.6-55.9 MiB a version, 59.0-59.3 with the working tree. A call carries 64 MiB, so the
four versions cannot travel together: the payload is for one Python (``--python``, default 3.12:
no lent device has recorded its Python yet; the facts phase does), and a device with another stops
at ``install`` with that reason saved, naming the ``prepare`` to run for the next call.

``run`` writes each phase's result as ``DIR/exl2-<phase>.json`` as it goes (facts first, so a
later failure still returns them) and packs ``DIR/results.tgz`` after every phase:

  facts     Python, torch and torch.version.cuda, numpy, nvcc, the driver, the payload (stdlib only)
  install   a venv seeing the device's torch (--system-site-packages; the rehearsal's is clean)
            and the wheelhouse installed into it offline (pip --no-index; exllamav2 --no-deps)
  ext       the build step's EnsureExllamav2 against the device's torch, for its GPU's arch, run
            twice (the build, then the no-op); TORCH_EXTENSIONS_DIR under .device-exl2/prefix
  convert   a generated Llama with shapes ExLlamaV2 takes (EXL2_MODEL) and the planner's file
            sizes for it; on the GPU, the quantize step's conversion at 3.3 and 4.0 bpw (the
            second reusing the first's measurement) and the real files against the plan
  tabbyapi  the tabbyapi step from the payload's archive and wheels (offline, its proof), twice:
            needs the GPU, since TabbyAPI's start imports exllamav2, torch and the extension;
            then serving a conversion (not written yet, see below)

The last three run in that venv (``phase NAME``). Each asks for the GPU where it first needs one
and, without one, stops with "needs a GPU" and what it would have run: the rehearsal runs every
phase that far. A device whose torch and toolkit cannot build ExLlamaV2 (another CUDA major)
stops ``ext`` with the step's own reason, saved: the "blocked" outcome.

Not written yet (issue 37 item 2, the next session's): TabbyAPI serving the conversion through
the deploy step and answering a streamed chat through the openai client, and the bench. The
run says so rather than passing them. Not measured: the size of the extension's build directory,
which a second call must carry beside the payload (~55 MiB of 64).
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

# run's first two phases use the device's own python3 and the standard library only; the
# others run in the venv that `install` made (python scripts/device_exl2.py phase NAME)

PAYLOAD = ROOT / ".device-exl2"
CARRY_LIMIT = 64 * 2**20  # what one device call carries, working tree included
EXLLAMAV2 = "exllamav2==0.3.2"
# ExLlamaV2 0.3.2's requirements (its wheel's METADATA) but torch, which is the device's
# and tokenizers, which it imports without declaring it (steps/build/exllamav2.py)
EXLLAMAV2_DEPS = (
    *("pandas", "ninja", "fastparquet", "safetensors>=0.3.2", "pygments", "websockets", "regex", "rich"),
    *("pillow>=9.1.0", "tokenizers"),
)
# what voltaforge's own steps need in that venv beside TabbyAPI's (pydantic, jinja2, PyYAML):
# gguf (the planner's tensor names), sentencepiece (the generated model's tokenizer), openai
# (the streamed chat through the official client, as a user would ask)
OURS = ("gguf>=0.17,<1", "sentencepiece>=0.2,<0.3", "openai>=1.40,<3")
DEVICE_PROVIDES = {"numpy": "every torch install carries it; 15 MiB a Python version"}
PHASES = ("facts", "install", "ext", "convert", "tabbyapi")
IN_VENV = ("ext", "convert", "tabbyapi")
NOT_WRITTEN = ("bench",)
#: a generated Llama with shapes ExLlamaV2's kernels take (head_dim 128, dims multiples of 128)
EXL2_MODEL = {
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
BPWS = ((3.3, 6), (4.0, 6))


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
    from playbooks.steps.build import wheelhouse

    tag = wheelhouse.python_tag(python)
    wheels = payload / "wheels" / tag
    wheels.mkdir(parents=True, exist_ok=True)
    shutil.copy(tabbyapi, payload / tabbyapi.name)
    reqs = wheelhouse.requirements(tabbyapi) + list(EXLLAMAV2_DEPS) + list(OURS)
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
    links = [str(payload / "wheels" / f"cp{here.replace('.', '')}")]
    if rehearse:  # what the device is expected to hold itself (DEVICE_PROVIDES), fetched for the rehearsal
        extra = out / "device-provides"
        code, text = sh([sys.executable, "-m", "pip", "download", "-q", "-d", str(extra), *DEVICE_PROVIDES])
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
    code, text = sh([*argv, str(tabby), *EXLLAMAV2_DEPS, *OURS], timeout=600)
    if code == 0:  # exllamav2 itself without its torch requirement: torch is the device's
        code, more = sh([*argv, "--no-deps", EXLLAMAV2], timeout=300)
        text += "\n" + more
    (out / "exl2-install.log").write_text(text + "\n")
    if code != 0:
        missing = [ln for ln in text.splitlines() if "No matching distribution" in ln]
        raise SystemExit(f"blocked: the offline install failed: {(missing or text.splitlines()[-1:])[0][-300:]}")
    _, freeze = sh([str(venv / "bin/pip"), "freeze"])
    return {"install_s": round(time.monotonic() - t0, 1), "installed": len(freeze.splitlines()), "offline": True}


def _facts(out: Path) -> dict[str, Any]:
    return json.loads((out / "exl2-facts.json").read_text())


def _device_toolchain(out: Path, arch: str) -> Any:
    """The pinned toolchain with the device's own torch, its CUDA and its GPU's arch: the build
    step's operation then checks what it checks on a V100 host (torch's CUDA major against the
    toolkit's) against what this device really has."""
    from playbooks.config.recipe import Toolchain

    f = _facts(out)
    if not f.get("torch") or not f.get("torch_cuda"):
        raise SystemExit(f"blocked: no CUDA torch on the device (torch {f.get('torch')}, CUDA {f.get('torch_cuda')})")
    major, minor = str(f["torch_cuda"]).split(".")[:2]
    return Toolchain(torch=f["torch"], cuda=f"{major}.{minor}", cuda_arch=arch)


def _arch(gpu: str) -> str:
    """'NVIDIA H200, 9.0' (nvidia-smi name,compute_cap) -> '90'."""
    return gpu.rsplit(",", 1)[-1].strip().replace(".", "")


def _ops(ops: list[Any]) -> list[dict[str, str]]:
    from playbooks.host.local import LocalHost
    from playbooks.host.ops import run_ops

    changes = run_ops(LocalHost(), ops)
    done = [{"step": c.step, "status": c.status, "why": c.why} for c in changes]
    failed = [c for c in changes if c.status == "failed"]
    if failed:
        raise SystemExit(f"{failed[0].step}: {failed[0].why}")
    return done


def phase_ext(out: Path, payload: Path, rehearse: bool) -> dict[str, Any]:
    from playbooks.steps.build.exllamav2 import EnsureExllamav2

    gpu = gpu_or_stop("the build step's EnsureExllamav2 (JIT build of exllamav2_ext for this arch)")
    tc = _device_toolchain(out, _arch(gpu))
    # the prefix (and so TORCH_EXTENSIONS_DIR, <prefix>/exllamav2/ext/<id>) under the payload:
    # the next call carries it and ninja finds its objects; the stamp is the venv's, made anew
    step = EnsureExllamav2(str(payload / "prefix"), str(Path(sys.prefix)), tc)
    t0 = time.monotonic()
    first = _ops([step])
    t1 = time.monotonic()
    again = _ops([step])
    return {"gpu": gpu, "first": first, "first_s": round(t1 - t0, 1), "again": again, "arch": tc.cuda_arch}


def phase_convert(out: Path, payload: Path, rehearse: bool) -> dict[str, Any]:
    """A generated model with EXL2 shapes, the planner's sizes for it, then the quantize step's
    conversion at 3.3 and 4.0 bpw (the second reusing the first's measurement) and the real
    files against the plan."""
    from playbooks.plan.exl2_size import estimate_exl2
    from playbooks.plan.model_config import shape_from_config
    from playbooks.steps.weights.exl2_convert import exl2_ops
    from playbooks.weights.tinymodel import write_tiny_llama

    model = out / "model"
    if not (model / "config.json").is_file():
        write_tiny_llama(model, EXL2_MODEL)
    shape = shape_from_config(EXL2_MODEL, where="the device check's EXL2 model")
    planned = {f"{b:g}": estimate_exl2(shape, b, hb).file_bytes for b, hb in BPWS}
    result: dict[str, Any] = {"model": EXL2_MODEL, "planned_file_bytes": planned}
    (out / "exl2-convert.json").write_text(json.dumps({"status": "running", **result}, indent=2) + "\n")
    gpu = gpu_or_stop(f"the quantize step's EnsureExl2Quant at {', '.join(planned)} bpw (planned bytes {planned})")
    root = out / "models"
    ops = exl2_ops(str(Path(sys.prefix)), str(model), str(root), list(BPWS), gpu_available=True)
    t0 = time.monotonic()
    result["changes"] = _ops(ops)
    result["convert_s"] = round(time.monotonic() - t0, 1)
    real = {}
    for b, _ in BPWS:
        files = [f for f in root.rglob("*.safetensors") if f"{b:g}bpw" in str(f.parent)]
        real[f"{b:g}"] = sum(f.stat().st_size for f in files)
    result.update(gpu=gpu, real_file_bytes=real)
    result["real_over_planned"] = {k: round(real[k] / planned[k], 4) if planned[k] else None for k in real}
    return result


def phase_tabbyapi(out: Path, payload: Path, rehearse: bool) -> dict[str, Any]:
    """TabbyAPI through its step (pushed from the payload's archive, its proof), then, on the
    GPU, serving the 4.0 bpw conversion with our rendered config.yml, asked for a streamed chat
    completion through the official openai client."""
    from playbooks.config.recipe import Toolchain
    from playbooks.steps.build.tabbyapi import EnsureTabbyAPI

    # TabbyAPI's start imports exllamav2 where it is installed (common/multimodal.py ->
    # backends/exllamav2/vision.py), so its proof needs torch and the extension `ext` built
    gpu_or_stop("the tabbyapi step (its proof starts TabbyAPI, which imports exllamav2 and the extension ext built)")
    manifest = json.loads((payload / "manifest.json").read_text())
    cache = out / "cache" / "sources"
    cache.mkdir(parents=True, exist_ok=True)
    shutil.copy(payload / manifest["tabbyapi"], cache / manifest["tabbyapi"])
    # the payload's wheels where the step looks for a wheelhouse: it installs offline, as on a host
    from playbooks.steps.build import wheelhouse

    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    ref = Toolchain().tabbyapi_ref
    tar = wheelhouse.packed(ref, tag, cache)
    tar.parent.mkdir(parents=True, exist_ok=True)
    wheelhouse.pack(payload / "wheels" / tag, tar)
    prefix = out / "prefix"
    step = EnsureTabbyAPI(str(prefix), str(Path(sys.prefix)), Toolchain(), cache=cache)
    result: dict[str, Any] = {"install": _ops([step]), "again": _ops([step])}
    (out / "exl2-tabbyapi.json").write_text(json.dumps({"status": "running", **result}, indent=2) + "\n")
    raise SystemExit("not written yet: serving the conversion through the deploy step (issue 37 item 2)")


def run_in_venv(name: str, out: Path, payload: Path, rehearse: bool) -> dict[str, Any]:
    """A phase in the venv `install` made: the device's torch and the payload's wheels."""
    argv = [str(out / "venv/bin/python"), __file__, "phase", name, "--out", str(out), "--payload", str(payload)]
    code, text = sh([*argv, *(["--rehearse"] if rehearse else [])], timeout=600)
    (out / f"exl2-{name}.log").write_text(text + "\n")
    last = text.splitlines()[-1] if text else ""
    try:
        return dict(json.loads(last))
    except ValueError:
        return {"status": "failed", "why": f"exit {code}: {last[-400:]}"}


def one_phase(name: str, out: Path, payload: Path, rehearse: bool) -> dict[str, Any]:
    try:
        return {"status": "done", **globals()[f"phase_{name}"](out, payload, rehearse)}
    except NeedsGPU as e:
        return {"status": "needs a GPU", "why": str(e)}
    except SystemExit as e:
        return {"status": "stopped", "why": str(e)}
    except Exception as e:  # a phase's bug is its result too: the next phase still runs
        return {"status": "failed", "why": f"{type(e).__name__}: {e}"[:500]}


def run(out: Path, payload: Path, rehearse: bool) -> int:
    out.mkdir(parents=True, exist_ok=True)
    status: dict[str, str] = {}
    for name in PHASES:
        t0 = time.monotonic()
        if name in IN_VENV and status.get("install") != "done":
            result: dict[str, Any] = {"status": "stopped", "why": "no venv: the install phase did not finish"}
        elif name in IN_VENV:
            result = run_in_venv(name, out, payload, rehearse)
        else:
            result = one_phase(name, out, payload, rehearse)
        result["seconds"] = round(time.monotonic() - t0, 1)
        (out / f"exl2-{name}.json").write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
        status[name] = result["status"]
        print(f"== exl2 {name}: {result['status']}" + (f" - {result['why']}" if "why" in result else ""), flush=True)
        with tarfile.open(out / "results.tgz", "w:gz") as tar:
            for f in sorted(out.glob("exl2-*")):
                tar.add(f, arcname=f.name)
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
    ph = sub.add_parser("phase", help="one phase, in the venv `install` made (run calls it)")
    ph.add_argument("name", choices=IN_VENV)
    ph.add_argument("--out", type=Path, required=True)
    ph.add_argument("--payload", type=Path, default=PAYLOAD)
    ph.add_argument("--rehearse", action="store_true")
    a = p.parse_args()
    if a.cmd == "phase":
        print(json.dumps(one_phase(a.name, a.out, a.payload, a.rehearse), default=str))
        return 0
    if a.cmd == "prepare":
        from playbooks.config.recipe import Toolchain
        from playbooks.steps.build.tabbyapi import staged_archive

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
