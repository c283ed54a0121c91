"""Real llama.cpp tools for the tests, built once and cached.

- the llama.cpp tree vendored by the llama-cpp-python sdist on PyPI (the offline source:
  GitHub is not reachable here), pinned to the recipe default's version;
- `llama-quantize`, `llama-server` and `llama-bench`, a CPU build of that tree by the build
  step itself (shared libraries found beside the binaries);
- a converter venv: convert_hf_to_gguf.py needs torch, transformers and sentencepiece. torch
  is the CPU build, fetched once into the cache by cpu_torch_wheel() (a CUDA build would pull
  GBs of nvidia-* wheels).

Everything lives under VOLTAFORGE_CACHE (default ~/.cache/voltaforge), keyed by version, so
a second run reuses it; a half-done build is redone, never trusted.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"  # vendors llama.cpp 0c1e570 (recipes/defaults.yaml)
TORCH_CPU = "2.13.0+cpu"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CONVERT_REQUIREMENTS = ["transformers>=4.45,<5", "sentencepiece>=0.2,<0.3", "protobuf>=4.21,<5", "numpy", "safetensors"]


def cache_dir() -> Path:
    return Path(os.environ.get("VOLTAFORGE_CACHE") or Path.home() / ".cache" / "voltaforge")


@contextlib.contextmanager
def _cache_lock(name: str):
    """One builder at a time per cached thing: tests, helpers and a CI run in another checkout
    share the cache, and two cmake runs in one build directory truncate each other's objects
    (seen: "file truncated"). The waiter then finds the thing built and returns it."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _run(cmd: list[str], log: Path, **kw) -> None:
    with open(log, "w") as out:
        r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, **kw)
    if r.returncode != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({r.returncode}); log {log}:\n{tail}")


def llamacpp_tree() -> Path:
    """vendor/llama.cpp of the pinned sdist, fetched by `invoke build`'s own controller-side
    fetch (one download for the build step and the tools) and unpacked once."""
    from playbooks.steps.build.llamacpp_source import fetch_sdist

    root = cache_dir() / "llama-cpp-python-0.3.36"
    tree = root / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    done = root / ".unpacked"
    if done.exists():
        return tree
    with _cache_lock("llama-cpp-python-0.3.36"):
        if not done.exists():
            root.mkdir(parents=True, exist_ok=True)
            sdist = fetch_sdist(SDIST, "0c1e570").archive
            with tarfile.open(sdist) as tar:
                tar.extractall(root / "src", filter="data")
            done.touch()
    return tree


TARGETS = ("llama-quantize", "llama-server", "llama-bench")


def tools_layout():
    """Where the tools' build lives: a build prefix of its own in the cache, laid out the way
    `invoke build` lays out a host's (src/, llama.cpp/builds/, llama.cpp/current)."""
    from playbooks.steps.build.build import BuildLayout

    return BuildLayout(str(cache_dir() / "llama-cpp-0c1e570-tools"))


def build_tools() -> Path:
    """llama-quantize, llama-server and llama-bench of the pinned tree, built on this machine by
    the build step itself (`build_ops` on a LocalHost: the product's CMake flags, shared
    libraries, no OpenMP), so the run's one full compile is this one: its objects go into the
    run's ccache (helpers.session_ccache), where every SSH build of the run finds them (the
    build step's CCACHE_BASEDIR makes the paths match; a static build, as before, shared
    nothing with them and was a second compile of the tree, 386.2 s in cold run 64b).

    The binaries find their libraries beside them ($ORIGIN, a link-time flag only, so the
    objects are the product's): :func:`put_tools` copies them to a test host with the
    libraries. Minutes on 2 cores, once per cache; returns the bin directory."""
    layout = tools_layout()
    bin_dir = Path(layout.current) / "bin"
    if all((bin_dir / t).exists() for t in TARGETS):
        return bin_dir
    from tests.helpers import cpu_quiet  # here: scripts import this module without pytest

    # minutes of both cores: not beside a measurement or another compile (helpers.cpu_quiet,
    # taken before the cache lock: a worker holding it may come here for the tools)
    with cpu_quiet(), _cache_lock("llama-cpp-0c1e570-tools"):
        if not all((bin_dir / t).exists() for t in TARGETS):
            _build_tools(layout)
    return bin_dir


