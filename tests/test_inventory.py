"""inventory.yaml and the ~/.ssh/config fallback."""

import pytest

from playbooks.config.inventory import load_inventory, resolve_host
from playbooks.errors import RecipeError


def test_inventory_entry(tmp_path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(
        "hosts:\n  v100-01:\n    host: 10.0.0.21\n    user: deploy\n    gpu: v100-16gb\n    recipe: tiny-cpu\n"
    )
    spec = resolve_host("v100-01", inv)
    assert (spec.host, spec.user, spec.port, spec.gpu, spec.prefix) == (
        "10.0.0.21",
        "deploy",
        22,
        "v100-16gb",
        "/opt/voltaforge",
    )


def test_unlisted_host_falls_back_to_ssh_config(tmp_path):
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host gpu-box\n  HostName 192.0.2.7\n  User lab\n  Port 2222\n  IdentityFile /keys/lab\n")
    spec = resolve_host("gpu-box", tmp_path / "none.yaml", ssh_config=cfg)
    assert (spec.host, spec.user, spec.port, spec.key_file) == ("192.0.2.7", "lab", 2222, "/keys/lab")


def test_local_needs_no_ssh(tmp_path):
    assert resolve_host("local", tmp_path / "none.yaml").local


def test_bad_inventory_messages(tmp_path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts:\n  v100-01:\n    host: 10.0.0.21\n    gpu: v100-99gb\n")
    with pytest.raises(RecipeError, match=r"inventory.yaml:4: hosts.v100-01.gpu: unknown GPU"):
        load_inventory(inv)
    inv.write_text("hosts:\n  v100-01:\n    hostname: 10.0.0.21\n")
    with pytest.raises(
        RecipeError, match=r"inventory.yaml:3: unknown key 'hosts.v100-01.hostname'; allowed here: .*host, user, port"
    ):
        load_inventory(inv)
    inv.write_text("hosts:\n  v100-01:\n    host: 10.0.0.21\n    prefix: /opt/vf; rm -rf /\n")
    with pytest.raises(RecipeError, match=r"prefix"):
        load_inventory(inv)
    inv.write_text("hosts: [\n")
    with pytest.raises(RecipeError, match=r"inventory.yaml:2: invalid YAML"):
        load_inventory(inv)


@pytest.mark.parametrize(
    "name,ok",
    [
        ("v100-01", True),
        ("gpu.lab.example", True),
        ("10.0.0.21", True),
        ("::1", True),
        ("5", False),  # the resolver's shorthand for 0.0.0.5, not a name
        ("10.1", False),  # 10.0.0.1 to inet_aton
        ("box.42", False),  # no top-level domain is all digits
        ("a..b", False),
        ("", False),
    ],
)
def test_host_addresses(name, ok):
    from playbooks.config.inventory import is_host_address

    assert is_host_address(name) is ok


def test_local_reads_an_entry_named_local(tmp_path):
    """`--host local` is this machine; an entry named local gives it what it serves and where
    (a layout of two recipes here), so a fleet's shape can be tried on one machine."""
    from playbooks.config.inventory import resolve_host

    inv = tmp_path / "inventory.yaml"
    assert resolve_host("local", inv).local  # no inventory: this machine, nothing more
    inv.write_text(
        "hosts:\n  local:\n    prefix: /srv/vf\n    serve:\n"
        "      - {recipe: tiny-cpu, instances: 2, port: 18300}\n      - {recipe: tiny-rpc-cpu, port: 18400}\n"
    )
    spec = resolve_host("local", inv)
    assert spec.local and spec.host == "localhost" and spec.prefix == "/srv/vf"
    assert [p.recipe for p in spec.serve] == ["tiny-cpu", "tiny-rpc-cpu"]


LAB = """hosts:
  lab-01:
    host: 10.0.0.31
    gpu: v100-sxm2-32gb
    serve:
      - recipe: qwen2.5-32b-v100-32gb
        gpus: [1]
      - set: chat
        models: [qwen2.5-14b-v100-16gb, qwen2.5-7b-v100-16gb]
        gpus: [0]
        port: 8300
        load_at_start: [qwen2.5-7b-v100-16gb]
        sleep_idle_s: 600
"""


def test_a_model_set_is_a_serve_entry_beside_single_recipes(tmp_path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(LAB)
    spec = load_inventory(inv)["lab-01"]
    assert [p.recipe for p in spec.placements] == ["qwen2.5-32b-v100-32gb"]
    (chat,) = spec.model_sets
    assert chat.set == "chat" and chat.models == ("qwen2.5-14b-v100-16gb", "qwen2.5-7b-v100-16gb")
    assert (chat.gpus, chat.port, chat.load_at_start, chat.sleep_idle_s) == ((0,), 8300, ("qwen2.5-7b-v100-16gb",), 600)
    # an entry named local keeps its set through resolve_host's re-validation
    inv.write_text(LAB.replace("lab-01:\n    host: 10.0.0.31", "local:"))
    assert resolve_host("local", inv).model_sets == (chat,)


@pytest.mark.parametrize(
    "edit,where,words",
    [
        # a GPU another entry uses (a set without gpus runs on GPU 0)
        (("gpus: [1]", "gpus: [0]"), "inventory.yaml:2: hosts.lab-01", "GPU 0 is placed twice in serve: "),
        (
            (
                "gpus: [1]\n      - set: chat",
                "gpus: [0]\n      - set: chat",
                "        gpus: [0]\n        port",
                "        port",
            ),
            None,
            "GPU 0 is placed twice in serve: qwen2.5-32b-v100-32gb and set chat",
        ),
        # a recipe in a set and as its own server
        (
            ("models: [qwen2.5-14b-v100-16gb,", "models: [qwen2.5-32b-v100-32gb,"),
            None,
            "a recipe is placed twice in serve (qwen2.5-32b-v100-32gb: qwen2.5-32b-v100-32gb and set chat)",
        ),
        (("models: [qwen2.5-14b-v100-16gb, ", "models: ["), "hosts.lab-01.serve.1.models", "at least 2 items"),
        (("[qwen2.5-7b-v100-16gb]\n        sleep", "[qwen2.5-0.5b]\n        sleep"), "load_at_start", "not among"),
        (("set: chat", "set: Chat Room"), "hosts.lab-01.serve.1.set", "lower-case letters, digits and -"),
        (("sleep_idle_s: 600", "sleep_idle_s: 0"), "hosts.lab-01.serve.1.sleep_idle_s", "greater than or equal to 1"),
        (("sleep_idle_s: 600", "sleep_idle_s: 600\n        slots: 4"), "serve.1.slots", "unknown key"),
    ],
)
def test_a_bad_model_set_is_one_line_saying_what_and_where(tmp_path, edit, where, words):
    inv = tmp_path / "inventory.yaml"
    text = LAB
    for old, new in zip(edit[::2], edit[1::2], strict=True):
        assert old in text, old
        text = text.replace(old, new)
    inv.write_text(text)
    with pytest.raises(RecipeError) as got:
        load_inventory(inv)
    line = str(got.value)
    assert "\n" not in line and words in line, line
    assert where is None or where in line, line


def test_a_memory_budget_belongs_to_a_host_with_a_set(tmp_path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts:\n  box:\n    host: 10.0.0.9\n    recipe: tiny-cpu\n    memory_budget_gib: 2\n")
    with pytest.raises(RecipeError, match=r"memory_budget_gib: it is a model set's budget: this host serves no set"):
        load_inventory(inv)
    inv.write_text(
        "hosts:\n  box:\n    host: 10.0.0.9\n    memory_budget_gib: 2\n"
        "    serve:\n      - set: two\n        models: [tiny-cpu, tiny-moe-cpu]\n"
    )
    assert load_inventory(inv)["box"].memory_budget_gib == 2


def test_the_docs_model_set_example_loads_and_plans(tmp_path):
    """docs/plan.md's inventory example, as written: it loads, and `invoke plan --host` plans it."""
    import json
    import re
    import subprocess
    import sys

    from tests.helpers import ROOT

    page = (ROOT / "docs" / "plan.md").read_text()
    block = re.search(r"```yaml\n(hosts:\n.*?)```", page, re.S)
    assert block, "docs/plan.md has no inventory example"
    inv = tmp_path / "inventory.yaml"
    inv.write_text(block[1])
    spec = load_inventory(inv)["lab-01"]
    assert [s.set for s in spec.model_sets] == ["chat"] and spec.placements
    cmd = [sys.executable, "-m", "invoke", "plan", "--inventory", str(inv), "--host", "lab-01", "--json"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (chat,) = json.loads(r.stdout)
    assert chat["set"] == "chat" and len(chat["members"]) == 2 and chat["models_max"] >= 1


#: LAB with shipped recipes only (its 7B is not one): what the commands that load recipes read
LAB_SHIPPED = LAB.replace("qwen2.5-7b-v100-16gb", "qwen3-30b-a3b-v100-16gb")


def test_a_layout_with_a_set_resolves_to_its_recipes_and_its_planned_set(tmp_path):
    """What provision, stop and status act on (conduct/settings.py ``targets``): the single
    recipes, then each set planned on the host's card, with the count its plan gives; a flag
    naming the set picks it alone; a command of single recipes on a host of sets only says so."""
    from playbooks.conduct.model_sets import ServedSet
    from playbooks.conduct.placements import Served
    from playbooks.conduct.settings import Settings
    from playbooks.errors import VoltaforgeError

    inv = tmp_path / "inventory.yaml"
    inv.write_text(LAB_SHIPPED)
    settings = Settings(inventory=inv)
    single, chat = settings.targets("lab-01", None)
    assert isinstance(single, Served) and single.name == "qwen2.5-32b-v100-32gb"
    assert isinstance(chat, ServedSet) and (chat.name, chat.port, chat.gpus) == ("chat", 8300, (0,))
    assert chat.unit_name == "voltaforge-set-chat.service" and chat.models_max == chat.plan.residency.models_max >= 1
    assert [m.recipe.name for m in chat.members] == ["qwen2.5-14b-v100-16gb", "qwen3-30b-a3b-v100-16gb"]
    assert settings.targets("lab-01", "chat") == [chat]
    assert settings.targets("lab-01", "qwen2.5-32b-v100-32gb") == [single]
    inv.write_text(LAB_SHIPPED.replace("      - recipe: qwen2.5-32b-v100-32gb\n        gpus: [1]\n", ""))
    with pytest.raises(VoltaforgeError) as got:
        settings.serves("lab-01", None)
    assert str(got.value) == (
        "lab-01: serves model sets (chat) and no single recipe: this command acts on single recipes; provision, "
        "status, stop and remove act on sets"
    )


@pytest.mark.parametrize(
    "edit,words",
    [
        # a member too large for the card: the plan's line, naming it and its parts
        (
            lambda t: (
                t.replace("gpu: v100-sxm2-32gb", "gpu: v100-sxm2-16gb")
                .replace("      - recipe: qwen2.5-32b-v100-32gb\n        gpus: [1]\n", "")
                .replace("qwen3-30b-a3b-v100-16gb]", "qwen2.5-32b-v100-32gb]", 1)
                .replace("load_at_start: [qwen3-30b-a3b-v100-16gb]", "load_at_start: []")
            ),
            "lab-01: serve: set chat: Qwen2.5-32B-Instruct (qwen2.5-32b-v100-32gb, Q4_K_M) holds",
        ),
        (
            lambda t: t.replace("qwen3-30b-a3b-v100-16gb]", "no-such-recipe]", 1).replace(
                "load_at_start: [qwen3-30b-a3b-v100-16gb]", "load_at_start: []"
            ),
            "lab-01: serve: set chat: unknown recipe 'no-such-recipe'",
        ),
        (lambda t: t.replace("port: 8300", "port: 8080"), "lab-01: serve: qwen2.5-32b-v100-32gb and set chat both"),
    ],
)
def test_a_set_that_cannot_be_served_is_one_line_before_anything_connects(tmp_path, edit, words):
    from playbooks.conduct.settings import Settings
    from playbooks.errors import VoltaforgeError

    inv = tmp_path / "inventory.yaml"
    inv.write_text(edit(LAB_SHIPPED))
    with pytest.raises(VoltaforgeError) as got:
        Settings(inventory=inv).targets("lab-01", None)
    assert str(got.value).startswith(words) and "\n" not in str(got.value), str(got.value)


@pytest.mark.parametrize("command", [["plan", "--host", "lab-01"], ["provision", "--host", "lab-01", "--dry-run"]])
def test_a_set_serving_one_name_twice_is_one_line_and_exit_2_through_the_cli(tmp_path, command):
    """Through the command a user runs: the line on stderr, exit 2 (bad input), and no host
    contacted (the entry's address is a closed loopback port: a connection would fail otherwise)."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    inv = tmp_path / "inventory.yaml"
    inv.write_text(
        LAB_SHIPPED.replace("host: 10.0.0.31", "host: 127.0.0.1\n    port: 9")
        .replace("qwen3-30b-a3b-v100-16gb]", "qwen2.5-14b-v100-32gb]", 1)
        .replace("load_at_start: [qwen3-30b-a3b-v100-16gb]", "load_at_start: []")
    )
    r = subprocess.run(
        [sys.executable, "-m", "invoke", "-r", str(ROOT), *command, "--inventory", str(inv)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: lab-01: serve: set chat: qwen2.5-14b-v100-16gb and qwen2.5-14b-v100-32gb both serve "
        "'Qwen2.5-14B-Instruct': the router routes by the served name (service.model_name)"
    ]
