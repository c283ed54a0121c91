"""Facts for an EXL2 conversion: the source model's files, a converter job's state, which paths exist.

Each a read-only command (exit 0 whatever the host holds) and a pure parser, as in the rest
of this package. The converter is exllamav2 0.3.2's ``exllamav2/conversion/convert_exl2.py``:
its job lives in ``<work dir>/job_new.json`` (line 85), whose ``progress`` walks begin ->
... -> finished and which carries ``invalid`` while a checkpoint is half written
(measure.py, lines 705-715; quantize.py, 530-538). That file holds the whole measurement too (hundreds of KB for a
big model), so only those two keys are read back, by the venv's own Python.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from playbooks.facts import lines

# ------------------------------------------------------------------------------------------
# the source model
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFiles:
    """A Hugging Face model directory as the converter reads it: config.json and *.safetensors
    (ExLlamaV2 loads only safetensors; compile.py ignores *.bin)."""

    config_sha256: str
    weights: tuple[tuple[str, int], ...]  # (file name, bytes), sorted

    @property
    def weights_bytes(self) -> int:
        return sum(size for _, size in self.weights)

    @property
    def fingerprint(self) -> str:
        """config.json's hash and every weight file's name and size: cheap on a 60 GB model,
        and what tells a re-downloaded or other model apart (a caller with the repo's commit
        sha passes it as well, which pins the content)."""
        blob = json.dumps({"config": self.config_sha256, "weights": self.weights}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def model_files_command(model_dir: str) -> str:
    q = shlex.quote(model_dir)
    return (
        f"if [ -f {q}/config.json ]; then cd -- {q} && sha256sum < config.json && "
        'for f in *.safetensors; do if [ -f "$f" ]; then stat -L -c \'%s %n\' -- "$f"; fi; done; fi; true'
    )


def parse_model_files(output: str) -> ModelFiles | None:
    """None when there is no config.json (no model there, or not readable)."""
    rows = [line.strip() for line in lines(output) if line.strip()]
    if not rows:
        return None
    digest = rows[0].split()[0]
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        return None
    weights = []
    for row in rows[1:]:
        size, _, name = row.partition(" ")
        if size.isdigit() and name:
            weights.append((name, int(size)))
    return ModelFiles(digest, tuple(sorted(weights)))


# ------------------------------------------------------------------------------------------
# a converter job
# ------------------------------------------------------------------------------------------

_JOB_STATE = (
    "import json, sys; j = json.load(open(sys.argv[1], encoding='utf8')); "
    "print(json.dumps({'progress': j.get('progress'), 'invalid': 'invalid' in j}))"
)


@dataclass(frozen=True)
class JobState:
    """A converter work directory: absent, without a job, or a job at some stage."""

    exists: bool = False
    progress: str | None = None  # convert_exl2.py's job["progress"]; None: no readable job
    corrupt: bool = False  # job["invalid"] (an interrupted checkpoint) or an unreadable job file

    @property
    def resumable(self) -> bool:
        return self.progress is not None and not self.corrupt

    @property
    def finished(self) -> bool:
        return self.resumable and self.progress == "finished"


def job_state_command(python: str, work_dir: str) -> str:
    job, w = shlex.quote(work_dir + "/job_new.json"), shlex.quote(work_dir)
    return (
        f"if [ -f {job} ]; then {shlex.quote(python)} -c {shlex.quote(_JOB_STATE)} {job} 2>&1 || true; "
        f"elif [ -d {w} ]; then echo no-job; else echo missing; fi"
    )


def parse_job_state(output: str) -> JobState:
    text = output.strip()
    if text == "missing" or not text:
        return JobState()
    if text == "no-job":
        return JobState(exists=True)
    try:
        data = json.loads(text.splitlines()[-1])
    except ValueError:
        return JobState(exists=True, corrupt=True)  # a truncated job file: the traceback
    if not isinstance(data, dict) or not isinstance(data.get("progress"), str):
        return JobState(exists=True, corrupt=True)
    return JobState(exists=True, progress=data["progress"], corrupt=bool(data.get("invalid")))


# ------------------------------------------------------------------------------------------
# paths
# ------------------------------------------------------------------------------------------


def exist_command(paths: Sequence[str]) -> str:
    """One line per path, in order: ``d`` directory, ``f`` file, ``-`` nothing (one round trip)."""
    return "; ".join(
        f"if [ -d {q} ]; then echo d; elif [ -e {q} ]; then echo f; else echo -; fi"
        for q in (shlex.quote(p) for p in paths)
    )


def parse_exist(output: str, paths: Sequence[str]) -> dict[str, str]:
    """{path: "d" | "f" | "-"}; a path the output does not answer for counts as absent."""
    answers = [x.strip() for x in lines(output) if x.strip()]
    return {p: (answers[i] if i < len(answers) and answers[i] in ("d", "f", "-") else "-") for i, p in enumerate(paths)}
