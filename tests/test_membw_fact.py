"""The host's memory bandwidth as a host fact: measured the way STREAM reports it, kept on the
host with what identifies its memory system, reused until that changes or ``--remeasure``.

The identity command and the probe run for real on this machine (its /proc, its sysfs, its
memory); the stored record goes through the same shell command a remote host runs."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pytest

from playbooks.facts import membw
from playbooks.host.local import LocalHost
from playbooks.steps.measure.bench_ceilings import host_membw
from tests import llamacpp_tools

PROBES = Path(membw.__file__).resolve().parent / "probes"


def _probe_module():
    spec = importlib.util.spec_from_file_location("membw_probe", PROBES / "membw_probe.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(prefix: str) -> tuple[membw.MemoryIdentity, dict | None]:
    out = subprocess.run(["sh", "-c", membw.identity_command(prefix)], capture_output=True, text=True, check=True)
    return membw.parse_identity(out.stdout)


def test_the_identity_is_this_machines_own(tmp_path):
    ident, stored = _read(str(tmp_path))
    assert stored is None
    assert ident.kernel == platform.release() and ident.cpus == len(os.sched_getaffinity(0))
    meminfo = Path("/proc/meminfo").read_text()
    assert ident.mem_total_kb == int(next(ln.split()[1] for ln in meminfo.splitlines() if ln.startswith("MemTotal:")))
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), "unknown")  # fmt: skip
    assert ident.cpu_model == model


def test_a_stored_figure_is_reused_only_on_the_same_memory_system(tmp_path):
    ident, _ = _read(str(tmp_path))
    figure = membw.Membw(copy_gb_s=24.4, method="numpy", trials=[24.4, 21.0], threads=2, buffer_bytes=2**30)
    record = membw.stored_record(ident, figure, "2026-12-01T15:00:00Z")
    subprocess.run(["sh", "-c", membw.store_command(str(tmp_path), record)], check=True)
    assert not list((tmp_path / "facts").glob("*.tmp"))
    again, stored = _read(str(tmp_path))
    now = datetime(2026, 12, 3, 7, 0, tzinfo=timezone.utc)
    found, why = membw.reusable(stored, again, now=now)
    assert found == figure and why == "stored, measured 2026-12-01T15:00:00Z"
    # a figure past its age is measured again; a pure-Python lower bound is never a ceiling
    later = datetime(2027, 1, 15, tzinfo=timezone.utc)
    assert membw.reusable(stored, again, now=later) == (None, "the stored figure is 44 days old (the limit: 30)")
    floor = record | {"membw": record["membw"] | {"lower_bound": True, "method": "python"}}
    assert membw.reusable(floor, again, now=now) == (
        None,
        "the stored figure is a pure-Python lower bound, not a ceiling",
    )
    refused = membw.ceiling_refusal(membw.Membw(copy_gb_s=3.1, method="python", lower_bound=True))
    assert refused is not None and refused.startswith("not a ceiling: 3.1 GB/s from pure-Python copies")
    assert membw.ceiling_refusal(figure) is None
    # each part of the identity, changed, means measuring again, and says which
    for field, value in (("cpu_model", "AMD EPYC 7742"), ("cpus", 64), ("mem_total_kb", 1), ("kernel", "6.1.0-99")):
        found, why = membw.reusable(stored, replace(again, **{field: value}), now=now)
        assert found is None and why.startswith("the host changed since it was measured (") and field in why
    assert membw.reusable(None, again) == (None, "no stored figure on the host")
    (tmp_path / "facts" / "membw.json").write_text("{torn")
    assert _read(str(tmp_path))[1] is None
    (tmp_path / "facts" / "membw.json").write_text(json.dumps(record | {"version": 99}))
    assert _read(str(tmp_path))[1] is None  # a record of another format is not trusted


def test_stream_sizing_leaves_the_caches(tmp_path):
    """Four times the sum of the last-level caches (each shared cache once), at least 256 MiB,
    at most 1 GiB; read from a sysfs tree of two sockets (L3 of 32 MiB each, four CPUs)."""
    probe = _probe_module()
    for cpu in range(4):
        for index, (level, size, shared) in enumerate(
            [(1, "32K", str(cpu)), (3, "32768K", "0-1" if cpu < 2 else "2-3")]
        ):
            d = tmp_path / f"cpu{cpu}" / "cache" / f"index{index}"
            d.mkdir(parents=True)
            (d / "level").write_text(f"{level}\n")
            (d / "size").write_text(f"{size}\n")
            (d / "shared_cpu_list").write_text(f"{shared}\n")
    assert probe.last_level_cache_bytes(str(tmp_path)) == 2 * 32 * 2**20
    assert probe.last_level_cache_bytes(str(tmp_path / "none")) == 0
    here = probe.default_mib()
    assert 256 <= here <= 1024 and here >= min(1024, 4 * probe.last_level_cache_bytes() // 2**20)


@pytest.mark.timeout(300)
def test_the_bench_measures_once_then_reuses_until_told(tmp_path):
    """Through the bench's own function on this machine: the first run measures (best of 10,
    every trial kept) and stores; the second reads the same figure back; ``--remeasure``
    measures again; a stored figure of another kernel is not used."""
    prefix = str(tmp_path / "vf")
    with LocalHost() as host:
        first = host_membw(host, prefix, sys.executable)
        assert first["gb_s"] > 0.5 and first["source"].startswith("measured ")
        assert "no stored figure on the host" in first["source"]
        assert len(first["probe"]["trials"]) == 10 and first["gb_s"] == max(first["probe"]["trials"])
        again = host_membw(host, prefix, sys.executable)
        assert again["gb_s"] == first["gb_s"] and again["source"].startswith("stored, measured ")
        fresh = host_membw(host, prefix, sys.executable, remeasure=True)
        assert fresh["source"].startswith("measured ") and "--remeasure" in fresh["source"]
        path = Path(membw.stored_path(prefix))
        record = json.loads(path.read_text())
        record["identity"]["kernel"] = "5.10.0-old"
        path.write_text(json.dumps(record))
        moved = host_membw(host, prefix, sys.executable)
        assert moved["source"].startswith("measured ") and "kernel: '5.10.0-old' -> " in moved["source"]
    print(f"membw here: {first['gb_s']} then {fresh['gb_s']} then {moved['gb_s']} GB/s (best of 10)")


def test_the_device_copy_runs_real_torch_and_says_why_there_is_no_gpu():
    """The GPU's own copy rate (``--device cuda``, reported beside the datasheet figure on a lent
    GPU) through the real torch of the converter's venv (a CPU build): no CUDA device here, one
    error line; without torch, another."""
    torch_python = llamacpp_tools.convert_python()
    run = subprocess.run(
        [str(torch_python), str(PROBES / "membw_probe.py"), "--device", "cuda", "--mib", "8"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    got = membw.read_membw(run.stdout)
    assert (
        run.returncode == 0
        and got.copy_gb_s is None
        and (got.kind, got.error) == ("no-cuda", "torch sees no CUDA device")
    )
    bare = subprocess.run(
        [sys.executable, "-S", str(PROBES / "membw_probe.py"), "--device", "cuda"], capture_output=True, text=True
    )
    assert membw.read_membw(bare.stdout).kind == "no-torch"
