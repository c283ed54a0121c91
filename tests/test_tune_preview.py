"""`invoke tune --dry-run` (issue 36, item 2): the space, the pruning counts, the measuring
order and a predicted time, connecting to nothing; --gpu plans the recipe for another card."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from playbooks.conduct.tune import TuneOptions, search_space
from playbooks.conduct.tune_preview import floor_cost, halving_schedule, preview, stored_rung_costs
from playbooks.config.recipe import load_recipe
from tests.helpers import ROOT


def _invoke(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "invoke", "-r", str(ROOT), "tune", *args], cwd=cwd, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_the_schedule_is_successive_halvings():
    assert halving_schedule(18, 3) == [18, 9, 5]
    assert halving_schedule(4, 3) == [4, 2]
    assert halving_schedule(2, 3) == [2] and halving_schedule(1, 3) == [1] and halving_schedule(0, 3) == []
    assert halving_schedule(40, 2) == [40, 20]


def test_the_prediction_adds_the_rungs_the_references_and_the_interleaving(tmp_path):
    loaded = load_recipe("qwen2.5-14b-v100-16gb")
    opts = TuneOptions()
    pv = preview(loaded, opts)
    space = search_space(loaded, opts)
    assert [p.candidate for p in pv.space.survivors] == [p.candidate for p in space.survivors]  # the run's order
    sched, cost = pv.schedule, pv.rung_s
    assert cost == [floor_cost(loaded, space.survivors, "single", r) for r in range(len(sched))]
    want = sum(n * c for n, c in zip(sched, cost, strict=True)) + sum(cost[:-1]) + 4 * cost[-1]
    assert pv.predicted_s == pytest.approx(want)
    # a rung measured before on that host is costed from it (the median), the others from the floor
    store = tmp_path / "measurements.jsonl"
    rows = [{"rung": 0, "took_s": t} for t in (40.0, 60.0, 50.0)] + [{"rung": 0}, "not json"]
    store.write_text("\n".join(json.dumps(r) if isinstance(r, dict) else r for r in rows) + "\n")
    assert stored_rung_costs(store) == {0: 50.0}
    kept = preview(loaded, opts, store)
    assert kept.rung_s[0] == 50.0 and kept.basis[0] == "measured before"
    assert kept.basis[1].startswith("the floor") and kept.predicted_s > pv.predicted_s


def test_dry_run_connects_to_nothing_and_plans_another_card(tmp_path, capsys):
    """The inventory's host is an address nothing answers: the dry run needs none of it."""
    from playbooks.cli.tune import options, run_tune_preview
    from playbooks.conduct.settings import Settings

    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts:\n  far:\n    host: 10.255.255.1\n    recipe: qwen2.5-14b-v100-16gb\n")
    settings = Settings(inventory=inv)
    opts = options("single", None, "f16,bf16", None, None, None, None, None, None, "45m", None, False, None)
    assert run_tune_preview("far", None, opts, as_json=True, settings=settings) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["recipe"] == "qwen2.5-14b-v100-16gb" and res["gpu"] == "Tesla V100-SXM2-16GB"
    assert res["space"]["pruned"].get("sm_70 has no BF16", 0) > 0 and res["order"]
    assert run_tune_preview("far", None, opts, gpu="a100-80gb", as_json=True, settings=settings) == 0
    a100 = json.loads(capsys.readouterr().out)
    assert a100["gpu"] == "NVIDIA A100-SXM4-80GB" and "sm_70 has no BF16" not in a100["space"]["pruned"]
    assert a100["order"][0]["predicted_tok_s"] > res["order"][0]["predicted_tok_s"]
    # the task, as typed: the text, and --gpu refused without --dry-run
    text = _invoke("--dry-run", "--recipe", "tiny-cpu")
    assert text.returncode == 0 and "nothing is run" in text.stdout and "predicted:" in text.stdout, text.stderr
    no = _invoke("--recipe", "tiny-cpu", "--gpu", "v100-16gb", "--host", "local")
    assert no.returncode == 2 and "--gpu goes with --dry-run" in no.stderr
