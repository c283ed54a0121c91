"""`invoke top` against a real Prometheus (Debian's) scraping two real GPU exporters: one on a
STAND-IN NVML that answers captured V100 values (tests/test_monitor.py: no GPU here), one on the
real NVML binding with no driver. What the view shows of the card is held to the captures, not
to what the code computed; the servers' half is shown for real in tests/test_monitor_real.py.
Bad input: no Prometheus where the monitor's settings say is one line; a query Prometheus
refuses is named."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from playbooks.cli.top import run_top
from playbooks.conduct.settings import Settings
from playbooks.conduct.top import NoMonitor, read_view
from playbooks.steps.monitor.bench_view import run_view, server_selector, window_queries
from playbooks.steps.monitor.top import parse_answer
from tests.helpers import ROOT, as_in_a_terminal
from tests.test_monitor import _exporter, needs_exporter_deps, v100_standin
from tests.testhosts import free_port

pytestmark = [
    needs_exporter_deps,
    pytest.mark.skipif(not shutil.which("prometheus"), reason="needs Debian's prometheus"),
]


def _prometheus(tmp_path: Path, targets: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """Prometheus scraping each exporter (host -> its /metrics URL) every second, as the
    configuration `invoke monitor` renders labels them (job gpu, host)."""
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": "gpu", "static_configs": [
                {"targets": [url.split("/")[2]], "labels": {"host": host}} for host, url in targets.items()
            ]}
        ],
    }  # fmt: skip
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return proc, port


def _inventory(tmp_path: Path, port: int) -> Settings:
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {}, "monitor": {"host": "local", "port": port}}))
    return Settings(inventory=inv)


def test_top_shows_each_card_as_its_exporter_read_it(tmp_path, capsys):
    (tmp_path / "v100").mkdir()
    (tmp_path / "none").mkdir()
    procs = []
    try:
        v100, v100_url = _exporter(tmp_path / "v100", v100_standin())
        none, none_url = _exporter(tmp_path / "none")
        procs += [v100, none]
        prom, port = _prometheus(tmp_path, {"gpu-01": v100_url, "cpu-01": none_url})
        procs.append(prom)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                view = read_view(httpx.Client(timeout=5), url, "local", "here")
                if view.gpus and view.no_gpu:
                    break
            except NoMonitor:
                pass
            assert time.monotonic() < deadline, "Prometheus did not scrape both exporters"
            time.sleep(0.5)
        # the card, as the captures say (nvidia-smi -q of a V100-SXM2-32GB; its table; H100's
        # reasons with HW thermal slowdown active)
        [g] = view.gpus
        assert (g.host, g.gpu, g.name) == ("gpu-01", "0", "Tesla V100-SXM2-32GB")
        assert (g.sm_mhz, g.temp_c, g.limit_w) == (1290, 32, 300)
        assert g.power_w == pytest.approx(57.44)
        assert (g.used_bytes, g.total_bytes, g.util) == (308 * 2**20, 32768 * 2**20, 0)
        assert g.held == ("hw_thermal_slowdown",)
        [line] = view.no_gpu
        assert line.startswith("cpu-01: no GPU seen (NVML no-"), line  # no-driver or no-nvml-library
        assert view.servers == []

        # the bench's view of a run on gpu-01 (steps/monitor/bench_view.py): its GPU over the
        # window, by the same queries, is the card as the captures say
        now = time.time()
        result = {"host": "gpu-01", "server": {"service": "s", "model": "m"},
                  "sent": {"from": now - 3, "to": now - 1, "requests": 1, "completion_tokens": 2}}  # fmt: skip
        queries = window_queries(result, server_selector(result), 5)
        answers = {k: parse_answer(httpx.get(f"{url}/api/v1/query", params={"query": q}).json())
                   for k, q in queries.items()}  # fmt: skip
        counter = [(now - 4, 0.0), (now, 2.0)]  # (no llama-server here: the tokens are the test's)
        bench = run_view(result, {"tokens": counter}, answers, "here")
        assert bench["gpus"] == [{"gpu": "0", "sm_min_mhz": 1290.0, "temp_max_c": 32.0, "power_max_w": 57.4,
                                  "held": ["hw_thermal_slowdown"]}] and bench["gpus_seen"] == 1  # fmt: skip

        # the command, piped (not a terminal): one snapshot
        assert run_top(settings=_inventory(tmp_path, port)) == 0
        out = capsys.readouterr().out
        print(out)
        assert f"Prometheus on local at 127.0.0.1:{port}: no llama-server among its targets" in out
        row = next(r for r in out.splitlines() if "gpu-01" in r)
        for cell in ("Tesla V100-SXM2-32GB", "1290", "32", "57/300", "0%", "0.3/32.0", "hw_thermal_slowdown"):
            assert cell in row, (cell, row)
        # the page shows this run's rows as they are
        page = (ROOT / "docs" / "monitor.md").read_text()
        for line in out.splitlines()[
            out.splitlines().index(next(r for r in out.splitlines() if r.startswith("GPUs"))) :
        ]:
            assert line.rstrip() in page, line

        # a query Prometheus refuses is named, with Prometheus's own word
        bad = httpx.get(f"{url}/api/v1/query", params={"query": "rate(x[1m]"}).json()
        with pytest.raises(ValueError, match="bad_data"):
            parse_answer(bad)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


def test_no_prometheus_where_the_monitor_should_be_is_one_line(tmp_path):
    port = free_port()
    with pytest.raises(NoMonitor) as exc:
        run_top(settings=_inventory(tmp_path, port))
    assert str(exc.value) == (
        f"local: no Prometheus answers at 127.0.0.1:{port}: run `invoke monitor --host local` to make one"
    )


def test_ctrl_c_while_prometheus_has_not_answered_ends_top_with_exit_0(tmp_path):
    """Ctrl-C is how a watch ends, also before its first frame: here Prometheus's port is a real
    socket that accepts and never answers, so top waits on its first read when Ctrl-C comes.
    (Before, invoke turned the KeyboardInterrupt into exit 1.)"""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(60)
    settings = _inventory(tmp_path, listener.getsockname()[1])
    proc = subprocess.Popen(
        [sys.executable, "-m", "invoke", "--search-root", str(ROOT), "top", f"--inventory={settings.inventory}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path,
        preexec_fn=as_in_a_terminal,
    )  # fmt: skip
    try:
        conn, _ = listener.accept()  # top has connected and sent its query: it waits for the answer
        conn.recv(4096)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        conn.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        listener.close()
    assert proc.returncode == 0, out.decode(errors="replace")
    assert b"Traceback" not in out
