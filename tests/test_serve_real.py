"""The rendered unit, run for real: a booted Debian 12 container (systemd), the static CPU
llama-server build, the generated tiny model quantized to Q4_K_M by llama-quantize. The unit
must start unprivileged, answer /health on loopback and complete text over HTTP.

The same file is the demo's model: whatever a person types must get an answer. Served on this
machine by the same llama-server, it completes text the tokenizer never saw (capitals, a
newline, Chinese, accents: byte fallback) and chats through the template its GGUF carries."""

import json
import subprocess
import time

import httpx
import pytest
import yaml
from gguf import GGUFReader

from playbooks.config.recipe import load_recipe
from playbooks.host import connect
from playbooks.steps.serve.units import ServerLayout, render_llama_server_unit
from playbooks.weights.tinymodel import CHAT_TEMPLATE, write_tiny_llama
from tests import llamacpp_tools
from tests.helpers import ROOT, spec_for
from tests.testhosts import free_port

pytestmark = pytest.mark.slow
TINY = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())["model"]["config"]


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    work = tmp_path_factory.mktemp("serve")
    f16 = llamacpp_tools.convert_to_gguf(write_tiny_llama(work / "hf", TINY), work / "tiny-f16.gguf")
    return llamacpp_tools.quantize(f16, work / "tiny-Q4_K_M.gguf", "Q4_K_M")


def test_tiny_cpu_unit_serves_over_http(nspawn_host, tiny_q4):
    recipe = load_recipe("tiny-cpu").recipe
    layout = ServerLayout(prefix="/opt/voltaforge")
    unit = render_llama_server_unit(recipe, layout)
    port = recipe.service.port
    with connect(spec_for(nspawn_host)) as host:
        server_dir = layout.llama_server.rsplit("/", 1)[0]
        host.sudo(f"mkdir -p {server_dir} {layout.serve_dir}", stream=False)
        host.put(str(llamacpp_tools.llama_server()), layout.llama_server, mode=0o755, sudo=True)
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


def test_tiny_model_carries_a_chat_template_and_answers_whatever_is_typed(tiny_q4, tmp_path):
    field = GGUFReader(str(tiny_q4)).fields["tokenizer.chat_template"]
    assert bytes(field.parts[field.data[0]]).decode() == CHAT_TEMPLATE
    port = free_port()
    argv = [str(llamacpp_tools.llama_server()), "-m", str(tiny_q4), "--host", "127.0.0.1", "--port", str(port)]
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
    finally:
        server.terminate()
        server.wait(timeout=30)