def _build_tools(layout) -> None:
    from playbooks.host.local import LocalHost
    from playbooks.host.ops import run_ops
    from playbooks.host.output import Printer
    from playbooks.steps.build.build import build_ops
    from playbooks.steps.build.llamacpp_source import fetch_sdist
    from tests.helpers import session_ccache, share_ccache_dir

    prefix = Path(layout.prefix)
    (prefix / "llama.cpp").mkdir(parents=True, exist_ok=True)
    ccache = prefix / "llama.cpp" / "ccache"  # where the build step points CCACHE_DIR
    share_ccache_dir()
    if ccache.is_symlink() or ccache.exists():
        ccache.unlink() if ccache.is_symlink() else shutil.rmtree(ccache)
    ccache.symlink_to(session_ccache())
    log = cache_dir() / "llama-cpp-0c1e570-tools.log"
    with open(log, "w") as out:
        ops = build_ops(
            layout,
            fetch_sdist(SDIST, "0c1e570"),
            cuda_release=None,
            recipe_arch="70",  # a CUDA build's arch: not read for a CPU build
            targets=TARGETS,
            extra_flags=("-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",),
        )
        changes = run_ops(LocalHost("tools", Printer(out)), ops)
    failed = [c for c in changes if c.status == "failed"]
    if failed or len(changes) < len(ops):
        raise RuntimeError(f"the tools' build failed: {failed[0].detail if failed else changes}; log {log}")


def put_tools(host, tools: tuple[str, ...], remote_dir: str, sudo: bool = False) -> None:
    """``tools`` from :func:`build_tools` into ``remote_dir`` on a test host, with the shared
    libraries they load from beside themselves ($ORIGIN)."""
    local = build_tools()
    libs = sorted(p.name for p in local.iterdir() if ".so" in p.name)
    for name in (*tools, *libs):
        # a library's symlinks arrive as copies: the loader asks for the soname (libllama.so.0)
        host.put(str(local / name), f"{remote_dir}/{name}", mode=0o755, sudo=sudo)


def llama_quantize() -> Path:
    return build_tools() / "llama-quantize"


def llama_server() -> Path:
    return build_tools() / "llama-server"


RESERVE_LINE = re.compile(r"compute buffer size|graph: nodes|error loading model|failed")
_LOG_PREFIX = re.compile(r"^\d+\.\d+\.\d+\.\d+ [A-Z] ")  # -lv 4's time and level


