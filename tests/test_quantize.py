"""`invoke quantize`'s decisions (no host) and its parsers on real tool output. The real run
over SSH, twice and dry, is tests/test_quantize_real.py."""

from __future__ import annotations

import json
import re

import pytest

from playbooks.conduct.artifacts import parse_manifests
from playbooks.conduct.quantize import parse_quants, refuse_unfit
from playbooks.config.recipe import load_recipe
from playbooks.errors import VoltaforgeError
from playbooks.facts.artifacts import parse_gguf_check, parse_kld
from playbooks.host.ops import OperationError, PushFile, Record, Upload
from playbooks.plan.model_config import shape_from_config
from playbooks.steps.build.build import BuildLayout
from playbooks.steps.build.proven_build import Probe
from playbooks.steps.weights.fetch import EnsureHubWeights, EnsureWeights, HubFacts
from playbooks.steps.weights.fp16_range import EnsureFp16Range
from playbooks.steps.weights.gguf import ArtifactFacts, EnsureGguf
from playbooks.steps.weights.model_layout import ModelLayout
from playbooks.steps.weights.reference import EnsureReference
from playbooks.steps.weights.sources import HubWeights, LocalWeights
from tests.helpers import ROOT, fixture_body

TINY = load_recipe("tiny-cpu", ROOT / "recipes")
SHAPE = shape_from_config(TINY.recipe.model.config)
WEIGHTS = LocalWeights(
    "tiny-llama-abc",
    ROOT / "x",
    {"config.json": (10, "aa" * 32), "model.safetensors": (100, "bb" * 32)},
    {"generate": "tiny-llama"},
)
LAYOUT = ModelLayout("/opt/vf", "tiny-llama-abc")
BUILD = BuildLayout("/opt/vf")
STAMP = {
    "id": "0c1e570-cpu-271b9ade006d",
    "inputs": {"prefix": "/opt/vf", "ref": "0c1e570", "source_sha256": "832db0699007" + "0" * 52},
}


def gguf(quant, **kw):
    return EnsureGguf(LAYOUT, BUILD, "/opt/vf/venv", WEIGHTS, SHAPE, quant, **kw)


def made(op, **kw):
    """The manifest the operation writes, as the facts of a later run read it."""
    m = {"inputs": op.inputs(STAMP), "bytes": 2688448, "mtime": 1764512000, "sha256": "cd" * 32}
    return ArtifactFacts(manifest={**m, **kw}, stat=(2688448, 1764512000), build=STAMP, disk_free=10**12)


def test_f16_is_converted_by_the_current_builds_own_tree_and_checked_against_the_original():
    d = gguf("F16").decide(ArtifactFacts(build=STAMP, disk_free=10**12))
    shown = [c.show() for c in d.commands]
    assert d.reason == "not made yet"
    convert = next(s for s in shown if "convert_hf_to_gguf.py" in s)
    assert convert == (
        "/opt/vf/venv/bin/python /opt/vf/src/llama.cpp-0c1e570-832db0699007/convert_hf_to_gguf.py "
        "/opt/vf/models/tiny-llama-abc/hf --outtype f16 --outfile "
        "/opt/vf/models/tiny-llama-abc/gguf/tiny-llama-abc-F16.gguf.partial"
    )
    probes = [c for c in d.commands if isinstance(c, Probe)]
    assert [p.key for p in probes] == ["compare", "run"]
    assert " compare /opt/vf/models/tiny-llama-abc/gguf/tiny-llama-abc-F16.gguf.partial " in probes[0].command
    # verified as .partial, renamed, then described: a file without a manifest never counts
    assert shown[-2] == (
        "mv -f -- /opt/vf/models/tiny-llama-abc/gguf/tiny-llama-abc-F16.gguf.partial "
        "/opt/vf/models/tiny-llama-abc/gguf/tiny-llama-abc-F16.gguf"
    )
    assert isinstance(d.commands[-1], Record) and d.commands[-1].path.endswith("-F16.gguf.manifest.json")


