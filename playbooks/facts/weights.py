"""Weight facts: how many values of a checkpoint FP16 cannot hold, read on the host that has it.

Why: a V100 has no BF16, so the quantize step converts BF16 (or F32) checkpoints to FP16
first. A value with |x| >= 65520 becomes inf in that conversion, without a word from any
converter, and the served model then answers NaN or nothing. The check runs where the weights
are (tens of GB: they are not copied back), with the serving venv's python and numpy, as the
standalone probe `probes/fp16_range_probe.py` (its docstring has the JSON format and the
arithmetic of the threshold). It reads shard by shard in bounded chunks.

The pattern is the GPU probe's (facts/gpu.py): push the script, run `fp16_range_command`,
parse its one JSON line with `parse_fp16_range`, which never raises: anything unreadable is
an `Fp16Range` with `error` set.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from shlex import quote

from pydantic import BaseModel, ConfigDict, ValidationError

from playbooks.facts import lines

# The standalone probe script (stdlib + numpy), shipped as package data (probes/*.py).
FP16_RANGE_PROBE_PATH = Path(__file__).resolve().parent / "probes" / "fp16_range_probe.py"
FP16_RANGE_PROBE_NAME = "voltaforge-fp16-range"
FP16_RANGE_PROBE_VERSION = 1

# How many tensors a summary names before "and N more": enough to point at the culprits
# (usually a few down_proj/lm_head tensors), short enough for one line.
SUMMARY_TENSORS = 5


class TensorCount(BaseModel):
    """Values of one tensor in one shard: beyond FP16's range, or already NaN/inf."""

    model_config = ConfigDict(frozen=True)

    tensor: str
    file: str  # the shard's file name (basename)
    dtype: str = "BF16"
    count: int
    max_abs: float | None = None  # largest |x| among the counted values; None for NaN/inf
    nan: int = 0  # nonfinite entries only
    inf: int = 0


class Fp16Range(BaseModel):
    """What the FP16 range probe found in a set of shards, or why it could not say (error)."""

    model_config = ConfigDict(frozen=True)

    files: tuple[str, ...] = ()
    dtypes: dict[str, int] = {}  # tensors per safetensors dtype, e.g. {"BF16": 290}
    overflow: tuple[TensorCount, ...] = ()  # finite values that become +/-inf in FP16
    nonfinite: tuple[TensorCount, ...] = ()  # NaN/inf already in the checkpoint
    values_checked: int = 0  # BF16 + F32 values examined
    error: str | None = None
    # --clamp only: the clamped copies written, and how many values were clamped in them
    written: tuple[str, ...] = ()
    clamped_values: int = 0

    @property
    def ok(self) -> bool:
        """The probe ran to the end (says nothing about the values: see `overflow`)."""
        return self.error is None

    @property
    def overflow_values(self) -> int:
        return sum(t.count for t in self.overflow)

    @property
    def nonfinite_values(self) -> int:
        return sum(t.count for t in self.nonfinite)

    @property
    def summary(self) -> str:
        """One line for a person: what overflows where, or that nothing does."""
        if self.error is not None:
            return f"FP16 range check failed: {self.error}"
        parts = []
        if self.overflow:
            parts.append(
                f"{_values(self.overflow_values, _dtype_label(self.overflow))} beyond FP16's range "
                f"in {_tensors(self.overflow)}"
            )
        if self.nonfinite:
            parts.append(
                f"{_values(self.nonfinite_values, 'NaN/inf')} already in the checkpoint in {_tensors(self.nonfinite)}"
            )
        if not parts:
            return f"no value beyond FP16's range ({self.values_checked} values checked)"
        return "; ".join(parts)


def _dtype_label(entries: Sequence[TensorCount]) -> str:
    dtypes = sorted({t.dtype for t in entries})
    return "/".join(dtypes)


def _values(n: int, what: str) -> str:
    return f"{n} {what} value{'' if n == 1 else 's'}"


def _tensors(entries: Sequence[TensorCount]) -> str:
    """'2 tensors (a: 2, b: 1)'; at most SUMMARY_TENSORS named, the biggest counts first."""
    ranked = sorted(entries, key=lambda t: -t.count)  # stable: probe order among equals
    named = ", ".join(f"{t.tensor}: {t.count}" for t in ranked[:SUMMARY_TENSORS])
    rest = len(ranked) - SUMMARY_TENSORS
    if rest > 0:
        named += f" and {rest} more"
    n = len(entries)
    return f"{n} tensor{'' if n == 1 else 's'} ({named})"


def fp16_range_command(
    python: str,
    remote_probe: str,
    paths: Sequence[str],
    *,
    clamp_dir: str | None = None,
    chunk_bytes: int | None = None,
) -> str:
    """Command that runs the pushed probe with `python` (the serving venv's) over `paths`.

    Every argument is shell-quoted; `--` ends the options, so a path starting with '-' is
    still a path. stderr joins stdout (a numpy warning is noise before the JSON line, which
    the parser skips) and `|| true` keeps the exit status 0: the parser judges the output,
    including "python not found".
    """
    if not paths:
        raise ValueError("fp16_range_command needs at least one safetensors file or directory")
    args = [quote(python), quote(remote_probe)]
    if chunk_bytes is not None:
        args += ["--chunk-bytes", str(int(chunk_bytes))]
    if clamp_dir is not None:
        args += ["--clamp", quote(clamp_dir)]
    args += ["--", *(quote(p) for p in paths)]
    return " ".join(args) + " 2>&1 || true"


def parse_fp16_range(text: str) -> Fp16Range:
    """Parse the probe's one JSON line: the last line starting with '{' (earlier lines are
    noise). Never raises; anything unreadable gives an Fp16Range with `error` set."""
    candidates = [ln.strip() for ln in lines(text) if ln.strip().startswith("{")]
    if not candidates:
        first = next((ln.strip() for ln in lines(text) if ln.strip()), "")
        return Fp16Range(
            error=f"FP16 range probe printed no JSON: {first}" if first else "FP16 range probe printed nothing"
        )
    try:
        data = json.loads(candidates[-1])
    except ValueError as exc:
        return Fp16Range(error=f"FP16 range probe output is not JSON: {exc}")
    if not isinstance(data, dict):
        return Fp16Range(error="FP16 range probe JSON is not an object")
    if data.get("probe") != FP16_RANGE_PROBE_NAME:
        return Fp16Range(error=f"not the FP16 range probe's output (probe: {data.get('probe')!r})")
    if data.get("probe_version") != FP16_RANGE_PROBE_VERSION:
        return Fp16Range(
            error=f"FP16 range probe version {data.get('probe_version')!r}, expected {FP16_RANGE_PROBE_VERSION}"
        )
    if data.get("error") is not None:
        # the counts gathered before the failure cover only part of the shards: not kept
        return Fp16Range(error=str(data["error"]))
    fields = {k: v for k, v in data.items() if k in Fp16Range.model_fields and v is not None}
    try:
        return Fp16Range(**fields)
    except (ValidationError, TypeError) as exc:
        return Fp16Range(error=f"FP16 range probe JSON unreadable: {_first_error(exc)}")


def _first_error(exc: Exception) -> str:
    """One line out of pydantic's multi-line message."""
    if isinstance(exc, ValidationError) and exc.errors():
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{where}: {first['msg']}"
    return str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
