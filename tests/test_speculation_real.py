"""Speculative decoding with a known answer, through the real tools: generated models
(tests/draft_pair.py) converted by llama.cpp's convert_hf_to_gguf.py, quantized
to Q8_0 by the pinned llama-quantize and served by the pinned CPU llama-server, one
slot, one thread (``-t 1``, and one for the draft: two cores shared with other test runs make
a second thread wait on a descheduled one: 0.7 tok/s seen with ``-t 2``), greedy requests
(temperature 0, top_k 1) of 64 tokens with ignore_eos. The flags and type names at this ref
are recorded in draft_pair's docstring (``--spec-type draft-simple``, ``--spec-draft-model``,
``ngram-mod`` ...); the counts come from each response's ``timings.draft_n`` /
``draft_n_accepted``, summed by playbooks.facts.speculation.acceptance.

- The agreeing pair: a 1-layer draft (hidden 512, 5.4 MB in Q8_0) and its target, the same
  layer plus 15 layers whose o_proj and down_proj are zero (52 MB). The target computes the
  draft's function, so every proposal should be kept: measured 47 of 47 per request (n_max 3,
  the default) on every prompt, 100%. Asserted: >= 95% (a rejection could only come from the
  draft's one-token pass and the target's batched check rounding apart at a near-tie), and
  the text equals the target alone's (greedy speculation is lossless).
- The random draft (same shapes and tokenizer, another seed): measured 0 of 183 per request.
  Asserted: <= 5%, and the text again equals the target alone's.
- Speed: printed, not asserted against the target alone. Measured on this machine's two
  loaded cores, three requests each, over six runs: the target alone 81-298 tok/s (the
  server's own decode rate; 3.3-7.1 CPU-ms a token, depending on what the neighbours did to
  the cache), with the agreeing draft 133-274 tok/s (3.8-4.1 CPU-ms), with the random draft
  33-63 tok/s (14.3-15.2 CPU-ms). The medians' speed-up was 1.4-1.8x, but the target
  alone's fastest request (298 tok/s) beat the agreeing draft's typical one. A 52 MB target
  on one thread is about as compute-bound as memory-bound here, so checking four tokens at
  once saves little when the cache is quiet and a lot when it is not: no bound on that ratio
  holds on a shared CI machine. What holds is the cost of rejected drafts: the random draft costs the server
  about 3.7x the CPU time per token of the agreeing one, whatever the load (it slows both
  alike); asserted: at least 2x.
- The n-gram types need no draft model; their proposals are looked up in the text so far.
  Random weights give no contrast there (measured: a random model's greedy output falls
  into a loop of its own on any prompt, and the lookup catches that loop on prose as readily
  as on a repeated sentence), so the model here is the successor model: greedy next token =
  f(current token), one cycle through the sentence's five tokens and one long cycle through
  the rest. On the sentence repeated 40 times it continues the sentence and every lookup
  hits; on prose (recipes/calibration/general.txt) it writes a chain that never repeats in
  64 tokens and nothing is found to draft. Measured (fresh server each): ngram-mod 62 of 62
  on the repetition, 0 drafted on prose; ngram-map-k 61 of 61 and 0; ngram-simple with
  size-n 4 / size-m 8, 50 of 50 and 0. At ngram-simple's defaults (12 / 48) nothing is drafted
  even on the repetition: it uses the latest earlier match of the 12-token pattern and wants
  12 tokens after it (common/ngram-map.cpp:79-102), which a 5-token period never leaves.
  Asserted: on the repetition >= 90% accepted and >= 40 tokens; on prose at most 5 accepted
  and a rate of at most 50% if anything was drafted.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from playbooks.facts.speculation import acceptance
from tests import llamacpp_tools
from tests.draft_pair import write_draft_pair, write_successor_model
from tests.helpers import ROOT
from tests.testhosts import free_port

pytestmark = pytest.mark.slow

# the tiny-cpu recipe's Llama (vocab 2048, its tokenizer), wider and one layer deep: the draft
DRAFT = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())["model"]["config"] | {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
EXTRA_LAYERS = 15
# five distinct tokens of the generated tokenizer (one word each), no trailing space: the
# prompt's last token is the sentence's last, so the successor model goes on with its first
SENTENCE = "kalo mine ruta vosi debapo"
REPEATED = " ".join([SENTENCE] * 40)
PROSE = (ROOT / "recipes/calibration/general.txt").read_text()[:600]
SHORT_PROMPTS = ["kalo mine ruta vosi debapo", "guha vobane tasigulo", "zirumi vone fepofe"]
ONE_THREAD = ["-t", "1", "-tb", "1"]
DRAFT_ONE_THREAD = ["--spec-draft-threads", "1", "--spec-draft-threads-batch", "1"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Q8_0 GGUFs of the draft, its zero-layer target, the random draft and the successor (and
    the target's and the random draft's weight directories, "hf:...")."""
    work = tmp_path_factory.mktemp("speculation")
    pair = write_draft_pair(work / "hf", DRAFT, EXTRA_LAYERS)
    successor = write_successor_model(pair.draft, work / "hf" / "successor", SENTENCE)
    out = {"hf:target": pair.target, "hf:random": pair.random_draft}
    for name, hf in {
        "draft": pair.draft,
        "target": pair.target,
        "random": pair.random_draft,
        "successor": successor,
    }.items():
        f16 = llamacpp_tools.convert_to_gguf(hf, work / f"{name}-f16.gguf")
        out[name] = llamacpp_tools.quantize(f16, work / f"{name}-Q8_0.gguf", "Q8_0")
    return out