def test_a_quant_is_made_from_f16_with_the_imatrix_and_judged_by_kl_divergence():
    d = gguf("Q4_K_M", imatrix=True).decide(ArtifactFacts(build=STAMP, disk_free=10**12))
    shown = [c.show() for c in d.commands]
    assert (
        "/opt/vf/llama.cpp/current/bin/llama-quantize --imatrix /opt/vf/models/tiny-llama-abc/gguf/imatrix.gguf "
        "/opt/vf/models/tiny-llama-abc/gguf/tiny-llama-abc-F16.gguf "
        "/opt/vf/models/tiny-llama-abc/gguf/tiny-llama-abc-Q4_K_M.gguf.partial Q4_K_M"
    ) in shown
    kld = next(c for c in d.commands if isinstance(c, Probe) and c.key == "kld")
    assert "--kl-divergence-base /opt/vf/models/tiny-llama-abc/gguf/F16.kld --kl-divergence" in kld.command
    assert "-c 128 --chunks 20" in kld.command
    # no imatrix wanted (planner.imatrix false): none passed
    plain = gguf("Q8_0").decide(ArtifactFacts(build=STAMP, disk_free=10**12))
    assert not any("--imatrix" in c.show() for c in plain.commands)


def test_present_with_the_same_inputs_is_ok_after_a_stat_not_a_hash():
    op = gguf("Q4_K_M", imatrix=True)
    d = op.decide(made(op))
    assert d.commands == () and d.reason == f"artifact present (2.69 MB, sha256 {'cd' * 6})"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"stat": (2688448, 1764512999)}, "the file changed since its manifest"),
        ({"stat": None}, "the file changed since its manifest"),
        ({"build": {**STAMP, "id": "0c1e570-cpu-000000000000"}}, "made from other inputs"),
    ],
)
def test_a_changed_file_or_a_new_build_remakes_it(change, reason):
    op = gguf("Q4_K_M", imatrix=True)
    facts = made(op)
    facts = ArtifactFacts(**{**facts.__dict__, **change})
    assert op.decide(facts).reason == reason


def test_verify_rehashes_and_a_mismatch_is_one_line():
    op = gguf("Q8_0", verify=True)
    good = made(op)
    good.extra["sha256"] = "cd" * 32
    assert op.decide(good).reason == f"artifact present, sha256 re-checked ({'cd' * 6})"
    bad = made(op)
    bad.extra["sha256"] = "ef" * 32
    with pytest.raises(OperationError, match=r"sha256 efefefefefef is not the manifest's cdcdcdcdcdcd"):
        op.decide(bad)


def test_no_build_or_no_room_is_refused_before_any_work():
    with pytest.raises(OperationError, match=r"no proven llama.cpp build at /opt/vf/llama.cpp/current"):
        gguf("F16").decide(ArtifactFacts(build=None))
    with pytest.raises(OperationError, match=r"^1.00 MB free under .*/gguf, Q8_0 needs about 8.71 MB"):
        gguf("Q8_0").decide(ArtifactFacts(build=STAMP, disk_free=1_000_000))


def test_weights_are_pushed_checksummed_into_a_partial_directory_then_renamed():
    op = EnsureWeights(LAYOUT, WEIGHTS)
    assert op.decide(({"files": WEIGHTS.manifest()["files"]}, 0)).commands == ()
    d = op.decide((None, 10**9))
    pushes = [c for c in d.commands if isinstance(c, PushFile)]
    assert [(p.path, p.sha256) for p in pushes] == [
        ("/opt/vf/models/tiny-llama-abc/hf.partial/config.json", "aa" * 32),
        ("/opt/vf/models/tiny-llama-abc/hf.partial/model.safetensors", "bb" * 32),
    ]
    manifest = next(c for c in d.commands if isinstance(c, Upload))
    assert json.loads(manifest.content)["files"]["model.safetensors"] == {"bytes": 100, "sha256": "bb" * 32}
    assert d.commands[-1].show() == (
        "rm -rf -- /opt/vf/models/tiny-llama-abc/hf && "
        "mv -T -- /opt/vf/models/tiny-llama-abc/hf.partial /opt/vf/models/tiny-llama-abc/hf"
    )
    assert op.decide(({"files": {}}, None)).reason.startswith("the host has other files")
    with pytest.raises(OperationError, match=r"^0.00 MB free under /opt/vf/models/tiny-llama-abc, the weights need"):
        op.decide((None, 100))


