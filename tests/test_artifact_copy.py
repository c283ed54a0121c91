"""`invoke quantize --on H2`'s copy, for real: a finished artifact streamed from one host (this
machine, `--host local`'s transport) to another (a real sshd, its unprivileged user), hashed
on the way; a second run moves no byte; a file that changed after its manifest was written
fails in one line and leaves the target's previous copy as it was.

Those share this machine's filesystem. Between two hosts with two filesystems: a real GGUF
(the tiny model through the real converter and llama-quantize) from the private sshd to the
booted nspawn container, through `--on`'s own copy (cli.quantize.run_copy), checked on
the container's filesystem through the container's own connection, with the proof that no
same-disk shortcut could pass (test_quantize_on_copies_a_real_gguf_between_two_filesystems)."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import uuid
from pathlib import Path

import pytest
import yaml

from playbooks.cli.quantize import run_artifacts, run_copy
from playbooks.conduct.quantize import recipe_weights
from playbooks.conduct.settings import Settings
from playbooks.config.recipe import load_recipe
from playbooks.host import connect
from playbooks.host.local import LocalHost
from playbooks.host.ops import run_ops
from playbooks.steps.weights.artifact_copy import Artifact, EnsureArtifactCopy, parse_files_with_sha256
from playbooks.steps.weights.exl2_convert import STAMP_NAME
from playbooks.steps.weights.model_layout import ModelLayout, manifest_path
from tests import llamacpp_tools
from tests.helpers import ROOT, inventory_for, spec_for, stage_served_model

TINY_RECIPE = ROOT / "recipes" / "tiny-cpu.yaml"


def _gguf(directory: Path, content: bytes) -> Path:
    """A file with the manifest `invoke quantize` writes (the fields the copy reads)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "m-Q4_K_M.gguf"
    path.write_bytes(content)
    manifest = {"path": str(path), "kind": "gguf", "quant": "Q4_K_M", "bytes": len(content)}
    manifest |= {"sha256": hashlib.sha256(content).hexdigest(), "mtime": int(path.stat().st_mtime)}
    Path(f"{path}.manifest.json").write_text(json.dumps(manifest))
    os.chmod(directory, 0o755)
    return path


def test_a_gguf_copies_once_and_a_changed_source_fails_cleanly(sshd_host, tmp_path):
    content = os.urandom(3 * 1024 * 1024 + 17)  # several stream chunks, not a multiple of one
    src_path = _gguf(tmp_path / "src", content)
    dst_dir = sshd_host.prefix / "serve" / "gguf"
    dst_dir.mkdir(parents=True)
    os.chown(dst_dir, *_ids(sshd_host))
    src, dst = Artifact.gguf(str(src_path)), Artifact.gguf(str(dst_dir / "m-Q4_K_M.gguf"))
    with LocalHost() as source, connect(spec_for(sshd_host)) as target:
        op = EnsureArtifactCopy(source, src, dst)
        # dry run: the copy shown, nothing written
        [change] = run_ops(target, [op], dry_run=True)
        assert change.status == "changed" and any("copy local:" in c for c in change.commands)
        assert not list(dst_dir.iterdir())
        [change] = run_ops(target, [op])
        assert change.status == "changed", change.why
        copied = Path(dst.path)
        assert copied.read_bytes() == content
        manifest = json.loads(Path(dst.identity).read_text())
        assert manifest["path"] == dst.path and manifest["mtime"] == int(copied.stat().st_mtime)
        assert manifest["copied_from"] == {"host": "local", "path": src.path}
        # again: the same sha256 on both sides, nothing moves
        before = copied.stat().st_mtime_ns
        [change] = run_ops(target, [op])
        assert change.status == "ok" and "artifact present" in change.why
        assert copied.stat().st_mtime_ns == before
        # the source file changes under its manifest: the bytes do not hash to what it promised
        src_path.write_bytes(content[:-1] + bytes([content[-1] ^ 1]))
        stale = json.loads(Path(src.identity).read_text()) | {"sha256": "0" * 64}
        Path(src.identity).write_text(json.dumps(stale))
        [change] = run_ops(target, [op])
        assert change.status == "failed" and "the file changed while it was copied" in change.why
        assert "\n" not in change.why
        assert copied.read_bytes() == content  # the previous copy is untouched
        assert not Path(f"{dst.path}.partial").exists()


