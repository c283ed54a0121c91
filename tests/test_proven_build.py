"""The one build-id helper the three build steps share (steps/proven_build.inputs_id): the
same inputs name the same build whatever their order, any change names another, and the
names are the ones the steps used before the helper (a fleet cache keeps its hits)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

from playbooks.steps.build.build import BuildInputs
from playbooks.steps.build.exllamav2 import ExtInputs
from playbooks.steps.build.llamacpp_python import BindingsInputs
from playbooks.steps.build.proven_build import inputs_id


def _old(label: str, fields: dict) -> str:  # what each step computed on its own before
    return f"{label}-{hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]}"


def test_the_same_inputs_name_the_same_build_and_a_change_another():
    a = {"ref": "0c1e570", "arch": "70", "flags": ["-DGGML_NATIVE=OFF"]}
    assert inputs_id("x", a) == inputs_id("x", dict(reversed(list(a.items()))))
    assert inputs_id("x", a) != inputs_id("x", {**a, "arch": "70;80"})
    assert inputs_id("x", a).startswith("x-") and len(inputs_id("x", a)) == len("x-") + 12


def test_every_build_step_keeps_its_old_names():
    b = BuildInputs("/opt/vf", "0c1e570", "ab" * 32, "cuda", "70", "11.8", "gcc 12.2.0", ("-DA=1",), ("llama-server",))
    assert b.build_id == _old("0c1e570-cuda", asdict(b))
    # the bindings' inputs changed with issue 22 (no compile of their own): same helper, new names
    p = BindingsInputs("/opt/vf/venv", "0.3.36", "0c1e570", "ab" * 32, ("-DB=1",), "/opt/vf/llama.cpp/current/bin")
    assert p.build_id == _old("0.3.36", asdict(p))
    e = ExtInputs("/opt/vf/venv", "0.3.2", "2.7.1+cu118", "7.0", "11.8", "gcc 12.2.0")
    assert e.build_id == _old("0.3.2", asdict(e))
