"""A keyed server's secret on a real host (this machine through LocalHost, as root: the same
bash and coreutils a host runs): the file's mode checked, the key read into memory and redacted,
a managed process's 0600 copy made once and then left alone, and the key never in any argv
(every exec recorded by strace, tests/exec_trace.py, with a positive control: the old TabbyAPI
check, run as it was, caught in each of 20 runs)."""

from __future__ import annotations

import os
import shlex
import stat
from pathlib import Path

import pytest
import yaml

from playbooks.errors import VoltaforgeError
from playbooks.host.local import LocalHost
from playbooks.host.ops import run_ops
from playbooks.host.output import BufferedPrinter
from playbooks.steps.serve.engine_exllamav2 import EnsureTabbyTokens
from playbooks.steps.serve.secrets import CheckSecret, EnsureCredentialCopy, read_api_key
from tests.exec_trace import ExecTrace

KEY = "vf-test-key-Zq7P0xLm3"


@pytest.fixture
def host():
    printer = BufferedPrinter()
    h = LocalHost(printer=printer)
    yield h


def _secret(tmp_path: Path, mode: int = 0o600, text: str = KEY + "\n") -> Path:
    p = tmp_path / "api-key"
    p.write_text(text)
    p.chmod(mode)
    return p


def test_the_key_is_read_into_memory_and_redacted(host, tmp_path):
    path = _secret(tmp_path)
    assert read_api_key(host, str(path)) == KEY
    # whatever the host prints later (a failing command's message) shows *** for it
    with pytest.raises(Exception) as exc:
        host.run(f"echo {KEY} >&2; exit 3", stream=False)
    assert KEY not in str(exc.value) and "***" in str(exc.value)


@pytest.mark.parametrize(
    ("mode", "text", "why"),
    [
        (0o644, KEY, r"is mode 0644: others can read the key; `chmod 600 .*`"),
        (0o640, KEY, r"is mode 0640: others can read the key"),
        (0o600, "", r"is empty: put the key in it"),
        (0o600, "two words\n", r"is not a key: want 8 to 512"),
    ],
)
def test_a_key_others_can_read_or_no_key_is_refused_in_one_line(host, tmp_path, mode, text, why):
    path = _secret(tmp_path, mode, text)
    with pytest.raises(VoltaforgeError, match=f"^local: the API key (file )?(in )?{path}.*{why}") as exc:
        read_api_key(host, str(path))
    assert "\n" not in str(exc.value) and (not text or text.strip() not in str(exc.value))


def test_a_missing_or_open_secret_stops_a_deployment_before_anything_changes(host, tmp_path):
    missing = tmp_path / "nope"
    [ch] = run_ops(host, [CheckSecret(str(missing))], keep_going=True)
    assert ch.status == "failed" and f"the API key file {missing} does not exist on the host" in ch.why
    path = _secret(tmp_path, 0o604)
    dest = tmp_path / "state" / "credentials" / "api-key"
    changes = run_ops(host, [CheckSecret(str(path)), EnsureCredentialCopy(str(path), str(dest), "root")])
    assert [c.status for c in changes][0] == "failed" and "is mode 0604" in changes[0].why
    assert not dest.parent.exists()


def test_a_managed_process_gets_a_private_copy_once(host, tmp_path):
    path = _secret(tmp_path)
    dest = tmp_path / "state" / "credentials" / "api-key"
    op = EnsureCredentialCopy(str(path), str(dest), "root")
    [dry] = run_ops(host, [op], dry_run=True)
    assert dry.status == "changed" and not dest.exists()  # a dry run changes nothing
    [first] = run_ops(host, [op])
    assert first.status == "changed" and dest.read_text() == path.read_text()
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600 and stat.S_IMODE(dest.parent.stat().st_mode) == 0o700
    [again] = run_ops(host, [op])
    assert again.status == "ok", again.why
    path.write_text("another-key-1234567\n")  # the key rotated: the copy follows
    [rotated] = run_ops(host, [op])
    assert rotated.status == "changed" and "the key changed" in rotated.why and dest.read_text() == path.read_text()
    with pytest.raises(VoltaforgeError, match="not a user name"):
        EnsureCredentialCopy(str(path), str(dest), "root; rm -rf /")


def test_the_key_never_reaches_an_argv_and_the_trace_sees_one_that_does(host, tmp_path):
    """TabbyAPI's tokens check and write, the managed-process copy and the bench client's read,
    run while strace records every exec of this process's children (LocalHost runs each command
    as `bash -c LINE`, and that bash runs the rest); beside them the check deploy ran before
    issue 31 (grep with the key in its pattern argument), run unmodified 20 times: caught 20."""
    secret = _secret(tmp_path)
    tokens = tmp_path / "api_tokens.yml"
    dest = tmp_path / "creds" / "api-key"
    with ExecTrace(tmp_path / "ours", pids=[os.getpid()]) as ours:
        for _ in range(3):
            run_ops(host, [EnsureTabbyTokens(str(secret), str(tokens))])
            run_ops(host, [EnsureCredentialCopy(str(secret), str(dest), "root")])
            assert read_api_key(host, str(secret)) == KEY
    # the host's commands ran under the trace (cat, install, ...) and none held the key
    assert len(ours.execs()) >= 9 and {"bash", "env", "install"} <= {Path(p).name for p in ours.programs()}
    assert ours.holding(KEY) == []
    assert f'api_key: "{KEY}"' in tokens.read_text() and stat.S_IMODE(tokens.stat().st_mode) == 0o600
    # what TabbyAPI reads (common/auth.py: AuthKeys, both keys): YAML, the admin key its own
    written = yaml.safe_load(tokens.read_text())
    assert written["api_key"] == KEY and written["admin_key"] and written["admin_key"] != KEY
    [ok] = run_ops(host, [EnsureTabbyTokens(str(secret), str(tokens))])
    assert ok.status == "ok" and ok.why == "the API key is current"
    # the positive control: the old check as it ran, a grep that lives a millisecond
    old = f'key=$(head -n1 -- {shlex.quote(str(secret))}); printf x | grep -qxF "api_key: \\"$key\\"" - || true'
    with ExecTrace(tmp_path / "control", pids=[os.getpid()]) as control:
        for _ in range(20):
            host.run(old, stream=False)
    assert len(control.holding(KEY, program="grep")) == 20, control.execs()[-5:]