def _cpu_seconds(pid: int) -> float:
    """user + system time of the whole process (all threads), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Reply:
    text: str
    timings: dict
    cpu_s: float


class Server:
    """The pinned llama-server on 127.0.0.1 at a free port, log beside the test's files."""

    def __init__(self, model: Path, extra: list[str], log: Path):
        self.port = free_port()
        argv = [str(llamacpp_tools.llama_server()), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["-c", "1024", "-np", "1", "--no-webui", *ONE_THREAD, *extra]
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=300)
        deadline = time.monotonic() + 120
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.close()
        pytest.fail(f"llama-server not healthy (exit {self.proc.poll()}): {log.read_text()[-3000:]}")

    def complete(self, prompt: str) -> Reply:
        before = _cpu_seconds(self.proc.pid)
        body = {"prompt": prompt, "max_tokens": 64, "ignore_eos": True, "temperature": 0, "top_k": 1}
        r = self.client.post("/v1/completions", json=body | {"cache_prompt": False})
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["usage"]["completion_tokens"] == 64, data["usage"]
        return Reply(data["choices"][0]["text"], data["timings"], _cpu_seconds(self.proc.pid) - before)

    def tokenize(self, text: str) -> list[int]:
        r = self.client.post("/tokenize", json={"content": text})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _run(model: Path, extra: list[str], log: Path, prompts: list[str]) -> list[Reply]:
    server = Server(model, extra, log)
    try:
        server.complete("warm up")  # the first request pays for lazy set-up
        return [server.complete(p) for p in prompts]
    finally:
        server.close()


def _speed(label: str, replies: list[Reply]) -> str:
    tok_s = [r.timings["predicted_per_second"] for r in replies]
    spec = acceptance(r.timings for r in replies)
    return (
        f"{label:<24} decode {statistics.median(tok_s):6.1f} tok/s (median; {min(tok_s):.0f}-{max(tok_s):.0f}), "
        f"{sum(r.cpu_s for r in replies) / (64 * len(replies)) * 1e3:5.2f} CPU-ms/token, "
        f"drafted {spec['drafted']}, accepted {spec['accepted']}"
    )


def test_the_target_is_the_draft_plus_layers_that_add_zero(models):
    from gguf import GGUFReader

    draft = {t.name: t for t in GGUFReader(str(models["draft"])).tensors}
    target = {t.name: t for t in GGUFReader(str(models["target"])).tensors}
    assert len(target) == len(draft) + EXTRA_LAYERS * 9
    for name, t in draft.items():  # the draft's own tensors, the same bytes after conversion and Q8_0
        assert target[name].tensor_type == t.tensor_type and bytes(target[name].data) == bytes(t.data), name
    for i in range(1, 1 + EXTRA_LAYERS):
        for leaf in ("attn_output.weight", "ffn_down.weight"):
            assert not any(bytes(target[f"blk.{i}.{leaf}"].data)), f"blk.{i}.{leaf} is not all zero"
        assert any(bytes(target[f"blk.{i}.attn_q.weight"].data))  # the rest of the layer is real work


