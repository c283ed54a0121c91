"""Bad input, walked from the collection itself: every value-taking flag of every task, each
given junk, through the real CLI: what `python -m invoke TASK --FLAG=VALUE` runs, each case its
own process, forked from one that has done the imports once (tests/tools/cli_fork.py: about
0.4 s of each case's 0.45 s was Python importing Invoke and the collection).

A wrong value is one line on stderr, ``error: ...`` naming the flag or the value, and exit 2:
never a traceback, never exit 70 (a bug), never two lines. The tasks are read from
``ns`` (playbooks/cli/tasks.py) and each one's flags from ``get_arguments()``, so a task or a
flag added later is walked without touching this file. The few junk values that are right
for a flag (``--out abc`` is a directory to create, ``--ctx 5`` five tokens) are listed in
ACCEPTED: the task then runs on, and still says at most one line.

Nothing real is touched: each run has its own temporary cwd (three levels deep, so
``../../etc/x`` stays inside it), HOME and log directory, no INVOKE_* variables, a dry run
where the task has one, ``--host nowhere.invalid`` (RFC 6761: never resolves) where it takes a
host, and a recipe that does not exist for a task that would act on this machine. No junk
value names a path outside the run's directory: a flag may name a file the task writes
(``provision --json``), so "an existing file" and "an existing directory" are ones made for
the run ({file}, {dir}), never /etc/passwd or /. The values of invoke.yaml's ``voltaforge:``
keys are walked the same way.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from playbooks.cli.configured import DEFAULTS
from playbooks.cli.tasks import ns
from tests.helpers import ROOT
from tests.tools.cli_fork import CliFork

NOWHERE = "nowhere.invalid"
QWEN7 = str(ROOT / "recipes" / "models" / "qwen2.5-7b-instruct.config.json")
JUNK = (
    "abc",
    "",
    "-1",
    "5",
    "../../etc/x",
    "a b;rm",
    "1" + "0" * 400,  # a huge number, and a file name too long for any filesystem
    "1e999",  # infinity, to float()
    "x\ny",
    "{dir}",  # an existing directory (made for the run)
    "{file}",  # an existing file that is no recipe, inventory or config (made for the run)
)
# tasks not walked, and why
NOT_WALKED = {"test": "the developer's test runner: --k is any pytest expression (and it runs the suite)"}
# (task, flag) -> the junk values that are right for it: the task runs on with them
ACCEPTED = {
    ("plan", "ctx"): {"5"},  # 5 tokens per slot
    ("plan", "parallel"): {"5"},  # 5 slots
    ("plan", "host-membw"): {"5"},  # 5 GB/s of host memory bandwidth
    ("plan", "host-ram"): {"5"},  # 5 GiB of host RAM
    ("plan", "min-tok-s"): {"5"},  # a speed floor of 5 tok/s
    ("quantize", "bpw"): {"5"},  # EXL2 at 5.0 bits per weight
    ("provision", "drain-timeout"): {"5"},  # 5 s for a drained server's requests
    ("render", "gpus"): {"5"},  # GPU 5
    ("deploy", "gpus"): {"5"},
    # tune: 5 slots, a batch of 5, 5 tokens, 5 bits per weight, 5 rungs, port 5, 5 threads
    **{("tune", f): {"5"} for f in ("slots", "ubatch", "min-ctx", "min-bpw", "rungs", "port", "threads")},
    # a directory to write into (made under the run's directory)
    ("render", "out"): {"abc", "-1", "5", "../../etc/x", "a b;rm", "1e999", "{dir}"},
    ("verify-recipe", "reports"): {"abc", "-1", "5", "../../etc/x", "a b;rm", "1e999", "{dir}"},
    # a file to write the summary into (an existing one is replaced)
    ("provision", "json"): {"abc", "-1", "5", "../../etc/x", "a b;rm", "1e999", "{file}"},
    # well-formed host names: provision reports the one it cannot reach in its summary, exit 1
    ("provision", "host"): {"abc", "1e999"},
    # the same for status: the host it cannot reach is a row of its table, exit 1
    ("status", "host"): {"abc", "1e999"},
    # well-formed backend names: lb then fails on its own host (nowhere.invalid), exit 2
    ("lb", "hosts"): {"abc", "1e999"},
    # a well-formed balancer host: lb first reads its backends' records (nowhere.invalid), exit 2
    ("lb", "host"): {"abc", "1e999"},
    # port 5: well-formed, lb then fails on its host, exit 2
    ("lb", "port"): {"5"},
    # the same for monitor: well-formed fleet hosts and port 5, then its host fails (nowhere.invalid)
    ("monitor", "hosts"): {"abc", "1e999"},
    ("monitor", "port"): {"5"},
    # top: 5 s between redraws, then its host fails (nowhere.invalid)
    ("top", "interval"): {"5"},
    # tune --dry-run (the walk's context) reaches no host: a well-formed name is planned for
    ("tune", "host"): {"abc", "1e999"},
    # a balancer on port 5: well-formed, bench then fails on its host, exit 2
    ("bench", "lb"): {"5"},
    ("bench", "noise"): {"5"},
}
# what a flag needs beside it for its own value to be the one judged (default: see context())
CONTEXT = {
    ("wheelhouse", "recipe"): ["--python", "3.11"],  # else the missing --python is what is refused
    # render's own flags, without the balancer's (--hosts and the rest go with --lb only)
    ("render", "recipe"): ["--out", "out"],
    ("render", "out"): ["--recipe", "tiny-cpu"],
    ("render", "gpus"): ["--recipe", "tiny-cpu", "--out", "out"],
    # what the inventory gives one host: no recipe beside it
    ("render", "host"): ["--out", "out"],
    ("render", "inventory"): ["--host", NOWHERE, "--out", "out"],
    ("plan", "model-config"): [],  # not with --recipe: that is refused for naming both
    ("plan", "parallel"): ["--model-config", QWEN7],  # judged on a bare config: no recipe in the way
    ("plan", "quant"): ["--model-config", QWEN7],
    # a set of two GPU recipes: the budget's own value is judged (a CPU target's, refused here)
    ("plan", "memory-budget"): ["--models", "qwen2.5-14b-v100-16gb,qwen2.5-32b-v100-16gb"],
    # plan --host: the host's model sets, read from the inventory the flag names
    ("plan", "host"): [],
    ("plan", "inventory"): ["--host", NOWHERE],
}
WORKERS = max(2, min(8, os.cpu_count() or 2))
# tasks whose --host chooses what they do, not where (plan --host: the host's model sets), so a
# flag of the other mode is judged without it
HOST_IS_A_MODE = {"plan"}
# tasks that read a recipe and write nothing outside --out (under the run's cwd)
WRITES_ONLY_UNDER_CWD = {"plan", "render"}


def value_flags(task: str) -> dict[str, object]:
    """The task's flags that take a value (booleans take none to get wrong)."""
    return {a.name.replace("_", "-"): a for a in ns[task].get_arguments() if a.kind is not bool}


