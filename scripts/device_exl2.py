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
            twice (the build, then the no-op); TORCH_EXTENSIONS_DIR under the prefix, whose
            size it records
  convert   the device recipe (``device_recipe``: the generated EXL2_MODEL at 4.0 bpw on this
            GPU, TabbyAPI on loopback); the quantize step's own operations for --bpw 3.3 and
            4.0: the generated weights and their FP16 range (here too), then on the GPU the
            conversions (the second reusing the first's measurement), run again (all ok), and
            the real files against the planner's sizes
  tabbyapi  the tabbyapi step from the payload's archive and wheels (offline, its proof), twice:
            needs the GPU, since TabbyAPI's start imports exllamav2, torch and the extension
  serve     the deploy step's operations for the recipe, planned here (the rendered unit and
            config.yml saved as exl2-config.yml); on the GPU, run (TabbyAPI as a managed
            process, /health, the record), run again (all ok), a streamed chat completion
            through the official openai client, and the GPU memory held against the plan's VRAM
  bench     `invoke bench`'s gate run against the served conversion (levels 1 and 4, each
            figure with its interval; its reports under bench/), then the server stopped

Everything from ``ext`` on runs in that venv (``phase NAME``). Each asks for the GPU where it
first needs one and, without one, stops with "needs a GPU" and what it would have run: the
rehearsal runs every phase that far. A device whose torch and toolkit cannot build ExLlamaV2
(another CUDA major) stops ``ext`` with the step's own reason, saved: the "blocked" outcome.
The generated weights, the bench history and the staged TabbyAPI go under the prefix's cache/
(VOLTAFORGE_CACHE), not $HOME: a warm device keeps them too.

