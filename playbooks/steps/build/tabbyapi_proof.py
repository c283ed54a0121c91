"""TabbyAPI's proof, run on the host by the toolchain venv's Python (stdlib only: it is pushed
into the new tree and run there, before the tree replaces the installed one).

    python tabbyapi_proof.py TABBYAPI_DIR

It starts the tree's ``main.py`` without a model, on a free loopback port, from a private
working directory holding a config and a key of its own (0600; TabbyAPI reads
``api_tokens.yml`` from its working directory and prints keys only when it makes them, so
none is printed), and asks: ``/health`` answers 200; ``/v1/models`` is 401 without the key
and 200 with it. Then it stops the server and removes the directory.

``developer.unsafe_launch`` skips TabbyAPI's check that torch and ExLlamaV2 are installed:
this proof is the server's (its dependencies, its auth, its HTTP); the backend has its own,
ExLlamaV2's step importing its compiled extension beside the pinned torch. Where exllamav2 is
installed, TabbyAPI's start imports it even without a model (common/multimodal.py ->
backends/exllamav2/vision.py), and with it torch and the extension: the build conductor runs
ExLlamaV2's step first, so that import finds the built module and nothing compiles. Where it is
not (the test hosts), nothing of it is imported, and the proof needs no torch and no GPU.
"""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

WAIT_S = 90  # TabbyAPI's imports take ~1 s here; a loaded host gets room


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status(url: str, key: str | None = None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def prove(tree: Path) -> dict[str, int]:
    work = Path(tempfile.mkdtemp(prefix="vf-tabbyapi-proof-"))
    proc = None
    try:
        port, key = free_port(), secrets.token_hex(16)
        (work / "models").mkdir()
        tokens = work / "api_tokens.yml"
        tokens.touch(mode=0o600)
        tokens.write_text(f"api_key: {key}\nadmin_key: {secrets.token_hex(16)}\n")
        (work / "config.yml").write_text(
            json.dumps(  # JSON is YAML: no YAML library needed here
                {
                    "network": {"host": "127.0.0.1", "port": port, "disable_auth": False},
                    "model": {"model_dir": str(work / "models"), "model_name": None},
                    "logging": {"log_prompt": False, "log_requests": False},
                    "developer": {"unsafe_launch": True},
                }
            )
        )
        argv = [sys.executable, str(tree / "main.py"), "--config", str(work / "config.yml")]
        with (work / "server.log").open("wb") as log:  # the child holds its own copy of the descriptor
            proc = subprocess.Popen(argv, cwd=work, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        base, health, deadline = f"http://127.0.0.1:{port}", 0, time.monotonic() + WAIT_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                health = status(f"{base}/health")
                break
            except OSError:
                time.sleep(0.3)
        seen = {
            "health": health,
            "models_without_key": status(f"{base}/v1/models") if health else 0,
            "models_with_key": status(f"{base}/v1/models", key) if health else 0,
        }
        if seen != {"health": 200, "models_without_key": 401, "models_with_key": 200}:
            tail = (work / "server.log").read_text(errors="replace").splitlines()[-15:]
            why = f"exited {proc.returncode}" if proc.poll() is not None else f"running after {WAIT_S} s"
            raise SystemExit(f"TabbyAPI's proof failed ({why}): {json.dumps(seen)}\n" + "\n".join(tail))
        return seen
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    seen = prove(Path(sys.argv[1]).resolve())
    print(
        f"tabbyAPI ok: /health {seen['health']}, /v1/models {seen['models_without_key']} without the key, "
        f"{seen['models_with_key']} with it"
    )
