"""Three generated members of a model set (issue 55), for the tests that serve one for real:
tiny-cpu's model at three widths, each its own recipe (its served name its width's word, one
thread: two children beside each other and the client on two cores) and its own Q4_K_M GGUF."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests import llamacpp_tools
from tests.helpers import ROOT

#: three widths of tiny-cpu's model: a set whose members differ in size
WIDTHS = {"small": 256, "mid": 512, "large": 768}


def three_members(tmp_path: Path) -> tuple[Path, dict[str, Path]]:
    """The three recipes (under tmp_path/recipes) and each one's quantized GGUF."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "defaults.yaml").write_text((ROOT / "recipes/defaults.yaml").read_text())
    base = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())
    ggufs = {}
    for name, hidden in WIDTHS.items():
        data = yaml.safe_load(yaml.safe_dump(base))
        data["model"]["config"] |= {"hidden_size": hidden, "intermediate_size": hidden * 3}
        data["service"]["model_name"] = name
        data["threads"] = 1
        (recipes / f"{name}.yaml").write_text(yaml.safe_dump(data))
        work = tmp_path / name
        work.mkdir()
        f16 = llamacpp_tools.tiny_f16(work, data["model"]["config"])
        ggufs[name] = llamacpp_tools.quantize(f16, work / f"{name}-Q4_K_M.gguf", "Q4_K_M")
    return recipes, ggufs
