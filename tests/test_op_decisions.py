"""Every operation's decision, table-driven: facts in, commands and reason out (pyinfra's
tests/operations/*/*.json). Milliseconds, no host: the real sshd and container tests in
test_ops.py / test_toolchain.py cover reading the facts and applying the commands.

Each case is also decided twice on the same facts (a decision is a value: the same facts
give the same decision, and nothing is left on the operation), and the operation is checked
to hold no per-host state after deciding.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from playbooks.config.recipe import Toolchain
from playbooks.facts.cuda import Toolkit
from playbooks.facts.files import FileStat
from playbooks.facts.system import OsRelease
from playbooks.host.ops import (
    Command,
    EnsureDirectory,
    FileFacts,
    OperationError,
    Upload,
)
from playbooks.steps.build.toolchain import CudaFacts, EnsureCudaToolkit, EnsureTorch, EnsureVenv, TorchFacts
from tests.file_ops import EnsureFile

DATA = Path(__file__).parent / "data" / "operations"


def _stat(d):
    return None if d is None else FileStat(d["kind"], int(d["mode"], 8), d["owner"], d["group"])


def _mode(args):
    return {**args, **({"mode": int(args["mode"], 8)} if "mode" in args else {})}


BUILD = {
    "ensure_directory": (lambda a: EnsureDirectory(**_mode(a)), _stat),
    "ensure_file": (
        lambda a: EnsureFile(**{**_mode(a), "content": a["content"].encode()}),
        lambda f: FileFacts(_stat(f["stat"]), f["sha256"]),
    ),
    "ensure_cuda_toolkit": (
        lambda a: EnsureCudaToolkit(**a),
        lambda f: CudaFacts(
            toolkits=tuple(Toolkit(**t) for t in f["toolkits"]),
            os=OsRelease(**f["os"]),
            nonfree_sources=tuple(f["nonfree_sources"]),
            debian_mirror=f["debian_mirror"],
        ),
    ),
    "ensure_torch": (
        lambda a: EnsureTorch(a["venv"], Toolchain(torch=a["torch"], torch_index=a["torch_index"])),
        lambda f: TorchFacts(**f) if isinstance(f, dict) else TorchFacts(f),
    ),
    "ensure_venv": (lambda a: EnsureVenv(**a), lambda f: f),
}


def describe(cmd: Command) -> str:
    if isinstance(cmd, Upload):
        return f"upload {cmd.path} {cmd.mode:04o} {len(cmd.content)} bytes sha256 {cmd.digest[:12]}"
    return cmd.command


def cases():
    for path in sorted(DATA.glob("*.yaml")):
        spec = yaml.safe_load(path.read_text())
        for case in spec["cases"]:
            yield pytest.param(path.stem, {**spec["op"], **case.get("op", {})}, case, id=f"{path.stem}: {case['name']}")


def test_every_operation_has_a_table():
    assert {p.stem for p in DATA.glob("*.yaml")} == set(BUILD)


@pytest.mark.parametrize("kind,args,case", list(cases()))
def test_decision(kind, args, case):
    make_op, make_facts = BUILD[kind]
    op = make_op(args)
    facts = make_facts(case["facts"])
    before = copy.deepcopy(op.__dict__)
    if "error" in case:
        with pytest.raises(OperationError) as err:
            op.decide(facts)
        assert str(err.value) == case["error"]
        return
    first, second = op.decide(facts), op.decide(facts)
    assert first == second
    assert [describe(c) for c in first.commands] == case["commands"]
    assert first.reason == case["reason"]
    assert op.__dict__ == before, "deciding must not store anything on the operation"
