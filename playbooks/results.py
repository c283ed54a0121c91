"""Result files: a measured figure together with how, where, when and on what it was measured.

Every measured figure the README and docs/ publish comes from one of these files under `reports/`
(`tests/test_readme_figures.py` holds the pages to them). One JSON object per measurement:

    {
      "schema": 1,
      "title": "the gate of qwen2.5-14b-v100-16gb on a lent H200",
      "figures": {"single_stream_tok_s": 131.5, "ttft_p50_ms": 63},
      "units": {"single_stream_tok_s": "tok/s", "ttft_p50_ms": "ms"},
      "command": "python3 scripts/device_check.py gate --out $OUT/r",
      "commit": "20cabc3",
      "machine": "a lent NVIDIA H200 (driver 580.159.04, CUDA 13.0), 16 cores, 126 GiB RAM",
      "date": "2026-11-30",
      "source": "measured here",
      "notes": "",
      "extra": {}
    }

- `figures`: name -> number (finite; as measured, the README rounds); `units`: the same names,
  each a unit ("s", "tok/s", "GB/s", "MiB", "%", "x", "count", ...).
- `command`: what was run, as typed. `commit`: the short sha of the code measured; a transcribed
  result whose run did not keep it gives the nearest commit that is known (the one that first
  recorded the figures) and says so in `notes`.
- `machine`: what it ran on, in words. `date`: UTC, `YYYY-MM-DD` or `YYYY-MM-DDTHH:MM:SSZ`.
- `source`: "measured here" when the file was written by the run itself (`write_result`), or
  "transcribed: <where the raw numbers were recorded>" when they were copied from a README, a
  session note or a committed fixture after the fact: honest about what a file is.
- `notes`: anything a reader needs to read the figures right; `extra`: any JSON (a sample output
  the README shows whole is `extra["output"]`).
- `measures`: the code paths (files or folders, relative to the checkout) whose behaviour the
  figures are of. A file that names them is held to them: when a commit after `commit` changed
  one, the figures describe code that is gone, and `tests/test_samples_current.py` fails until
  `scripts/remake_samples.py` makes the file again.

Pure except file I/O: `write_result` reads git, /proc and os-release to fill what it is not given.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from playbooks.errors import VoltaforgeError

SCHEMA = 1
MEASURED_HERE = "measured here"
TRANSCRIBED = "transcribed: "
_COMMIT = re.compile(r"[0-9a-f]{7,40}")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}:\d{2}Z)?")
NAME = re.compile(r"[a-z][a-z0-9_]*")  # a figure's name (the README's markers name figures by it)


class ResultError(VoltaforgeError):
    """A result file is missing, unreadable or invalid; the message names the file."""


class Result(BaseModel):
    """One result file (see the module's docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_version: Literal[1] = Field(alias="schema")
    title: str = Field(min_length=1)
    figures: dict[str, int | float] = Field(min_length=1)  # ints stay ints in the file
    units: dict[str, str]
    command: str = Field(min_length=1)
    commit: str
    machine: str = Field(min_length=1)
    date: str
    source: str
    notes: str = ""
    extra: dict[str, Any] = Field(default_factory=dict)
    measures: list[str] = Field(default_factory=list)

    @field_validator("measures")
    @classmethod
    def _paths(cls, v: list[str]) -> list[str]:
        for path in v:
            if not path.strip() or path.startswith("/") or ".." in Path(path).parts:
                raise ValueError(f"{path!r} is not a path inside the checkout")
        return v

    @field_validator("figures", mode="before")
    @classmethod
    def _numbers(cls, v: Any) -> Any:
        if isinstance(v, dict):
            for name, value in v.items():
                if not isinstance(name, str) or not NAME.fullmatch(name):
                    raise ValueError(f"figure name {name!r} is not lowercase letters, digits and _")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"figure {name!r} is not a finite number: {value!r}")
        return v

    @field_validator("title", "command", "machine", "commit", "date", "source")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be blank")
        return v

    @field_validator("commit")
    @classmethod
    def _commit(cls, v: str) -> str:
        if not _COMMIT.fullmatch(v):
            raise ValueError(f"must be a git commit sha (7-40 lowercase hex digits), got {v!r}")
        return v

    @field_validator("date")
    @classmethod
    def _date(cls, v: str) -> str:
        if not _DATE.fullmatch(v):
            raise ValueError(f"must be a UTC date, YYYY-MM-DD or YYYY-MM-DDTHH:MM:SSZ, got {v!r}")
        datetime.strptime(v[:10], "%Y-%m-%d")  # a real day (ValueError otherwise)
        return v

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if v != MEASURED_HERE and not (v.startswith(TRANSCRIBED) and v[len(TRANSCRIBED) :].strip()):
            raise ValueError(f"must be {MEASURED_HERE!r} or 'transcribed: <where the raw numbers were recorded>'")
        return v

    @model_validator(mode="after")
    def _units_match(self) -> Result:
        if set(self.units) != set(self.figures):
            missing = sorted(set(self.figures) - set(self.units))
            stray = sorted(set(self.units) - set(self.figures))
            raise ValueError(f"units must name exactly the figures: without a unit {missing}, no such figure {stray}")
        blank = sorted(k for k, u in self.units.items() if not u.strip())
        if blank:
            raise ValueError(f"blank unit for {blank}")
        return self

    @property
    def transcribed(self) -> bool:
        return self.source != MEASURED_HERE

    def as_json(self) -> str:
        data = self.model_dump(by_alias=True)
        if not data["measures"]:
            del data["measures"]  # a file that names no code paths reads as it always did
        return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def _one_line(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(x) for x in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def parse_result(data: Any, where: str = "result") -> Result:
    """A result from already-parsed JSON; ResultError naming `where` and every problem."""
    if not isinstance(data, dict):
        raise ResultError(f"{where}: a result file holds a JSON object, got {type(data).__name__}")
    try:
        return Result.model_validate(data)
    except ValidationError as exc:
        raise ResultError(f"{where}: {_one_line(exc)}") from None


def load_result(path: Path | str) -> Result:
    """Read and validate a result file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ResultError(f"{path}: no such result file") from None
    except OSError as exc:
        raise ResultError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    return parse_result(data, str(path))


def checkout_commit(where: Path | None = None) -> str | None:
    """`git rev-parse --short HEAD` of the checkout holding `where` (this package's by
    default), or None outside a checkout or without git."""
    where = where or Path(__file__).resolve().parent
    try:
        r = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    sha = r.stdout.strip()
    return sha if r.returncode == 0 and _COMMIT.fullmatch(sha) else None


def changed_since(commit: str, paths: list[str], root: Path) -> list[str]:
    """The commits after ``commit`` that changed any of ``paths`` in the checkout at ``root``,
    newest first (``git log --format=%h commit..HEAD -- paths``); ResultError when git cannot
    tell (not a checkout, a commit it does not have)."""
    r = subprocess.run(
        ["git", "-C", str(root), "log", "--format=%h", f"{commit}..HEAD", "--", *paths],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0:
        raise ResultError(f"git log {commit}..HEAD in {root}: {r.stderr.strip() or 'failed'}")
    return r.stdout.split()


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def describe_machine() -> str:
    """This machine in words: OS, architecture, CPUs (model), RAM; from platform, os-release,
    /proc/cpuinfo and /proc/meminfo (what is not readable is left out)."""
    os_name = next(
        (
            ln.split("=", 1)[1].strip().strip('"')
            for ln in _read("/etc/os-release").splitlines()
            if ln.startswith("PRETTY_NAME=")
        ),
        platform.system(),
    )
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in _read("/proc/cpuinfo").splitlines() if ln.startswith("model name")), ""
    )
    mem = re.search(r"^MemTotal:\s+(\d+) kB", _read("/proc/meminfo"), re.M)
    parts = [f"{os_name}, {platform.machine()}", f"{os.cpu_count() or '?'} CPUs" + (f" ({cpu})" if cpu else "")]
    if mem:
        parts.append(f"{int(mem.group(1)) / 2**20:.1f} GiB RAM")
    return ", ".join(parts)


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_result(
    path: Path,
    title: str,
    figures: dict[str, float],
    units: dict[str, str],
    command: str,
    *,
    source: str = MEASURED_HERE,
    machine: str | None = None,
    notes: str = "",
    extra: dict[str, Any] | None = None,
    commit: str | None = None,
    date: str | None = None,
    measures: list[str] | None = None,
) -> Result:
    """Validate and write one result file (its folders made); returns it.

    Filled when not given: `commit` from git in this checkout (ResultError outside one: pass
    it), `machine` from describe_machine(), `date` now in UTC."""
    commit = commit or checkout_commit()
    if commit is None:
        raise ResultError(f"{path}: no commit: not run in a git checkout, so pass commit= (the sha of the code run)")
    result = parse_result(
        {
            "schema": SCHEMA,
            "title": title,
            "figures": figures,
            "units": units,
            "command": command,
            "commit": commit,
            "machine": machine or describe_machine(),
            "date": date or utc_now(),
            "source": source,
            "notes": notes,
            "extra": extra or {},
            "measures": measures or [],
        },
        str(path),
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(result.as_json())
    tmp.replace(path)
    return result
