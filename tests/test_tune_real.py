"""`invoke tune` for real, on this machine's CPU: the tiny model in two real quants (made by the
real converter and llama-quantize) on a private sshd host, a live service of the recipe
answering beside the search. The space (two quants x two -ub x one and two slots x
speculation on and off) is planned
and ordered, every candidate is served by the deploy step under the scratch unit on the
scratch port and benched with the bench's repeats, successive halving measures the better half
again; the live service answers at every check; the report, the chart and a winning recipe are
written; a re-run measures nothing new; a budget of half the search's time stops inside its
bound (the budget plus one measurement) and lists what it left out; the winner, deployed as it
is, passes its gate.
Speculation (ngram-mod) is one lever: its rows carry the server's own drafted/accepted counts.
`--take-over` on a plan too small for two servers: the live service is stopped for the search
and is back (the same model, answering) after it, after a candidate that crashes and after
Ctrl-C; a budget below the first measurement's floor is refused before anything is stopped."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from playbooks.cli.bench import run_bench
from playbooks.cli.deploy import run_deploy, run_stop
from playbooks.cli.tune import options, run_tune
from playbooks.conduct.settings import Settings
from playbooks.config.recipe import load_recipe
from playbooks.errors import VoltaforgeError
from playbooks.host import connect
from playbooks.steps.measure.bench_run import bench_health
from tests import llamacpp_tools
from tests.helpers import ROOT, as_in_a_terminal, inventory_for, spec_for, stage_served_model
from tests.testhosts import free_port

pytestmark = pytest.mark.slow
TINY = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())


@pytest.fixture(scope="module")
def tiny_quants(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("tune")
    f16 = llamacpp_tools.tiny_f16(work, TINY["model"]["config"])
    return {q: llamacpp_tools.quantize(f16, work / f"tiny-{q}.gguf", q) for q in ("Q4_K_M", "Q8_0")}


def _recipe(where: Path, port: int, **over) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    data = json.loads(json.dumps(TINY))
    data["service"] = {"port": port}
    data["parallel"] = 1
    # the tiny vocabulary makes some passages of the shipped text long in tokens: room for them
    data["context"] = 1024
    data["gate"] = {"levels": [1], "prompt_tokens": 16, "max_tokens": 16, "min_tok_s": 1}
    data |= over
    (where / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    path = where / "tiny-tune.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _stage(sshd_host, prefix: str, recipe: Path, quants: dict[str, Path], kld: dict[str, float] | None = None) -> None:
    """The quants as quantize leaves them; ``kld``: a mean KL divergence written into a quant's
    manifest the way quantize's verification records it (an input here: the plumbing from the
    manifest to the report is what is tested; tests/test_quantize_real.py measures real ones)."""
    with connect(spec_for(sshd_host)) as host:
        for q, f in quants.items():
            verified = {"verification": {"kld": {"mean_kld": kld[q]}}} if kld and q in kld else None
            stage_served_model(host, prefix, recipe, f, q, verified)


@pytest.mark.timeout(1500)
@pytest.mark.usefixtures("cpu_quiet")  # tests/helpers.cpu_quiet: its search measures
def test_tune_searches_beside_the_live_service_and_writes_a_winner(
    sshd_host, tiny_quants, tmp_path, monkeypatch, capsys
):
    port = free_port()
    prefix = str(sshd_host.prefix / "vf-tune")
    settings = Settings(inventory=inventory_for(tmp_path, "box", sshd_host, prefix=prefix))
    recipe = _recipe(tmp_path / "r", port)
    _stage(sshd_host, prefix, recipe, tiny_quants, kld={"Q4_K_M": 0.0421, "Q8_0": 0.0013})
    monkeypatch.setenv("VOLTAFORGE_CACHE", str(tmp_path / "cache"))
    assert run_deploy("box", str(recipe), settings=settings) == 0  # the live service
    capsys.readouterr()
    out_dir = tmp_path / "my-recipes"
    opts = options(
        "single", "Q4_K_M,Q8_0", "f16", None, 2, "64,512", "none,ngram-mod", None, None, "20m", 2, False, None
    )
    opts = type(opts)(**{**opts.__dict__, "recipes_dir": out_dir})
    try:
        assert run_tune("box", str(recipe), opts, as_json=True, settings=settings) == 0
        res = json.loads(capsys.readouterr().out)
        # 2 quants x f16 (the recipe's cache is f16 too) x 1..2 slots x 2 -ub x speculation off
        # and ngram-mod: 16 planned, all fit
        assert res["space"] == {"total": 16, "measured": 16, "pruned": {}}
        rows = res["candidates"]
        assert len(rows) == 16 and all(r["error"] is None for r in rows), rows
        # speculation: the server's own drafted/accepted counts, and the same configuration without it
        for r in rows:
            assert (r["speculation"] is not None) == (r["spec_type"] is not None), r
        # (whether ngram-mod drafts depends on the text: on 16 tokens of this random model it drafted
        # nothing; tests/test_speculation_real.py proves the types on a model built to repeat)
        assert {r["quant"]: r["kld"] for r in rows} == {"Q4_K_M": 0.0421, "Q8_0": 0.0013}  # from the manifests
        for r in rows:
            assert r["measured"] > 0 and r["n"] >= 4 and r["halfwidth"] is not None and r["predicted"] > 0
        # successive halving: the better half measured again, longer
        assert sorted(r["rung"] for r in rows) == [0] * 8 + [1] * 8
        # the live service answered at every check, before and after each candidate
        live = res["live"]
        assert live["services"] == ["voltaforge-llama-server"] and not live["taken_over"]
        # (and around each of the contenders' interleaved blocks, when two were tied: A B B A)
        blocks = len((res.get("interleaved") or {}).get("order") or [])
        assert blocks in (0, 4), res.get("interleaved")
        # before rung 1, rung 0's leader measured again at rung 0's workload: the drift between rungs
        (ref,) = res["references"]
        assert ref["rung"] == 0 and ref["first"] > 0 and ref["again"] > 0
        assert ref["moved_pct"] == pytest.approx((ref["again"] / ref["first"] - 1) * 100, abs=0.01)
        assert ref["candidate"] in {r["label"] for r in rows if r["rung"] == 1}, ref
        assert len(live["checks"]) == 2 * (16 + 1 + 8 + blocks) and all(code == 200 for _, code in live["checks"])
        w = res["winner"]
        assert w and w["recipe"] == str(out_dir / "tiny-tune-tuned.yaml") and any(r["winner"] for r in rows)
        winner = load_recipe(w["recipe"])  # self-contained: no defaults.yaml beside it
        assert winner.recipe.name == "tiny-tune-tuned" and winner.recipe.service.port == port
        won = next(r for r in rows if r["winner"])
        assert (winner.recipe.quant_name, winner.recipe.parallel, winner.recipe.planner.n_ubatch) == (
            won["quant"],
            won["slots"],
            won["ubatch"],
        )
        assert winner.recipe.spec_type == won["spec_type"]
        assert Path(w["recipe"]).read_text().startswith("# tiny-tune-tuned: found by `invoke tune` (--host box")
        reports = next((tmp_path / "cache" / "tune" / "box" / "tiny-tune").glob("*/tune.json")).parent
        import matplotlib.image

        assert matplotlib.image.imread(reports / "tune.png").shape[:2] == (500, 1200)
        assert "| candidate | predicted |" in (reports / "tune.md").read_text()
        # nothing of the scratch server is left on the host
        with connect(spec_for(sshd_host)) as host:
            assert not host.exists(f"{prefix}/deploy/voltaforge-tune") and not host.exists(
                f"{prefix}/serve/voltaforge-tune"
            )

        # a re-run measures nothing new: every measurement is kept by its inputs
        assert run_tune("box", str(recipe), opts, as_json=True, settings=settings) == 0
        again = json.loads(capsys.readouterr().out)
        assert all(r["reused"] for r in again["candidates"]) and again["winner"]["label"] == w["label"]
        assert again["references"] == []  # the leader was kept: nothing fresh to repeat

        # a budget that allows about half the search (half the first one's time, nothing kept:
        # another controller cache): it stops inside its bound, the budget plus one
        # measurement, and lists what it left out
        made = len(rows) + len(res["references"]) + blocks
        monkeypatch.setenv("VOLTAFORGE_CACHE", str(tmp_path / "cache-half"))
        half = type(opts)(**{**opts.__dict__, "budget_s": res["budget"]["used_s"] / 2, "recipes_dir": tmp_path / "h"})
        assert run_tune("box", str(recipe), half, as_json=True, settings=settings) == 0
        part = json.loads(capsys.readouterr().out)
        b = part["budget"]
        assert part["budget_ran_out"] and b["used_s"] <= b["planned_s"] + b["longest_s"], b
        fresh = len(part["candidates"]) + len(part["references"])
        # some of the search, not all of it: measurements are not equally long (a later rung repeats
        # more requests, the interleaved blocks come last), so half the time covers more than half
        # of them (16 of 21 in one cold CI run)
        assert 0.25 * made <= fresh < made and not any(r["reused"] for r in part["candidates"]), (fresh, made)
        assert b["skipped"] and b["cut"], b  # what the budget left out, listed

        # the winner, deployed as it is (in place of the live service), passes its gate
        assert run_stop("box", str(recipe), settings=settings) == 0
        assert run_deploy("box", w["recipe"], settings=settings) == 0
        assert run_bench("box", w["recipe"], settings=settings) == 0, capsys.readouterr().out[-2000:]
    finally:
        for r in (recipe, out_dir / "tiny-tune-tuned.yaml"):
            try:
                run_stop("box", str(r), settings=settings)
            except VoltaforgeError:
                pass


@pytest.mark.timeout(900)
def test_take_over_stops_the_live_service_and_brings_it_back(sshd_host, tiny_quants, tmp_path, monkeypatch, capsys):
    """The plan budgets the CPU target's memory: a margin that takes more than half of it per
    server leaves no room for a second one. Without --take-over: one line, the live service
    untouched. With it: stopped for the search, the same model answering after it; a candidate
    that cannot start (a port nothing unprivileged may bind) is a failed row, and the live
    service is back all the same."""
    port = free_port()
    prefix = str(sshd_host.prefix / "vf-take")
    settings = Settings(inventory=inventory_for(tmp_path, "box", sshd_host, prefix=prefix))
    # the planner's CPU target budgets 4 GiB (plan/gpus.py): a margin of 2.2 GiB per server
    # leaves room for one, not two (nothing of it is allocated: it is the plan's)
    planner = TINY["planner"] | {"margin_mib": 2200}
    recipe = _recipe(tmp_path / "r", port, planner=planner)
    _stage(sshd_host, prefix, recipe, {"Q4_K_M": tiny_quants["Q4_K_M"]})
    monkeypatch.setenv("VOLTAFORGE_CACHE", str(tmp_path / "cache"))
    assert run_deploy("box", str(recipe), settings=settings) == 0
    capsys.readouterr()
    opts = options("single", None, "f16", None, None, "512", None, None, None, "10m", 1, False, None)
    opts = type(opts)(**{**opts.__dict__, "recipes_dir": tmp_path / "out"})
    try:
        with pytest.raises(VoltaforgeError, match="does not fit beside the live service .*pass --take-over"):
            run_tune("box", str(recipe), opts, as_json=True, settings=settings)
        with connect(spec_for(sshd_host)) as host:
            assert bench_health(host, port) == 200  # untouched
        took = type(opts)(**{**opts.__dict__, "take_over": True, "port": 81})  # port 81: the candidate cannot bind
        assert run_tune("box", str(recipe), took, as_json=True, settings=settings) == 1
        res = json.loads(capsys.readouterr().out)
        assert res["live"]["taken_over"] and res["winner"] is None
        assert res["candidates"][0]["error"].startswith("the server did not come up")
        with connect(spec_for(sshd_host)) as host:
            assert bench_health(host, port) == 200  # back after the failed candidate
        # a budget below the first measurement's floor (its weights read, its requests decoded
        # at the roofline): refused up front with the figure it needs, nothing stopped
        took = type(opts)(**{**opts.__dict__, "take_over": True, "budget_s": 0.001})
        with pytest.raises(
            VoltaforgeError, match=r"cannot hold even the first measurement: .* give --budget 1s or more"
        ):
            run_tune("box", str(recipe), took, as_json=True, settings=settings)
        assert "taking over" not in capsys.readouterr().out
        with connect(spec_for(sshd_host)) as host:
            assert bench_health(host, port) == 200  # never stopped

        # Ctrl-C amid a candidate (the command as a user runs it): exit 130 with one line saying
        # what was left; the scratch server is gone and the live service answers again
        scratch = port + 100
        cmd = [sys.executable, "-m", "invoke", "-r", str(ROOT), "tune", "--host", "box", "--recipe", str(recipe)]
        cmd += ["--inventory", str(settings.inventory), "--cache", "f16", "--ubatch", "256", "--take-over"]
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=as_in_a_terminal,
        )  # fmt: skip
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if f"serving on port {scratch}" in line:
                break
        else:
            raise AssertionError("".join(seen)[-3000:])
        time.sleep(1.0)  # inside the deploy or the bench of the candidate
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 130, err[-3000:]
        assert err.strip().splitlines()[-1] == (
            "error: interrupted: the scratch server was stopped and removed; the live service: deployed "
            "again; every measurement finished so far is kept (a re-run resumes)"
        ), err[-3000:]
        with connect(spec_for(sshd_host)) as host:
            assert bench_health(host, port) == 200 and bench_health(host, scratch) == 0
            assert not host.exists(f"{prefix}/deploy/voltaforge-tune") and not host.exists(
                f"{prefix}/serve/voltaforge-tune"
            )
    finally:
        run_stop("box", str(recipe), settings=settings)
