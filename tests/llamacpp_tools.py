"""Real llama.cpp tools for the tests, built once and cached.

- the llama.cpp tree vendored by the llama-cpp-python sdist on PyPI (the offline source:
  GitHub is not reachable here), pinned to the recipe default's version;
- `llama-quantize` and `llama-server`, a static CPU build of that tree;
- a converter venv: convert_hf_to_gguf.py needs torch, transformers and sentencepiece. torch
  is the CPU build from /opt/wheels when the machine has it (a CUDA wheel would be GBs).

Everything lives under VOLTAFORGE_CACHE (default ~/.cache/voltaforge), keyed by version, so
a second run reuses it; a half-done build is redone, never trusted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"  # vendors llama.cpp 0c1e570 (recipes/defaults.yaml)
WHEELS = Path("/opt/wheels")
CONVERT_REQUIREMENTS = ["transformers>=4.45,<5", "sentencepiece>=0.2,<0.3", "protobuf>=4.21,<5", "numpy", "safetensors"]


def cache_dir() -> Path:
    return Path(os.environ.get("VOLTAFORGE_CACHE") or Path.home() / ".cache" / "voltaforge")


def _run(cmd: list[str], log: Path, **kw) -> None:
    with open(log, "w") as out:
        r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, **kw)
    if r.returncode != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({r.returncode}); log {log}:\n{tail}")


def llamacpp_tree() -> Path:
    """vendor/llama.cpp of the pinned sdist, downloaded from PyPI and unpacked once."""
    root = cache_dir() / "llama-cpp-python-0.3.36"
    tree = root / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    done = root / ".unpacked"
    if done.exists():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          "-d", str(root), SDIST], root / "download.log")
    sdist = next(root.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(root / "src", filter="data")
    done.touch()
    return tree


TARGETS = ("llama-quantize", "llama-server")


def build_tools() -> Path:
    """A static CPU build of llama-quantize and llama-server from the pinned tree.

    Static (no shared libllama/libggml) and without OpenMP, so the binaries can be copied to a
    test host as they are. About 8 minutes on 2 cores, once; returns the bin directory.
    """
    tree = llamacpp_tree()
    build = cache_dir() / "llama-cpp-0c1e570-cpu-static"
    done = build / ".built"
    if done.exists() and all((build / "bin" / t).exists() for t in TARGETS):
        return build / "bin"
    build.mkdir(parents=True, exist_ok=True)
    _run(["cmake", "-S", str(tree), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_CUDA=OFF",
          "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF",
          "-DGGML_OPENMP=OFF", "-DGGML_NATIVE=OFF"],
         build / "configure.log")
    _run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *TARGETS],
         build / "build.log")
    done.touch()
    return build / "bin"


def llama_quantize() -> Path:
    return build_tools() / "llama-quantize"


def llama_server() -> Path:
    return build_tools() / "llama-server"


def convert_python() -> Path:
    """The python of a venv that can run convert_hf_to_gguf.py."""
    venv = cache_dir() / "convert-venv"
    python = venv / "bin" / "python"
    done = venv / ".installed"
    if done.exists():
        return python
    _run([sys.executable, "-m", "venv", "--clear", str(venv)], cache_dir() / "convert-venv.log")
    torch = ["torch==2.13.0+cpu", "--find-links", str(WHEELS)] if WHEELS.is_dir() else [
        "torch", "--index-url", "https://download.pytorch.org/whl/cpu", "--extra-index-url", "https://pypi.org/simple"]
    _run([str(python), "-m", "pip", "install", "-q", *torch, *CONVERT_REQUIREMENTS], cache_dir() / "convert-venv.log")
    done.touch()
    return python


def convert_to_gguf(hf_dir: Path, out: Path, outtype: str = "f16") -> Path:
    tree = llamacpp_tree()
    _run([str(convert_python()), str(tree / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", outtype,
          "--outfile", str(out)], out.with_suffix(".convert.log"))
    return out


def quantize(src: Path, out: Path, ftype: str) -> Path:
    _run([str(llama_quantize()), str(src), str(out), ftype], out.with_suffix(".quantize.log"))
    return out
