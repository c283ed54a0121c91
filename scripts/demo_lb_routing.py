"""The balancer's edge as a client sees it, for docs/fleet.md: two real llama-servers (the pinned
build, a generated model) serving under two model names, HAProxy with the configuration `invoke
lb` renders in front of them, and the requests a person would send. Prints the transcript.

Run: .venv/bin/python scripts/demo_lb_routing.py (needs haproxy and the test tools' llama.cpp
build, which the test suite makes: tests/llamacpp_tools.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PORT = 18443
CHAT = '{"messages":[{"role":"user","content":"Hi"}],"model":"qwen2.5-14b","max_tokens":4}'
SHOW = 'python3 -c \'import json,sys; d=json.load(sys.stdin); print(d["model"], d["usage"]["completion_tokens"])\''
COMMANDS = [
    f"curl -s http://127.0.0.1:{PORT}/v1/models",
    f"curl -s http://127.0.0.1:{PORT}/v1/chat/completions -H 'Content-Type: application/json' -d '{CHAT}' | {SHOW}",
    f"""curl -s -w ' %{{http_code}}\\n' http://127.0.0.1:{PORT}/v1/completions -d '{{"model":"llama-70b"}}'""",
    f"""curl -s -w ' %{{http_code}}\\n' http://127.0.0.1:{PORT}/v1/completions -d '{{"prompt":"Hi"}}'""",
]


def main() -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from playbooks.config.recipe import load_recipe
    from playbooks.steps.serve.balancer import Backend, Balancer, render_haproxy_config
    from tests import sparse_gguf
    from tests.test_balancer_real import Server, csv_row, haproxy, wait_for
    from tests.testhosts import free_port

    tmp = Path(tempfile.mkdtemp(prefix="vf-demo-"))
    model = sparse_gguf.write(tmp, sparse_gguf.shape_of("llama-E1024-F2816-L8-H8-K2-D128-V2048.gguf"))
    names = ("qwen2.5-32b", "qwen2.5-14b")
    servers = {m: Server(model, free_port(), tmp / f"{m}.log", slots=1, alias=m, ctx=2048).start() for m in names}
    backends = tuple(Backend("box", "127.0.0.1", s.port, 1, m, 2048) for m, s in servers.items())
    lb = Balancer(load_recipe("tiny-cpu").recipe, backends, port=PORT, stats_port=free_port())
    proc, _ = haproxy(render_haproxy_config(lb), tmp)
    try:
        wait_for(lambda: all(csv_row(lb.stats_port, "box", f"model_{m}")["status"] == "UP" for m in names), 30)
        for cmd in COMMANDS:
            print(f"$ {cmd}")
            print(subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.rstrip())
    finally:
        for s in servers.values():
            s.kill()
        os.killpg(proc.pid, signal.SIGTERM)


if __name__ == "__main__":
    main()