Where things live: DIR holds the results only (a device call's $OUT starts empty); the prefix
(``--prefix``, default ``.device-exl2-prefix/``: ignored by git and never carried, since a carried
path replaces what is there) holds the venv, the extension's build, the models, TabbyAPI and the
deployment, as a host's prefix does. A warm device keeps ignored paths between calls, so a
second call finds the venv, the extension and the conversions and changes nothing there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# run's first two phases use the device's own python3 and the standard library only; the
# others run in the venv that `install` made (python scripts/device_exl2.py phase NAME)

PAYLOAD = ROOT / ".device-exl2"
#: the prefix on the device: ignored by git, not carried (a carried path is replaced), so a warm
#: device keeps it between calls
PREFIX = ROOT / ".device-exl2-prefix"
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
PHASES = ("facts", "install", "ext", "convert", "tabbyapi", "serve", "bench")
IN_VENV = PHASES[2:]
#: the device recipe's TabbyAPI port (loopback)
SERVE_PORT = 18470
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
    """The phase reached its first GPU call and there is no GPU; ``done``: what it did before."""

    def __init__(self, why: str, done: dict[str, Any] | None = None):
        super().__init__(why)
        self.done = done or {}


@dataclass(frozen=True)
class Call:
    """One run's places: ``out`` its results (the device call's $OUT, empty each call),
    ``payload`` what it carried, ``prefix`` the voltaforge prefix (venv, extension build,
    models, TabbyAPI, the deployment), kept where a warm device keeps ignored paths between
    calls, so a second call finds the build and the conversions and changes nothing."""

    out: Path
    payload: Path
    prefix: Path
    rehearse: bool

    def argv(self) -> list[str]:
        flags = ["--out", str(self.out), "--payload", str(self.payload), "--prefix", str(self.prefix)]
        return flags + (["--rehearse"] if self.rehearse else [])


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
    made = premade_tokenizer(payload / "tokenizers")
    manifest = {
        "python": python,
        "wheels": sorted(w.name for w in wheels.glob("*.whl")),
        "tabbyapi": tabbyapi.name,
        "tokenizer_json": made.name,
        "left_to_the_device": DEVICE_PROVIDES,
        "payload_bytes": payload_bytes(payload),
        "tree_bytes": tree_bytes(),
    }
    (payload / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def premade_tokenizer(where: Path) -> Path:
    """The generated EXL2_MODEL's tokenizer.json, made here: the device has no transformers
    (11.4 MiB the payload has no room for), so the generator there takes this file, named by the
    sha256 of the tokenizer.model it was made from (tinymodel.cached_tokenizer_json). The
    tokenizer's training is deterministic, so the device trains the same bytes."""
    import tempfile

    from playbooks.modelgen.tinymodel import cached_tokenizer_json, train_tokenizer, write_tokenizer_json

    where.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        train_tokenizer(Path(tmp), int(EXL2_MODEL["vocab_size"]))  # the generator's seed: 0
        out = where / cached_tokenizer_json(Path(tmp) / "tokenizer.model").name
        shutil.copyfile(write_tokenizer_json(Path(tmp)), out)
    return out


# ------------------------------------------------------------------------------------------
# run (on the device; here with --rehearse)
# ------------------------------------------------------------------------------------------


def gpu_or_stop(what: str, done: dict[str, Any] | None = None) -> str:
    """The GPU's name, or NeedsGPU saying what the phase would run on it (with what it did)."""
    code, out = sh("nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader", timeout=30)
    if code != 0 or not out:
        raise NeedsGPU(f"needs a GPU: {what} (nvidia-smi: {out.splitlines()[-1] if out else 'not found'})", done)
    return out.splitlines()[0]


def phase_facts(c: Call) -> dict[str, Any]:
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
    manifest = c.payload / "manifest.json"
    facts["payload"] = json.loads(manifest.read_text()) if manifest.is_file() else None
    return facts


def phase_install(c: Call) -> dict[str, Any]:
    manifest = json.loads((c.payload / "manifest.json").read_text())
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if manifest["python"] != here:
        raise SystemExit(
            f"blocked: the wheelhouse is for Python {manifest['python']}, this Python is {here}: "
            f"run `python3 scripts/device_exl2.py prepare --python {here}` for the next call"
        )
    venv = venv_of(c)
    # the device's torch (and numpy) seen from the venv; here, a clean venv with no site packages
    # (it proves the wheelhouse complete). A venv an earlier call made is kept: the extension
    # and its stamp live in it
    kept = (venv / "bin/python").exists()
    if not kept:
        make_venv(venv, see_interpreter=not c.rehearse)
    # the generated model's tokenizer.json, made on the controller (transformers is not carried):
    # where the generator looks for it (tinymodel.cached_tokenizer_json, VOLTAFORGE_CACHE=<prefix>/cache)
    made = c.prefix / "cache" / "tokenizers"
    made.mkdir(parents=True, exist_ok=True)
    for f in (c.payload / "tokenizers").glob("*.json"):
        shutil.copyfile(f, made / f.name)
    links = [str(c.payload / "wheels" / f"cp{here.replace('.', '')}")]
    if c.rehearse:  # what the device is expected to hold itself (DEVICE_PROVIDES), fetched for the rehearsal
        extra = c.out / "device-provides"
        code, text = sh([sys.executable, "-m", "pip", "download", "-q", "-d", str(extra), *DEVICE_PROVIDES])
        links.append(str(extra))
    tabby = c.out / "tabbyAPI"
    shutil.rmtree(tabby, ignore_errors=True)
    tabby.mkdir()
    with tarfile.open(c.payload / manifest["tabbyapi"]) as tar:
        tar.extractall(tabby, filter="data")
    argv = [str(venv / "bin/pip"), "install", "--disable-pip-version-check", "--no-index"]
    for link in links:
        argv += ["--find-links", link]
    t0 = time.monotonic()
    code, text = sh([*argv, str(tabby), *EXLLAMAV2_DEPS, *OURS], timeout=600)
    if code == 0:  # exllamav2 itself without its torch requirement: torch is the device's
        code, more = sh([*argv, "--no-deps", EXLLAMAV2], timeout=300)
        text += "\n" + more
    (c.out / "exl2-install.log").write_text(text + "\n")
    if code != 0:
        missing = [ln for ln in text.splitlines() if "No matching distribution" in ln]
        raise SystemExit(f"blocked: the offline install failed: {(missing or text.splitlines()[-1:])[0][-300:]}")
    _, freeze = sh([str(venv / "bin/pip"), "freeze"])
    return {
        "install_s": round(time.monotonic() - t0, 1),
        "installed": len(freeze.splitlines()),
        "offline": True,
        "venv": "kept from an earlier call" if kept else "made",
    }


def make_venv(venv: Path, see_interpreter: bool, python: str = sys.executable) -> None:
    """A venv of ``python`` that sees its packages (the device's torch and numpy).

    ``--system-site-packages`` gives a venv the *base* interpreter's site-packages. Where
    ``python`` is itself a venv's (a lent H200's is /opt/torch/.venv, its torch in there), that
    base is /usr's and torch is not seen (``ModuleNotFoundError``). So the interpreter's own
    site-packages directories are named in a .pth file of the new venv as well: searched after
    the venv's own, so what the phase installs comes first."""
    flags = ["--system-site-packages"] if see_interpreter else []
    code, text = sh([python, "-m", "venv", *flags, str(venv)])
    if code != 0:
        raise SystemExit(f"venv: {text[-300:]}")
    if not see_interpreter:
        return
    probe = (
        "import json, sys, sysconfig; p = sysconfig.get_paths(); "
        "print(json.dumps({'venv': sys.prefix != sys.base_prefix, 'dirs': [p['purelib'], p['platlib']]}))"
    )
    code, text = sh([python, "-c", probe])
    own = json.loads(text.splitlines()[-1]) if code == 0 else {"venv": False}
    if own["venv"]:
        code, site = sh([str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
        if code != 0:
            raise SystemExit(f"venv: {site[-300:]}")
        dirs = "\n".join(dict.fromkeys(own["dirs"]))
        (Path(site.splitlines()[-1]) / "_voltaforge_interpreter.pth").write_text(dirs + "\n")


def venv_check(python: str = sys.executable) -> dict[str, Any]:
    """Proves make_venv on this machine: a venv made from ``python`` (CI's .venv/bin/python, a
    venv's interpreter, as the lent H200's was) imports a package that only ``python``'s own
    site-packages holds."""
    import tempfile

    probe = "import sys; print(sys.base_prefix if sys.prefix != sys.base_prefix else '')"
    base = sh([python, "-c", probe])[1].splitlines()[-1].strip()
    if not base:
        raise SystemExit(f"venv-check: {python} is not a venv's interpreter: nothing to prove")
    # a package of the interpreter's venv that its base interpreter cannot import
    base_py = f"{base}/bin/python3"
    package = next(
        (p for p in ("yaml", "pydantic", "gguf", "jinja2") if sh([base_py, "-c", f"import {p}"])[0] != 0), None
    )
    if package is None:
        raise SystemExit(f"venv-check: {base_py} imports every candidate package: nothing to prove")
    with tempfile.TemporaryDirectory() as tmp:
        make_venv(Path(tmp) / "v", see_interpreter=True, python=python)
        code, out = sh([f"{tmp}/v/bin/python", "-c", f"import {package}; print({package}.__file__)"])
    if code != 0:
        raise SystemExit(f"venv-check: a venv made from {python} cannot import {package}: {out.splitlines()[-1]}")
    return {"interpreter": python, "package": package, "from": out.splitlines()[-1]}


def _facts(c: Call) -> dict[str, Any]:
    return json.loads((c.out / "exl2-facts.json").read_text())


def venv_of(c: Call) -> Path:
    """The prefix's venv (steps/build/toolchain.venv_path; `install` makes it with the standard
    library alone, so the path is spelled here and checked against venv_path in the venv)."""
    return c.prefix / "venv"


def _device_toolchain(c: Call, arch: str) -> Any:
    """The pinned toolchain with the device's own torch, its CUDA and its GPU's arch: the build
    step's operation then checks what it checks on a V100 host (torch's CUDA major against the
    toolkit's) against what this device really has."""
    from playbooks.config.recipe import Toolchain

    f = _facts(c)
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


def device_recipe(c: Call) -> Any:
    """The recipe the device serves: the generated EXL2_MODEL at 4.0 bpw on this GPU (the
    catalogue's entry for nvidia-smi's name; without a GPU, the lent kind, an H200), TabbyAPI
    on loopback without a key, a gate that measures and does not judge (random weights)."""
    import yaml

    from playbooks.config.recipe import load_recipe
    from playbooks.facts.gpu import NVIDIA_SMI_CSV_COMMAND, parse_nvidia_smi_csv
    from playbooks.plan.gpus import gpu_from_nvidia_name

    # the GPU fact preflight reads, matched to the catalogue as preflight matches it
    facts = parse_nvidia_smi_csv(sh(NVIDIA_SMI_CSV_COMMAND, timeout=30)[1])
    gpu = "h200"
    if facts.available and facts.gpus:
        g = facts.gpus[0]
        found = gpu_from_nvidia_name(g.name or "", g.memory_total_mib)
        if found is None:
            raise SystemExit(f"blocked: {g.name} is not in the planner's catalogue (playbooks/plan/gpus.py)")
        gpu = found.key
    recipe = {
        "description": "the device check's generated Llama, EXL2 4.0 bpw through TabbyAPI",
        "model": {"generate": "tiny-llama", "config": {**EXL2_MODEL, "architectures": ["LlamaForCausalLM"]}},
        "gpu": gpu,
        "backend": "exllamav2",
        "quant": {"bpw": BPWS[-1][0], "head_bits": BPWS[-1][1]},
        "context": 4096,
        "service": {"port": SERVE_PORT},
        "gate": {"levels": [1, 4], "prompt_tokens": 128, "max_tokens": 64},
    }
    path = c.out / "recipes" / "exl2-device.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return load_recipe(path)


def _is_conversion(op: Any) -> bool:
    from playbooks.steps.weights import exl2_convert

    return type(op).__module__ == exl2_convert.__name__


def phase_ext(c: Call) -> dict[str, Any]:
    from playbooks.steps.build.buildenv import SYSTEM_PATH
    from playbooks.steps.build.exllamav2 import EnsureExllamav2, jit_env

    # the PATH the step gives the JIT build (here without a toolkit's directory in front): torch's
    # cpp_extension runs the ninja it finds there, which must be the venv's (pip's wheel)
    venv = venv_of(c)
    path = jit_env({"PATH": ":".join(SYSTEM_PATH)}, str(venv), str(c.prefix / "exllamav2"), 1)["PATH"]
    ninja = shutil.which("ninja", path=path)
    if ninja is None or Path(ninja).parent != venv / "bin":
        raise SystemExit(
            f"the extension's build would run ninja {ninja or '(none)'}, not {venv}/bin/ninja (PATH {path})"
        )
    gpu = gpu_or_stop("the build step's EnsureExllamav2 (JIT build of exllamav2_ext for this arch)", {"ninja": ninja})
    tc = _device_toolchain(c, _arch(gpu))
    # the extension's build directory (TORCH_EXTENSIONS_DIR, <prefix>/exllamav2/ext/<id>) and the
    # venv it is installed into are the prefix's: a warm device keeps them for the next call
    step = EnsureExllamav2(str(c.prefix), str(venv_of(c)), tc)
    t0 = time.monotonic()
    first = _ops([step])
    t1 = time.monotonic()
    again = _ops([step])
    ext = c.prefix / "exllamav2"
    build_bytes = sum(f.stat().st_size for f in ext.rglob("*") if f.is_file()) if ext.is_dir() else 0
    return {
        "gpu": gpu,
        "first": first,
        "first_s": round(t1 - t0, 1),
        "again": again,
        "arch": tc.cuda_arch,
        # what it leaves on the device (measured there)
        "build_dir_bytes": build_bytes,
    }


def phase_convert(c: Call) -> dict[str, Any]:
    """The quantize step's own operations for the device recipe (`invoke quantize --bpw 3.3`,
    then the recipe's 4.0): the generated weights, their FP16 range, then on the GPU the
    conversions, the second reusing the first's measurement; the real files against the
    planner's sizes."""
    from playbooks.conduct.quantize import made_artifacts, quantize_step
    from playbooks.plan.exl2_size import estimate_exl2
    from playbooks.steps.build.toolchain import venv_path

    loaded = device_recipe(c)
    prefix = str(c.prefix)
    assert venv_path(prefix) == str(venv_of(c)), "the venv `install` made is not the prefix's"
    planned = {f"{b:g}": estimate_exl2(loaded.shape, b, hb).file_bytes for b, hb in BPWS}
    result: dict[str, Any] = {"recipe": loaded.recipe.name, "gpu": loaded.recipe.gpu, "planned_file_bytes": planned}
    ops = [op for b, _ in BPWS for op in quantize_step(loaded, prefix, bpw=f"{b:g}")]
    # what needs no GPU runs everywhere (the rehearsal too): the weights and their FP16 range
    result["before_gpu"] = _ops([op for op in ops if not _is_conversion(op)])
    # exllamav2 0.3.2 reads tokenizer.json only: the model the conversions read must have one
    from playbooks.conduct.quantize import recipe_weights
    from playbooks.steps.weights.model_layout import ModelLayout

    hf = Path(ModelLayout(prefix, recipe_weights(loaded).model_id).hf)
    if not (hf / "tokenizer.json").is_file():
        raise SystemExit(
            f"{hf} has no tokenizer.json: exllamav2's converter would stop with 'No supported tokenizer found'"
        )
    result["tokenizer"] = sorted(f.name for f in hf.glob("tokenizer*"))
    (c.out / "exl2-convert.json").write_text(json.dumps({"status": "running", **result}, indent=2) + "\n")
    gpu = gpu_or_stop(
        f"the quantize step's EnsureExl2Quant at {', '.join(planned)} bpw (planned bytes {planned})", result
    )
    t0 = time.monotonic()
    result["changes"] = _ops(ops)
    result["convert_s"] = round(time.monotonic() - t0, 1)
    result["again"] = _ops(ops)  # a second run: every operation ok, nothing converted again
    real = {}
    for b, _ in BPWS:  # where the quantize conductor says each conversion is (what --on copies)
        (made,) = made_artifacts(loaded, None, f"{b:g}", prefix)
        real[f"{b:g}"] = sum(f.stat().st_size for f in Path(made.path).glob("*.safetensors"))
    result.update(gpu=gpu, real_file_bytes=real)
    result["real_over_planned"] = {k: round(real[k] / planned[k], 4) if planned[k] else None for k in real}
    return result


def phase_tabbyapi(c: Call) -> dict[str, Any]:
    """TabbyAPI through its step, pushed from the payload's archive and installed offline from
    its wheels, its proof run, twice (the second changes nothing)."""
    from playbooks.config.recipe import Toolchain
    from playbooks.steps.build import wheelhouse
    from playbooks.steps.build.tabbyapi import EnsureTabbyAPI

    # TabbyAPI's start imports exllamav2 where it is installed (common/multimodal.py ->
    # backends/exllamav2/vision.py), so its proof needs torch and the extension `ext` built
    gpu_or_stop("the tabbyapi step (its proof starts TabbyAPI, which imports exllamav2 and the extension ext built)")
    manifest = json.loads((c.payload / "manifest.json").read_text())
    cache = c.prefix / "cache" / "sources"
    cache.mkdir(parents=True, exist_ok=True)
    shutil.copy(c.payload / manifest["tabbyapi"], cache / manifest["tabbyapi"])
    # the payload's wheels where the step looks for a wheelhouse: it installs offline, as on a host
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    tar = wheelhouse.packed(Toolchain().tabbyapi_ref, tag, cache)
    tar.parent.mkdir(parents=True, exist_ok=True)
    wheelhouse.pack(c.payload / "wheels" / tag, tar)
    step = EnsureTabbyAPI(str(c.prefix), str(venv_of(c)), Toolchain(), cache=cache)
    return {"install": _ops([step]), "again": _ops([step])}


def _deploy(c: Call) -> tuple[Any, list[Any]]:
    from playbooks.conduct.deploy import deploy_ops
    from playbooks.host.local import LocalHost

    loaded = device_recipe(c)
    # a managed process: a device (a container) runs no systemd, and `auto` would say so too
    return loaded, deploy_ops(loaded, LocalHost(), str(c.prefix), "process")


def phase_serve(c: Call) -> dict[str, Any]:
    """The deploy step serving the 4.0 bpw conversion (TabbyAPI as a managed process, /health
    waited for, the record written), run twice; a streamed chat completion through the official
    openai client; the GPU memory TabbyAPI holds against the plan's VRAM."""
    from playbooks.config.planning import plan_recipe
    from playbooks.steps.serve.lifecycle import EnsureServing
    from playbooks.steps.serve.service_file import EnsureServiceFile

    loaded, ops = _deploy(c)
    files = {Path(op.file.path).name: op.file.text for op in ops if isinstance(op, EnsureServiceFile)}
    result: dict[str, Any] = {"planned_ops": [op.name for op in ops], "rendered": sorted(files)}
    # the managed process's environment as it will start: no systemd specifier (%C) left in it
    (serving,) = [op for op in ops if isinstance(op, EnsureServing)]
    env = dict(getattr(serving.manager, "environment", ()))
    result["process_environment"] = env
    unresolved = {k: v for k, v in env.items() if "%" in v}
    if unresolved:
        raise SystemExit(f"the managed process would start with systemd specifiers unresolved: {unresolved}")
    (c.out / "exl2-config.yml").write_text(files.get("config.yml", ""))
    plan = plan_recipe(loaded)
    option = next((o for o in plan.options if o.quant == loaded.recipe.quant_name), None)
    result["planned_vram_bytes"] = option.vram_bytes if option else None
    gpu_or_stop(
        f"the deploy step starting TabbyAPI on the {loaded.recipe.quant_name} conversion ({len(ops)} ops)", result
    )
    t0 = time.monotonic()
    result["deploy"] = _ops(ops)
    result["deploy_s"] = round(time.monotonic() - t0, 1)
    result["again"] = _ops(_deploy(c)[1])
    result["chat"] = streamed_chat(loaded.recipe.service.port, loaded.recipe.served_name)
    code, apps = sh("nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits", timeout=30)
    used = sum(int(x.rsplit(",", 1)[1]) for x in apps.splitlines() if "," in x) * 2**20 if code == 0 else None
    result["gpu_used_bytes"] = used
    if used and result["planned_vram_bytes"]:
        result["used_over_planned"] = round(used / result["planned_vram_bytes"], 4)
    return result


def streamed_chat(port: int, model: str, max_tokens: int = 32) -> dict[str, Any]:
    """One streamed chat completion through the official openai client, as a user asks: EOS
    ignored (random weights may end at once; TabbyAPI takes ignore_eos as ban_eos_token), the
    server's own token count from the usage chunk."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    t0 = time.monotonic()
    first, chunks, text, usage = None, 0, [], None
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "kalo mine ruta"}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        usage = chunk.usage or usage
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            first = first if first is not None else time.monotonic() - t0
            chunks += 1
            text.append(delta)
    if not chunks:
        raise SystemExit("the streamed chat completion returned no content chunks")
    return {
        "chunks": chunks,
        "completion_tokens": usage.completion_tokens if usage else None,
        "ttft_s": round(first or 0, 3),
        "wall_s": round(time.monotonic() - t0, 3),
        "text": "".join(text)[:200],
    }


def phase_bench(c: Call) -> dict[str, Any]:
    """`invoke bench`'s run against the served conversion (the gate's sweep, levels 1 and 4,
    each figure with its interval), then the server stopped."""
    from playbooks.host.local import LocalHost
    from playbooks.host.ops import run_command
    from playbooks.steps.measure.bench_run import gate_run, thresholds
    from playbooks.steps.serve.lifecycle import EnsureServing

    loaded, ops = _deploy(c)
    (serving,) = [op for op in ops if isinstance(op, EnsureServing)]  # the deployment serve started
    layout = serving.layout
    result: dict[str, Any] = {"thresholds": thresholds(loaded), "service": layout.service}
    gpu_or_stop(f"the bench of {layout.service} (the gate's sweep at levels {loaded.recipe.gate.levels})", result)
    host = LocalHost()
    try:
        run, files, _ = gate_run(loaded, host, str(c.prefix), layout, c.out / "bench")
    finally:  # the server stopped by its manager, as `invoke stop` does: the device left as found
        run_command(host, serving.manager.stop())
    result["files"] = {k: str(v) for k, v in files.items()}
    result["error"] = run.get("error")
    result["levels"] = [
        {k: lv.get(k) for k in ("concurrency", "requests", "errors", "per_stream_decode_tok_s", "decode",
                                "aggregate_tok_s", "aggregate", "prefill_tok_s", "ttft_worst")}
        for lv in run.get("levels", [])
    ]  # fmt: skip
    result["gate"] = run.get("gate")
    result["telemetry"] = run.get("telemetry")
    return result


def run_in_venv(name: str, c: Call) -> dict[str, Any]:
    """A phase in the venv `install` made: the device's torch and the payload's wheels."""
    argv = [str(venv_of(c) / "bin/python"), __file__, "phase", name, *c.argv()]
    env = {**os.environ, "VOLTAFORGE_CACHE": str(c.prefix / "cache")}
    code, text = sh(argv, timeout=600, env=env)
    (c.out / f"exl2-{name}.log").write_text(text + "\n")
    last = text.splitlines()[-1] if text else ""
    try:
        return dict(json.loads(last))
    except ValueError:
        return {"status": "failed", "why": f"exit {code}: {last[-400:]}"}


def one_phase(name: str, c: Call) -> dict[str, Any]:
    try:
        result = globals()[f"phase_{name}"](c)
        if result.get("error"):  # a phase that ran to its end and says it failed (the gate's run)
            return {**result, "status": "failed", "why": str(result["error"])[:500]}
        return {"status": "done", **result}
    except NeedsGPU as e:
        return {**e.done, "status": "needs a GPU", "why": str(e)}
    except SystemExit as e:
        return {"status": "stopped", "why": str(e)}
    except Exception as e:  # a phase's bug is its result too: the next phase still runs
        return {"status": "failed", "why": f"{type(e).__name__}: {e}"[:500]}


def run(c: Call) -> int:
    c.out.mkdir(parents=True, exist_ok=True)
    status: dict[str, str] = {}
    for name in PHASES:
        t0 = time.monotonic()
        if name in IN_VENV and status.get("install") != "done":
            result: dict[str, Any] = {"status": "stopped", "why": "no venv: the install phase did not finish"}
        elif name in IN_VENV:
            result = run_in_venv(name, c)
        else:
            result = one_phase(name, c)
        result["seconds"] = round(time.monotonic() - t0, 1)
        (c.out / f"exl2-{name}.json").write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
        status[name] = result["status"]
        print(f"== exl2 {name}: {result['status']}" + (f" - {result['why']}" if "why" in result else ""), flush=True)
        with tarfile.open(c.out / "results.tgz", "w:gz") as tar:
            for f in sorted(c.out.glob("exl2-*")):
                tar.add(f, arcname=f.name)
    return 0 if all(s in ("done", "needs a GPU") for s in status.values()) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare")
    pp.add_argument("--python", default="3.12")
    pp.add_argument("--tabbyapi", type=Path, default=None, help="the staged archive (default: the controller's)")
    pp.add_argument("--payload", type=Path, default=PAYLOAD)
    sub.add_parser("venv-check", help="a venv made from this (venv's) interpreter sees its packages")
    pr = sub.add_parser("run")
    ph = sub.add_parser("phase", help="one phase, in the venv `install` made (run calls it)")
    ph.add_argument("name", choices=IN_VENV)
    for q in (pr, ph):
        q.add_argument("--out", type=Path, required=True)
        q.add_argument("--payload", type=Path, default=PAYLOAD)
        q.add_argument("--prefix", type=Path, default=PREFIX)
        q.add_argument("--rehearse", action="store_true")
    a = p.parse_args()
    if a.cmd == "phase":
        call = Call(a.out, a.payload, a.prefix, a.rehearse)
        print(json.dumps(one_phase(a.name, call), default=str))
        return 0
    if a.cmd == "venv-check":
        print(json.dumps(venv_check()))
        return 0
    if a.cmd == "prepare":
        import importlib.util

        # the planner's tensor names, and the generated model's tokenizer.json
        lacking = [m for m in ("gguf", "transformers") if importlib.util.find_spec(m) is None]
        if lacking:
            raise SystemExit(
                f"prepare needs voltaforge's venv ({', '.join(lacking)} not installed for {sys.executable}): "
                "run it as .venv/bin/python scripts/device_exl2.py prepare (bash scripts/install.sh makes it)"
            )
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
    return run(Call(a.out.resolve(), a.payload.resolve(), a.prefix.resolve(), a.rehearse))


if __name__ == "__main__":
    sys.exit(main())
