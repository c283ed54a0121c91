"""Small shared helpers for tests (no fixtures here: see conftest.py)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parent.parent


def doc_pages() -> list[Path]:
    """The README and the docs/ pages it links to: where the project's words and figures are."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def docs_text() -> str:
    """Every page of :func:`doc_pages` joined (a search for what the docs say, wherever it is)."""
    return "\n".join(p.read_text() for p in doc_pages())


def fixture_body(name: str) -> str:
    """A captured output without its '# source/# what' header (everything after '# ---')."""
    text = (FIXTURES / name).read_text()
    head, sep, body = text.partition("\n# ---\n")
    return body if sep else text


def host_entry(host) -> dict:
    return {
        "host": host.hostname,
        "port": host.port,
        "user": host.user,
        "key_file": str(host.key_filename),
        "known_hosts": str(host.known_hosts),
    }


def spec_for(host, name: str = "test-host"):
    """A HostSpec for a test host (sshd_host, nspawn_host, ...)."""
    from playbooks.config.inventory import HostSpec

    return HostSpec(name=name, **host_entry(host))


def inventory_for(tmp_path: Path, name: str, host, prefix: str | None = None, recipe: str | None = None) -> Path:
    """An inventory.yaml that points `name` at a test host (sshd_host, nspawn_host, ...)."""
    import yaml

    entry = host_entry(host)
    if prefix:
        entry["prefix"] = prefix
    if recipe:
        entry["recipe"] = recipe
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({"hosts": {name: entry}}))
    return path


def recipe_with(tmp_path: Path, base: str, extra: str, name: str = "test-recipe") -> Path:
    """A copy of a shipped recipe with YAML appended (its model config path made absolute)."""
    src = (ROOT / "recipes" / f"{base}.yaml").read_text()
    src = src.replace("config: models/", f"config: {ROOT}/recipes/models/")
    (tmp_path / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    path = tmp_path / f"{name}.yaml"
    path.write_text(src + extra)
    return path


def per_run(name: str) -> Path:
    """/tmp/vf-test-NAME-<run>: one per test run, not per process (every xdist worker has the
    run's id in PYTEST_XDIST_TESTRUNUID; one process alone uses its pid)."""
    import os
    import tempfile

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())
    return Path(tempfile.gettempdir()) / f"vf-test-{name}-{run}"


def session_ccache() -> Path:
    """The ccache directory this test run's SSH hosts share, so each pytest-xdist worker finds
    what another worker's build compiled."""
    return per_run("ccache")