def test_fp16_overflow_found_earlier_is_refused_with_its_summary():
    op = EnsureFp16Range(LAYOUT, "/opt/vf/venv", "s" * 64)
    summary = "3 BF16 values beyond FP16's range in 2 tensors (a: 2, b: 1)"
    with pytest.raises(OperationError, match=r"^3 BF16 values beyond FP16's range in 2 tensors"):
        op.decide({"summary": summary, "overflow_values": 3})
    assert op.decide({"summary": "no value beyond FP16's range", "overflow_values": 0}).commands == ()
    probe = op.decide(None).commands[0]
    assert "fp16_range_probe.py" in probe.show() and "/opt/vf/models/tiny-llama-abc/hf" in probe.show()


def test_reference_is_keyed_by_the_f16_file():
    op = EnsureReference(LAYOUT, BUILD, imatrix=True)
    key = op.reference_key("ab" * 32)
    assert op.decide(("ab" * 32, key)).commands == ()
    d = op.decide(("cd" * 32, key))
    assert d.reason == "not computed for this F16 file"
    assert any("llama-imatrix" in c.show() for c in d.commands)
    assert not any(
        "llama-imatrix" in c.show() for c in EnsureReference(LAYOUT, BUILD, False).decide((None, None)).commands
    )


def test_kld_statistics_from_a_real_run():
    kld = parse_kld(fixture_body("thishost-llama-perplexity-kld-tiny-q4km.txt"))
    assert kld == {
        "mean_kld": 0.00202,
        "max_kld": 0.003182,
        "same_top_p": 66.825,
        "ppl_q": 2178.001867,
        "ppl_base": 2179.168472,
    }
    assert parse_kld("main: error: failed to load model\n") is None


def test_kld_from_the_last_chunk_row_when_the_statistics_are_lost():
    """llama.cpp's leaked log thread loses the lines still queued at exit (seen in cold CI: the
    output ended at chunk 20's row). A whole real run, cut where that run was cut, gives the
    statistics' mean KLD and same top p from the last row; cut a row earlier it gives none."""
    whole = fixture_body("thishost-llama-perplexity-kld-whole.txt")
    full = parse_kld(whole)
    assert full is not None and full["mean_kld"] == 0.002171 and full["same_top_p"] == 45.079
    assert full["max_kld"] == 0.002772 and full["ppl_q"] == 1846.338743
    rows = whole[: whole.index("====== Perplexity statistics")]
    cut = parse_kld(rows)
    assert cut == {"mean_kld": 0.00217, "same_top_p": 45.079, "ppl_q": 1846.3387}
    assert cut["mean_kld"] == pytest.approx(full["mean_kld"], abs=5e-6)  # the row's 5 decimals
    before_last = rows[: rows.index("\n  20 ")] + "\n"
    assert "  19 " in before_last and parse_kld(before_last) is None  # a run cut short is never finished
    assert parse_kld(rows.replace("computing over 20 chunks", "computing over 21 chunks")) is None


def test_the_gguf_check_line_or_an_error_never_an_exception():
    line = '{"probe": "voltaforge-gguf-check", "probe_version": 1, "mode": "run", "tokens_out": 16, "finite": true}'
    assert parse_gguf_check("llama noise\n" + line + "\n")["tokens_out"] == 16
    assert parse_gguf_check("Traceback (most recent call last):\n")["error"].startswith("the check printed no result")
    assert parse_gguf_check("")["error"] == "the check printed nothing"