def test_a_draft_the_target_agrees_with_is_accepted_and_a_random_one_is_not(models, tmp_path, capsys):
    spec = ["--spec-type", "draft-simple", *DRAFT_ONE_THREAD]
    alone = _run(models["target"], [], tmp_path / "alone.log", SHORT_PROMPTS)
    agreeing = _run(
        models["target"], ["--spec-draft-model", str(models["draft"]), *spec], tmp_path / "agree.log", SHORT_PROMPTS
    )
    rand = _run(
        models["target"], ["--spec-draft-model", str(models["random"]), *spec], tmp_path / "random.log", SHORT_PROMPTS
    )
    with capsys.disabled():
        print()
        for label, replies in (("target alone", alone), ("+ agreeing draft", agreeing), ("+ random draft", rand)):
            print(_speed(label, replies))
        base = statistics.median(r.timings["predicted_per_second"] for r in alone)
        fast = statistics.median(r.timings["predicted_per_second"] for r in agreeing)
        print(f"speed-up with the agreeing draft: {fast / base:.2f}x decode (printed, not asserted)")

    # greedy speculation is lossless: the target decides every token, whatever was proposed
    assert [r.text for r in agreeing] == [r.text for r in alone]
    assert [r.text for r in rand] == [r.text for r in alone]
    assert all("draft_n" not in r.timings for r in alone)

    agree = acceptance(r.timings for r in agreeing)
    assert agree["drafted"] >= 40 * len(SHORT_PROMPTS), agree  # 47 a request measured (n_max 3)
    assert agree["rate"] is not None and agree["rate"] >= 0.95, agree

    refused = acceptance(r.timings for r in rand)
    assert refused["drafted"] >= 40 * len(SHORT_PROMPTS), refused  # 183 a request measured
    assert refused["rate"] is not None and refused["rate"] <= 0.05, refused

    # rejected drafts are paid for: the random draft's work per token, several times the
    # agreeing draft's (about 4x measured); CPU time, so neighbours' load slows both alike
    assert sum(r.cpu_s for r in rand) >= 2 * sum(r.cpu_s for r in agreeing)


NGRAM = {
    "ngram-mod": [],
    "ngram-map-k": [],
    # the defaults (12 / 48) never draft on a 5-token period (the module docstring says why)
    "ngram-simple": ["--spec-ngram-simple-size-n", "4", "--spec-ngram-simple-size-m", "8"],
}


@pytest.mark.parametrize("spec_type", list(NGRAM))
def test_ngram_drafts_are_accepted_on_a_repeated_sentence_not_on_prose(models, tmp_path, capsys, spec_type):
    extra = ["--spec-type", spec_type, *NGRAM[spec_type]]
    # a fresh server for each prompt: ngram-mod and ngram-map-k keep what they saw in earlier
    # requests (ngram-map-k's history assumes the next prompt continues the last: after the
    # prose, measured, it drafted nothing on the repetition)
    server = Server(models["successor"], extra, tmp_path / "ngram-prose.log")
    try:
        sentence = server.tokenize(SENTENCE)
        assert len(set(sentence)) == 5 and server.tokenize(REPEATED) == sentence * 40
        assert server.tokenize(PROSE)[-1] not in sentence  # the prose does not lead into the cycle
        prose = server.complete(PROSE)
    finally:
        server.close()
    server = Server(models["successor"], extra, tmp_path / "ngram-repeated.log")
    try:
        repeated = server.complete(REPEATED)
    finally:
        server.close()
    with capsys.disabled():
        print()
        print(_speed(f"{spec_type}, prose", [prose]))
        print(_speed(f"{spec_type}, repetition", [repeated]))

    # the known answer: the successor model goes on with the sentence
    assert repeated.text.split() == (SENTENCE.split() * 13)[:64]
    rep = acceptance([repeated.timings])
    assert rep["accepted"] >= 40 and rep["rate"] is not None and rep["rate"] >= 0.9, rep
    other = acceptance([prose.timings])
    assert other["accepted"] <= 5 and (other["rate"] is None or other["rate"] <= 0.5), other


