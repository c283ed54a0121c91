"""The CLI edge, as a user meets it: real `invoke` subprocesses, real exit codes.

Every flag of every task is walked with a bad value (one line on stderr, `error: ...`, exit 2,
never a traceback); -h is help; defaults come from Invoke's own configuration; a bug prints
one line and the path of a log holding the traceback; host text is shown as text.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from playbooks.cli.tasks import ns
from tests.helpers import ROOT

QWEN7 = "recipes/models/qwen2.5-7b-instruct.config.json"
QWEN3_MOE = "recipes/models/qwen3-30b-a3b.config.json"


def invoke(*args, env=None, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "invoke", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


# (task, flag): bad values with the words the one-line error must hold
BAD = {
    ("plan", "recipe"): [("nope", "unknown recipe 'nope'"), ("", "is not a name or a path")],
    ("plan", "gpu"): [("v100-64gb", "unknown GPU 'v100-64gb'")],
    ("plan", "model-config"): [("no/such/config.json", "cannot read model config")],
    ("plan", "ctx"): [
        ("abc", "--ctx 'abc' is not a number"),
        ("0", "--ctx must be a positive"),
        ("-3", "--ctx must be a positive"),
        ("1e9", "is not a number"),
        ("131072", "above the model's maximum"),
    ],
    ("plan", "parallel"): [
        ("x", "--parallel 'x' is not a number"),
        ("0", "--parallel must be a positive"),
        ("-3", "--parallel must be a positive"),
    ],
    ("plan", "quant"): [
        ("Q9_K", "--quant 'Q9_K' is not a known quant"),
        ("EXL2-9.5", "between 2.0 and 8.0"),
        ("EXL2-x", "EXL2 needs a number"),
    ],
    ("plan", "n-cpu-moe"): [
        ("abc", "want a number of layers or auto"),
        ("-1", "from 0 to 10000 or auto"),
        ("49", "more than the model's 48 layers"),
    ],
    ("plan", "host-membw"): [("x", "is not a number of GB/s"), ("0", "must be a positive number of GB/s")],
    ("plan", "host-ram"): [("abc", "is not a number of GiB")],
    ("plan", "cache-type-k"): [("q9_0", "--cache-type-k 'q9_0': want one of f16")],
    ("plan", "cache-type-v"): [("Q8", "--cache-type-v 'Q8': want one of f16")],
    ("plan", "min-tok-s"): [("0", "must be a positive number of tok/s"), ("fast", "want a decode speed")],
    ("plan", "host"): [
        ("nosuch..host", "is not a valid host name"),
        ("a,b", "takes one host"),
        ("nowhere.invalid", "its inventory entry serves no model set"),
    ],
    ("plan", "inventory"): [("BROKEN", "inventory")],
    ("preflight", "host"): [
        ("nosuch..host", "is not a valid host name"),
        ("a,b", "takes one host"),
        ("-", "is not a valid host name"),
        (",", "give one or more host names"),
    ],
    ("preflight", "recipe"): [("nope", "unknown recipe 'nope'")],
    ("preflight", "inventory"): [("BROKEN", "inventory")],
    ("toolchain", "host"): [("nosuch..host", "is not a valid host name"), ("a,b", "takes one host")],
    ("toolchain", "recipe"): [("nope", "unknown recipe 'nope'")],
    ("toolchain", "inventory"): [("BROKEN", "inventory")],
    ("build", "host"): [("nosuch..host", "is not a valid host name"), ("a,b", "takes one host")],
    ("build", "recipe"): [("nope", "unknown recipe 'nope'")],
    ("build", "inventory"): [("BROKEN", "inventory")],
    ("wheelhouse", "python"): [("3.9", "give the Python version as 3.10"), ("3.11 x", "--python '3.11 x'")],
    ("wheelhouse", "recipe"): [("nope", "unknown recipe 'nope'")],
    ("stage-tabbyapi", "archive"): [("no/such.tar.gz", "--archive 'no/such.tar.gz': no such file")],
    ("stage-tabbyapi", "recipe"): [("nope", "unknown recipe 'nope'")],
    ("quantize", "host"): [("nosuch..host", "is not a valid host name"), ("a,b", "takes one host")],
    ("quantize", "recipe"): [("nope", "unknown recipe 'nope'")],
    ("quantize", "inventory"): [("BROKEN", "inventory")],
    ("quantize", "quant"): [("Q9_K", "--quant 'Q9_K': not a GGUF quant type"), ("F16", "not a GGUF quant type")],
    ("quantize", "bpw"): [("1.5", "--bpw 1.5: outside 2.0-8.0"), ("lots", "want bits per weight")],
    ("quantize", "on"): [("nosuch..host", "is not a valid host name"), ("a,b", "--on: this command takes one host")],
    ("deploy", "host"): [("nosuch..host", "is not a valid host name"), ("a,b", "takes one host")],
    ("deploy", "recipe"): [("nope", "unknown recipe 'nope'")],
    ("deploy", "inventory"): [("BROKEN", "inventory")],
    ("deploy", "manager"): [("docker", "--manager 'docker': want one of auto, systemd, process")],
    ("deploy", "gpus"): [("a,b", "give GPU indexes"), ("0,0", "distinct GPU indexes")],
    ("bench", "host"): [("nosuch..host", "is not a valid host name"), ("a,b", "takes one host")],
    ("bench", "recipe"): [("nope", "unknown recipe 'nope'")],
    ("bench", "inventory"): [("BROKEN", "inventory")],
    ("bench", "lb"): [("0", "must be a positive number"), ("70000", "at most 65535"), ("x", "a TCP port")],
    ("bench", "noise"): [("0", "must be a positive number"), ("51", "at most 50"), ("x", "a number of runs")],
    ("bench", "against"): [("nope", "unknown recipe 'nope'"), ("x\ny", "is not a name or a path")],
    ("test", "workers"): [("0", "must be a positive number of workers"), ("x", "not a number of workers")],
    ("stop", "host"): [("nosuch..host", "is not a valid host name"), ("a,b", "takes one host")],
    ("stop", "recipe"): [("nope", "unknown recipe 'nope'")],
    ("stop", "inventory"): [("BROKEN", "inventory")],
    ("remove", "host"): [("nosuch..host", "is not a valid host name"), ("a,b", "takes one host")],
    ("remove", "recipe"): [("nope", "unknown recipe 'nope'")],
    ("remove", "inventory"): [("BROKEN", "inventory")],
    ("lb", "host"): [("nosuch..host", "is not a valid host name"), ("a,b", "takes one host")],
    ("lb", "hosts"): [("", "one or more host names"), ("a,,b", "one or more host names")],
    ("lb", "recipe"): [("nope", "unknown recipe 'nope'")],
    ("lb", "bind"): [("all", "is not an IP address")],
    ("lb", "port"): [("0", "must be a positive number"), ("70000", "at most 65535")],
    ("lb", "inventory"): [("BROKEN", "inventory")],
    ("lb", "tls"): [("maybe", "--tls")],
    ("lb", "cert"): [("no/such.pem", "--cert")],
    ("lb", "key"): [("no/such.pem", "--key")],
    ("monitor", "host"): [("nosuch..host", "is not a valid host name"), ("a,b", "takes one host")],
    ("monitor", "hosts"): [("", "one or more host names"), ("a,,b", "one or more host names")],
    ("monitor", "bind"): [("all", "is not an IP address")],
    ("monitor", "port"): [("0", "must be a positive number"), ("70000", "at most 65535")],
    ("monitor", "inventory"): [("BROKEN", "inventory")],
    ("top", "host"): [("nosuch..host", "is not a valid host name"), ("a,b", "takes one host")],
    ("top", "interval"): [("0", "must be a positive number"), ("abc", "is not a number"), ("1e999", "at most 3600")],
    ("top", "inventory"): [("BROKEN", "inventory")],
    ("rpc-worker", "host"): [("nosuch..host", "is not a valid host name"), ("a,b", "takes one host")],
    ("rpc-worker", "recipe"): [("nope", "unknown recipe 'nope'")],
    ("rpc-worker", "inventory"): [("BROKEN", "inventory")],
    ("plan", "gpu-count"): [("0", "must be a positive number of cards"), ("17", "at most 16")],
    ("plan", "tensor-split"): [("1,x", "shares separated by commas"), ("0,0", "at least one above 0")],
    ("plan", "split-mode"): [("row", "does not support split buffers"), ("diagonal", "unknown split mode")],
    ("plan", "models"): [("tiny-cpu", "give two or more recipe names"), ("tiny-cpu,nope", "unknown recipe 'nope'")],
    ("plan", "memory-budget"): [
        ("0", "must be a positive number of GiB"),
        ("8", "--memory-budget) is for a CPU target"),
    ],
    ("status", "host"): [("nosuch..host", "is not a valid host name"), ("a,a", "a host is named twice")],
    ("status", "inventory"): [("BROKEN", "inventory")],
    ("tune", "host"): [("nosuch..host", "is not a valid host name"), ("a,b", "takes one host")],
    ("tune", "recipe"): [("nope", "unknown recipe 'nope'")],
    ("tune", "inventory"): [("BROKEN", "inventory")],
    ("tune", "objective"): [("fast", "want one of single, aggregate, latency")],
    ("tune", "quants"): [("Q9_K", "not a GGUF type"), ("Q8_0,Q8_0", "distinct values")],
    ("tune", "cache"): [("q9", "want cache types"), ("q8_0/zz", "want cache types")],
    ("tune", "flash-attn"): [("maybe", "want on, off")],
    ("tune", "slots"): [("x", "is not a number of slots"), ("65", "at most 64")],
    ("tune", "ubatch"): [("0", "want whole numbers 1-8192"), ("64,", "distinct values")],
    ("tune", "spec"): [("magic", "want none or")],
    ("tune", "threads"): [("0", "want whole numbers 1-1024"), ("two", "want whole numbers 1-1024")],
    ("tune", "min-ctx"): [("x", "is not a number of tokens")],
    ("tune", "min-bpw"): [("x", "is not a number of bits per weight"), ("0", "must be a positive number")],
    ("tune", "budget"): [("soon", "a duration such as 45m"), ("0m", "longer than nothing")],
    ("tune", "rungs"): [("x", "is not a number of rungs")],
    ("tune", "port"): [("70000", "must be at most 65535")],
    ("artifacts", "host"): [("nosuch..host", "is not a valid host name"), ("a,b", "takes one host")],
    ("artifacts", "inventory"): [("BROKEN", "inventory")],
    ("render", "recipe"): [("nope", "unknown recipe 'nope'"), ("", "is not a name or a path")],
    ("render", "out"): [("", "is not a directory path"), ("README.md", "exists and is not a directory")],
    ("render", "gpus"): [("a,b", "give GPU indexes"), ("0,0", "distinct GPU indexes"), ("99", "distinct GPU")],
    ("render", "lb"): [("a,b", "takes one host"), ("lb-01", "which hosts it balances: pass --hosts")],
    ("render", "hosts"): [("a,,b", "one or more host names"), ("box", "--hosts goes with --lb")],
    ("render", "bind"): [("all", "is not an IP address"), ("0.0.0.0", "--bind goes with --lb")],
    ("render", "port"): [("0", "must be a positive number"), ("9000", "--port goes with --lb")],
    ("render", "tls"): [("maybe", "--tls"), ("on", "--tls goes with --lb")],
    ("render", "inventory"): [("BROKEN", "inventory")],
    ("tune", "gpu"): [("v100-64gb", "unknown GPU 'v100-64gb'"), ("", "give a GPU name")],
    ("render", "host"): [
        ("a,b", "takes one host"),
        ("ghost", "nothing would be installed"),
        ("-x", "is not a valid host name"),
    ],
    ("provision", "host"): [("nosuch..host", "is not a valid host name"), ("a,a", "a host is named twice")],
    ("provision", "recipe"): [("nope", "unknown recipe 'nope'"), ("", "is not a name or a path")],
    ("provision", "inventory"): [("BROKEN", "inventory")],
    ("provision", "json"): [("", "is not a file path"), ("tests", "is a directory, not a file")],
    ("provision", "drain-timeout"): [("0", "must be a positive number of seconds"), ("soon", "is not a number")],
    ("verify-recipe", "recipe"): [("nope", "unknown recipe 'nope'"), ("", "is not a name or a path")],
    ("verify-recipe", "reports"): [("README.md", "exists and is not a directory")],
}
# what else each bad value needs beside it, so that the flag under test is the one judged
CONTEXT = {
    ("plan", "gpu"): ["--model-config", QWEN7],
    ("plan", "ctx"): ["--model-config", QWEN7],
    ("plan", "parallel"): ["--model-config", QWEN7],
    ("plan", "quant"): ["--model-config", QWEN7],
    ("plan", "n-cpu-moe"): ["--model-config", QWEN3_MOE],
    ("plan", "host-membw"): ["--model-config", QWEN3_MOE],
    ("plan", "host-ram"): ["--model-config", QWEN3_MOE],
    ("plan", "cache-type-k"): ["--model-config", QWEN7],
    ("plan", "cache-type-v"): ["--model-config", QWEN7],
    ("plan", "min-tok-s"): ["--model-config", QWEN7],
    ("plan", "gpu-count"): ["--model-config", QWEN7],
    ("plan", "tensor-split"): ["--model-config", QWEN7, "--gpu-count", "2"],
    ("plan", "split-mode"): ["--model-config", QWEN7, "--gpu-count", "2"],
    ("plan", "memory-budget"): ["--models", "qwen2.5-14b-v100-16gb,qwen2.5-32b-v100-16gb"],
    ("lb", "recipe"): ["--host", "local", "--hosts", "local"],
    ("lb", "bind"): ["--host", "local", "--hosts", "local"],
    ("lb", "port"): ["--host", "local", "--hosts", "local"],
    ("lb", "hosts"): ["--host", "local"],
    ("lb", "inventory"): ["--host", "some-host", "--hosts", "some-host"],
    ("lb", "tls"): ["--host", "local", "--hosts", "local"],
    ("lb", "cert"): ["--host", "local", "--hosts", "local", "--key", "README.md"],
    ("lb", "key"): ["--host", "local", "--hosts", "local", "--cert", "README.md"],
    ("monitor", "hosts"): ["--host", "local"],
    ("monitor", "bind"): ["--host", "local"],
    ("monitor", "port"): ["--host", "local"],
    ("monitor", "inventory"): ["--host", "some-host"],
    ("top", "inventory"): ["--host", "some-host"],
    ("render", "lb"): ["--out", "/tmp/vf-render-unused"],
    ("render", "hosts"): ["--recipe", "tiny-cpu", "--out", "/tmp/vf-render-unused"],
    ("render", "bind"): ["--recipe", "tiny-cpu", "--out", "/tmp/vf-render-unused"],
    ("render", "port"): ["--recipe", "tiny-cpu", "--out", "/tmp/vf-render-unused"],
    ("render", "tls"): ["--recipe", "tiny-cpu", "--out", "/tmp/vf-render-unused"],
    ("rpc-worker", "recipe"): ["--host", "local"],
    ("rpc-worker", "inventory"): ["--host", "some-host"],
    ("plan", "inventory"): ["--host", "some-host"],
    ("preflight", "recipe"): ["--host", "local"],
    ("preflight", "inventory"): ["--host", "some-host"],
    ("toolchain", "recipe"): ["--host", "local"],
    ("toolchain", "inventory"): ["--host", "some-host"],
    ("build", "recipe"): ["--host", "local"],
    ("build", "inventory"): ["--host", "some-host"],
    ("wheelhouse", "recipe"): ["--python", "3.11"],
    ("quantize", "recipe"): ["--host", "local"],
    ("quantize", "inventory"): ["--host", "some-host"],
    ("quantize", "quant"): ["--host", "local", "--recipe", "tiny-cpu"],
    ("quantize", "bpw"): ["--host", "local", "--recipe", "tiny-cpu"],
    ("quantize", "on"): ["--host", "local", "--recipe", "tiny-cpu"],
    ("deploy", "recipe"): ["--host", "local"],
    ("deploy", "inventory"): ["--host", "some-host"],
    ("deploy", "manager"): ["--host", "local", "--recipe", "tiny-cpu"],
    ("deploy", "gpus"): ["--host", "local", "--recipe", "tiny-cpu"],
    ("bench", "recipe"): ["--host", "local"],
    ("bench", "inventory"): ["--host", "some-host"],
    ("bench", "noise"): ["--host", "local", "--recipe", "tiny-cpu"],
    ("bench", "against"): ["--host", "local", "--recipe", "tiny-cpu"],
    ("bench", "lb"): ["--host", "local", "--recipe", "tiny-cpu"],
    ("stop", "recipe"): ["--host", "local"],
    ("stop", "inventory"): ["--host", "some-host"],
    ("remove", "recipe"): ["--host", "local", "--dry-run"],
    ("remove", "inventory"): ["--host", "some-host"],
    ("status", "inventory"): ["--host", "some-host"],
    ("tune", "recipe"): ["--host", "local"],
    ("tune", "gpu"): ["--dry-run", "--recipe", "tiny-cpu"],
    ("tune", "inventory"): ["--host", "some-host"],
    ("artifacts", "inventory"): ["--host", "some-host"],
    ("render", "recipe"): ["--out", "/tmp/vf-render-unused"],
    ("render", "gpus"): ["--recipe", "tiny-cpu", "--out", "/tmp/vf-render-unused"],
    ("render", "inventory"): ["--host", "some-host", "--out", "/tmp/vf-render-unused"],
    ("render", "host"): ["--out", "/tmp/vf-render-unused"],
    ("provision", "inventory"): ["--host", "some-host"],
    ("provision", "json"): ["--host", "nosuch-host-anywhere"],
    ("provision", "drain-timeout"): ["--host", "nosuch-host-anywhere"],
    ("verify-recipe", "reports"): ["tiny-cpu"],
}
# flags that take no value to get wrong (booleans) or are not user input (the test runner's)
NO_BAD_VALUE = {
    ("plan", "json"),
    ("preflight", "json"),
    ("toolchain", "dry-run"),
    ("build", "dry-run"),
    ("build", "no-cache"),
    ("quantize", "dry-run"),
    ("deploy", "dry-run"),
    ("rpc-worker", "dry-run"),
    ("lb", "dry-run"),
    ("lb", "stop"),
    ("lb", "remove"),
    ("monitor", "dry-run"),
    ("monitor", "stop"),
    ("monitor", "remove"),
    ("top", "once"),
    ("remove", "dry-run"),
    ("provision", "in-place"),
    ("bench", "json"),
    ("bench", "compare"),
    ("bench", "remeasure"),
    ("status", "json"),
    ("tune", "take-over"),
    ("tune", "remeasure"),
    ("tune", "json"),
    ("tune", "dry-run"),
    ("quantize", "force"),
    ("quantize", "verify"),
    ("artifacts", "json"),
    ("provision", "dry-run"),
    ("provision", "rebench"),
    ("provision", "verbose"),
    ("test", "k"),
    ("test", "fast"),
}


def all_flags():
    for name, t in ns.tasks.items():
        for arg in t.get_arguments():
            yield name, arg.name.replace("_", "-")


def test_every_flag_of_every_task_is_walked():
    assert set(all_flags()) == set(BAD) | NO_BAD_VALUE


@pytest.mark.parametrize(
    "task,flag,value,words", [(t, f, v, w) for (t, f), vals in BAD.items() for v, w in vals], ids=lambda x: str(x)[:30]
)
def test_bad_value_is_one_line_and_exit_2(task, flag, value, words, tmp_path):
    if value == "BROKEN":
        value = str(tmp_path / "inventory.yaml")
        (tmp_path / "inventory.yaml").write_text("hosts:\n  some-host: {host: [unclosed\n")
    r = invoke(task, f"--{flag}={value}", *CONTEXT.get((task, flag), []))
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert words in lines[0] and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "task",
    [
        "plan",
        "preflight",
        "toolchain",
        "build",
        "quantize",
        "artifacts",
        "render",
        "deploy",
        "stop",
        "bench",
        "status",
        "provision",
    ],
)
def test_dash_h_is_help_not_host(task):
    r = invoke(task, "-h")
    assert r.returncode == 0 and "Usage:" in r.stdout and "--host" not in r.stderr
    assert "-h STRING" not in r.stdout and "-h, --host" not in r.stdout


def test_defaults_come_from_invokes_configuration(tmp_path):
    # an INVOKE_* variable, as Invoke users expect
    r = invoke("plan", "--json", env={"INVOKE_VOLTAFORGE_RECIPE": "tiny-cpu"})
    assert r.returncode == 0 and '"recipe": "tiny-cpu"' in r.stdout, r.stderr
    # ~/.invoke.yaml (the user's file)
    (tmp_path / ".invoke.yaml").write_text("voltaforge:\n  recipe: qwen2.5-14b-v100-16gb\n")
    r = invoke("plan", "--json", env={"HOME": str(tmp_path)})
    assert r.returncode == 0 and '"recipe": "qwen2.5-14b-v100-16gb"' in r.stdout, r.stderr
    # the flag wins over both
    r = invoke("plan", "--json", "--recipe", "tiny-cpu", env={"HOME": str(tmp_path)})
    assert '"recipe": "tiny-cpu"' in r.stdout
    # a runtime config file (-f) for the host default: preflight refuses the bad name from it
    cfg = tmp_path / "site.yaml"
    cfg.write_text("voltaforge:\n  host: bad..name\n")
    r = invoke("-f", str(cfg), "preflight")
    assert r.returncode == 2 and "'bad..name' is not a valid host name" in r.stderr


def test_an_unexpected_error_is_one_line_and_a_log(tmp_path, capsys):
    from playbooks.cli.edge import BUG_EXIT, run_command

    def broken():
        return {}["no such key"]

    os.environ["VOLTAFORGE_LOG_DIR"] = str(tmp_path)
    try:
        with pytest.raises(SystemExit) as exit_:
            run_command(broken)
    finally:
        del os.environ["VOLTAFORGE_LOG_DIR"]
    assert exit_.value.code == BUG_EXIT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unexpected KeyError: 'no such key'; the traceback is in ")
    log = next(tmp_path.glob("error-*.log"))
    assert str(log) in err[0] and "Traceback" in log.read_text() and "def broken" not in err[0]


def test_host_text_is_data_not_markup():
    """An OS called `Debian [/testing] [beta]` reaches the table as text (rich used to raise
    MarkupError on the first and swallow the second)."""
    from io import StringIO

    from playbooks.cli.render import console, render_verdict
    from playbooks.facts import cuda, gpu, system
    from playbooks.steps.preflight import HostFacts, judge

    name = "Debian GNU/Linux [/testing] [beta]"
    facts = HostFacts(
        host="box[1]",
        os=system.OsRelease(available=True, id="debian", version_id="13", pretty_name=name),
        gpus=gpu.GpuFacts(available=False, reason="nvidia-smi [not found]"),
        toolkits=[],
        gcc=cuda.GccVersion(available=False),
        gxx11=cuda.GccVersion(available=False),
        python=system.PythonVersion(available=True, version=(3, 11, 2)),
        disk={},
        memory=system.MemInfo(available=True, mem_total_bytes=8 << 30),
        systemd=system.SystemdState(
            available=True, state="running", systemd_running=True, booted=True, systemctl_present=True
        ),
    )
    out = StringIO()
    render_verdict(judge(facts, None, "/opt/vf/models", "/opt/vf"), console(out, width=200))
    text = out.getvalue()
    assert name in text and "box[1]" in text and "nvidia-smi [not found]" in text


def test_shared_settings_from_the_configuration(tmp_path):
    # recipes_dir: a site's own recipes beside the shipped ones (theirs first)
    site = tmp_path / "recipes"
    site.mkdir()
    (site / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    (site / "site-tiny.yaml").write_text((ROOT / "recipes" / "tiny-cpu.yaml").read_text())
    r = invoke("plan", "--recipe", "site-tiny", "--json", env={"INVOKE_VOLTAFORGE_RECIPES_DIR": str(site)})
    assert r.returncode == 0 and '"recipe": "site-tiny"' in r.stdout, r.stderr
    r = invoke("plan", "--recipe", "tiny-cpu", env={"INVOKE_VOLTAFORGE_RECIPES_DIR": str(site)})
    assert r.returncode == 0 and r.stdout.startswith("tiny-cpu:"), r.stderr
    r = invoke("plan", "--recipe", "nope", env={"INVOKE_VOLTAFORGE_RECIPES_DIR": str(site)})
    assert r.returncode == 2 and f"unknown recipe 'nope'; recipes in {site}: site-tiny; shipped recipes:" in r.stderr
    # prefix: where a host the inventory does not place gets installed (a dry run shows it)
    prefix = tmp_path / "srv" / "vf"
    r = invoke(
        "toolchain",
        "--host",
        "local",
        "--recipe",
        "tiny-cpu",
        "--dry-run",
        env={"INVOKE_VOLTAFORGE_PREFIX": str(prefix)},
    )
    assert f"would run: mkdir -p -m 0755 -- {prefix}" in r.stdout and not prefix.exists()
    # a bad value in the configuration is one line naming the key
    cfg = tmp_path / "site.yaml"
    cfg.write_text("voltaforge:\n  connect_timeout: soon\n")
    r = invoke("-f", str(cfg), "preflight", "--host", "local")
    assert (
        r.returncode == 2 and r.stderr.strip() == "error: voltaforge.connect_timeout 'soon' is not a number of seconds"
    )
    cfg.write_text("voltaforge:\n  prefix: relative/path\n")
    r = invoke("-f", str(cfg), "preflight", "--host", "local")
    assert r.returncode == 2 and "voltaforge.prefix 'relative/path': want an absolute path" in r.stderr


def test_render_writes_every_file_at_its_host_path_and_nothing_else(tmp_path):
    from playbooks.config.recipe import load_recipe
    from playbooks.steps.serve.service_files import render_service_files

    out = tmp_path / "out"
    r = invoke("render", "--recipe", "qwen2.5-14b-v100-16gb", "--out", str(out), "--gpus", "0,1")
    assert r.returncode == 0, r.stderr
    expected = render_service_files(load_recipe("qwen2.5-14b-v100-16gb").recipe, gpu_indexes=(0, 1))
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert written == sorted(f.path.lstrip("/") for f in expected)
    for f in expected:
        target = out / f.path.lstrip("/")
        assert target.read_text() == f.text and target.stat().st_mode & 0o777 == f.mode
        assert f"wrote {target}" in r.stdout.replace("\n", "")
    # the prefix from invoke's configuration reaches the rendered paths
    r = invoke(
        "render",
        "--recipe",
        "seed-exl2-3.3-v100-16gb",
        "--out",
        str(tmp_path / "o2"),
        env={"INVOKE_VOLTAFORGE_PREFIX": "/srv/vf"},
    )
    assert r.returncode == 0, r.stderr
    unit = (tmp_path / "o2/etc/systemd/system/voltaforge-tabbyapi.service").read_text()
    assert "ExecStart=/srv/vf/venv/bin/python /srv/vf/tabbyAPI/main.py" in unit
    assert (tmp_path / "o2/etc/voltaforge/tabbyapi/config.yml").is_file()


def test_list_shows_each_tasks_first_sentence_whole():
    """`invoke --list` prints each task's first docstring line: that line is a whole sentence
    (issue 22: `...against the roofline, telemetry, the` was cut mid-sentence)."""
    r = subprocess.run([sys.executable, "-m", "invoke", "--list"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for name, task in ns.tasks.items():
        first = (task.__doc__ or "").strip().splitlines()[0]
        assert first.endswith(".") and len(first) <= 100, f"{name}: {first!r}"
        assert name in r.stdout
    shown = " ".join(r.stdout.split())
    assert "Measure the deployed server against its roofline and judge the gate (exit 1: failed)." in shown


def test_a_task_is_declared_once_its_help_from_its_own_lines_or_the_shared_ones():
    """command.py: the signature is the flag list, and every flag has one help line, the task's
    own or the shared one; a flag without help, or help for no flag, is refused at import."""
    from invoke import Context

    from playbooks.cli.command import SHARED_HELP, command

    def lonely(c: Context, host: str | None = None, widgets: str | None = None) -> int:
        return 0

    with pytest.raises(TypeError, match="no help for --widgets"):
        command()(lonely)
    with pytest.raises(TypeError, match="help for --gadgets, which it does not take"):
        command(help={"widgets": "w", "gadgets": "g"})(lonely)
    made = command(help={"widgets": "how many widgets"})(lonely)
    assert {a.name: a.help for a in made.get_arguments()} == {
        "host": SHARED_HELP["host"],
        "widgets": "how many widgets",
    }
    # the collection as a user reads it: the shared line under each task that takes the flag
    for name in ("preflight", "deploy"):
        shown = " ".join(invoke("--help", name).stdout.split())
        assert SHARED_HELP["inventory"] in shown, (name, shown)


def test_a_task_returns_its_exit_code_through_the_edge():
    """A task's body returns the exit code: 1 is exit 1, bad input one line and exit 2."""
    r = invoke("plan", "--recipe", "tiny-cpu", "--quant", "Q9_Z")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Q9_Z" in r.stderr, r.stderr


@pytest.mark.parametrize("program", ["invoke", "voltaforge"])
def test_the_package_is_compiled_once_not_on_every_run(program, tmp_path):
    """Invoke turns bytecode caching off while it loads a tasks file, and that reached every
    module imported after it: each run compiled playbooks/ from source (a quarter of a second of
    a no-op). Both entry points turn the interpreter's own setting back on, so a task's lazy
    imports (here plan's planner) are cached like any package's."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(tmp_path)  # the caches land here, not in the checkout
    if program == "invoke":
        cmd = [sys.executable, "-m", "invoke", "--search-root", str(ROOT)]
    else:
        cmd = [sys.executable, "-c", "from playbooks.cli.main import program; program.run()"]
    r = subprocess.run(
        [*cmd, "plan", "--recipe", "tiny-cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    cached = {p.name.split(".")[0] for p in tmp_path.rglob("*.pyc") if "playbooks" in p.parts}
    assert {"planner", "budget", "plan"} <= cached, sorted(cached)
