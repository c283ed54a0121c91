"""An EXL2 quant of a model on the host, converted by the pinned exllamav2's own converter.

The converter is ``exllamav2/conversion/convert_exl2.py`` of exllamav2 0.3.2 (the wheel
EnsureExllamav2 installs). The module has no ``main()`` and no ``__name__`` guard: it parses
its arguments and converts at import (the repository's ``convert.py`` is the single line
``import exllamav2.conversion.convert_exl2``, commit a0ea2b0), and ``conversion/`` has no
``__init__.py`` (a namespace package inside ``exllamav2``, how its own imports reach it). So
``<venv>/bin/python -m exllamav2.conversion.convert_exl2`` runs exactly what ``convert.py``
runs, from the pip-installed wheel, with no repository checkout.

What the converter does that shapes this step (line numbers of convert_exl2.py):
- A measurement pass (how much error each layer takes at each bit rate) is the slow half and
  depends only on the model and the calibration, not on the bpw. ``-om FILE`` (26) stops after
  it and writes it to FILE (measure.py 727-734; -om and -cf conflict, 62); ``-m FILE`` (27)
  reuses one and skips straight to optimizing for the bpw (123-128, 234-238). So the model is
  measured once, into ``<models_root>/exl2/measurement.json``, and every bpw reuses it.
- ``-o DIR`` (16) is a work directory: the job (``job_new.json``, 85), the calibration
  tokens, hidden states and every quantized tensor. A job found there is resumed unless
  ``-nr`` (18, which empties the directory, 93-100); a resumed job takes its options from the
  job file, not the command line (143-146). So each bpw has its own work directory, a job is
  resumed only when a marker beside the directory says it was started for these very inputs,
  and ``-nr`` starts over otherwise.
- ``-cf DIR`` (19) writes the finished model with the source's config and tokenizer files and
  ``quantization_config`` in config.json (compile.py 248-293). It is pointed at
  ``<bpw>bpw-h<hb>.partial`` and renamed to ``<bpw>bpw-h<hb>`` only once proven, with a stamp
  inside: an interrupted run never leaves a directory that looks finished.
- Its argument errors and a finished or corrupted job end with ``sys.exit()``: exit status 0
  with nothing done (48-53, 58-60, 147-153). So the exit status proves nothing: a probe reads
  back the job's progress and what was written (``quantization_config``, the shards, the
  measurement) before anything counts, and a stamp records what it found.
- It needs a CUDA GPU (the measurement and quantization run on ``cuda:0``: measure.py 128-132),
  so a host without one is refused before anything runs, naming what to do instead.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from playbooks.facts import builds, exl2, files, gpu, python, read_fact
from playbooks.host.base import Host
from playbooks.host.commands import check_path
from playbooks.host.ops import Command, Decision, Operation, OperationError, Record, Shell, Upload
from playbooks.plan.exl2_size import EXL2_BPW_RANGE, HEAD_BITS_OPTIONS, exl2_quant_name
from playbooks.steps.build.buildenv import env_prefix
from playbooks.steps.build.exllamav2 import ext_module
from playbooks.steps.build.proven_build import Probe, run_proven

#: ``python -m`` target: the converter module of the installed wheel (see the module doc).
CONVERTER = "exllamav2.conversion.convert_exl2"
STAMP_NAME = "voltaforge-exl2.json"
#: a converter already running on the same work directory (a re-run after a dropped SSH
#: connection while the first still converts): flock's exit status for "locked"
BUSY_EXIT = 75

# The probes: read back what the converter wrote, exit non-zero with one line when it is not
# what was asked (the converter's own exit status proves nothing, see the module doc).
_CHECK_JOB = (
    "job = json.load(open(os.path.join(work, 'job_new.json'), encoding='utf8')); "
    "progress = job.get('progress'); "
    "progress == 'finished' or sys.exit(f'the converter stopped at {progress!r} (see its output above): re-run')"
)
VERIFY_MEASUREMENT = (
    "import json, os, sys; work, path = sys.argv[1:3]; " + _CHECK_JOB + "; m = json.load(open(path, encoding='utf8')); "
    "'measurement' in m and 'last_module_idx' in m or sys.exit(f'{path} is not a measurement'); "
    "print(json.dumps({'modules': len(m['measurement']), 'last_module_idx': m['last_module_idx']}))"
)
VERIFY_QUANT = (
    "import json, os, sys; work, out, bits, head = sys.argv[1:5]; "
    + _CHECK_JOB
    + "; q = json.load(open(os.path.join(out, 'config.json'), encoding='utf8')).get('quantization_config') or {}; "
    "want = {'quant_method': 'exl2', 'bits': float(bits), 'head_bits': int(head)}; "
    "got = {k: q.get(k) for k in want}; "
    "got == want or sys.exit(f'{out}/config.json has quantization_config {got}, want {want}'); "
    "shards = sorted(f for f in os.listdir(out) if f.endswith('.safetensors')); "
    "shards or sys.exit(f'no *.safetensors in {out}'); "
    "print(json.dumps({'exllamav2': q.get('version'), 'calibration': q.get('calibration'), 'shards': shards, "
    "'bytes': sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))}))"
)


@dataclass(frozen=True)
class Sampling:
    """How much calibration text the converter uses: its own defaults (convert_exl2.py 28-31).

    The row counts apply only to a parquet given with ``-c``: without one the converter builds
    its standard mix and sets the rows itself (tokenize.py 45-53); the lengths apply either way
    (capped at 2048 for the standard mix, tokenize.py 88)."""

    rows: int = 100  # -r, the quantization pass
    measurement_rows: int = 16  # -mr
    length: int = 2048  # -l
    measurement_length: int = 2048  # -ml


@dataclass(frozen=True)
class Exl2Layout:
    """Where one model's EXL2 files live under its models root."""

    models_root: str  # <prefix>/models/<model-name>

    @property
    def root(self) -> str:
        return f"{self.models_root}/exl2"

    @property
    def measurement(self) -> str:
        return f"{self.root}/measurement.json"

    @property
    def measurement_partial(self) -> str:
        return f"{self.root}/measurement.json.partial"

    @property
    def measurement_stamp(self) -> str:
        return f"{self.root}/measurement.{STAMP_NAME}"

    @property
    def measure_work(self) -> str:
        return f"{self.root}/work-measure"

    @staticmethod
    def tag(bpw: float, head_bits: int) -> str:
        """'4.0bpw-h6', '3.3bpw-h6', '2.25bpw-h8': the bpw as EXL2 repos name it (exl2_quant_name)."""
        return f"{bpw_text(bpw)}bpw-h{head_bits}"

    def work(self, tag: str) -> str:
        return f"{self.root}/work-{tag}"

    def output(self, tag: str) -> str:
        return f"{self.root}/{tag}"

    def partial(self, tag: str) -> str:
        return f"{self.root}/{tag}.partial"

    @staticmethod
    def marker(work: str) -> str:
        """Beside the work directory, not in it: ``-nr`` empties the directory (93-100)."""
        return f"{work}.inputs.json"

    @staticmethod
    def lock(work: str) -> str:
        """Beside the work directory too: a lock file removed while held locks nothing."""
        head, _, name = work.rpartition("/")
        return f"{head}/.{name}.lock"