@pytest.mark.timeout(900)
def test_tune_measures_a_random_draft_and_keeps_the_target_alone(models, sshd_host, tmp_path, monkeypatch, capsys):
    """`invoke tune --spec none,draft-simple` on a recipe whose draft is the random one: the
    draft candidate is planned with the draft's weights and cache, quantize's layout gives the
    draft its own model directory and deploy links it beside the model, the server drafts
    (the row carries its counts: near 0% accepted) and the winner speculates not at all."""
    from playbooks.cli.deploy import run_stop
    from playbooks.cli.tune import options, run_tune
    from playbooks.conduct.quantize import draft_artifact
    from playbooks.conduct.settings import Settings
    from playbooks.config.recipe import load_recipe
    from playbooks.host import connect
    from tests.helpers import inventory_for, put_gguf, spec_for, stage_served_model

    port = free_port()
    prefix = str(sshd_host.prefix / "vf-draft")
    settings = Settings(inventory=inventory_for(tmp_path, "box", sshd_host, prefix=prefix))
    (tmp_path / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    recipe = tmp_path / "tiny-draft.yaml"
    target, rand = models["hf:target"], models["hf:random"]
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(target), "config": str(target / "config.json")},
                "gpu": "cpu",
                "backend": "llamacpp",
                "quant": "Q8_0",
                "context": 1024,
                "threads": 1,  # and the draft's: the module docstring says why one
                "draft": {"model": {"path": str(rand), "config": str(rand / "config.json")}, "quant": "Q8_0"},
                "service": {"port": port},
                "gate": {"levels": [1], "prompt_tokens": 16, "max_tokens": 48, "min_tok_s": 1},
            }
        )
    )
    loaded = load_recipe(recipe)
    with connect(spec_for(sshd_host)) as host:
        stage_served_model(host, prefix, recipe, models["target"], "Q8_0")
        draft = draft_artifact(loaded, prefix)
        assert draft and "/models/random-draft-" in draft and draft.endswith("-Q8_0.gguf")  # its own directory
        put_gguf(host, models["random"], draft, "Q8_0")
        host.run(f"chmod -R a+rX {prefix}", stream=False)
    monkeypatch.setenv("VOLTAFORGE_CACHE", str(tmp_path / "cache"))
    opts = options("single", None, "f16", None, None, "512", "none,draft-simple", None, None, "10m", 1, False, None)
    opts = type(opts)(**{**opts.__dict__, "recipes_dir": tmp_path / "out"})
    try:
        assert run_tune("box", str(recipe), opts, as_json=True, settings=settings) == 0
        res = json.loads(capsys.readouterr().out)
    finally:
        run_stop("box", str(recipe), settings=settings)  # nothing live: a no-op, said so
    rows = {r["spec_type"]: r for r in res["candidates"]}
    assert set(rows) == {None, "draft-simple"} and all(r["error"] is None for r in rows.values()), rows
    spec = rows["draft-simple"]["speculation"]
    assert spec["drafted"] >= 40 and spec["acceptance"] is not None and spec["acceptance"] <= 0.05, spec
    assert rows[None]["speculation"] is None
    # the draft's 1 layer of 512 wide, counted in the draft candidate's plan
    assert rows["draft-simple"]["vram_gib"] > rows[None]["vram_gib"]
    assert res["winner"]["label"] == rows[None]["label"]
    winner = load_recipe(res["winner"]["recipe"])
    assert winner.recipe.spec_type is None and winner.recipe.draft is None


@pytest.mark.parametrize("workload", ["chat", "code", "long"])
def test_each_workload_kind_is_sized_by_the_servers_own_count(models, tmp_path, workload):
    """The bench's measure_level against the real llama-server, once per gate.workload: the
    prompts of each shipped text (words, code laid out, prose laid out) come out at about the
    asked length by the server's own count (one probe calibrates words per token: code costs
    more tokens a word than prose, so the same word count would miss)."""
    from playbooks.config.recipe import Gate
    from playbooks.host.local import LocalHost
    from playbooks.steps.measure.bench_run import measure_level

    server = Server(models["successor"], [], tmp_path / f"{workload}.log")
    try:
        g = Gate(levels=[1], prompt_tokens=96, max_tokens=8, requests_per_level=4, max_requests_per_level=4)
        level = measure_level(LocalHost(), server.port, "llama-server", 1, g.model_copy(update={"workload": workload}))
    finally:
        server.close()
    assert not level.get("error"), level
    assert 0.6 * 96 <= level["prompt_tokens"] <= 1.5 * 96, level["prompt_tokens"]
