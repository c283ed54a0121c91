"""The REAL NVML binding (PyPI nvidia-ml-py, module `pynvml`, a test extra) for the GPU and
telemetry probes' tests, in the two states a host without a working GPU driver is found in:

- the NVML library installed but no driver loaded (this machine: Debian's libnvidia-ml1, pulled
  in by nvidia-cuda-toolkit, and no nvidia kernel module): nvmlInit raises
  NVMLError_DriverNotLoaded;
- no NVML library: `without_nvml_library` runs a command in a private mount namespace where
  every file the dynamic loader would open for libnvidia-ml.so.1 reads as /dev/null, so the
  package's own CDLL("libnvidia-ml.so.1") fails and nvmlInit raises NVMLError_LibraryNotFound.

Nothing here stands in for the package: the probes import the installed pynvml. The stand-in
modules in tests/test_telemetry.py and tests/test_facts_gpu.py remain only where GPU VALUES are
needed (there is no GPU here)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

NVML_SONAME = "libnvidia-ml.so.1"
# what the real package raises, checked by the tests before they look at a probe's line
WHICH_ERROR = (
    "import pynvml\n"
    "try:\n"
    "    pynvml.nvmlInit()\n"
    "except pynvml.NVMLError as exc:\n"
    "    print(type(exc).__name__, exc.value)\n"
    "else:\n"
    "    print('initialised')\n"
)


def real_pynvml_version() -> str:
    """The installed nvidia-ml-py's version, after checking that `import pynvml` in this python
    is that package's own file (not a stand-in found first on sys.path)."""
    try:
        version = importlib.metadata.version("nvidia-ml-py")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("nvidia-ml-py is not installed in this python (pip install -e '.[test]')")
    run = subprocess.run(
        [sys.executable, "-c", "import pynvml; print(pynvml.__file__)"],
        env=clean_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    files = importlib.metadata.files("nvidia-ml-py") or []
    owned = {Path(str(f.locate())).resolve() for f in files}
    assert Path(run.stdout.strip()).resolve() in owned, (run.stdout, "is not nvidia-ml-py's pynvml")
    return version


def clean_env() -> dict[str, str]:
    """This environment without PYTHONPATH (no stand-in module) and LD_LIBRARY_PATH (the loader
    searches only the system's directories, the ones without_nvml_library hides)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("LD_LIBRARY_PATH", None)
    return env


def nvml_library_files() -> list[Path]:
    """Every file the dynamic loader finds for libnvidia-ml.so.1 (ldconfig's cache), resolved."""
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    listing = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, check=True).stdout
    found = re.findall(rf"^\s*{re.escape(NVML_SONAME)} \(.*\) => (\S+)$", listing, re.M)
    return sorted({Path(p).resolve() for p in found})


def without_nvml_library(argv: list[str]) -> list[str]:
    """argv, run in a private mount namespace where each of nvml_library_files() is /dev/null
    bind-mounted over it (so dlopen fails: the file is empty). Needs root and unshare (CI runs
    as root); skips otherwise, which strict mode turns into a failure."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding libnvidia-ml.so.1 needs root and unshare (a private mount namespace)")
    hide = "".join(f'mount --bind /dev/null "{p}" && ' for p in nvml_library_files())
    return ["unshare", "-m", "sh", "-c", f'{hide}exec "$@"', "sh", *argv]


def require_nvml_library_without_driver() -> None:
    """This machine's own state for the driver-not-loaded tests: the NVML library loads, and no
    nvidia kernel module is loaded (/proc/driver/nvidia absent)."""
    if not nvml_library_files():
        pytest.skip(f"{NVML_SONAME} is not installed here (Debian: libnvidia-ml1, via nvidia-cuda-toolkit)")
    if Path("/proc/driver/nvidia").exists():
        pytest.skip("an nvidia kernel module is loaded here: NVML would not fail with DRIVER_NOT_LOADED")
