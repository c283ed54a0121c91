"""`invoke quantize` for real over SSH: the tiny model pushed to a real SSH test host, F16,
imatrix, Q4_K_M and Q8_0, each verified (F16 against the original weights through
transformers; quants by KL divergence against F16; every file loaded and run through the
venv's llama-cpp-python), with manifests that `invoke artifacts --json` lists; a second run
does no work; a dry run changes nothing. Then the bad inputs that need a host: FP16 overflow
in the weights, and a disk that fills during the conversion.

The host gets its toolchain (the CPU torch wheel, served from a find-links directory) and its
build (the four tools quantize uses, and the bindings) through the real `invoke toolchain` and
`invoke build` code first."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from playbooks.steps.build.fleet_cache import FleetCache
from tests.helpers import ROOT, inventory_for, shared_ccache
from tests.llamacpp_tools import TORCH_CPU, cpu_torch_wheel

pytestmark = pytest.mark.slow

TOOLS = ("llama-server", "llama-quantize", "llama-imatrix", "llama-perplexity")


def _links() -> Path:
    """The CPU torch wheel where the test host's unprivileged user can read it."""
    wheel = cpu_torch_wheel()
    links = Path(tempfile.mkdtemp(prefix="vf-torch-links-", dir="/tmp"))
    os.chmod(links, 0o755)
    try:
        os.link(wheel, links / wheel.name)
    except OSError:
        shutil.copyfile(wheel, links / wheel.name)
    os.chmod(links / wheel.name, 0o644)
    return links


