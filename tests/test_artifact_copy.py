"""`invoke quantize --on H2`'s copy, for real: a finished artifact streamed from one host (this
machine, `--host local`'s transport) to another (a real sshd, its unprivileged user), hashed
on the way; a second run moves no byte; a file that changed after its manifest was written
fails in one line and leaves the target's previous copy as it was."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from playbooks.host import connect
from playbooks.host.local import LocalHost
from playbooks.host.ops import run_ops
from playbooks.steps.artifact_copy import Artifact, EnsureArtifactCopy, parse_files_with_sha256
from playbooks.steps.exl2_convert import STAMP_NAME
from tests.helpers import spec_for


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
