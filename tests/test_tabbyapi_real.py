"""TabbyAPI's real path without a GPU: the pinned commit as the staged copy (what `invoke
stage-tabbyapi` staged, or the git archive beside the checkout: helpers.tabbyapi_archive), its
dependencies as a wheelhouse this controller downloads for the host's Python, the tabbyapi
step over real SSH to a private sshd and to the booted Debian container (its own network
namespace: no index, no GitHub), and the proof: the installed server started without a model
answers /health, 401 without its key, 200
with it. Then TabbyAPI's own config model at that commit parses the config.yml we render.

What this proves: the step's push, offline install and proof on real hosts, and that TabbyAPI
accepts our config's keys and values. Not proven here: a model loaded (ExLlamaV2 needs a GPU;
scripts/device_check.sh's exl2 phase does that on a lent one). The toolchain venv stands in
without its torch (+cu118 is 2 GB), which the proof does not need (tabbyapi_proof.py says why).
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from playbooks.config.planning import resolve_gpu_split
from playbooks.config.recipe import Toolchain, load_recipe
from playbooks.host import connect
from playbooks.host.ops import run_ops
from playbooks.steps.build import wheelhouse
from playbooks.steps.build.tabbyapi import MARKER, EnsureTabbyAPI, staged_archive
from playbooks.steps.serve.engine_exllamav2 import render_tabbyapi_config
from tests.helpers import ROOT, spec_for, tabbyapi_archive

TC = Toolchain()
PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"  # this machine's and the container's python3 (Debian 12: 3.11)
TAG = wheelhouse.python_tag(PYTHON)
EXL2_RECIPES = [n.stem for n in sorted((ROOT / "recipes").glob("*.yaml")) if "exl2" in n.stem]


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    """A controller cache holding the staged TabbyAPI and a wheelhouse for this Python."""
    sources = tmp_path_factory.mktemp("cache") / "sources"
    sources.mkdir()
    shutil.copy(tabbyapi_archive(), staged_archive(TC.tabbyapi_ref, sources))
    wheelhouse.build(staged_archive(TC.tabbyapi_ref, sources), PYTHON, sources)
    return sources


def test_the_staged_copy_is_the_pinned_commit():
    from playbooks.steps.build.tabbyapi_stage import archive_commit

    staged = tabbyapi_archive()
    assert archive_commit(staged) == TC.tabbyapi_ref  # the id git archive wrote, not a file hash
    reqs = wheelhouse.requirements(staged)
    assert "pydantic == 2.11.0" in reqs and not any(r.startswith(("torch", "exllamav2")) for r in reqs)


def test_a_wheelhouse_is_made_for_one_python_and_packed_the_same_twice(staged):
    tar = wheelhouse.packed(TC.tabbyapi_ref, wheelhouse.python_tag(PYTHON), staged)
    names = subprocess.run(["tar", "-tf", str(tar)], capture_output=True, text=True, check=True).stdout.split()
    assert any(n.startswith("pydantic-2.11.0-") for n in names)
    assert {"setuptools", "wheel", "packaging"} <= {n.split("-")[0] for n in names}
    before = tar.read_bytes()
    wheelhouse.pack(wheelhouse.wheels_dir(TC.tabbyapi_ref, wheelhouse.python_tag(PYTHON), staged), tar)
    assert tar.read_bytes() == before
    with pytest.raises(Exception, match=r"give the Python version as 3.10, 3.11"):
        wheelhouse.python_tag("3.11; rm -rf /")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sshd_host", "nspawn_host"])
def test_tabbyapi_is_pushed_installed_offline_and_proven_then_left_alone(kind, request, staged):
    th = request.getfixturevalue(kind)
    prefix = f"{th.prefix}/tabby-{uuid.uuid4().hex[:8]}"  # the container is shared: a prefix of its own
    venv = f"{prefix}/venv"
    step = EnsureTabbyAPI(prefix, venv, TC, cache=staged)
    with connect(spec_for(th)) as host:
        try:
            # the toolchain venv as the toolchain step makes it (stdlib venv), without its torch
            host.run(f"python3 -m venv {shlex.quote(venv)}")
            (dry,) = run_ops(host, [step], dry_run=True)
            assert dry.status == "changed", dry.why
            assert "from the copy staged on the controller" in dry.why
            assert f"offline from the controller's wheelhouse (tabbyAPI-{TC.tabbyapi_ref}-{TAG}.tar)" in dry.why
            assert any(" --no-index --find-links " in c for c in dry.commands), dry.commands
            assert not host.exists(f"{prefix}/tabbyAPI") and not host.exists(f"{prefix}/src")

            (change,) = run_ops(host, [step])
            assert change.status == "changed", change.detail[-3000:] or change.why
            assert host.read_bytes(f"{prefix}/tabbyAPI/{MARKER}").decode().strip() == TC.tabbyapi_ref
            assert not host.exists(f"{prefix}/tabbyAPI.vf-new") and not host.exists(
                f"{prefix}/tabbyAPI/.voltaforge-proof.py"
            )
            # the wheels were unpacked for the install and removed; the pushed tar stays (checksummed)
            assert not host.exists(f"{prefix}/src/tabbyAPI-{TC.tabbyapi_ref}-{TAG}")
            pins = host.run(f"{shlex.quote(venv)}/bin/python -m pip freeze", stream=False).stdout
            assert "pydantic==2.11.0" in pins and "torch" not in pins

            # TabbyAPI's own config model, at this commit, in this venv, parses what we render
            parsed = _parse_with_tabbyapi(host, f"{prefix}/tabbyAPI", venv)
            for name, (ours, theirs) in parsed.items():
                for section, values in ours.items():
                    for key, value in values.items():
                        # a key TabbyAPI does not know would be dropped from its dump: none is
                        assert _fold(theirs[section][key]) == _fold(value), (name, section, key)

            (again,) = run_ops(host, [step])
            assert again.status == "ok" and again.why == f"TabbyAPI {TC.tabbyapi_ref[:12]} at {prefix}/tabbyAPI"
        finally:
            host.run(f"rm -rf -- {shlex.quote(prefix)}", check=False)


PARSE = """
import json, sys
sys.path.insert(0, ".")
from ruamel.yaml import YAML
from common.config_models import TabbyConfigModel
out = {}
for path in sys.argv[1:]:
    with open(path) as f:
        ours = YAML(typ="safe").load(f)
    out[path] = [ours, TabbyConfigModel.model_validate(ours).model_dump(mode="json")]