def _recipe(tmp_path: Path, name: str, **sections) -> Path:
    """tiny-cpu with some sections' keys replaced (next to a copy of defaults.yaml)."""
    data = yaml.safe_load((ROOT / "recipes" / "tiny-cpu.yaml").read_text())
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    (tmp_path / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _with_overflow(src: Path, dst: Path) -> None:
    """A copy of a generated model whose final norm holds one BF16 value FP16 cannot: 99840."""
    shutil.copytree(src, dst)
    st = dst / "model.safetensors"
    raw = bytearray(st.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    start = 8 + n + header["model.norm.weight"]["data_offsets"][0]
    raw[start : start + 2] = struct.pack("<H", 0x47C3)  # BF16 0x47C3 = 99840
    st.write_bytes(bytes(raw))
    (dst / ".complete").unlink(missing_ok=True)


@pytest.mark.timeout(2400)  # toolchain, a build and the bindings (cold in CI), then quantize
@pytest.mark.usefixtures("cpu_alone")  # tests/helpers.cpu_alone
def test_quantize_over_ssh_twice_dry_and_its_bad_inputs(sshd_host, tmp_path, capsys, monkeypatch):
    from playbooks.cli.build import run_build
    from playbooks.cli.quantize import run_artifacts, run_quantize
    from playbooks.cli.toolchain import run_toolchain
    from playbooks.conduct.settings import Settings
    from playbooks.steps.build.llamacpp_source import source_cache_dir

    links = _links()  # the test cache's torch wheel, before the cache is moved below
    real_sources = source_cache_dir()
    # the server is compiled here (an empty fleet cache); the bindings' wheel, when an earlier
    # test compiled and proved it for the same inputs and ABI (the provision e2e test, in its
    # container), is pushed as on a fleet's second host instead of compiled a second time
    real_wheels = FleetCache.default().root / "wheels"
    if real_wheels.is_dir():
        shutil.copytree(real_wheels, tmp_path / "fleet" / "wheels")
    monkeypatch.setattr(FleetCache, "default", classmethod(lambda cls: cls(tmp_path / "fleet")))
    monkeypatch.setenv("VOLTAFORGE_CACHE", str(tmp_path / "cache"))  # the controller's model cache too
    (tmp_path / "cache" / "sources").mkdir(parents=True)
    for item in real_sources.iterdir() if real_sources.is_dir() else []:
        (tmp_path / "cache" / "sources" / item.name).symlink_to(item)  # the sdist, fetched once
    try:
        recipe = _recipe(
            tmp_path,
            "cpu-torch",
            toolchain={"torch": TORCH_CPU, "torch_index": "https://pypi.org/simple", "torch_find_links": str(links)},
        )
        prefix = sshd_host.prefix / "vf"
        inv = inventory_for(tmp_path, "box", sshd_host, prefix=str(prefix))
        settings = Settings(inventory=inv)
        assert run_toolchain("box", str(recipe), settings=settings) == 0
        shared_ccache(prefix, sshd_host.user)
        assert run_build("box", str(recipe), settings=settings, targets=TOOLS) == 0
        out = capsys.readouterr().out
        # the bindings: the package without a llama.cpp compile of its own (one compile per host)
        assert "CMAKE_ARGS='-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF'" in out and "pip install" in out
        assert out.count(" --build ") == 1  # cmake's compile: the server's, once
        # the bindings: from the same archive as the server, loading the server build's library
        builds = prefix / "llama.cpp" / "builds"

        def proven_bindings() -> tuple[dict, str]:
            stamp = json.loads((prefix / "venv" / "voltaforge-llama-cpp-python.json").read_text())
            current = (prefix / "llama.cpp" / "current").resolve()
            return stamp, current.name

        bindings, server_id = proven_bindings()
        server = json.loads((builds / server_id / "voltaforge-stamp.json").read_text())
        assert bindings["inputs"]["source_sha256"] == server["inputs"]["source_sha256"]
        assert bindings["import"] == "0.3.36" and bindings["system_info"].startswith("CPU : ")
        assert bindings["server_build"] == server_id
        assert bindings["library"].startswith(f"{builds / server_id}/bin/libllama.so"), bindings
        assert run_build("box", str(recipe), settings=settings, targets=TOOLS) == 0
        out = capsys.readouterr().out
        assert "8 ok" in out and "pip install" not in out and "cmake" not in out
        # the server rebuilt with new inputs (a target more): the bindings follow, no pip
        assert run_build("box", str(recipe), settings=settings, targets=(*TOOLS, "llama-bench")) == 0
        out = capsys.readouterr().out
        assert "followed, not rebuilt" in out and "pip install" not in out and "pip wheel" not in out, out[-3000:]
        followed, new_id = proven_bindings()
        assert new_id != server_id and followed["server_build"] == new_id
        assert followed["library"].startswith(f"{builds / new_id}/bin/libllama.so")

        def quantize(*, dry_run=False, rec=recipe):
            code = run_quantize("box", str(rec), quant="Q4_K_M,Q8_0", dry_run=dry_run, settings=settings)
            return code, capsys.readouterr().out

        # dry run: the exact commands, nothing made
        code, out = quantize(dry_run=True)
        assert code == 0 and "convert_hf_to_gguf.py" in out and "would run: " in out
        assert not (prefix / "models").exists()
        # first run: everything made and verified
        code, out = quantize()
        assert code == 0, out[-4000:]
        assert run_artifacts("box", as_json=True, settings=settings) == 0
        listed = json.loads(capsys.readouterr().out)
        assert sorted(a["quant"] for a in listed) == ["F16", "Q4_K_M", "Q8_0"]
        for a in listed:
            path = Path(a["path"])
            assert a["kind"] == "gguf" and a["bytes"] == path.stat().st_size and a["sha256"] == _sha256(path)
            # the whole file, metadata and tokenizer included, within 2% of the prediction
            assert abs(a["predicted_bytes"] - a["bytes"]) / a["bytes"] < 0.02, a
            run = a["verification"]["run"]
            assert run["finite"] and run["tokens_out"] == 16
            assert not Path(f"{a['path']}.partial").exists()
        by = {a["quant"]: a["verification"] for a in listed}
        # F16 computes what the BF16 original computes (transformers, float32): same top token
        # everywhere, logits within a few thousandths (random weights: logits are small)
        assert by["F16"]["compare"]["top1_agreement"] == 1.0 and by["F16"]["compare"]["max_abs_logit_diff"] < 0.01
        assert 0 <= by["Q8_0"]["kld"]["mean_kld"] < by["Q4_K_M"]["kld"]["mean_kld"] < 0.05
        # second run: nothing to do, no file re-hashed or remade
        mtimes = {a["path"]: Path(a["path"]).stat().st_mtime_ns for a in listed}
        code, out = quantize()
        assert code == 0 and "0 changed" in out and "would run" not in out, out[-3000:]
        assert {p: Path(p).stat().st_mtime_ns for p in mtimes} == mtimes

        # --on: made on "box", copied to a serving host (another prefix, its own SSH session):
        # box has it (all ok), the quant streams over, checked by sha256; again moves nothing
        two = yaml.safe_load(inv.read_text())
        serve_prefix = sshd_host.prefix / "serve"
        two["hosts"]["serve"] = {**two["hosts"]["box"], "prefix": str(serve_prefix)}
        inv.write_text(yaml.safe_dump(two))
        settings = Settings(inventory=inv)
        code = run_quantize("serve", str(recipe), quant="Q4_K_M", on="box", settings=settings)
        out = capsys.readouterr().out
        assert code == 0 and "is the copy of box's" in out, out[-3000:]
        q4 = next(a for a in listed if a["quant"] == "Q4_K_M")
        copied = serve_prefix / Path(q4["path"]).relative_to(prefix)
        assert _sha256(copied) == q4["sha256"] and not (serve_prefix / "models" / copied.parent.name / "hf").exists()
        assert run_artifacts("serve", as_json=True, settings=settings) == 0
        [served] = json.loads(capsys.readouterr().out)
        assert served["path"] == str(copied) and served["sha256"] == q4["sha256"]
        code = run_quantize("serve", str(recipe), quant="Q4_K_M", on="box", settings=settings)
        out = capsys.readouterr().out
        assert code == 0 and "0 changed" in out and "artifact present: the same sha256" in out, out[-3000:]

        # FP16 overflow in the weights: refused with the count and the tensor, nothing converted
        gen = next((tmp_path / "cache" / "models").glob("tiny-llama-*"))
        bad = tmp_path / "overflowing"
        _with_overflow(gen, bad)
        bad_recipe = _recipe(
            tmp_path,
            "overflow",
            toolchain=yaml.safe_load(recipe.read_text())["toolchain"],
            model={"generate": None, "path": str(bad)},
        )
        code, out = quantize(rec=bad_recipe)
        failed = [line for line in out.splitlines() if "failed:" in line]
        assert code == 1 and len(failed) == 1, out[-3000:]
        assert "1 BF16 value beyond FP16's range in 1 tensor (model.norm.weight: 1)" in failed[0]
        assert not list((prefix / "models").glob("overflowing-*/gguf"))

        # a repo on the hub, which this machine cannot reach: one line, nothing left behind
        hub_recipe = _recipe(
            tmp_path,
            "hub",
            toolchain=yaml.safe_load(recipe.read_text())["toolchain"],
            model={
                "generate": None,
                "repo": "Qwen/Qwen2.5-0.5B",
                "revision": "060db6499f32faf8b98477b0a26969ef7d8b9987",
            },
        )
        code, out = quantize(rec=hub_recipe)
        failed = [line for line in out.splitlines() if "failed:" in line]
        assert code == 1 and len(failed) == 1 and "the host cannot reach huggingface.co (" in failed[0], out[-2000:]
        assert not (prefix / "models" / "Qwen--Qwen2.5-0.5B-060db6499f32" / "hf").exists()

        # the disk fills while the converter writes: one line naming it, no file that looks made
        user = pwd.getpwnam(sshd_host.user)
        small = prefix / "models-small"
        small.mkdir()
        os.chown(small, user.pw_uid, user.pw_gid)
        opts = f"size=40m,mode=0755,uid={user.pw_uid},gid={user.pw_gid}"
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "vf-models-full", str(small)], check=True)
        try:
            (prefix / "models").rename(prefix / "models-full")
            (prefix / "models").symlink_to(small)
            stop = threading.Event()

            def fill():
                while not stop.is_set():
                    if subprocess.run(["pgrep", "-f", "convert_hf_to_gguf"], capture_output=True).returncode == 0:
                        subprocess.run(["dd", "if=/dev/zero", f"of={small}/filler", "bs=1M"], capture_output=True)
                        return
                    time.sleep(0.05)

            filler = threading.Thread(target=fill)
            filler.start()
            code, out = quantize()
            stop.set()
            filler.join(60)
            failed = [line for line in out.splitlines() if "failed:" in line]
            assert code == 1 and len(failed) == 1, out[-3000:]
            assert "disk full during the F16 GGUF (" in failed[0] and "No space left on device" in failed[0]
            made = list(small.glob("*/gguf/*"))
            assert not [p for p in made if p.name.endswith((".gguf", ".manifest.json"))], made
        finally:
            subprocess.run(["umount", str(small)], check=False)
            if (prefix / "models").is_symlink():
                (prefix / "models").unlink()
                (prefix / "models-full").rename(prefix / "models")
    finally:
        shutil.rmtree(links, ignore_errors=True)
