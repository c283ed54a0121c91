"""Small shared helpers for tests (no fixtures here: see conftest.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

# One module under both of its names: conftest imports ``helpers`` (tests/ is on sys.path) and
# the test modules ``tests.helpers``; two copies would keep two sets of lock state below, and
# a process could wait on its own lock.
sys.modules.setdefault("helpers", sys.modules[__name__])
sys.modules.setdefault("tests.helpers", sys.modules[__name__])

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parent.parent


def exited(pid: int) -> bool:
    """The process is gone or has exited and waits to be reaped (a zombie): a managed process's
    stop returns once it has exited (service_manager.ProcessRunner), and its reaping is pid 1's,
    1.6 s later on this VM's."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def as_in_a_terminal() -> None:
    """A ``preexec_fn``: SIGINT back to its default in the child, as a terminal starts a program.
    A suite started in the background of a non-interactive shell (`nohup bash .ci/run &`) runs
    with SIGINT ignored, every child inherits that, and Python then never turns a Ctrl-C into
    KeyboardInterrupt: a Ctrl-C test would test nothing (cold runs 80-84)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def doc_pages() -> list[Path]:
    """The README and the docs/ pages it links to: where the project's words and figures are."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def docs_text() -> str:
    """Every page of :func:`doc_pages` joined (a search for what the docs say, wherever it is)."""
    return "\n".join(p.read_text() for p in doc_pages())


def rich_text(render, *args, width: int = 120) -> str:
    """What a renderer taking ``(*args, console)`` prints, as plain text."""
    import io

    from playbooks.cli.render import console

    buf = io.StringIO()
    render(*args, console(file=buf, width=width))
    return buf.getvalue()


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
    in a container, the keyed provision) and, through :func:`cpu_quiet`, by those that measure
    the CPU (the bench's sweep, tune's search): with two xdist workers, no two of them run at
    once, and the compiles follow one another, each finding the one before in the run's ccache.
    The other worker goes on with the rest (a measurement also stops it: :func:`cpu_quiet`).
    One lock per run (all workers share its id).

    Re-entrant within a process: the tools' llama.cpp build (llamacpp_tools.build_tools) takes
    it too, from inside a test that may hold it already (the bench's model fixture). Taken
    before any cache lock, never after one, so two workers never wait on each other; a test
    that shares the CPU (:func:`sharing_the_cpu`) lets its share go while it waits here."""
    import fcntl

    global _cpu_held
    if _cpu_held:
        _cpu_held += 1
        try:
            yield
        finally:
            _cpu_held -= 1
        return
    with _share_let_go(), open(per_run("cpu.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _cpu_held = 1
        try:
            yield
        finally:
            _cpu_held = 0


_cpu_held = 0  # how deep this process holds cpu_alone


# -- quiet: a measurement with the cores to itself ---------------------------------------------
#
# cpu_alone keeps two heavy tests apart, but the other worker's ordinary tests (a CLI walk
# starting interpreters, a server loading) still ran beside a measurement: in cold run 64a the
# bench's sweep took 786.9 s (every level to its cap, the noise never settling; 71.2 s quiet in
# run 64b) and its single stream was not timeable (8.6 tok/s). Priorities cannot help: the kernel groups
# processes by session (sched_autogroup), so each SSH session's server competes as a group of
# its own whatever the test process's nice value. So a reader-writer lock: every ordinary
# test holds it shared while it runs, a measurement exclusively, and the other worker waits
# between two tests until the measurement ends. A turnstile (the gate) keeps a waiting
# measurement from being passed by the other worker's next test.

_quiet_fd: Any = None  # the shared or exclusive hold of quiet.lock, while this process has one
_quiet_mode: str | None = None  # "shared" | "exclusive"


def _take_quiet(mode: str) -> None:
    import fcntl

    global _quiet_fd, _quiet_mode
    fd = open(per_run("quiet.lock"), "w")  # noqa: SIM115 (held until _drop_quiet)
    with open(per_run("quiet.gate"), "w") as gate:
        fcntl.flock(gate, fcntl.LOCK_EX)  # behind a measurement already waiting
        fcntl.flock(fd, fcntl.LOCK_SH if mode == "shared" else fcntl.LOCK_EX)
    _quiet_fd, _quiet_mode = fd, mode


def _drop_quiet() -> None:
    global _quiet_fd, _quiet_mode
    if _quiet_fd is not None:
        _quiet_fd.close()  # closing the file lets the flock go
    _quiet_fd, _quiet_mode = None, None


@contextlib.contextmanager
def _share_let_go():
    """While this process waits for cpu_alone, its shared hold is let go (and taken again
    after): a measurement holding cpu_alone may be waiting for it, and neither would move."""
    held = _quiet_mode == "shared"
    if held:
        _drop_quiet()
    try:
        yield
    finally:
        if held:
            _take_quiet("shared")


@contextlib.contextmanager
def sharing_the_cpu():
    """Held shared by every test that neither holds cpu_alone nor measures (conftest's autouse
    fixture): a measurement waits for the test running now, and the next one waits for it."""
    if _quiet_mode is not None:
        yield
        return
    _take_quiet("shared")
    try:
        yield
    finally:
        if _quiet_mode == "shared":
            _drop_quiet()


@contextlib.contextmanager
def cpu_quiet():
    """cpu_alone, and the other worker stopped between its tests until this ends: for the tests
    that measure the CPU (the bench's sweep and its stream tests, tune's search) and for the
    tools' build the other worker's real tests wait on. Re-entrant."""
    with cpu_alone():
        if _quiet_mode == "exclusive":
            yield
            return
        _take_quiet("exclusive")
        try:
            yield
        finally:
            _drop_quiet()


def share_ccache_dir(shared: Path | None = None) -> Path:
    """A ccache directory (the run's, :func:`session_ccache`, by default) that the builds of
    every user and session share."""
    shared = shared or session_ccache()
    shared.mkdir(exist_ok=True)
    # each xdist worker has its own test user (tests/testhosts.py), and the tools' build runs
    # as this process's user: what one leaves here, the next one's writes beside (ccache
    # applies its own umask setting)
    shared.chmod(0o777)
    # the tools' build (llamacpp_tools.build_tools) runs in this process's environment (LANG
    # C.UTF-8 here, whatever CI has), the SSH builds in login sessions without LANG: ccache
    # hashes LANG and LC_* unless the locale is declared sloppy, so nothing hit across them
    # (measured: 0 of 159). The build step's LC_ALL=C decides the compiler's language anyway.
    (shared / "ccache.conf").write_text("umask = 000\nsloppiness = locale\n")
    return shared


def shared_ccache(prefix: Path, user: str) -> None:
    """Point a test host's ccache (<prefix>/llama.cpp/ccache) at one directory shared by this
    test run's hosts (every worker's test user), so the second host's build hits what the first compiled:
    the build step sets CCACHE_BASEDIR to the prefix, which makes the paths match."""
    import shutil

    shared = share_ccache_dir()
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
    host,
    prefix: str,
    recipe: Path,
    gguf_file: Path,
    quant: str = "Q4_K_M",
    manifest_extra: dict | None = None,
    tools: bool = True,
) -> str:
    """What `invoke build` and `invoke quantize` leave for `invoke deploy`: the tools' CPU
    llama-server and llama-bench (with their libraries) behind a `current` link, and the quantized model with its
    manifest under models/<id>/gguf/ (quantize's own run of it: tests/test_quantize_real.py).
    ``tools`` False: the model only (another quant beside a server that runs)."""
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
    if tools:
        llamacpp_tools.put_tools(host, ("llama-server", "llama-bench"), f"{build}/bin")
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
