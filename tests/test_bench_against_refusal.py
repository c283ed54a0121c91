"""`invoke bench --against` refuses, before anything changes, a recipe the plan says does not fit
beside the live service (conduct/bench_against.py), on a real host: one line with the figures,
the remedy, exit 2, and nothing of a scratch server made there.

What it proves: the fit is judged from the plan once the host is reached and before the lock,
the artifact or a scratch unit; the figures are the plan's. The measuring itself is
tests/test_bench_real.py's."""

from __future__ import annotations

import pytest
import yaml

from playbooks.cli.bench import run_bench_against
from playbooks.conduct.settings import Settings
from playbooks.errors import VoltaforgeError
from tests.helpers import ROOT, inventory_for

pytestmark = pytest.mark.slow


def test_a_recipe_too_large_to_serve_beside_the_live_one_is_refused_before_anything_changes(sshd_host, tmp_path):
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "defaults.yaml").write_text((ROOT / "recipes/defaults.yaml").read_text())
    tiny = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())
    (recipes / "live.yaml").write_text(yaml.safe_dump(tiny))
    big = yaml.safe_load(yaml.safe_dump(tiny))
    # a 7B shape: about 4 GiB at Q4_K_M, beside the live one past the CPU target's 4 GiB budget
    big["model"]["config"] |= {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32}
    big["model"]["config"] |= {"num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000}
    (recipes / "big.yaml").write_text(yaml.safe_dump(big))
    prefix = sshd_host.prefix / "vf"
    settings = Settings(inventory=inventory_for(tmp_path, "box", sshd_host, prefix=str(prefix)), recipes_dir=recipes)
    with pytest.raises(VoltaforgeError) as err:
        run_bench_against("box", "big", "live", settings=settings)
    line = str(err.value)
    assert "\n" not in line and err.value.exit_code == 2
    assert line.startswith("box: big or a fresh live (")
    assert " GiB planned) does not fit beside the live service (" in line
    assert "in the host CPU (llama.cpp CPU build)'s 4 GiB the plan budgets: compare on a host with room" in line, line
    assert not prefix.exists()  # no lock, no scratch unit, no artifact: nothing made there
