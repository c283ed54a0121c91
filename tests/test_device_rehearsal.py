"""`bash scripts/device_check.sh --rehearse`, as CI runs it: the EXL2 phase's payload made for
this Python and measured against what one device call carries, its wheelhouse installed
offline into a clean venv, each phase run until its first GPU call, the results archive
written. So the device script cannot rot while no GPU is lent (issue 37 item 3)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile

import pytest
import yaml

from tests.helpers import ROOT, tabbyapi_archive


@pytest.mark.slow
def test_the_device_script_rehearses_here_to_its_first_gpu_call(tmp_path):
    staged = tabbyapi_archive()
    env = {**os.environ, "PYTHON": sys.executable, "VF_TABBYAPI": str(staged), "VF_REHEARSE_KEEP": str(tmp_path)}
    r = subprocess.run(
        ["bash", "scripts/device_check.sh", "--rehearse"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    m = re.search(r"= ([\d.]+) MiB of 64 \((\d+) wheels", out)
    assert m and float(m.group(1)) <= 64, out
    assert "== exl2 facts: done" in out and "== exl2 install: done" in out
    # every later phase runs in the device venv until its first GPU call
    assert "== exl2 ext: needs a GPU - needs a GPU: the build step's EnsureExllamav2" in out
    assert "== exl2 convert: needs a GPU - needs a GPU: the quantize step's EnsureExl2Quant at 3.3, 4 bpw" in out
    assert "== exl2 tabbyapi: needs a GPU - needs a GPU: the tabbyapi step (its proof starts TabbyAPI" in out
    assert "== exl2 serve: needs a GPU - needs a GPU: the deploy step starting TabbyAPI on the EXL2-4.0" in out
    assert "== exl2 bench: needs a GPU - needs a GPU: the bench of voltaforge-tabbyapi" in out
    # the archive holds each phase's result, and what each did before its GPU call
    got = _archive(tmp_path / "results.tgz")
    phases = ("facts", "install", "ext", "convert", "tabbyapi", "serve", "bench")
    assert {f"exl2-{p}.json" for p in phases} <= set(got)
    convert = json.loads(got["exl2-convert.json"])
    # the quantize step's own operations up to the converter: the generated weights pushed and
    # their FP16 range checked, then the same operations again (the 4.0 bpw run's) all ok
    before = [(c["step"], c["status"]) for c in convert["before_gpu"]]
    assert ("Ensure every weight fits FP16 (V100 has no BF16)", "changed") in before, before
    assert before[len(before) // 2 :] == [(s, "ok") for s, _ in before[: len(before) // 2]], before
    assert convert["gpu"] == "h200" and all(b > 0 for b in convert["planned_file_bytes"].values())
    # what a lent H200 met only on the GPU, seen before it now (issue 49): the converter's model
    # has its tokenizer.json (the file prepare made, this venv having no transformers), the
    # extension's build would run the venv's ninja, the managed process has no %C left
    assert convert["tokenizer"] == ["tokenizer.json", "tokenizer.model", "tokenizer_config.json"], convert
    assert ("Ensure the model has a tokenizer.json (exllamav2 reads no other)", "ok") in before, before
    ext = json.loads(got["exl2-ext.json"])
    assert ext["ninja"].endswith("/prefix/venv/bin/ninja"), ext
    serve = json.loads(got["exl2-serve.json"])
    assert serve["rendered"] == ["config.yml", "voltaforge-tabbyapi.service"] and serve["planned_vram_bytes"] > 0
    env = serve["process_environment"]
    assert env["HOME"].endswith("/prefix/deploy/voltaforge-tabbyapi/cache/voltaforge-tabbyapi"), env
    assert not any("%" in v for v in env.values()), env
    config = yaml.safe_load(got["exl2-config.yml"])
    # TabbyAPI on loopback without a key, loading the conversion through the deploy step's link
    assert config["network"]["host"] == "127.0.0.1" and config["network"]["disable_auth"] is True
    assert config["model"]["model_name"] == "tiny-llama"
    # a second call on a warm device (the same prefix, fresh results): the venv kept, the
    # quantize step's operations before the GPU all ok, every later phase at the same GPU call
    again = out.split("== again")[1]
    assert again.count(": needs a GPU - ") == 5, again
    second = _archive(tmp_path / "results-again.tgz")
    assert json.loads(second["exl2-install.json"])["venv"] == "kept from an earlier call"
    assert json.loads(got["exl2-install.json"])["venv"] == "made"
    redo = json.loads(second["exl2-convert.json"])["before_gpu"]
    assert redo and all(c["status"] == "ok" for c in redo), redo
    # the venv fix proven apart: a venv made from this suite's venv interpreter sees its packages
    check = json.loads(out.split("== venv-check")[1].strip().splitlines()[0])
    assert check["interpreter"] == sys.executable and check["from"].startswith(sys.prefix), check


def _archive(path):
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
