"""The rendered unit, run for real: a booted Debian 12 container (systemd), the CPU
llama-server build, the generated tiny model quantized to Q4_K_M by llama-quantize. The unit
must start unprivileged, answer /health on loopback and complete text over HTTP.

The same file is the demo's model: whatever a person types must get an answer. Served on this
machine by the same llama-server, it completes text the tokenizer never saw (capitals, a
newline, Chinese, accents: byte fallback) and chats through the template its GGUF carries.
It is also the gate's model in the quick start, served about 2,500 tokens a second here: a
client that stops reading for a moment gets a whole stream at once, and the bench must not
take that stream's span for a decode time."""

import asyncio
import json
import subprocess
import time
from contextlib import contextmanager

import httpx
import pytest
import yaml
from gguf import GGUFReader

from playbooks.config.recipe import load_recipe
from playbooks.host import connect
from playbooks.modelgen.tinymodel import CHAT_TEMPLATE
from playbooks.steps.measure import bench, bench_client
from playbooks.steps.measure.bench_stats import compressed_streams
from playbooks.steps.serve.engine_llamacpp import render_llama_server_unit
from playbooks.steps.serve.units import ServerLayout
from tests import llamacpp_tools
from tests.helpers import ROOT, spec_for
from tests.testhosts import free_port

pytestmark = pytest.mark.slow
TINY = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())["model"]["config"]


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    work = tmp_path_factory.mktemp("serve")
    f16 = llamacpp_tools.tiny_f16(work, TINY, "tiny-f16.gguf")
    return llamacpp_tools.quantize(f16, work / "tiny-Q4_K_M.gguf", "Q4_K_M")


def test_tiny_cpu_unit_serves_over_http(nspawn_host, tiny_q4):
    recipe = load_recipe("tiny-cpu").recipe
    layout = ServerLayout(prefix="/opt/voltaforge")
    unit = render_llama_server_unit(recipe, layout)
    port = recipe.service.port
    with connect(spec_for(nspawn_host)) as host:
        server_dir = layout.llama_server.rsplit("/", 1)[0]
        host.sudo(f"mkdir -p {server_dir} {layout.serve_dir}", stream=False)
        llamacpp_tools.put_tools(host, ("llama-server",), server_dir, sudo=True)
        # the unit reads the model through serve_dir's link; a plain file there serves as well
        host.put(str(tiny_q4), layout.model_file(recipe), mode=0o644, sudo=True)
        host.sudo(f"chmod -R a+rX {layout.prefix}", stream=False)
        host.write_file(f"/etc/systemd/system/{unit.name}", unit.text.encode(), 0o644, sudo=True)
        try:
            host.sudo(f"systemctl daemon-reload && systemctl start {unit.name}", stream=False)
            deadline = time.monotonic() + 60
            health = None
            while time.monotonic() < deadline:
                health = host.run(
                    f"curl -s -o /dev/null -w '%{{http_code}}' http://127.0.0.1:{port}/health",
                    check=False,
                    stream=False,
                ).stdout.strip()
                if health == "200":
                    break
                time.sleep(0.5)
            log = host.sudo(f"journalctl -u {unit.name} -o cat --no-pager", check=False, stream=False).stdout
            assert health == "200", log[-3000:]
            body = json.dumps({"prompt": "ka lo mi", "n_predict": 16, "ignore_eos": True})
            r = host.run(
                f"curl -s http://127.0.0.1:{port}/completion -H 'Content-Type: application/json' -d '{body}'",
                stream=False,
            )
            data = json.loads(r.stdout)
            assert data["timings"]["predicted_n"] == 16 and data["timings"]["predicted_per_second"] > 0
            # unprivileged: DynamicUser gives the process a transient uid, never root
            pid = host.run(f"systemctl show -p MainPID --value {unit.name}", stream=False).stdout.strip()
            uid = host.run(f"stat -c %u /proc/{pid}", stream=False).stdout.strip()
            assert pid != "0" and uid != "0"
            # and it listens on loopback only
            listening = host.sudo(f"ss -ltnH 'sport = :{port}'", stream=False).stdout
            assert [line.split()[3] for line in listening.splitlines()] == [f"127.0.0.1:{port}"]
        finally:
            host.sudo(
                f"systemctl stop {unit.name}; rm -f /etc/systemd/system/{unit.name}; systemctl daemon-reload",
                check=False,
                stream=False,
            )


# what a person types: a capital, a newline, CJK and accents, none of them in the training text
TYPED = "Hello\nWorld! 你好 ünïcode"