@contextlib.contextmanager
def cpu_alone():
    """Held by the tests that keep both cores busy for minutes (a llama.cpp compile over SSH or
    in a container) or measure the CPU (the bench's sweep, tune's search): with two xdist
    workers, no two of them run at once, so a measurement never shares the CPU with a compile
    (its cross-check compares the client's clock with the server's, not with a neighbour's
    load) and the compiles follow one another, each finding the one before in the run's ccache.
    The other worker goes on with the rest. One lock per run (all workers share its id).

    Re-entrant within a process: the static llama.cpp build (llamacpp_tools.build_tools) takes
    it too, from inside a test that may hold it already (the bench's model fixture). Taken
    before any cache lock, never after one, so two workers never wait on each other."""
    import fcntl

    global _cpu_held
    if _cpu_held:
        _cpu_held += 1
        try:
            yield
        finally:
            _cpu_held -= 1
        return
    with open(per_run("cpu.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _cpu_held = 1
        try:
            yield
        finally:
            _cpu_held = 0


_cpu_held = 0  # how deep this process holds cpu_alone


def shared_ccache(prefix: Path, user: str) -> None:
    """Point a test host's ccache (<prefix>/llama.cpp/ccache) at one directory shared by this
    test run's hosts (every worker's test user), so the second host's build hits what the first compiled:
    the build step sets CCACHE_BASEDIR to the prefix, which makes the paths match."""
    import shutil

    shared = session_ccache()
    shared.mkdir(exist_ok=True)
    # each xdist worker has its own test user (tests/testhosts.py): what one user's compile
    # leaves here, the next one's writes beside (ccache applies its own umask setting)
    shared.chmod(0o777)
    (shared / "ccache.conf").write_text("umask = 000\n")
    for d in (prefix, prefix / "llama.cpp"):
        d.mkdir(exist_ok=True)
        shutil.chown(d, user, user)
    (prefix / "llama.cpp" / "ccache").symlink_to(shared)


def put_gguf(host, local: Path, remote: str, quant: str, manifest_extra: dict | None = None) -> None:
    """A GGUF where quantize leaves it, with the manifest quantize writes beside it (path, kind,
    quant, bytes, sha256; ``manifest_extra`` added, e.g. a verification)."""
    import hashlib
    import json

    from playbooks.steps.weights.model_layout import manifest_path

    host.run(f"mkdir -p {remote.rsplit('/', 1)[0]}", stream=False)
    host.put(str(local), remote, mode=0o644)
    data = local.read_bytes()
    manifest = {"path": remote, "kind": "gguf", "quant": quant, "bytes": len(data)}
    manifest["sha256"] = hashlib.sha256(data).hexdigest()
    host.put(json.dumps(manifest | (manifest_extra or {})).encode(), manifest_path(remote), mode=0o644)


def stage_served_model(
    host, prefix: str, recipe: Path, gguf_file: Path, quant: str = "Q4_K_M", manifest_extra: dict | None = None
) -> str:
    """What `invoke build` and `invoke quantize` leave for `invoke deploy`: the static CPU
    llama-server and llama-bench behind a `current` link, and the quantized model with its
    manifest under models/<id>/gguf/ (quantize's own run of it: tests/test_quantize_real.py)."""
    from playbooks.conduct.quantize import recipe_weights
    from playbooks.config.recipe import load_recipe
    from playbooks.steps.weights.model_layout import ModelLayout
    from tests import llamacpp_tools

    loaded = load_recipe(str(recipe))
    gguf = ModelLayout(prefix, recipe_weights(loaded).model_id).gguf(quant)
    build = f"{prefix}/llama.cpp/builds/test-cpu"
    host.run(
        f"mkdir -p {build}/bin {gguf.rsplit('/', 1)[0]} && ln -sfn {build} {prefix}/llama.cpp/current", stream=False
    )
    tools = llamacpp_tools.build_tools()
    for tool in ("llama-server", "llama-bench"):
        host.put(str(tools / tool), f"{build}/bin/{tool}", mode=0o755)
    put_gguf(host, gguf_file, gguf, quant, manifest_extra)
    host.run(f"chmod -R a+rX {prefix}", stream=False)
    return gguf


def tabbyapi_archive() -> Path:
    """TabbyAPI at its pinned commit, where the project keeps staged sources: the controller's
    cache, as `invoke stage-tabbyapi` fills it (from $VOLTAFORGE_TABBYAPI_ARCHIVE, or fetched
    where GitHub is reachable), or staged from the copy a developer's checkout has beside it
    (../shared/vendor). With none of them the test is skipped (a failure in strict mode) with
    the message saying which command stages it."""
    import pytest

    from playbooks.config.recipe import Toolchain
    from playbooks.errors import VoltaforgeError
    from playbooks.steps.build.tabbyapi import ARCHIVE_ENV
    from playbooks.steps.build.tabbyapi_stage import stage

    tc = Toolchain()
    beside = ROOT.parent / "shared" / "vendor" / f"tabbyAPI-{tc.tabbyapi_ref}.tar.gz"
    given = beside if beside.is_file() and not os.environ.get(ARCHIVE_ENV) else None
    try:
        return stage(tc, given)[0]
    except VoltaforgeError as exc:
        pytest.skip(str(exc))
