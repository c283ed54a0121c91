"""Real CUDA toolkits for the tests, the same on every image.

- Debian's CUDA 11.8 (`nvidia-cuda-toolkit`, /usr/bin/nvcc), installed by
  ci/install-system-deps.sh: the toolkit that CAN build sm_70.
- A CUDA 13.0 nvcc from PyPI wheels, installed by ci/install-cuda13-nvcc.sh into the test
  cache (or by `cuda13_bin()` on first use): a toolkit that CANNOT build sm_70. Tests that
  need it put its bin/ first on PATH themselves, in an explicit env of the subprocess, so
  they never depend on whatever nvcc an image has preinstalled.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from playbooks.steps.build.buildenv import SYSTEM_PATH
from tests.helpers import ROOT
from tests.llamacpp_tools import cache_dir

DEBIAN_NVCC = "/usr/bin/nvcc"
DEBIAN_CUOBJDUMP = "/usr/bin/cuobjdump"
CUDA13_SCRIPT = ROOT / "ci" / "install-cuda13-nvcc.sh"
# the script is the one place the version is written down
CUDA13_VERSION = re.search(r"^version=(\S+)$", CUDA13_SCRIPT.read_text(), re.M).group(1)

needs_debian_cuda118 = pytest.mark.skipif(
    not os.path.exists(DEBIAN_NVCC),
    reason="needs Debian's CUDA 11.8 (/usr/bin/nvcc): ci/install-system-deps.sh installs it",
)


def system_path() -> str:
    """The distribution's own directories (/usr/sbin:/usr/bin:/sbin:/bin): Debian's 11.8 only."""
    return ":".join(SYSTEM_PATH)


def cuda13_root() -> Path:
    return cache_dir() / f"cuda13-nvcc-{CUDA13_VERSION}"


def cuda13_bin() -> Path:
    """bin/ of the CUDA 13.0 nvcc from PyPI; installs it (about 3 s) if ci/ has not yet.

    Raises (the test errors, it never skips) when it cannot be installed."""
    root = cuda13_root()
    nvcc = root / "nvidia" / "cu13" / "bin" / "nvcc"
    if not ((root / ".installed").exists() and nvcc.exists()):
        r = subprocess.run(
            ["bash", str(CUDA13_SCRIPT), sys.executable],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "VOLTAFORGE_CACHE": str(cache_dir())},
        )
        if r.returncode != 0 or not nvcc.exists():
            raise RuntimeError(f"{CUDA13_SCRIPT} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return nvcc.parent


def cuda13_first_path() -> str:
    """A PATH with the CUDA 13 nvcc/ptxas first and Debian's CUDA 11.8 (/usr/bin) after it."""
    return f"{cuda13_bin()}:{system_path()}"