def context(task: str, flag: str, out: Path) -> list[str]:
    if (task, flag) in CONTEXT:
        return list(CONTEXT[(task, flag)])
    flags = {a.name.replace("_", "-") for a in ns[task].get_arguments()}
    ctx: list[str] = []
    if "host" in flags and flag != "host" and task not in HOST_IS_A_MODE:
        ctx += ["--host", NOWHERE]
    if "hosts" in flags and flag != "hosts":  # the balancer's backends
        ctx += ["--hosts", NOWHERE]
    if "recipe" in flags and flag != "recipe":
        # a recipe that loads only where nothing can happen: a dry run, a host that is never
        # reached, or a task that only writes under the run's directory; a task that acts on
        # this machine (verify-recipe) gets one that does not exist, so it stops there
        harmless = "dry-run" in flags or "host" in flags or task in WRITES_ONLY_UNDER_CWD
        ctx += ["--recipe", "tiny-cpu" if harmless else "no-such-recipe"]
    if "dry-run" in flags:
        ctx.append("--dry-run")
    if "out" in flags and flag != "out":
        ctx += ["--out", str(out / "out")]
    return ctx


def clean_env(home: Path, prefix: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INVOKE_", "VOLTAFORGE_"))}
    env.update(HOME=str(home), VOLTAFORGE_LOG_DIR=str(home / "logs"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if prefix:  # where a host task would install (not beside a file that sets it: Invoke casts
        # the variable to the file's type, and a `prefix: 5` would make it an int)
        env["INVOKE_VOLTAFORGE_PREFIX"] = str(home / "prefix")
    return env


def made_for_the_run(home: Path, value: str) -> str:
    """{dir} and {file} in a junk value: an existing directory and file of this run."""
    (home / "existing-dir").mkdir(parents=True, exist_ok=True)
    (home / "existing-file").write_text("root:x:0:0:root:/root:/bin/bash\n")  # neither YAML nor JSON
    return value.replace("{dir}", str(home / "existing-dir")).replace("{file}", str(home / "existing-file"))


#: idle fork servers, one taken by each case while it runs (at most WORKERS made per session)
_IDLE: queue.Queue[CliFork] = queue.Queue()
_MADE: list[CliFork] = []


@pytest.fixture(scope="module", autouse=True)
def _fork_servers():
    yield
    while not _IDLE.empty():
        _IDLE.get_nowait()
    while _MADE:
        _MADE.pop().close()


def run(args: list[str], home: Path, program: str = "invoke") -> subprocess.CompletedProcess[str]:
    cwd = home / "a" / "b" / "c"
    cwd.mkdir(parents=True, exist_ok=True)
    env = clean_env(home, prefix="-f" not in args)
    if program == "invoke":
        try:
            server = _IDLE.get_nowait()
        except queue.Empty:
            server = CliFork(clean_env(home.parent, prefix=False))
            _MADE.append(server)
        try:
            return server.run(["--search-root", str(ROOT), *args], cwd, env)
        finally:
            _IDLE.put(server)
    # the installed wheel's `voltaforge` command
    cmd = [sys.executable, "-c", "from playbooks.cli.main import program; program.run()", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def judge(what: str, r: subprocess.CompletedProcess[str], names: tuple[str, ...], accepted: bool) -> str | None:
    """None when the outcome is right, else what is wrong (with the output)."""
    lines = r.stderr.strip().splitlines()
    shown = f"{what}: exit {r.returncode}, stderr {r.stderr[-600:]!r}, stdout {r.stdout[-300:]!r}"
    if "Traceback" in r.stderr + r.stdout or r.returncode == 70:
        return f"a traceback or a bug: {shown}"
    if accepted:
        if r.returncode not in (0, 1, 2) or len(lines) > 1 or (lines and not lines[0].startswith("error: ")):
            return f"accepted, but not 0/1/2 with at most one line: {shown}"
        if lines and names[0] in lines[0]:
            return f"listed as accepted, but refused (update ACCEPTED): {shown}"
        return None
    if r.returncode != 2 or len(lines) != 1 or not lines[0].startswith("error: "):
        return f"want exit 2 and one line 'error: ...': {shown}"
    if not any(n and n in lines[0] for n in names):
        return f"the line names neither the flag nor the value {names}: {shown}"
    return None


WALKED = sorted(set(ns.tasks) - set(NOT_WALKED))


def test_the_walk_covers_every_task_and_the_tables_name_real_flags():
    assert set(NOT_WALKED) <= set(ns.tasks), "NOT_WALKED names a task that no longer exists"
    assert set(WALKED) | set(NOT_WALKED) == set(ns.tasks)
    for task, flag in [*ACCEPTED, *CONTEXT]:
        assert flag in value_flags(task), f"{task} --{flag} is no flag of the collection"
    for (task, flag), values in ACCEPTED.items():
        assert values < set(JUNK), f"{task} --{flag}: accepts every junk value?"


@pytest.mark.parametrize("task", WALKED)
def test_junk_in_every_flag_is_one_line_and_exit_2(task, tmp_path):
    cases = [(flag, junk) for flag in value_flags(task) for junk in JUNK]

    def one(i_case: tuple[int, tuple[str, str]]) -> str | None:
        i, (flag, junk) = i_case
        home = tmp_path / str(i)
        value = made_for_the_run(home, junk)
        r = run([task, f"--{flag}={value}", *context(task, flag, home)], home)
        # a positional argument (verify-recipe RECIPE) is named as its usage shows it; a long
        # value is quoted by its start (flags._short)
        names = (f"--{flag}", flag.upper(), value, repr(value)[1:-1], value[:24] if len(value) > 40 else "")
        return judge(f"{task} --{flag}={value!r}", r, names, junk in ACCEPTED.get((task, flag), ()))

    with ThreadPoolExecutor(WORKERS) as pool:
        problems = [p for p in pool.map(one, enumerate(cases)) if p]
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------
# the values of invoke.yaml's `voltaforge:` keys
# ------------------------------------------------------------------------------------------

YAML_JUNK = [
    '"abc"',
    '""',
    '"-1"',
    '"../../etc/x"',
    '"a b;rm"',
    '"1' + "0" * 400 + '"',
    '"1e999"',
    '"x\\ny"',
    '"{dir}"',
    '"{file}"',
    "5",
    "-1",
    "0",
    "true",
    "null",
    "[1]",
    ".inf",
    ".nan",
]
# key -> the YAML values that are right for it (null: unset, the default applies)
CONFIG_ACCEPTED = {
    "host": {'"abc"', '"1e999"', "true"},  # host names that do not resolve: refused when connecting, named
    "recipe": {"null"},  # no recipe: preflight judges the host alone
    "inventory": {"null"},
    "recipes_dir": {"null", '"{dir}"'},  # a directory; no recipe is asked for
    "prefix": {"null", '"{dir}"', '"{file}"'},  # absolute paths on the host (what is there is the host's to say)
    "connect_timeout": {"5"},
}


def test_every_configuration_key_is_walked():
    assert set(CONFIG_ACCEPTED) == set(DEFAULTS["voltaforge"])


@pytest.mark.parametrize("key", sorted(DEFAULTS["voltaforge"]))
def test_junk_in_every_configuration_key_is_one_line_and_exit_2(key, tmp_path):
    def one(i_value: tuple[int, str]) -> str | None:
        i, junk = i_value
        home = tmp_path / str(i)
        value = made_for_the_run(home, junk)
        cfg = home / "site.yaml"
        cfg.write_text(f"voltaforge:\n  {key}: {value}\n")
        args = ["-f", str(cfg), "preflight"] + ([] if key == "host" else ["--host", NOWHERE])
        r = run(args, home)
        parsed = str(yaml.safe_load(value))  # what the task gets: true is 'True', .inf 'inf'
        names = (f"voltaforge.{key}", f"--{key}", parsed, repr(parsed)[1:-1])
        return judge(f"{key}: {value}", r, names, junk in CONFIG_ACCEPTED[key])

    with ThreadPoolExecutor(WORKERS) as pool:
        problems = [p for p in pool.map(one, enumerate(YAML_JUNK)) if p]
    assert not problems, "\n".join(problems)


def test_a_misspelt_key_is_named(tmp_path):
    cfg = tmp_path / "site.yaml"
    cfg.write_text("voltaforge:\n  recipies_dir: /srv/recipes\n")
    r = run(["-f", str(cfg), "plan", "--recipe", "tiny-cpu"], tmp_path)
    assert r.returncode == 2 and r.stderr.startswith(
        "error: voltaforge.recipies_dir in the configuration is not a setting; known: connect_timeout, host, "
    ), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "text,says",
    [
        ("voltaforge:\n  host: {a: 1}\n", "Can't cleanly merge"),
        ("voltaforge: 5\n", "Can't cleanly merge"),
        ("voltaforge: [1]\n", "Can't cleanly merge"),
        ("voltaforge:\n  host: [unclosed\n", "while parsing a flow sequence"),
    ],
)
def test_a_file_invoke_cannot_merge_is_one_line_from_the_voltaforge_command(text, says, tmp_path):
    """What Invoke itself refuses before any task runs (its own traceback under `invoke`): the
    installed `voltaforge` command says it in one line."""
    cfg = tmp_path / "site.yaml"
    cfg.write_text(text)
    r = run(["-f", str(cfg), "plan", "--recipe", "tiny-cpu"], tmp_path, program="voltaforge")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: the Invoke configuration (invoke.yaml, ~/.invoke.yaml or -f FILE): ")
    assert says in lines[0] and "Traceback" not in r.stderr