def test_unknown_quant_and_a_quant_that_cannot_fit():
    with pytest.raises(VoltaforgeError, match=r"^--quant 'Q9_K': not a GGUF quant type; allowed: "):
        parse_quants("Q4_K_M,Q9_K", "Q4_K_M")
    assert parse_quants(None, "Q4_K_M") == ["Q4_K_M"] and parse_quants("Q4_K_M, Q8_0", "x") == ["Q4_K_M", "Q8_0"]
    assert parse_quants("Q8_0,Q8_0", "x") == ["Q8_0"]  # once each
    for given in ("", " , "):  # given, but naming none: not "the recipe's quant"
        with pytest.raises(VoltaforgeError, match=r"^--quant .*: give GGUF types separated by commas"):
            parse_quants(given, "Q4_K_M")
    big = load_recipe("qwen2.5-32b-v100-16gb", ROOT / "recipes")
    with pytest.raises(VoltaforgeError, match=r"^Q8_0 does not fit .* needs \d+\.\d\d GiB of 1\d\.\d\d GiB .*--force"):
        refuse_unfit(big, "Q8_0", force=False)
    refuse_unfit(big, "Q8_0", force=True)  # made anyway


def test_artifacts_listing_parses_every_manifest():
    out = '### voltaforge-manifest /m/a.gguf.manifest.json\n{"path": "/m/a.gguf", "quant": "Q8_0"}\n'
    out += "### voltaforge-manifest /m/b.gguf.manifest.json\nnot json\n"
    assert parse_manifests(out) == [
        {"path": "/m/a.gguf", "quant": "Q8_0"},
        {"path": "/m/b.gguf", "error": "unreadable manifest"},
    ]


HUB = HubWeights("Qwen/Qwen2.5-0.5B", "060db6499f32faf8b98477b0a26969ef7d8b9987", "/home/vf/.hf-token")


def hub(**kw):
    facts = {"manifest": None, "token_mode": 0o600, "disk_free": 10**12, **kw}
    return EnsureHubWeights(ModelLayout("/opt/vf", HUB.model_id), HUB, "/opt/vf/venv", 4 * 10**9), HubFacts(**facts)


def test_the_hub_download_is_the_pinned_sha_with_the_token_from_a_file_never_argv():
    op, facts = hub()
    d = op.decide(facts)
    fetch = next(c for c in d.commands if isinstance(c, Probe))
    assert fetch.command.startswith(
        "env HF_HUB_DISABLE_TELEMETRY=1 HF_TOKEN_PATH=/home/vf/.hf-token /opt/vf/venv/bin/python"
    )
    assert fetch.command.endswith(
        "Qwen/Qwen2.5-0.5B 060db6499f32faf8b98477b0a26969ef7d8b9987 "
        "/opt/vf/models/Qwen--Qwen2.5-0.5B-060db6499f32/hf.partial"
    )
    done = {"origin": {"repo": HUB.repo, "revision": HUB.revision, "sha": HUB.revision}, "files": {"a": {}}}
    assert op.decide(hub(manifest=done)[1]).reason == "1 files at 060db6499f32, checked against the hub's sha256"


@pytest.mark.parametrize(
    ("facts", "error"),
    [
        ({"token_mode": 0o644}, "model.token_file /home/vf/.hf-token is mode 0644: others can read the token"),
        ({"token_mode": None}, "model.token_file /home/vf/.hf-token does not exist on the host"),
        ({"disk_free": 10**9}, "1.00 GB free under /opt/vf/models/Qwen--Qwen2.5-0.5B-060db6499f32, "),
    ],
)
def test_hub_refusals_before_any_download(facts, error):
    op, f = hub(**facts)
    with pytest.raises(OperationError, match="^" + re.escape(error)):
        op.decide(f)


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("revision-not-found", "has no revision '060db6499f32faf8b98477b0a26969ef7d8b9987' (model.revision)"),
        ("gated", "is gated: accept its terms on huggingface.co, put a read token in /home/vf/.hf-token"),
        ("repo-not-found", "no repo Qwen/Qwen2.5-0.5B on the hub, or it is private"),
        ("unreachable", "the host cannot reach huggingface.co (ConnectionError)"),
        ("corrupt", "model.safetensors: sha256 aaaa, the hub publishes bbbb: the download is corrupt"),
    ],
)
def test_hub_failures_are_one_line_each(kind, says):
    op, _ = hub()
    message = {
        "unreachable": "ConnectionError: (MaxRetryError(...))",
        "corrupt": "model.safetensors: sha256 aaaa, the hub publishes bbbb",
    }.get(kind, "x")
    text = op._error({"error": kind, "message": message})
    assert says in text and len(text.splitlines()) == 1