print(json.dumps(out))
"""


def _fold(value):
    """TabbyAPI's validators lower-case some names (api_servers: OAI -> oai); nothing else moves."""
    return [_fold(v) for v in value] if isinstance(value, list) else value.lower() if isinstance(value, str) else value


def _parse_with_tabbyapi(host, tree: str, venv: str) -> dict[str, tuple[dict, dict]]:
    """Each shipped EXL2 recipe's config.yml (a split one with its planned gpu_split), and the
    first one keyed and open to the network (auth on: disable_auth false), parsed on the host by
    TabbyAPI's TabbyConfigModel: ours as written, theirs as validated."""
    recipes = {name: load_recipe(name) for name in EXL2_RECIPES}
    first = recipes[EXL2_RECIPES[0]].recipe
    keyed = first.model_copy(
        update={"service": first.service.model_copy(update={"bind": "0.0.0.0", "api_key_ref": "k"})}
    )
    texts = {name: render_tabbyapi_config(r.recipe, gpu_split=resolve_gpu_split(r)) for name, r in recipes.items()}
    texts["keyed"] = render_tabbyapi_config(keyed)
    assert "disable_auth: false" in texts["keyed"] and "0.0.0.0" in texts["keyed"]
    paths = {}
    for name, text in texts.items():
        path = f"{tree}/../cfg-{name}.yml"
        host.write_file(path, text.encode(), 0o644)
        paths[path] = name
    host.write_file(f"{tree}/../parse.py", PARSE.encode(), 0o644)
    cmd = f"cd {shlex.quote(tree)} && {shlex.quote(venv)}/bin/python ../parse.py " + " ".join(map(shlex.quote, paths))
    out = json.loads(host.run(cmd, stream=False).stdout)
    return {paths[p]: (ours, theirs) for p, (ours, theirs) in out.items()}


def test_the_proof_fails_in_one_message_where_the_server_cannot_start(tmp_path):
    """The proof is not a formality: run by a Python without TabbyAPI's dependencies (this
    project's own venv has no loguru), it fails saying how the server ended, with its log."""
    subprocess.run(["tar", "-xzf", str(tabbyapi_archive()), "-C", str(tmp_path)], check=True)
    from playbooks.steps.build import tabbyapi_proof

    r = subprocess.run([sys.executable, tabbyapi_proof.__file__, str(tmp_path)], capture_output=True, text=True)
    assert r.returncode != 0
    assert r.stderr.startswith("TabbyAPI's proof failed (exited 1): ")
    assert '"health": 0' in r.stderr and "No module named 'loguru'" in r.stderr