@dataclass(frozen=True)
class Exl2Facts:
    gpus: gpu.GpuFacts = gpu.GpuFacts(available=False, reason="not read")
    exllamav2: str | None = None  # the installed version in the venv
    ext_built: bool = True  # the venv holds exllamav2_ext (the build step's), so nothing JIT-compiles
    model: exl2.ModelFiles | None = None
    calibration_sha256: str | None = None
    paths: dict[str, str] = field(default_factory=dict)  # exl2.parse_exist: "d" | "f" | "-"
    measurement_stamp: dict[str, Any] | None = None
    output_stamp: dict[str, Any] | None = None
    measure_job: exl2.JobState = exl2.JobState()
    measure_marker: str | None = None  # the inputs id the measurement work dir was started for
    quant_job: exl2.JobState = exl2.JobState()
    quant_marker: str | None = None


def _digest(data: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


class EnsureExl2Quant(Operation):
    """``<models_root>/exl2/<bpw>bpw-h<hb>`` holds this model converted to EXL2 at this bpw, proven.

    ``env``: the environment the converter runs in (the caller's CUDA setup: the toolkit on
    PATH for a JIT fallback, ``CUDA_VISIBLE_DEVICES``); ``gpu_available``: the caller's word
    on whether the host has a CUDA GPU, else nvidia-smi is read; ``source_sha``: the model
    repository's commit when known (pins the content the measurement and stamps name).
    """

    def __init__(
        self,
        venv: str,
        model_dir: str,
        models_root: str,
        bpw: float,
        head_bits: int = 6,
        *,
        env: Mapping[str, str] | None = None,
        calibration: str | None = None,
        sampling: Sampling = Sampling(),
        source_sha: str | None = None,
        gpu_available: bool | None = None,
    ):
        lo, hi = EXL2_BPW_RANGE
        if not lo <= bpw <= hi:
            # convert_exl2.py 66-67 only warns outside 2-8 ("will likely not be attainable")
            raise OperationError(f"EXL2 bpw {bpw:g} is outside {lo:g}-{hi:g}: the converter cannot reach it")
        if head_bits not in HEAD_BITS_OPTIONS:
            options = ", ".join(map(str, HEAD_BITS_OPTIONS))
            raise OperationError(f"EXL2 head bits {head_bits} is not one the converter knows ({options})")
        self.venv, self.model_dir = check_path(venv), check_path(model_dir)
        self.layout = Exl2Layout(check_path(models_root))
        self.bpw, self.head_bits = float(bpw), head_bits
        self.env = dict(env or {})
        self.calibration = check_path(calibration) if calibration else None
        self.sampling, self.source_sha, self.gpu_available = sampling, source_sha, gpu_available
        self.tag = Exl2Layout.tag(self.bpw, head_bits)
        self.python = f"{self.venv}/bin/python"
        self.name = f"Ensure {self.layout.output(self.tag)} holds the EXL2 {self.tag} conversion"

    # -- facts ---------------------------------------------------------------------------

    @property
    def watched(self) -> tuple[str, ...]:
        lay = self.layout
        return (lay.measurement, lay.measurement_partial, lay.output(self.tag), lay.partial(self.tag))

    def read(self, host: Host) -> Exl2Facts:
        lay = self.layout

        def cat(path: str) -> dict[str, Any] | None:
            return builds.parse_stamp(read_fact(host, f"cat -- {shlex.quote(path)} 2>/dev/null || true"))

        def marker(work: str) -> str | None:
            return (cat(Exl2Layout.marker(work)) or {}).get("id")

        if self.gpu_available is None:
            gpus = gpu.parse_nvidia_smi_csv(read_fact(host, gpu.NVIDIA_SMI_CSV_COMMAND))
            if gpus.needs_legacy_query:  # drivers before ~R510 reject compute_cap (facts/gpu.py)
                gpus = gpu.parse_nvidia_smi_csv(
                    read_fact(host, gpu.NVIDIA_SMI_CSV_LEGACY_COMMAND), gpu.QUERY_FIELDS_LEGACY
                )
        else:
            gpus = gpu.GpuFacts(available=self.gpu_available, reason="" if self.gpu_available else "the caller says so")
        cal = None
        if self.calibration:
            cal = files.parse_sha256(read_fact(host, files.sha256_command(self.calibration)))
        work = lay.work(self.tag)
        return Exl2Facts(
            gpus=gpus,
            exllamav2=python.read_package_version(host, self.venv, "exllamav2"),
            ext_built=bool(read_fact(host, f"ls -1 -- {ext_module(self.venv)} 2>/dev/null || true").strip()),
            model=exl2.parse_model_files(read_fact(host, exl2.model_files_command(self.model_dir))),
            calibration_sha256=cal,
            paths=exl2.parse_exist(read_fact(host, exl2.exist_command(self.watched)), self.watched),
            measurement_stamp=cat(lay.measurement_stamp),
            output_stamp=cat(f"{lay.output(self.tag)}/{STAMP_NAME}"),
            measure_job=exl2.parse_job_state(read_fact(host, exl2.job_state_command(self.python, lay.measure_work))),
            measure_marker=marker(lay.measure_work),
            quant_job=exl2.parse_job_state(read_fact(host, exl2.job_state_command(self.python, work))),
            quant_marker=marker(work),
        )

    # -- decision --------------------------------------------------------------------------

    def measurement_inputs(self, facts: Exl2Facts) -> dict[str, Any]:
        """What a measurement depends on: the model, the calibration, the converter's version."""
        assert facts.model is not None
        return {
            "model_dir": self.model_dir,
            "model": facts.model.fingerprint,
            "source_sha": self.source_sha,
            "calibration": self.calibration,
            "calibration_sha256": facts.calibration_sha256,
            "measurement_rows": self.sampling.measurement_rows if self.calibration else None,
            "measurement_length": self.sampling.measurement_length,
            "exllamav2": facts.exllamav2,
        }

    def quant_inputs(self, measurement_id: str) -> dict[str, Any]:
        return {
            "measurement": measurement_id,
            "bpw": self.bpw,
            "head_bits": self.head_bits,
            "rows": self.sampling.rows if self.calibration else None,
            "length": self.sampling.length,
        }

    def decide(self, facts: Exl2Facts) -> Decision:
        lay, tag = self.layout, self.tag
        out, partial, work = lay.output(tag), lay.partial(tag), lay.work(tag)
        stamp = facts.output_stamp or {}
        if facts.model is None or not facts.model.weights:
            if stamp.get("bpw") == self.bpw and stamp.get("head_bits") == self.head_bits:
                # the FP16 source may be deleted once converted: nothing left to compare with
                return Decision.ok(f"artifact present: {out} ({self._summary(stamp)}; its source is gone)")
            what = "no config.json" if facts.model is None else "config.json but no *.safetensors"
            raise OperationError(f"{self.model_dir} has {what}: put the Hugging Face model there first")
        m_inputs = self.measurement_inputs(facts)
        m_id = _digest(m_inputs)
        q_inputs = self.quant_inputs(m_id)
        q_id = _digest(q_inputs)
        if stamp.get("id") == q_id and facts.paths.get(out) == "d":
            return Decision.ok(f"artifact present: {out} ({self._summary(stamp)})")
        if facts.paths.get(out) == "d" and not stamp:
            raise OperationError(f"{out} exists without a voltaforge stamp: move it away (it is not ours to replace)")
        if not facts.gpus.available:
            why = f" ({facts.gpus.reason})" if facts.gpus.reason else ""
            raise OperationError(
                f"EXL2 conversion needs a CUDA GPU and this host has none{why}: "
                "convert on a CUDA host of the inventory (`invoke quantize --host HOST --bpw ...`)"
            )
        if facts.exllamav2 is None:
            raise OperationError(f"no exllamav2 in {self.venv}: run `invoke build` first (its converter does this)")
        if not facts.ext_built:
            # exllamav2 imports a ready exllamav2_ext before it compiles one: without it the
            # converter compiles for minutes into a directory of its own (a lent H200's did)
            raise OperationError(
                f"{self.venv} has exllamav2 but not the exllamav2_ext `invoke build` builds: the converter "
                "would compile the extension itself; run `invoke build` first"
            )

        commands: list[Command] = []
        if (facts.measurement_stamp or {}).get("id") == m_id and facts.paths.get(lay.measurement) == "f":
            reasons = [f"measurement {m_id} reused"]
        else:
            reasons = ["no measurement of this model yet" if not facts.measurement_stamp else f"new measurement {m_id}"]
            commands += self._measure(facts, m_inputs, m_id)
        if stamp:
            reasons.append(f"{out} is from other inputs ({stamp.get('id')}, want {q_id})")
        # the quant's id names the measurement's: a job begun on another measurement starts over
        state = job_plan(facts.quant_job, facts.quant_marker == q_id, facts.paths.get(partial) == "d")
        if state == "done":
            reasons.append(f"the conversion finished, {partial} is checked and put in place")
        else:
            if state == "resume":
                reasons.append(f"the interrupted conversion in {work} is resumed (at {facts.quant_job.progress})")
            else:
                commands += self._fresh(work, q_id, q_inputs, partial)
            argv = [
                "-i", self.model_dir,
                "-o", work,
                "-cf", partial,
                "-m", lay.measurement,
                "-b", bpw_text(self.bpw),
                "-hb", str(self.head_bits),
                *self._calibration_args(measure=False),
            ]  # fmt: skip
            commands.append(self._convert(work, argv, start_over=state == "fresh" and facts.quant_job.exists))
        meta = {"kind": "quant", "id": q_id, "inputs": q_inputs, "measurement_inputs": m_inputs, "tag": tag}
        q_out, q_old, q_part = shlex.quote(out), shlex.quote(out + ".old"), shlex.quote(partial)
        commands += [
            Probe(
                f"{shlex.quote(self.python)} -c {shlex.quote(VERIFY_QUANT)} "
                f"{shlex.quote(work)} {q_part} {bpw_text(self.bpw)} {self.head_bits} 2>&1",
                key="quant",
            ),
            Record(f"{partial}/{STAMP_NAME}", "the conversion's inputs and what it wrote", json.dumps(meta)),
            # the finished name appears only by renaming a proven, stamped directory
            Shell(
                f"rm -rf -- {q_old} && {{ [ ! -e {q_out} ] || mv -T -- {q_out} {q_old}; }} && "
                f"mv -T -- {q_part} {q_out} && rm -rf -- {q_old}"
            ),
            self._cleanup(work),
        ]
        return Decision.act("; ".join(reasons), *commands)

    def _measure(self, facts: Exl2Facts, inputs: dict[str, Any], m_id: str) -> list[Command]:
        """The measurement pass (-om), proven, moved into place and stamped."""
        lay = self.layout
        work = lay.measure_work
        cmds: list[Command] = []
        state = job_plan(
            facts.measure_job, facts.measure_marker == m_id, facts.paths.get(lay.measurement_partial) == "f"
        )
        if state == "fresh":
            cmds += self._fresh(work, m_id, inputs, lay.measurement_partial)
        if state != "done":
            argv = ["-i", self.model_dir, "-o", work, "-om", lay.measurement_partial, *self._calibration_args(True)]
            cmds.append(self._convert(work, argv, start_over=state == "fresh" and facts.measure_job.exists))
        meta = {"kind": "measurement", "id": m_id, "inputs": inputs}
        return cmds + [
            Probe(
                f"{shlex.quote(self.python)} -c {shlex.quote(VERIFY_MEASUREMENT)} "
                f"{shlex.quote(work)} {shlex.quote(lay.measurement_partial)} 2>&1",
                key="measurement",
            ),
            # the file first, its stamp after: an interruption between leaves the old stamp,
            # which names other inputs, so the file is measured again rather than trusted
            Shell(f"mv -f -- {shlex.quote(lay.measurement_partial)} {shlex.quote(lay.measurement)}"),
            Record(lay.measurement_stamp, "the measurement's inputs", json.dumps(meta)),
            self._cleanup(work),
        ]

    def _calibration_args(self, measure: bool) -> list[str]:
        """-c with its row count when a parquet is given; the sample length always."""
        s = self.sampling
        args = []
        if self.calibration:
            args = ["-c", self.calibration, *(["-mr", str(s.measurement_rows)] if measure else ["-r", str(s.rows)])]
        return args + (["-ml", str(s.measurement_length)] if measure else ["-l", str(s.length)])

    def _fresh(self, work: str, inputs_id: str, inputs: dict[str, Any], target: str) -> list[Command]:
        """A new job: what an older one left at the target goes, a marker names these inputs."""
        marker = json.dumps({"id": inputs_id, "inputs": inputs}, sort_keys=True, indent=2) + "\n"
        return [
            Shell(f"mkdir -p -- {shlex.quote(self.layout.root)} && rm -rf -- {shlex.quote(target)}"),
            Upload(Exl2Layout.marker(work), marker.encode()),
        ]

    def _convert(self, work: str, argv: list[str], *, start_over: bool) -> Shell:
        """The converter under a lock beside its work directory; ``-nr`` over a job of other
        inputs, which it would otherwise resume with that job's options (143-146)."""
        if start_over:
            argv = [*argv, "-nr"]
        run = f"{env_prefix(self.env)} " if self.env else ""
        lock = shlex.quote(Exl2Layout.lock(work))
        busy = shlex.quote(f"voltaforge: another conversion is running in {work}: wait for it, then re-run")
        return Shell(
            f"{run}flock -n -E {BUSY_EXIT} {lock} {shlex.quote(self.python)} -m {CONVERTER} "
            f"{' '.join(shlex.quote(a) for a in argv)} || {{ rc=$?; [ $rc -ne {BUSY_EXIT} ] || echo {busy} >&2; "
            "exit $rc; }"
        )

    @staticmethod
    def _cleanup(work: str) -> Shell:
        """A finished job's work directory holds every quantized tensor again: it goes, with
        its marker and lock (``flock -n``: no other run waits on it)."""
        marker, lock = shlex.quote(Exl2Layout.marker(work)), shlex.quote(Exl2Layout.lock(work))
        return Shell(f"rm -rf -- {shlex.quote(work)} && rm -f -- {marker} {lock}")

    def _summary(self, stamp: dict[str, Any]) -> str:
        size = stamp.get("bytes")
        shards = len(stamp.get("shards") or ())
        gb = f"{size / 1e9:.2f} GB, " if isinstance(size, int) else ""
        return f"EXL2 {stamp.get('bpw')} bpw, head {stamp.get('head_bits')}, {gb}{shards} shard(s), {stamp.get('id')}"

    # -- acting ------------------------------------------------------------------------------

    def apply(self, host: Host, decision: Decision) -> None:
        run_proven(host, decision, exl2_stamp, after="re-run to resume the conversion")


def bpw_text(bpw: float) -> str:
    """'4.0', '3.3', '2.25': how -b and the directory names spell a bpw."""
    return exl2_quant_name(bpw).removeprefix("EXL2-")


def job_plan(job: exl2.JobState, ours: bool, target_present: bool) -> Literal["done", "resume", "fresh"]:
    """What to do with a work directory. ``ours``: its marker names these inputs. A finished
    job whose result is gone cannot be resumed: the converter would only say it is finished
    (convert_exl2.py 151-153) and exit 0 having written nothing."""
    if not (ours and job.resumable):
        return "fresh"
    if job.finished:
        return "done" if target_present else "fresh"
    return "resume"


def exl2_stamp(record: Record, proof: dict[str, str]) -> bytes:
    """The stamp of a measurement or a conversion: its inputs and what its probe read back."""
    meta = json.loads(record.meta)
    kind = meta["kind"]
    found = json.loads(proof[kind].strip().splitlines()[-1])
    stamp: dict[str, Any] = {
        "id": meta["id"],
        "at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "inputs": meta["inputs"],
        **found,
    }
    if kind == "quant":
        stamp |= {
            "bpw": meta["inputs"]["bpw"],
            "head_bits": meta["inputs"]["head_bits"],
            "measurement_inputs": meta["measurement_inputs"],
        }
    return (json.dumps(stamp, indent=2, sort_keys=True) + "\n").encode()


def exl2_ops(
    venv: str, model_dir: str, models_root: str, quants: list[tuple[float, int]], **kw: Any
) -> list[Operation]:
    """One operation per (bpw, head bits), in order: the first measures, the rest reuse it."""
    return [EnsureExl2Quant(venv, model_dir, models_root, bpw, hb, **kw) for bpw, hb in quants]
