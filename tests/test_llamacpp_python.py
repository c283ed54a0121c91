"""llama-cpp-python's decisions: one compile of llama.cpp per host. The bindings are the
pinned sdist's Python package without its own llama.cpp compile, their ``llama_cpp/lib`` a link
to the server build's ``current/bin``; decided on facts, stamped from the real import check of
such bindings on this machine (fixture). The real install, load and generation over SSH, and
the bindings following a rebuilt server, are in test_quantize_real.py."""

from __future__ import annotations

import json

import pytest

from playbooks.facts import gpu
from playbooks.host.ops import OperationError, Record
from playbooks.steps.build.build import BuildLayout
from playbooks.steps.build.llamacpp_python import BindingsFacts, EnsureLlamaCppPython, bindings_stamp
from playbooks.steps.build.llamacpp_source import Source
from playbooks.steps.build.proven_build import Probe
from tests.helpers import ROOT, fixture_body

SOURCE = Source("llama-cpp-python==0.3.36", "0c1e570", ROOT / "x.tar.gz", "ab" * 32, "x/vendor/llama.cpp")
LAYOUT = BuildLayout("/opt/vf")
VENV = "/opt/vf/venv"
BUILD = "0c1e570-cpu-0123456789ab"
CURRENT = f"/opt/vf/llama.cpp/builds/{BUILD}"
NO_GPU = gpu.GpuFacts(available=False, reason="nvidia-smi not found")
TITAN_ADA = gpu.parse_nvidia_smi_csv(fixture_body("nvidia-smi-csv-compute-cap-titanv-volta-driver570.txt"), fields=None)
#: the real import check of such bindings, here, its build directory moved under the layout's
IMPORTED = fixture_body("thishost-llama-cpp-python-import-shared-build.txt").replace(
    "/tmp/exp/build/bin", f"{CURRENT}/bin"
)


def op(cuda=False):
    return EnsureLlamaCppPython(LAYOUT, SOURCE, VENV, cuda=cuda)


def facts(**kw):
    return BindingsFacts(**{"current": CURRENT, "gpus": NO_GPU, **kw})


def proven(o, f, output=IMPORTED):
    """The stamp the operation writes after a successful install on these facts."""
    record = next(c for c in o.decide(f).commands if isinstance(c, Record))
    return json.loads(bindings_stamp(record, {"version": output}))


def test_a_fresh_venv_gets_the_package_without_a_compile_linked_to_the_current_build():
    d = op().decide(facts())
    mkdir, wheel, install, link, probe, record = d.commands
    assert d.reason == "not installed"
    # the sdist's own switches: no llama.cpp compile, the system PATH only (no toolkit at all)
    assert "CMAKE_ARGS='-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF'" in wheel.show()
    assert "PATH=/usr/sbin:/usr/bin:/sbin:/bin" in wheel.show() and "FORCE_CMAKE" not in wheel.show()
    assert "cuda" not in wheel.show().lower() and "/opt/vf/src/llama_cpp_python-" not in mkdir.show()
    assert install.show().startswith("/opt/vf/venv/bin/pip install --disable-pip-version-check --no-cache-dir /opt")
    assert link.show() == (
        "for d in /opt/vf/venv/lib/python3*/site-packages/llama_cpp; do "
        'rm -rf -- "$d/lib" && ln -s -- /opt/vf/llama.cpp/current/bin "$d/lib"; done'
    )
    assert isinstance(probe, Probe) and not probe.may_fail and "realpath" in probe.command


def test_cuda_bindings_are_the_same_package_and_import_where_the_driver_is():
    cpu, cuda = op().decide(facts()), op(cuda=True).decide(facts())
    assert cpu.shown()[:4] == cuda.shown()[:4]  # nothing to compile: the kernels are the server's
    assert cuda.commands[4].may_fail  # no GPU here: the import needs libcuda, recorded only
    assert not op(cuda=True).decide(facts(gpus=TITAN_ADA)).commands[4].may_fail


def test_proven_on_the_current_build_is_ok_without_pip():
    stamp = proven(op(), facts())
    assert stamp["server_build"] == BUILD and stamp["library"] == f"{CURRENT}/bin/libllama.so.0.5.0"
    d = op().decide(facts(installed="0.3.36", stamp=stamp, link="/opt/vf/llama.cpp/current/bin"))
    assert d.commands == () and d.reason.endswith(f"on build {BUILD}")


def test_a_new_server_build_is_followed_by_a_proof_not_a_rebuild():
    stamp = proven(op(), facts())
    new = "/opt/vf/llama.cpp/builds/0c1e570-cpu-ba9876543210"
    d = op().decide(facts(installed="0.3.36", stamp=stamp, link="/opt/vf/llama.cpp/current/bin", current=new))
    assert d.reason == f"the server build switched from {BUILD} to 0c1e570-cpu-ba9876543210: followed, not rebuilt"
    probe, record = d.commands
    assert isinstance(probe, Probe) and isinstance(record, Record)
    # a package whose link was lost (a reinstall by hand) gets it back, again without pip
    d = op().decide(facts(installed="0.3.36", stamp=stamp, link=None))
    assert d.reason.startswith("its library link points at nothing") and "pip" not in " ".join(d.shown())


@pytest.mark.parametrize(
    ("installed", "stamp", "reason"),
    [
        ("0.3.20", None, "0.3.20 installed, want 0.3.36"),
        ("0.3.36", None, "0.3.36 installed without a proof of how it was built"),
        ("0.3.36", {"id": "0.3.36-0123456789ab"}, "built from other inputs (0.3.36-0123456789ab)"),
    ],
)
def test_other_bindings_are_reinstalled_without_touching_their_dependencies(installed, stamp, reason):
    d = op().decide(facts(installed=installed, stamp=stamp))
    assert d.reason.startswith(reason)
    assert "--force-reinstall --no-deps" in d.commands[2].show()


def test_a_library_loaded_from_elsewhere_is_refused():
    stray = IMPORTED.replace(f"{CURRENT}/bin", "/opt/vf/venv/lib/python3.11/site-packages/llama_cpp/lib")
    with pytest.raises(OperationError, match="must link to /opt/vf/llama.cpp/current/bin"):
        proven(op(), facts(), stray)


def test_an_import_that_could_not_run_records_the_build_it_was_decided_on():
    stamp = proven(op(cuda=True), facts(), "(exit 1) OSError: libcuda.so.1: cannot open shared object file")
    assert stamp["library"] is None and stamp["server_build"] == BUILD
    d = op(cuda=True).decide(facts(installed="0.3.36", stamp=stamp, link="/opt/vf/llama.cpp/current/bin"))
    assert d.commands == ()  # a second run on the build box changes nothing
