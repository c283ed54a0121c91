"""The model set's real output for docs/sets.md (issue 56); asserts nothing.

Three generated members of different sizes (tests/model_set_members.py: tiny-cpu's model at
three widths, one thread each) in one inventory set on `local`, under a CPU memory budget that
holds two of them. Then, as a user runs them:

1. `invoke plan --host local`: the set's residency plan (CLI output);
2. the set's deploy step and its gate, as provision runs them (conduct/set_deploy.py,
   steps/measure/set_gate.py; the models staged where `invoke quantize` leaves them, so no
   toolchain or build runs): the gate's lines, one per member, and its Markdown report;
3. `invoke status --host local` right after (CLI output);
then stop and remove.

Usage: .venv/bin/python scripts/sample_set.py
Writes reports/local/set-plan.json, set-gate.json, set-status.json (each block's text as its
``extra.output``; the gate's figures per member as the gate file's figures).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from playbooks.conduct.remove import remove_deployed  # noqa: E402
from playbooks.conduct.set_deploy import set_deploy_ops  # noqa: E402
from playbooks.conduct.settings import Settings  # noqa: E402
from playbooks.conduct.stop import stop_served  # noqa: E402
from playbooks.config.model_set import plan_set  # noqa: E402
from playbooks.host.local import LocalHost  # noqa: E402
from playbooks.host.ops import run_ops  # noqa: E402
from playbooks.host.output import BufferedPrinter  # noqa: E402
from playbooks.plan.gpus import GIB, MIB  # noqa: E402
from playbooks.results import write_result  # noqa: E402
from playbooks.steps.measure.set_gate import EnsureSetGate  # noqa: E402
from playbooks.steps.serve.lifecycle import EnsureServing  # noqa: E402
from tests.helpers import stage_served_model  # noqa: E402
from tests.model_set_members import WIDTHS, three_members  # noqa: E402

REPORTS = ROOT / "reports" / "local"
MEASURES = [
    "playbooks/cli/plan_set.py",
    "playbooks/cli/status.py",
    "playbooks/config/model_set.py",
    "playbooks/plan/residency.py",
    "playbooks/conduct/set_deploy.py",
    "playbooks/conduct/status.py",
    "playbooks/steps/measure/set_gate.py",
    "scripts/sample_set.py",
]
#: a path of this run's temporary directory, as the samples show it
TMP = re.compile(r"/tmp/[\w.-]+/")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def invoke(inv: Path, recipes: Path, *args: str) -> str:
    env = {**os.environ, "COLUMNS": "110", "INVOKE_VOLTAFORGE_RECIPES_DIR": str(recipes)}
    r = subprocess.run(
        [sys.executable, "-m", "invoke", "-r", str(ROOT), *args, "--inventory", str(inv)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    if r.returncode:
        raise SystemExit(f"invoke {' '.join(args)} exited {r.returncode}: {r.stdout[-2000:]}{r.stderr[-2000:]}")
    return TMP.sub("/tmp/…/", r.stdout.rstrip())


def main() -> int:
    names = list(WIDTHS)
    with tempfile.TemporaryDirectory(prefix="vf-set-") as work:
        tmp = Path(work)
        recipes, ggufs = three_members(tmp)
        alone = plan_set(names, memory_gib=4.0, recipes_dir=recipes).residency
        held = {m.name: m.held for m in alone.members}
        budget = round((alone.parent + held["large"] + held["mid"] + MIB) / GIB, 3)  # two resident, never three
        prefix, port = tmp / "opt", free_port()
        entry = {"set": "trio", "models": names, "port": port, "sleep_idle_s": 600}
        host_entry = {"host": "127.0.0.1", "local": True, "prefix": str(prefix), "memory_budget_gib": budget}
        inv = tmp / "inventory.yaml"
        inv.write_text(yaml.safe_dump({"hosts": {"local": host_entry | {"serve": [entry]}}}))
        settings = Settings(inventory=inv, recipes_dir=recipes)
        plan_text = invoke(inv, recipes, "plan", "--host", "local")
        [trio] = settings.targets("local", None)
        printer = BufferedPrinter()
        with LocalHost(printer=printer) as host:
            for i, name in enumerate(names):
                stage_served_model(host, str(prefix), recipes / f"{name}.yaml", ggufs[name], tools=i == 0)
            ops = set_deploy_ops(trio, host, str(prefix), "process", gated=True)
            serving = next(op for op in ops if isinstance(op, EnsureServing))
            gate = EnsureSetGate(serving, trio.members, trio.models_max, str(prefix), out_dir=tmp / "gate")
            try:
                done = run_ops(host, [*ops, gate])
                failed = [c for c in done if c.status == "failed"]
                if failed:
                    raise SystemExit(f"the set did not deploy: {failed}")
                status_text = invoke(inv, recipes, "status", "--host", "local")
            finally:
                stop_served(settings, "local")
                remove_deployed(settings, "local", "trio", dry_run=False)
        report = json.loads((tmp / "gate" / "set-gate.json").read_text())
        table = (tmp / "gate" / "set-gate.md").read_text().rstrip()
    said = [text for _, text in printer.lines if re.match(rf"({'|'.join(names)}): |gate passed", text)]
    gate_text = "\n".join(f"[local] {t}" for t in said)
    figures: dict[str, float] = {"members": len(names), "models_max": trio.models_max}
    units = {"members": "models", "models_max": "models"}
    for m in report["per_member"]:
        figures[f"{m['name']}_swap_first_token_s"] = m["swap"]["first_token_s"]
        figures[f"{m['name']}_decode_tok_s"] = m["single_tok_s"]
        units |= {f"{m['name']}_swap_first_token_s": "s", f"{m['name']}_decode_tok_s": "tok/s"}
    common = {"measures": MEASURES, "command": ".venv/bin/python scripts/sample_set.py"}
    write_result(
        REPORTS / "set-plan.json",
        "invoke plan --host local for a set of three generated models under a CPU budget for two",
        {"members": len(names), "models_max": trio.models_max, "budget_gib": budget},
        {"members": "models", "models_max": "models", "budget_gib": "GiB"},
        notes="extra.output: the command's output as printed (110 columns)",
        extra={"output": plan_text},
        **common,
    )
    write_result(
        REPORTS / "set-gate.json",
        "the set's gate per member (a swap's first token, then its own recipe's gate) through the router on local",
        figures,
        units,
        notes="extra.output: the gate's lines as provision prints them; extra.report: its Markdown report",
        extra={"output": gate_text, "report": table},
        **common,
    )
    write_result(
        REPORTS / "set-status.json",
        "invoke status --host local right after the set's gate",
        {"members": len(names)},
        {"members": "models"},
        notes="extra.output: the command's output as printed (110 columns); temporary paths shortened to /tmp/…/",
        extra={"output": status_text},
        **common,
    )
    print(plan_text, gate_text, table, status_text, sep="\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