def test_fp16_overflow_is_refused_or_clamped_as_the_recipe_says(tmp_path):
    """For real on this machine (LocalHost, this venv's python and numpy): a BF16 99840 in a
    shard is refused, with the tensor named; with model.fp16_overflow: clamp the shard is
    replaced by a clamped copy and a second check finds nothing beyond FP16's range."""
    import sys
    from pathlib import Path

    import numpy as np

    from playbooks.facts import weights as weights_facts
    from playbooks.host import LocalHost
    from playbooks.host.ops import run_ops
    from playbooks.modelgen.tinymodel import _bf16_bytes, write_safetensors

    layout = ModelLayout(str(tmp_path), "m")
    hf = Path(layout.hf)
    hf.mkdir(parents=True)
    values = np.array([1.0, 99840.0, -2.0, 3.0], dtype=np.float32)
    write_safetensors(hf / "model.safetensors", {"lm_head.weight": ((2, 2), _bf16_bytes(values))})
    venv = str(Path(sys.executable).parent.parent)
    host = LocalHost()
    (refused,) = run_ops(host, [EnsureFp16Range(layout, venv, "s" * 64)])
    assert (
        refused.status == "failed"
        and "1 BF16 value beyond FP16's range in 1 tensor (lm_head.weight: 1)" in (refused.why)
        and "model.fp16_overflow: clamp" in refused.why
    )
    (clamped,) = run_ops(host, [EnsureFp16Range(layout, venv, "s" * 64, clamp=True)])
    assert clamped.status == "changed", clamped.why
    again = weights_facts.parse_fp16_range(
        host.run(
            weights_facts.fp16_range_command(
                sys.executable, str(weights_facts.FP16_RANGE_PROBE_PATH), [str(hf / "model.safetensors")]
            ),
            stream=False,
        ).stdout
    )
    assert again.overflow_values == 0 and not (tmp_path / "models" / "m" / "hf.clamped").exists()
    (ok,) = run_ops(host, [EnsureFp16Range(layout, venv, "s" * 64, clamp=True)])
    assert ok.status == "ok" and "clamped to the largest FP16-safe value" in ok.why


