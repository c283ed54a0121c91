"""A command loads what it needs when it needs it (issue 36, item 5): the CLI and the whole
provision path import no numpy, no gguf package and no httpx, which a no-op never uses (0.2 s
of its 1.4 s here); the GGML types come from gguf's own constants module, shared with the
package when something (the shaped-GGUF writer) imports it later."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("numpy", "gguf", "httpx")

PROBE = """
import sys
import playbooks.cli.tasks, playbooks.cli.provision, playbooks.conduct.provision
from playbooks.config.recipe import load_recipe
from playbooks.conduct.quantize import quantize_step
from playbooks.config.planning import plan_recipe
loaded = load_recipe("tiny-cpu")
plan_recipe(loaded)
quantize_step(loaded, "/opt/voltaforge")
print(" ".join(m for m in {heavy!r} if m in sys.modules))
"""


def test_the_provision_path_imports_no_numpy_gguf_or_httpx():
    # a no-op's path: tiny-cpu's generated weights already in the controller's cache. The first
    # run makes them where no test has yet (with numpy: generating needs it), the second is
    # the one measured (a cold run's order put this test before any generation)
    probe = [sys.executable, "-c", PROBE.format(heavy=HEAVY)]
    subprocess.run(probe, capture_output=True, text=True, check=True)
    out = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    assert out.split() == [], f"imported on the provision path: {out.strip()} (import it where it is used)"


def test_the_ggml_types_are_the_gguf_packages_own():
    """Loaded first through plan/ggml_types.py, then the package: one module, one enum."""
    probe = (
        "from playbooks.plan.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType as T\n"
        "import gguf\n"
        "assert gguf.GGMLQuantizationType is T and gguf.GGML_QUANT_SIZES is GGML_QUANT_SIZES\n"
        "assert T.Q4_K in GGML_QUANT_SIZES and GGML_QUANT_SIZES[T.Q4_K] == (256, 144)\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True)
    # the other order: the package first, the types then taken from it
    subprocess.run([sys.executable, "-c", "import gguf\n" + probe.replace("import gguf\n", "")], check=True)