@contextmanager
def _local_server(model, tmp_path):
    """The pinned llama-server on this machine, healthy; yields its port."""
    port = free_port()
    argv = [str(llamacpp_tools.llama_server()), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    log = tmp_path / "llama-server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([*argv, "-c", "1024", "--no-webui"], stdout=out, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            deadline = time.monotonic() + 60
            while server.poll() is None and time.monotonic() < deadline:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            else:
                pytest.fail(f"llama-server not healthy (exit {server.poll()}): {log.read_text()[-3000:]}")
        yield port
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_tiny_model_carries_a_chat_template_and_answers_whatever_is_typed(tiny_q4, tmp_path):
    field = GGUFReader(str(tiny_q4)).fields["tokenizer.chat_template"]
    assert bytes(field.parts[field.data[0]]).decode() == CHAT_TEMPLATE
    with _local_server(tiny_q4, tmp_path) as port:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            # a completion (no `400 unordered_map::at`), every byte of the text tokenized
            r = client.post("/completion", json={"prompt": TYPED, "n_predict": 8, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["timings"]["predicted_n"] == 8
            ids = client.post("/tokenize", json={"content": TYPED}).json()["tokens"]
            assert client.post("/detokenize", json={"tokens": ids}).json()["content"].lstrip(" ") == TYPED
            # the GGUF's template, not llama-server's built-in fallback; one BOS (the vocabulary
            # adds it, so the template's own is dropped), and each turn ends with the EOS token
            assert client.get("/props").json()["chat_template"] == CHAT_TEMPLATE
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TYPED}]
            prompt = client.post("/apply-template", json={"messages": messages}).json()["prompt"]
            assert (
                prompt == f"<|im_start|>system\nBe brief.</s>\n<|im_start|>user\n{TYPED}</s>\n<|im_start|>assistant\n"
            )
            tokens = client.post("/tokenize", json={"content": prompt, "add_special": True, "parse_special": True})
            assert [t for t in tokens.json()["tokens"] if t in (1, 2)] == [1, 2, 2]
            r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "ignore_eos": True})
            assert r.status_code == 200, r.text
            chat = r.json()
            assert chat["choices"][0]["message"]["role"] == "assistant" and chat["choices"][0]["message"]["content"]
            assert chat["usage"]["completion_tokens"] == 8


@pytest.mark.usefixtures("cpu_quiet")  # it compares the client's clock with the server's rate (helpers.cpu_quiet)
def test_a_stream_the_client_read_all_at_once_lends_the_level_no_rate(tiny_q4, tmp_path):
    """Real streams from the real server: twelve read as they come, and one whose reader stops
    (ten times the slowest request's time) as soon as the answer's headers arrive (a client descheduled on a busy
    2-core machine), so that its 64 tokens wait in the socket and come in one read. Its raw
    span makes a rate many times the server's own; the level's figure stays with the server's."""
    with _local_server(tiny_q4, tmp_path) as port:
        url = f"http://127.0.0.1:{port}"
        prompts = [f"Once upon a time, in the village number {i}, there lived" for i in range(12)]
        read, _ = asyncio.run(bench_client.run_level(url, prompts, 1, 64, 1, "llama-server", 60))
        # the stall: ten times the slowest whole request just measured, so the server has made
        # every token before the client reads one, on a fast machine or a slow one
        stall_s = 10 * max(s.e2e or 0.0 for s in read)

        async def descheduled() -> bench_client.Sample:
            async def stall(response: httpx.Response) -> None:
                time.sleep(stall_s)  # blocks the event loop: nothing is read meanwhile

            async with httpx.AsyncClient(base_url=url, event_hooks={"response": [stall]}) as client:
                body = bench_client.request_body(prompts[0], 64, 99, "llama-server")
                return await bench_client.stream_one(client, bench_client.COMPLETIONS, body, 60)

        whole = asyncio.run(descheduled())
    assert all(s.error is None and s.completion_tokens == 64 for s in [*read, whole]), [*read, whole]
    server_rate = whole.timings["predicted_per_second"]
    assert whole.decode_tok_s and whole.decode_tok_s > 5 * server_rate, (whole.decode_tok_s, server_rate)
    assert compressed_streams([*read, whole]) == [whole]
    lv = bench.level_summary(1, [*read, whole], wall_s=1.0)
    # one stream in thirteen: timed by the client without that stream, unless the twelve others
    # came in bursts too often (at 2,500 tok/s they sometimes do): then the server's rates judge
    assert lv["timing"]["compressed_streams"] == 1
    assert lv["decode"]["n"] == (12 if lv["decode"]["source"] == "client" else 13), lv["timing"]
    servers = [s.timings["predicted_per_second"] for s in read]
    assert min(servers) / 2 < bench.decode_figure(lv) < 2 * max(servers), (bench.decode_figure(lv), servers)