def test_an_architecture_the_converter_does_not_know_is_one_line_before_any_work(tmp_path):
    """The recipe's shape is read before a host is touched: a Mamba config is refused in one
    line naming the recipe's line and the architectures voltaforge can plan and convert."""
    import subprocess
    import sys

    import yaml

    data = yaml.safe_load((ROOT / "recipes" / "tiny-cpu.yaml").read_text())
    data["model"]["config"].update(model_type="mamba", architectures=["MambaForCausalLM"])
    (tmp_path / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    recipe = tmp_path / "mamba.yaml"
    recipe.write_text(yaml.safe_dump(data))
    r = subprocess.run(
        [sys.executable, "-m", "invoke", "quantize", "--host", "local", "--recipe", str(recipe)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "model_type 'mamba' is not supported by the planner; supported: " in r.stderr


def test_calibration_text_is_the_recipes_file_the_tiny_models_words_or_the_shipped_text(tmp_path):
    from playbooks.steps.weights.sources import calibration_text

    tiny = LocalWeights("tiny-llama-x", tmp_path, {}, {"generate": "tiny-llama"})
    real = LocalWeights("m-x", tmp_path, {}, {"path": str(tmp_path)})
    assert "Hello, World!" in calibration_text(tiny) and "def " not in calibration_text(tiny)
    shipped = calibration_text(real)
    # the shipped text: many domains (prose, code, Chinese), thousands of words
    assert len(shipped.split()) > 3000 and "def " in shipped and "的" in shipped
    assert calibration_text(HubWeights("Qwen/Qwen2.5-0.5B", "a" * 40, None)) == shipped
    named = tmp_path / "mine.txt"
    named.write_text("word " * 300)
    assert calibration_text(real, named) == "word " * 300
    named.write_text("too short")
    with pytest.raises(VoltaforgeError, match=r"mine.txt: 2 words; imatrix wants thousands"):
        calibration_text(real, named)
    with pytest.raises(VoltaforgeError, match="cannot read it as UTF-8"):
        calibration_text(real, tmp_path / "absent.txt")


def test_the_generated_models_id_changes_with_the_generator_not_only_the_config(tmp_path, monkeypatch):
    """The tiny model is cached under its id and never regenerated: a generator that writes
    something new (v2: a chat template) must make a new id for the same config."""
    from playbooks.modelgen import tinymodel
    from playbooks.steps.weights.sources import generated_weights

    made = []

    def fake_writer(out, config):
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps(config))
        made.append(tinymodel.GENERATOR_VERSION)

    monkeypatch.setattr(tinymodel, "write_tiny_llama", fake_writer)
    config = TINY.recipe.model.config
    first = generated_weights(config, tmp_path)
    assert generated_weights(config, tmp_path).model_id == first.model_id and len(made) == 1  # cached
    assert first.origin["generator"] == tinymodel.GENERATOR_VERSION
    monkeypatch.setattr(tinymodel, "GENERATOR_VERSION", tinymodel.GENERATOR_VERSION + 1)
    newer = generated_weights(config, tmp_path)
    assert newer.model_id != first.model_id and newer.model_id.startswith("tiny-llama-") and len(made) == 2
    assert newer.origin["config_sha256"] == first.origin["config_sha256"]
    assert generated_weights({**config, "num_hidden_layers": 2}, tmp_path).model_id not in (
        first.model_id,
        newer.model_id,
    )


def test_the_generated_model_is_the_same_bytes_wherever_it_is_generated(tmp_path):
    """The same config and seed give the same files in any directory: two caches (a device's
    and the controller's, say) hold one model, and a second run pushes nothing. The tokenizer
    differed once: the trainer spec inside tokenizer.model named the corpus file's path."""
    from playbooks.steps.weights.sources import generated_weights

    config = {**TINY.recipe.model.config, "num_hidden_layers": 1}
    one, two = generated_weights(config, tmp_path / "a"), generated_weights(config, tmp_path / "b")
    assert one.directory != two.directory and "tokenizer.model" in one.files
    # name -> (bytes, sha256) of every file, hashed from what was written
    assert one.files == two.files


def test_a_kld_run_whose_statistics_are_lost_runs_once_more(tmp_path):
    """Seen once in a cold test run: llama-perplexity exited 0 after printing every row up to
    chunk 16 of 20 and none of its statistics. The check runs it once more (on this machine,
    LocalHost, a script standing in for it with the captured report); lost twice: one line
    saying the statistics are missing."""
    from playbooks.host.local import LocalHost
    from playbooks.host.ops import Decision
    from playbooks.host.output import BufferedPrinter

    report = fixture_body("thishost-llama-perplexity-kld-tiny-q4km.txt")
    (tmp_path / "full.txt").write_text(report)
    (tmp_path / "cut.txt").write_text(report[: report.index("\n  17 ")])
    once = (
        f"if [ -e {tmp_path}/ran ]; then cat {tmp_path}/full.txt; else touch {tmp_path}/ran; cat {tmp_path}/cut.txt; fi"
    )
    op = EnsureGguf(
        ModelLayout(str(tmp_path), "tiny-llama-abc"), BuildLayout(str(tmp_path)), "/x", WEIGHTS, SHAPE, "Q4_K_M"
    )
    host = LocalHost(printer=BufferedPrinter())
    (tmp_path / "models" / "tiny-llama-abc").mkdir(parents=True)  # what the step's earlier commands make
    op.apply(host, Decision.act("made", Probe(once, key="kld")))
    assert (tmp_path / "ran").exists()  # the first run's output had no statistics: run again
    always_cut = f"cat {tmp_path}/cut.txt"
    with pytest.raises(OperationError, match=r"exit 0; its statistics \(Mean KLD, Same top p\) are missing"):
        op.apply(host, Decision.act("made", Probe(always_cut, key="kld")))
