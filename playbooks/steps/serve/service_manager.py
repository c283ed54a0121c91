"""Who runs a deployed server: systemd where it is PID 1, else a managed process.

Both are driven by the same rendered unit. systemd reads it from /etc/systemd/system; the
process runner (containers, CI, a laptop: hosts without systemd) runs the unit's own
ExecStart, parsed back by systemd's quoting rules (``units.parse_exec_start``), with the
unit's Environment= lines, so there is one command line, never a second flag list. The
runner keeps a pid file and a log file under the deployment's state directory and says what
it is: a process, not a unit (no restart on crash, no start at boot).

Pure: each method returns the commands or reads nothing; deploy's operations run them. Which
manager a deployment gets: ``make_manager``; what only systemd can run: ``systemd_only``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from playbooks.config.recipe import Recipe
from playbooks.errors import VoltaforgeError
from playbooks.facts.service import (
    ProcessState,
    UnitState,
    parse_process_state,
    parse_unit_state,
    process_state_command,
    unit_state_command,
)
from playbooks.host.ops import Shell
from playbooks.steps.serve.deploy_record import DeployLayout
from playbooks.steps.serve.units import parse_exec_start


@dataclass(frozen=True)
class Running:
    """The one thing deploy asks of a manager's state: is it up, and which run is it."""

    up: bool
    ident: str  # a systemd InvocationID, or "<pid>:<start ticks>" (changes on every start)
    pid: int
    detail: str


@dataclass(frozen=True)
class Systemd:
    """A unit in /etc/systemd/system, run by the host's systemd (as root through sudo)."""

    unit: str
    kind: str = "systemd"

    def state_command(self) -> str:
        return unit_state_command(self.unit)

    def running(self, output: str) -> Running:
        st: UnitState = parse_unit_state(output)
        return Running(st.running, st.invocation, st.main_pid, f"{st.active} ({st.sub}), pid {st.main_pid}")

    def restart(self) -> Shell:
        u = shlex.quote(self.unit)
        return Shell(f"systemctl daemon-reload && systemctl enable --quiet -- {u} && systemctl restart -- {u}", True)

    def stop(self) -> Shell:
        return Shell(f"systemctl stop -- {shlex.quote(self.unit)}", True)

    def log_command(self, ident: str) -> str:
        """This run's log only: the journal entries of one invocation of the unit."""
        match = f" _SYSTEMD_INVOCATION_ID={ident}" if re.fullmatch(r"[0-9a-f]{32}", ident) else ""
        return f"journalctl -u {shlex.quote(self.unit)}{match} -o cat --no-pager 2>&1 | tail -n 2000"

    def describe(self) -> str:
        return f"systemd unit {self.unit}"


@dataclass(frozen=True)
class ProcessRunner:
    """The unit's command line run as a process of the SSH user, detached, with a pid file."""

    state_dir: str  # <prefix>/deploy/<service>
    binary: str
    argv: tuple[str, ...]
    environment: tuple[tuple[str, str], ...] = ()
    kind: str = "process"
    cwd: str | None = None  # the unit's WorkingDirectory= (TabbyAPI's serve directory), else state_dir
    make_dirs: tuple[str, ...] = ()  # made before a start, as systemd makes CacheDirectory=

    @property
    def pid_file(self) -> str:
        return f"{self.state_dir}/server.pid"

    @property
    def log_file(self) -> str:
        return f"{self.state_dir}/server.log"

    @property
    def exe_file(self) -> str:
        """The real path the process was started as: `current` may point at another build, or
        the binary be replaced, under a running server, which is still ours to stop."""
        return f"{self.state_dir}/server.exe"

    def state_command(self) -> str:
        return process_state_command(self.pid_file, self.binary, self.exe_file)

    def running(self, output: str) -> Running:
        st: ProcessState = parse_process_state(output)
        up = st.running
        return Running(up, f"{st.pid}:{st.start_ticks}" if up else "", st.pid if up else 0, f"pid {st.pid}")

    def _stop_script(self) -> str:
        """TERM the recorded process if it is still ours, wait up to 10 s, then KILL. CONT after
        the TERM, as systemd sends after its KillSignal: a stopped process (SIGSTOP, a debugger)
        acts on the TERM only once it runs again, and otherwise sat out the whole wait. Ours is
        the executable it was started as (:attr:`exe_file`), replaced on disk or not. Gone is
        when its executable link is (``/proc/PID/exe`` resolves for a live process, its binary
        deleted or not, and not for a zombie): the process is an orphan of its detached start,
        reaped by whatever runs as pid 1, which takes 1.6 s on this VM's and forever in a
        container whose pid 1 reaps nothing; /proc/PID itself lasts until the reaping."""
        pid, exe, started = shlex.quote(self.pid_file), shlex.quote(self.binary), shlex.quote(self.exe_file)
        return (
            f'pid=$(cat -- {pid} 2>/dev/null | head -c 32); case "$pid" in ""|*[!0-9]*) pid=;; esac; '
            f"want=$(cat -- {started} 2>/dev/null || readlink -f -- {exe}); "
            'exe=$(readlink "/proc/$pid/exe" 2>/dev/null); '
            'if [ -n "$pid" ] && [ -n "$want" ] && { [ "$exe" = "$want" ] || [ "$exe" = "$want (deleted)" ]; }; then '
            'kill -TERM "$pid"; kill -CONT "$pid" 2>/dev/null; '
            'for i in $(seq 100); do [ -e "/proc/$pid/exe" ] || break; sleep 0.1; done; '
            'kill -KILL "$pid" 2>/dev/null || true; fi; '
            f"rm -f -- {pid} {started}"
        )

    def restart(self) -> Shell:
        env = " ".join(shlex.quote(f"{k}={v}") for k, v in self.environment)
        run = " ".join(shlex.quote(a) for a in self.argv)
        log = shlex.quote(self.log_file)
        mkdir = f"mkdir -p -m 0700 -- {' '.join(shlex.quote(d) for d in self.make_dirs)} && " if self.make_dirs else ""
        return Shell(
            f"{self._stop_script()} && {mkdir}cd -- {shlex.quote(self.cwd or self.state_dir)} && "
            f"readlink -f -- {shlex.quote(self.binary)} > {shlex.quote(self.exe_file)} && "
            f"{{ setsid env {env} {run} > {log} 2>&1 < /dev/null & echo $! > {shlex.quote(self.pid_file)}; }}"
        )

    def stop(self) -> Shell:
        return Shell(self._stop_script())

    def log_command(self, ident: str) -> str:
        return f"tail -n 2000 -- {shlex.quote(self.log_file)} 2>/dev/null || true"

    def describe(self) -> str:
        return f"a managed process (no systemd on this host: {self.pid_file}, log {self.log_file})"