def test_an_exl2_directory_copies_with_its_stamp(sshd_host, tmp_path):
    src_dir = tmp_path / "exl2" / "3.3bpw-h6"
    (src_dir / "sub").mkdir(parents=True)
    files = {"config.json": b"{}", "output.safetensors": os.urandom(200_000), "sub/tokenizer.json": b"[1]"}
    for name, data in files.items():
        (src_dir / name).write_bytes(data)
    (src_dir / STAMP_NAME).write_text(json.dumps({"id": "abc123", "bpw": 3.3}))
    for d in (tmp_path / "exl2", src_dir, src_dir / "sub"):
        os.chmod(d, 0o755)
    dst_root = sshd_host.prefix / "serve-exl2"
    dst_root.mkdir()
    os.chown(dst_root, *_ids(sshd_host))
    src = Artifact.exl2(str(src_dir), STAMP_NAME)
    dst = Artifact.exl2(str(dst_root / "3.3bpw-h6"), STAMP_NAME)
    with LocalHost() as source, connect(spec_for(sshd_host)) as target:
        op = EnsureArtifactCopy(source, src, dst)
        [change] = run_ops(target, [op])
        assert change.status == "changed", change.why
        for name, data in files.items():
            assert (dst_root / "3.3bpw-h6" / name).read_bytes() == data
        [change] = run_ops(target, [op])
        assert change.status == "ok" and "abc123" in change.why
        # a new conversion on the source (a new stamp id): copied again, swapped in whole
        (src_dir / STAMP_NAME).write_text(json.dumps({"id": "def456", "bpw": 3.3}))
        [change] = run_ops(target, [op])
        assert change.status == "changed" and "this host has id abc123" in change.why
        assert json.loads((dst_root / "3.3bpw-h6" / STAMP_NAME).read_text())["id"] == "def456"
        assert sorted(p.name for p in dst_root.iterdir()) == ["3.3bpw-h6"]


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory) -> Path:
    """The tiny-cpu recipe's model, generated, converted by the real convert_hf_to_gguf.py and
    quantized to Q4_K_M by the real llama-quantize (the pinned CPU build)."""
    work = tmp_path_factory.mktemp("copy")
    config = yaml.safe_load(TINY_RECIPE.read_text())["model"]["config"]
    f16 = llamacpp_tools.tiny_f16(work, config)
    return llamacpp_tools.quantize(f16, work / "tiny-Q4_K_M.gguf", "Q4_K_M")


def _out(host, cmd: str) -> str:
    return host.run(cmd, stream=False).stdout.strip()