def reserve_compute_buffer(model: Path, args: list[str], timeout: float = 300) -> list[str]:
    """The pinned llama-server, CPU only, on ``model`` with a load's ``args`` (-c -ub -fa -np
    -ctk -ctv), run the way tests/fixtures' compute-buffer loads were made (``--fit off -t 1
    --host 127.0.0.1 --port P -lv 4``) and stopped once llama_context's reserve is logged
    (its graph's node count) or something failed. Returns the log's compute-buffer, graph and
    failure lines, without their time and level prefix."""
    cmd = [str(llama_server()), "-m", str(model), *args, "--fit", "off", "-t", "1", "--host", "127.0.0.1"]
    from tests.testhosts import free_port  # here: scripts import this module without pytest

    # a port the kernel says is free now (a random one could be another worker's server)
    cmd += ["--port", str(free_port()), "-lv", "4"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    timer = threading.Timer(timeout, lambda: os.killpg(p.pid, signal.SIGKILL))
    timer.start()
    kept = []
    try:
        assert p.stdout is not None
        for line in p.stdout:
            if RESERVE_LINE.search(line):
                kept.append(_LOG_PREFIX.sub("", line.rstrip("\n")))
            if "graph: nodes" in line or "failed" in line:
                break
    finally:
        timer.cancel()
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        p.wait(timeout=30)
    return kept


CBUF_DIR = Path(__file__).parent / "tools" / "cbuf"


def build_cbuf(out: Path) -> Path:
    """tests/tools/cbuf (build.sh) against the pinned tree and static CPU build: a loader that
    prints what llama_context reserves, with an in-process RPC device for a full-offload
    split, and the graph allocator's own byte totals (CBUF_TRACE). Seconds; returns it."""
    env = {**os.environ, "SRC": str(llamacpp_tree()), "B": str(build_tools().parent), "OUT": str(out)}
    out.mkdir(parents=True, exist_ok=True)
    _run(["sh", str(CBUF_DIR / "build.sh")], out / "build.log", env=env)
    return out / "cbuf"


def cbuf_reserve(cbuf: Path, model: Path, args: list[str], timeout: float = 300) -> list[str]:
    """``cbuf -m MODEL ARGS`` with CBUF_TRACE, the way the cbuf fixtures were made: its
    compute-buffer, graph and failure lines, then ``CBUF_TRACE last reserve: S|...`` for each
    buffer of the last reserve in the trace (the allocator's total in bytes, its alignment)."""
    trace = model.parent / "trace.txt"
    trace.unlink(missing_ok=True)
    run = subprocess.run(
        [str(cbuf), "-m", model.name, *args],
        cwd=model.parent,
        env={**os.environ, "CBUF_TRACE": trace.name},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    kept = [line for line in run.stderr.splitlines() if RESERVE_LINE.search(line)]
    if run.returncode != 0:
        kept.append(f"exit {run.returncode}: {run.stderr.strip().splitlines()[-1] if run.stderr.strip() else ''}")
    events = trace.read_text().splitlines() if trace.exists() else []
    last = max((i for i, e in enumerate(events) if e.startswith("G|")), default=len(events))
    return kept + [f"CBUF_TRACE last reserve: {e}" for e in events[last:] if e.startswith("S|")]


def cpu_torch_wheel() -> Path:
    """The CPU build of torch (torch-2.13.0+cpu-*.whl, ~190 MB), fetched once into
    cache/wheels for this interpreter's Python.

    The `+cpu` label pins the CPU build: PyPI's torch 2.13.0 is a 500 MB CUDA build whose
    dependencies are GBs of nvidia-* wheels. Sources, in order: pip's own configuration (this
    kind of machine serves the wheel from a local find-links directory, and a machine whose pip
    is set up for PyTorch's index gets it from there), then PyTorch's CPU index itself (not
    reachable here). Raises, naming every attempt, when none has it: the tests that need it
    fail loudly, they never skip.
    """
    wheels = cache_dir() / "wheels"
    pattern = f"torch-{TORCH_CPU}-*.whl"
    found = sorted(wheels.glob(pattern))
    if found:
        return found[-1]
    wheels.mkdir(parents=True, exist_ok=True)
    failures = []
    for extra in ([], ["--index-url", PYTORCH_CPU_INDEX]):
        tmp = Path(tempfile.mkdtemp(prefix=".torch-download-", dir=wheels))
        try:
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--disable-pip-version-check",
                    "-q",
                    "--no-deps",
                    "--only-binary",
                    ":all:",
                    "--timeout",
                    "30",
                    "--retries",
                    "1",
                    "-d",
                    str(tmp),
                    *extra,
                    f"torch=={TORCH_CPU}",
                ],
                capture_output=True,
                text=True,
                timeout=1800,
            )
            got = sorted(tmp.glob(pattern))
            if r.returncode == 0 and got:
                os.replace(got[-1], wheels / got[-1].name)  # whole file or nothing
                return wheels / got[-1].name
            failures.append(
                f"pip download {' '.join(extra) or '(pip configuration)'}: exit {r.returncode}: "
                f"{r.stderr.strip()[-800:]}"
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    raise RuntimeError(f"no torch=={TORCH_CPU} wheel for {sys.executable}:\n" + "\n".join(failures))


def convert_python() -> Path:
    """The python of a venv that can run convert_hf_to_gguf.py."""
    venv = cache_dir() / "convert-venv"
    python = venv / "bin" / "python"
    done = venv / ".installed"
    if done.exists():
        return python
    with _cache_lock("convert-venv"):
        if done.exists():
            return python
        _run([sys.executable, "-m", "venv", "--clear", str(venv)], cache_dir() / "convert-venv.log")
        torch = [f"torch=={TORCH_CPU}", "--find-links", str(cpu_torch_wheel().parent)]
        log = cache_dir() / "convert-venv.log"
        _run([str(python), "-m", "pip", "install", "-q", *torch, *CONVERT_REQUIREMENTS], log)
        done.touch()
    return python


def convert_to_gguf(hf_dir: Path, out: Path, outtype: str = "f16") -> Path:
    tree = llamacpp_tree()
    _run(
        [
            str(convert_python()),
            str(tree / "convert_hf_to_gguf.py"),
            str(hf_dir),
            "--outtype",
            outtype,
            "--outfile",
            str(out),
        ],
        out.with_suffix(".convert.log"),
    )
    return out


def tiny_f16(work: Path, config: dict, name: str = "f16.gguf") -> Path:
    """``convert_to_gguf(write_tiny_llama(work / "hf", config), work / name)``, made once per shape.

    The generator is deterministic (the same config and GENERATOR_VERSION give the same bytes)
    and so is the converter, so the F16 GGUF of a shape is converted once and kept in the cache
    under the hash of both; each caller gets its own copy in ``work`` (a test may change its
    file). tests/test_gguf_real.py still converts on every run (and checks the checkpoint)."""
    import hashlib
    import json

    from playbooks.modelgen.tinymodel import GENERATOR_VERSION, write_tiny_llama

    key = hashlib.sha256(json.dumps([GENERATOR_VERSION, SDIST, config], sort_keys=True).encode()).hexdigest()[:16]
    cached = cache_dir() / "tiny-gguf" / f"{key}-f16.gguf"
    if not cached.exists():
        with _cache_lock(f"tiny-gguf-{key}"):
            if not cached.exists():
                made = tempfile.mkdtemp(prefix="vf-tiny-")
                try:
                    f16 = convert_to_gguf(write_tiny_llama(Path(made) / "hf", config), Path(made) / "f16.gguf")
                    cached.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(f16, cached.with_suffix(".part"))
                    cached.with_suffix(".part").rename(cached)  # whole or absent
                finally:
                    shutil.rmtree(made, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cached, work / name)
    return work / name


def quantize(src: Path, out: Path, ftype: str) -> Path:
    _run([str(llama_quantize()), str(src), str(out), ftype], out.with_suffix(".quantize.log"))
    return out


def gguf_tensors(path: Path) -> dict[str, tuple[str, int]]:
    """A GGUF file's tensors as written: name -> (type, bytes)."""
    from gguf import GGUFReader

    return {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in GGUFReader(str(path)).tensors}