Manager = Systemd | ProcessRunner


def unit_environment(unit_text: str) -> tuple[tuple[str, str], ...]:
    """The unit's Environment= assignments (the renderer validated them: NAME=digits,commas)."""
    found = []
    for line in unit_text.splitlines():
        if line.startswith("Environment="):
            key, _, value = line.removeprefix("Environment=").partition("=")
            found.append((key, value))
    return tuple(found)


def process_environment(env: tuple[tuple[str, str], ...], cache_dir: str) -> tuple[tuple[str, str], ...]:
    """The unit's Environment= as a process gets it: systemd's %C (the cache directory root,
    where CacheDirectory= lives) is ``cache_dir``, the deployment's own, and %% a percent sign;
    any other specifier has no meaning outside systemd: refused. Passed on as it is, ``%C/x``
    became a directory named ``%C`` in the process's working directory."""
    out = []
    for key, value in env:
        rest = value.replace("%%", "").replace("%C", "")
        if "%" in rest:
            raise VoltaforgeError(
                f"the unit's Environment={key}={value} uses a systemd specifier a process cannot resolve"
            )
        out.append((key, value.replace("%C", cache_dir).replace("%%", "%")))
    return tuple(out)


def unit_working_directory(unit_text: str) -> str | None:
    """The unit's WorkingDirectory=, where the process is started as systemd would start it."""
    for line in unit_text.splitlines():
        if line.startswith("WorkingDirectory="):
            return line.removeprefix("WorkingDirectory=").strip() or None
    return None


def process_argv(argv: list[str], credentials_dir: str) -> tuple[str, ...]:
    """ExecStart as a process runs it: systemd's %d (the credentials directory) is the state
    directory's credentials/; any other specifier has no meaning outside systemd: refused."""
    out = []
    for arg in argv:
        if "%" in arg.replace("%d", ""):
            raise VoltaforgeError(f"the unit's argument {arg!r} uses a systemd specifier a process cannot resolve")
        if "${" in arg:
            raise VoltaforgeError(f"the unit's argument {arg!r} needs systemd's EnvironmentFile: run it under systemd")
        out.append(arg.replace("%d", credentials_dir))
    return tuple(out)


def make_manager(kind: str, state: DeployLayout, unit_name: str, unit_text: str) -> Manager:
    """The manager of one deployed server: its systemd unit, or the unit's own command line
    as a process whose pid file, log and credentials live in its state directory."""
    state_dir = state.state_dir
    if kind == "systemd":
        return Systemd(unit_name)
    argv = parse_exec_start(unit_text)
    unit_env = unit_environment(unit_text)
    env = process_environment(unit_env, f"{state_dir}/cache")
    return ProcessRunner(
        state_dir,
        argv[0],
        process_argv(argv, f"{state_dir}/credentials"),
        env,
        cwd=unit_working_directory(unit_text),
        # what CacheDirectory= would have made: the directories %C named
        make_dirs=tuple(dict.fromkeys(v for (_, unit_v), (_, v) in zip(unit_env, env, strict=True) if "%C" in unit_v)),
    )


def systemd_only(recipe: Recipe, gpu_indexes: Sequence[int] = (0,)) -> str | None:
    """Why this deployment cannot run as a managed process (None: it can). Deploy refuses it
    on a host without systemd; preflight judges a host's missing systemd by it."""
    if len(gpu_indexes) > 1 and recipe.gpu_count == 1:
        return "one server per GPU (or CPU instance) is a systemd instance template"
    return None


def require_systemd(booted: bool, manager: str, host: str) -> None:
    """`--manager systemd` on a host without it: one line, before anything is touched."""
    if manager == "systemd" and not booted:
        raise VoltaforgeError(
            f"{host}: systemd is not running there (no /run/systemd/system): a unit cannot be started; "
            "deploy with --manager process to run the same command line as a managed process"
        )