@pytest.mark.slow
def test_quantize_on_copies_a_real_gguf_between_two_filesystems(sshd_host, nspawn_host, tiny_q4, tmp_path, capsys):
    """`invoke quantize serve --on box`'s copy between two different hosts with two filesystems:
    cli.quantize.run_copy (what run_quantize runs once `box` has made the quants; the
    making over SSH is test_quantize_real.py's) streams a real Q4_K_M from the private sshd
    (`box`: this machine's filesystem, its unprivileged user) to the booted nspawn container
    (`serve`: its own root filesystem, its own SSH session as `deploy`), hashed on the way.

    Everything about the target is read through the container's connection. A same-disk
    shortcut could not pass: the source file does not exist in the container, the copy does
    not exist on the sshd host, the two directories are on different devices, and the two
    hosts are different systems (machine-id)."""
    data = tiny_q4.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    src_prefix = str(sshd_host.prefix / "vf")
    dst_prefix = f"{nspawn_host.prefix}/quantize-on-{uuid.uuid4().hex[:8]}"  # the shared container: its own prefix
    inv = inventory_for(tmp_path, "box", sshd_host, prefix=src_prefix)
    (tmp_path / "serve").mkdir()
    serve = yaml.safe_load(inventory_for(tmp_path / "serve", "serve", nspawn_host, prefix=dst_prefix).read_text())
    inv.write_text(yaml.safe_dump({"hosts": {**yaml.safe_load(inv.read_text())["hosts"], **serve["hosts"]}}))
    settings = Settings(inventory=inv)
    model_id = recipe_weights(load_recipe(str(TINY_RECIPE))).model_id
    dst = ModelLayout(dst_prefix, model_id).gguf("Q4_K_M")

    with connect(spec_for(sshd_host, "box")) as box, connect(spec_for(nspawn_host, "serve")) as target:
        try:
            # what `invoke quantize box` leaves: the file and its manifest under models/<id>/gguf/
            src = stage_served_model(box, src_prefix, TINY_RECIPE, tiny_q4)
            assert src == ModelLayout(src_prefix, model_id).gguf("Q4_K_M") and src != dst
            # two hosts, two filesystems: neither path exists on the other host
            assert not target.exists(src) and not target.exists(os.path.dirname(src))
            assert _out(box, "cat /etc/machine-id") != _out(target, "cat /etc/machine-id")

            # dry run: the copy shown, nothing written on the container
            assert run_copy(settings, "box", "serve", str(TINY_RECIPE), "Q4_K_M", None, True) == 0
            assert "is the copy of box's" in capsys.readouterr().out
            assert not target.exists(dst_prefix)

            assert run_copy(settings, "box", "serve", str(TINY_RECIPE), "Q4_K_M", None, False) == 0
            out = capsys.readouterr().out
            assert f"copying {len(data)} bytes" in out, out[-3000:]
            # on the container's own filesystem, read through its connection
            assert target.sha256(dst) == digest
            assert int(_out(target, f"stat -c %s {shlex.quote(dst)}")) == len(data)
            manifest = json.loads(target.read_bytes(manifest_path(dst)))
            assert manifest["path"] == dst and manifest["sha256"] == digest and manifest["bytes"] == len(data)
            assert manifest["copied_from"] == {"host": "box", "path": src}
            mtime = int(_out(target, f"stat -c %Y {shlex.quote(dst)}"))
            assert manifest["mtime"] == mtime
            assert not target.exists(f"{dst}.partial")
            # the copy is not the source seen twice: absent on the sshd host, another device
            assert not box.exists(dst) and not box.exists(dst_prefix)
            src_dev = _out(box, f"stat -c %d {shlex.quote(os.path.dirname(src))}")
            dst_dev = _out(target, f"stat -c %d {shlex.quote(os.path.dirname(dst))}")
            assert src_dev != dst_dev, (src_dev, dst_dev)

            # again: the same sha256 on both hosts, nothing moves
            assert run_copy(settings, "box", "serve", str(TINY_RECIPE), "Q4_K_M", None, False) == 0
            out = capsys.readouterr().out
            assert "artifact present: the same sha256" in out and "copying" not in out, out[-3000:]
            assert int(_out(target, f"stat -c %Y {shlex.quote(dst)}")) == mtime
            # `invoke artifacts serve` lists the copy
            assert run_artifacts("serve", as_json=True, settings=settings) == 0
            [listed] = json.loads(capsys.readouterr().out)
            assert listed["path"] == dst and listed["sha256"] == digest
        finally:
            target.run(f"rm -rf -- {shlex.quote(dst_prefix)}", check=False, stream=False)


def test_a_missing_source_is_one_line_and_a_pending_dry_run_shows_the_copy(tmp_path):
    src = Artifact.gguf(str(tmp_path / "nothing.gguf"))
    dst = Artifact.gguf(str(tmp_path / "dst" / "nothing.gguf"))
    with LocalHost() as host:
        [change] = run_ops(host, [EnsureArtifactCopy(host, src, dst)])
        assert change.status == "failed" and "local has no finished" in change.why
        [change] = run_ops(host, [EnsureArtifactCopy(host, src, dst, pending=True)], dry_run=True)
        assert change.status == "changed" and "makes it first" in change.why


def test_the_file_list_parser_reads_sizes_hashes_and_names_with_spaces():
    digest = "a" * 64
    out = f"12 {digest} config.json\n7 {digest} sub/a b.json\ngarbage\n"
    assert parse_files_with_sha256(out) == (("config.json", 12, digest), ("sub/a b.json", 7, digest))


def _ids(host) -> tuple[int, int]:
    import pwd

    user = pwd.getpwnam(host.user)
    return user.pw_uid, user.pw_gid
