"""EXL2 conversion as an operation: measure once per model, one quant per bpw, resume, proof.

Decisions are table-driven on facts (no host). The commands are checked twice against the
pinned converter: their exact text here, with the flags read from exllamav2 0.3.2's
``exllamav2/conversion/convert_exl2.py`` (line numbers below), and for real by running that
file's own argparse declarations, taken out of the wheel with ``ast`` (the module cannot be
imported without a CUDA torch: it parses and converts at import), on the argv the commands
carry. For real on this machine as well (no GPU): the facts are read from a real layout, the
real wheel is installed into a venv and found by ``python -m``'s module lookup, and the proof
-> stamp -> rename -> clean-up path runs on the files a finished converter leaves.
"""

from __future__ import annotations

import argparse
import ast
import json
import shlex
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from playbooks.facts import exl2
from playbooks.facts.gpu import GpuFacts
from playbooks.host.ops import OperationError, Record, Shell, Upload, run_ops
from playbooks.plan.exl2_size import HEAD_BITS_OPTIONS
from playbooks.steps.build.proven_build import Probe
from playbooks.steps.weights.exl2_convert import (
    CONVERTER,
    STAMP_NAME,
    VERIFY_MEASUREMENT,
    VERIFY_QUANT,
    EnsureExl2Quant,
    Exl2Facts,
    Exl2Layout,
    Sampling,
    exl2_stamp,
    job_plan,
)
from tests.llamacpp_tools import cache_dir

VENV = "/opt/vf/venv"
HF = "/opt/vf/models/qwen2.5-14b/hf"
ROOT = "/opt/vf/models/qwen2.5-14b"
X = f"{ROOT}/exl2"
MODEL = exl2.ModelFiles("ab" * 32, (("model-00001-of-00002.safetensors", 4 << 30), ("model-00002.safetensors", 9)))
GPU = GpuFacts(available=True, source="nvidia-smi")
ENV = {"CUDA_VISIBLE_DEVICES": "0"}
PY = f"{VENV}/bin/python -m {CONVERTER}"


def busy(work: str) -> str:
    msg = shlex.quote(f"voltaforge: another conversion is running in {work}: wait for it, then re-run")
    return f" || {{ rc=$?; [ $rc -ne 75 ] || echo {msg} >&2; exit $rc; }}"


def op(bpw: float = 4.0, head_bits: int = 6, **kw) -> EnsureExl2Quant:
    return EnsureExl2Quant(VENV, HF, ROOT, bpw, head_bits, env=ENV, **kw)


def facts(**kw) -> Exl2Facts:
    return Exl2Facts(**{"gpus": GPU, "exllamav2": "0.3.2", "model": MODEL, **kw})


def ids(o: EnsureExl2Quant, f: Exl2Facts) -> tuple[str, str]:
    """(measurement id, quant id) as the operation names them (from its own markers)."""
    d = o.decide(replace(f, measurement_stamp=None, paths={}))
    markers = [json.loads(c.content)["id"] for c in d.commands if isinstance(c, Upload)]
    return markers[0], markers[1]


def measured(o: EnsureExl2Quant, **kw) -> Exl2Facts:
    """Facts of a host where this model's measurement is in place and stamped."""
    m_id, _ = ids(o, facts())
    paths = {f"{X}/measurement.json": "f", **kw.pop("paths", {})}
    return facts(measurement_stamp={"id": m_id}, paths=paths, **kw)


def converter_argv(command: str) -> list[str]:
    """The converter's own arguments in one of our commands (between the module and `||`)."""
    words = shlex.split(command.split(" || ", 1)[0])
    return words[words.index(CONVERTER) + 1 :]


def shells(d) -> list[str]:
    return [c.command for c in d.commands if type(c) is Shell]


# ------------------------------------------------------------------------------------------
# decisions
# ------------------------------------------------------------------------------------------


def test_the_first_bpw_measures_then_quantizes_with_that_measurement():
    d = op().decide(facts())
    kinds = [type(c).__name__ for c in d.commands]
    assert kinds == [
        # measurement: clear, marker, convert -om, prove, move into place, stamp, clean up
        "Shell", "Upload", "Shell", "Probe", "Shell", "Record", "Shell",
        # quant: clear, marker, convert -m, prove, stamp, rename .partial, clean up
        "Shell", "Upload", "Shell", "Probe", "Record", "Shell", "Shell",
    ]  # fmt: skip
    assert d.reason.startswith("no measurement of this model yet")
    c = d.commands
    # convert_exl2.py: -i in_dir (15), -o out_dir = the work dir (16), -om output_measurement
    # (26, measurement pass only), -ml measurement_length (31); no -nr, nothing to start over
    assert c[2].command == (
        f"env CUDA_VISIBLE_DEVICES=0 flock -n -E 75 {X}/.work-measure.lock {PY} "
        f"-i {HF} -o {X}/work-measure -om {X}/measurement.json.partial -ml 2048" + busy(f"{X}/work-measure")
    )
    assert c[4].command == f"mv -f -- {X}/measurement.json.partial {X}/measurement.json"
    assert isinstance(c[5], Record) and c[5].path == f"{X}/measurement.{STAMP_NAME}"
    assert c[6].command == f"rm -rf -- {X}/work-measure && rm -f -- {X}/work-measure.inputs.json {X}/.work-measure.lock"
    # -cf compile_full (19), -m measurement (27), -b bits (21), -hb head_bits (25), -l length (30)
    assert c[9].command == (
        f"env CUDA_VISIBLE_DEVICES=0 flock -n -E 75 {X}/.work-4.0bpw-h6.lock {PY} "
        f"-i {HF} -o {X}/work-4.0bpw-h6 -cf {X}/4.0bpw-h6.partial -m {X}/measurement.json -b 4.0 -hb 6 -l 2048"
        + busy(f"{X}/work-4.0bpw-h6")
    )
    assert isinstance(c[11], Record) and c[11].path == f"{X}/4.0bpw-h6.partial/{STAMP_NAME}"
    assert c[12].command == (
        f"rm -rf -- {X}/4.0bpw-h6.old && {{ [ ! -e {X}/4.0bpw-h6 ] || mv -T -- {X}/4.0bpw-h6 {X}/4.0bpw-h6.old; }} && "
        f"mv -T -- {X}/4.0bpw-h6.partial {X}/4.0bpw-h6 && rm -rf -- {X}/4.0bpw-h6.old"
    )
    # the quant uses the measurement the same run made, never its own (-om and -cf conflict, 62)
    assert "-om" not in converter_argv(c[9].command) and "-cf" not in converter_argv(c[2].command)
    assert [u.path for u in d.commands if isinstance(u, Upload)] == [
        f"{X}/work-measure.inputs.json",
        f"{X}/work-4.0bpw-h6.inputs.json",
    ]


def test_a_second_bpw_reuses_the_measurement_and_never_measures_again():
    o = op(3.3)
    d = o.decide(measured(o))
    assert d.reason.startswith("measurement ") and " reused" in d.reason
    converts = [s for s in shells(d) if CONVERTER in s]
    assert len(converts) == 1
    assert converts[0] == (
        f"env CUDA_VISIBLE_DEVICES=0 flock -n -E 75 {X}/.work-3.3bpw-h6.lock {PY} "
        f"-i {HF} -o {X}/work-3.3bpw-h6 -cf {X}/3.3bpw-h6.partial -m {X}/measurement.json -b 3.3 -hb 6 -l 2048"
        + busy(f"{X}/work-3.3bpw-h6")
    )
    assert not any("-om" in converter_argv(s) for s in converts)
    assert not any(isinstance(c, Probe) and c.key == "measurement" for c in d.commands)


def test_a_measurement_of_other_inputs_is_redone():
    o = op()
    d = o.decide(facts(measurement_stamp={"id": "0123456789abcdef"}, paths={f"{X}/measurement.json": "f"}))
    assert d.reason.startswith("new measurement ")
    assert any("-om" in converter_argv(s) for s in shells(d) if CONVERTER in s)


def test_an_interrupted_conversion_of_these_inputs_resumes_without_nr():
    o = op()
    _, q_id = ids(o, facts())
    f = measured(o, quant_job=exl2.JobState(True, "quant"), quant_marker=q_id)
    d = o.decide(f)
    assert f"the interrupted conversion in {X}/work-4.0bpw-h6 is resumed (at quant)" in d.reason
    (convert,) = [s for s in shells(d) if CONVERTER in s]
    assert "-nr" not in converter_argv(convert) and not any(isinstance(c, Upload) for c in d.commands)
    # no clearing of the .partial the job is writing into
    assert not any(f"rm -rf -- {X}/4.0bpw-h6.partial" in s for s in shells(d))


def test_an_interrupted_measurement_resumes_too():
    o = op()
    m_id, _ = ids(o, facts())
    d = o.decide(facts(measure_job=exl2.JobState(True, "measure_quant"), measure_marker=m_id))
    measure = next(s for s in shells(d) if "-om" in s)
    assert "-nr" not in converter_argv(measure)
    assert [u.path for u in d.commands if isinstance(u, Upload)] == [f"{X}/work-4.0bpw-h6.inputs.json"]


@pytest.mark.parametrize(
    ("job", "marker_is_ours"),
    [
        (exl2.JobState(True, "quant"), False),  # begun for other inputs: it would resume their options
        (exl2.JobState(True, "quant", corrupt=True), True),  # "invalid": the converter exits 0 doing nothing
        (exl2.JobState(True, None), True),  # a work dir without a job
        (exl2.JobState(True, "finished"), True),  # finished, but its .partial is gone
    ],
)
def test_a_work_dir_that_cannot_be_resumed_starts_over_with_nr(job, marker_is_ours):
    o = op()
    _, q_id = ids(o, facts())
    d = o.decide(measured(o, quant_job=job, quant_marker=q_id if marker_is_ours else "other"))
    (convert,) = [s for s in shells(d) if CONVERTER in s]
    assert converter_argv(convert)[-1] == "-nr"  # convert_exl2.py 18: empties the work dir
    assert f"mkdir -p -- {X} && rm -rf -- {X}/4.0bpw-h6.partial" in shells(d)
    assert any(isinstance(c, Upload) and c.path == f"{X}/work-4.0bpw-h6.inputs.json" for c in d.commands)


def test_a_finished_job_with_its_partial_output_is_only_proven_and_renamed():
    o = op()
    _, q_id = ids(o, facts())
    f = measured(o, quant_job=exl2.JobState(True, "finished"), quant_marker=q_id)
    f = replace(f, paths={**f.paths, f"{X}/4.0bpw-h6.partial": "d"})
    d = o.decide(f)
    assert "the conversion finished" in d.reason
    assert [type(c).__name__ for c in d.commands] == ["Probe", "Record", "Shell", "Shell"]


def test_present_and_stamped_is_ok():
    o = op()
    _, q_id = ids(o, facts())
    stamp = {"id": q_id, "bpw": 4.0, "head_bits": 6, "bytes": 8_123_456_789, "shards": ["output.safetensors"]}
    d = o.decide(measured(o, output_stamp=stamp, paths={f"{X}/4.0bpw-h6": "d"}))
    assert d.commands == ()
    assert d.reason == f"artifact present: {X}/4.0bpw-h6 (EXL2 4.0 bpw, head 6, 8.12 GB, 1 shard(s), {q_id})"
    # a CPU host with the artifact is fine: nothing to convert
    cpu = measured(o, output_stamp=stamp, paths={f"{X}/4.0bpw-h6": "d"}, gpus=GpuFacts(available=False))
    assert o.decide(cpu).commands == ()
    # the FP16 source deleted after converting: the stamp's bpw and head bits are what is left
    gone = o.decide(facts(model=None, output_stamp=stamp, paths={f"{X}/4.0bpw-h6": "d"}))
    assert gone.commands == () and gone.reason.endswith("its source is gone)")


def test_an_output_of_other_inputs_is_replaced_and_a_foreign_one_refused():
    o = op()
    other = {"id": "feedfacefeedface", "bpw": 4.0, "head_bits": 6}
    d = o.decide(measured(o, output_stamp=other, paths={f"{X}/4.0bpw-h6": "d"}))
    assert f"{X}/4.0bpw-h6 is from other inputs (feedfacefeedface" in d.reason
    with pytest.raises(OperationError, match=r"4.0bpw-h6 exists without a voltaforge stamp: move it away"):
        o.decide(measured(o, paths={f"{X}/4.0bpw-h6": "d"}))


def test_no_cuda_gpu_is_refused_naming_on_host():
    no_gpu = GpuFacts(available=False, source="none", reason="nvidia-smi not found")
    with pytest.raises(OperationError) as err:
        op().decide(facts(gpus=no_gpu))
    assert str(err.value) == (
        "EXL2 conversion needs a CUDA GPU and this host has none (nvidia-smi not found): "
        "convert on a CUDA host of the inventory (`invoke quantize --host HOST --bpw ...`)"
    )
    o = EnsureExl2Quant(VENV, HF, ROOT, 4.0, gpu_available=False)
    with pytest.raises(
        OperationError, match=r"needs a CUDA GPU and this host has none: convert on a CUDA host of the inventory"
    ):
        o.decide(facts(gpus=GpuFacts(available=False)))


@pytest.mark.parametrize("bpw", [1.5, 8.5, 0.0, 1.99, 8.01])
def test_a_bpw_outside_2_to_8_is_refused_in_one_line(bpw):
    with pytest.raises(OperationError) as err:
        op(bpw)
    assert str(err.value) == f"EXL2 bpw {bpw:g} is outside 2-8: the converter cannot reach it"
    assert "\n" not in str(err.value)


def test_the_ends_of_the_range_and_the_converters_head_bits_are_accepted():
    assert op(2.0).tag == "2.0bpw-h6" and op(8.0, 8).tag == "8.0bpw-h8" and op(2.25).tag == "2.25bpw-h6"
    for hb in HEAD_BITS_OPTIONS:
        op(4.0, hb)
    with pytest.raises(OperationError, match=r"head bits 7 is not one the converter knows \(2, 3, 4, 5, 6, 8\)"):
        op(4.0, 7)


def test_no_model_or_no_exllamav2_says_what_to_do():
    with pytest.raises(OperationError, match=f"{HF} has no config.json: put the Hugging Face model there first"):
        op().decide(facts(model=None))
    with pytest.raises(OperationError, match="config.json but no \\*.safetensors"):
        op().decide(facts(model=exl2.ModelFiles("ab" * 32, ())))
    with pytest.raises(OperationError, match=f"no exllamav2 in {VENV}: run `invoke build` first"):
        op().decide(facts(exllamav2=None))


def test_calibration_and_odd_paths_are_quoted():
    o = EnsureExl2Quant(
        VENV,
        "/srv/my models/qwen's hf",
        ROOT,
        5.0,
        8,
        calibration="/srv/cal data/wiki.parquet",
        sampling=Sampling(rows=50, measurement_rows=8, length=1024, measurement_length=512),
    )
    d = o.decide(facts())
    measure, quant = (s for s in shells(d) if CONVERTER in s)
    assert measure.startswith(f"flock -n -E 75 {X}/.work-measure.lock {PY} -i '/srv/my models/qwen'\"'\"'s hf' ")
    assert converter_argv(measure) == [
        "-i", "/srv/my models/qwen's hf", "-o", f"{X}/work-measure", "-om", f"{X}/measurement.json.partial",
        "-c", "/srv/cal data/wiki.parquet", "-mr", "8", "-ml", "512",
    ]  # fmt: skip
    assert converter_argv(quant) == [
        "-i", "/srv/my models/qwen's hf", "-o", f"{X}/work-5.0bpw-h8", "-cf", f"{X}/5.0bpw-h8.partial",
        "-m", f"{X}/measurement.json", "-b", "5.0", "-hb", "8",
        "-c", "/srv/cal data/wiki.parquet", "-r", "50", "-l", "1024",
    ]  # fmt: skip
    # the calibration's content is part of what a measurement depends on
    a, _ = ids(o, facts(calibration_sha256="1" * 64))
    b, _ = ids(o, facts(calibration_sha256="2" * 64))
    assert a != b


def test_the_measurement_depends_on_the_model_not_on_the_bpw():
    m4, q4 = ids(op(4.0), facts())
    m3, q3 = ids(op(3.3), facts())
    assert m4 == m3 and q4 != q3
    other = exl2.ModelFiles("cd" * 32, MODEL.weights)
    assert ids(op(4.0), facts(model=other))[0] != m4
    assert ids(op(4.0, source_sha="1" * 40), facts())[0] != m4


def test_the_stamp_written_makes_the_next_run_ok():
    o = op()
    d = o.decide(measured(o))
    record = next(c for c in d.commands if isinstance(c, Record))
    proof = {"quant": '{"exllamav2": "0.3.2", "shards": ["output.safetensors"], "bytes": 123, "calibration": null}\n'}
    stamp = json.loads(exl2_stamp(record, proof))
    assert stamp["bpw"] == 4.0 and stamp["head_bits"] == 6 and stamp["shards"] == ["output.safetensors"]
    again = o.decide(measured(o, output_stamp=stamp, paths={f"{X}/4.0bpw-h6": "d"}))
    assert again.commands == () and again.reason.startswith("artifact present")


def test_job_plan():
    assert job_plan(exl2.JobState(), True, False) == "fresh"
    assert job_plan(exl2.JobState(True, "optimize"), True, False) == "resume"
    assert job_plan(exl2.JobState(True, "optimize"), False, False) == "fresh"
    assert job_plan(exl2.JobState(True, "finished"), True, True) == "done"
    assert job_plan(exl2.JobState(True, "finished"), True, False) == "fresh"


def test_fact_parsers():
    assert exl2.parse_job_state("missing\n") == exl2.JobState()
    assert exl2.parse_job_state("no-job\n") == exl2.JobState(True)
    assert exl2.parse_job_state('{"progress": "quant", "invalid": false}\n') == exl2.JobState(True, "quant")
    assert exl2.parse_job_state('{"progress": "quant", "invalid": true}').corrupt
    assert exl2.parse_job_state("Traceback ...\njson.decoder.JSONDecodeError: x").corrupt
    m = exl2.parse_model_files(f"{'ab' * 32}  -\n9 b.safetensors\n4294967296 a.safetensors\n")
    assert m is not None and m.weights == (("a.safetensors", 1 << 32), ("b.safetensors", 9))
    assert exl2.parse_model_files("") is None
    assert exl2.parse_exist("d\nf\n-\n", ["/a", "/b", "/c", "/d"]) == {"/a": "d", "/b": "f", "/c": "-", "/d": "-"}


# ------------------------------------------------------------------------------------------
# for real: the pinned converter's own argument parser, from the wheel
# ------------------------------------------------------------------------------------------


def exllamav2_wheel() -> Path:
    """exllamav2 0.3.2's wheel (pure Python): the test cache's copy, else the package index."""
    where = cache_dir() / "wheels"
    found = sorted(where.glob("exllamav2-0.3.2-*.whl"))
    if not found:
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(where), "exllamav2==0.3.2"],
            check=True,
            timeout=600,
        )
        found = sorted(where.glob("exllamav2-0.3.2-*.whl"))
    return found[0]


def converter_source() -> str:
    with zipfile.ZipFile(exllamav2_wheel()) as z:
        return z.read("exllamav2/conversion/convert_exl2.py").decode()


def converter_parser(source: str) -> argparse.ArgumentParser:
    """The converter's ``parser`` built by its own statements (lines 14-34), nothing else run."""
    tree = ast.parse(source)

    def is_parser_stmt(node: ast.stmt) -> bool:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "parser" for t in node.targets):
            return True
        call = node.value if isinstance(node, ast.Expr) else None
        return (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "add_argument"
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "parser"
        )

    stmts = [n for n in tree.body if is_parser_stmt(n)]
    assert len(stmts) > 15, "convert_exl2.py no longer declares its arguments at module level"
    scope: dict = {"argparse": argparse}
    exec(compile(ast.Module(body=stmts, type_ignores=[]), "convert_exl2.py", "exec"), scope)
    parser = scope["parser"]
    parser.exit_on_error = False
    return parser


def all_commands() -> list[str]:
    """Every converter command the step can emit: measure, quant, with and without -c/-nr."""
    o = op()
    cal = EnsureExl2Quant(VENV, HF, ROOT, 2.25, 8, calibration="/srv/c.parquet")
    _, q_id = ids(o, facts())
    cases = [
        o.decide(facts()),
        cal.decide(facts()),
        o.decide(measured(o, quant_job=exl2.JobState(True, "quant"), quant_marker="other")),
        o.decide(facts(measure_job=exl2.JobState(True, "quant"), measure_marker="other")),
    ]
    return [s for d in cases for s in shells(d) if CONVERTER in s]


def test_every_flag_we_pass_is_declared_by_the_pinned_converter():
    source = converter_source()
    declared = {
        s.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
        for s in node.args
        if isinstance(s, ast.Constant) and isinstance(s.value, str)
    }
    used = {w for cmd in all_commands() for w in converter_argv(cmd) if w.startswith("-")}
    assert used == {"-i", "-o", "-om", "-cf", "-m", "-b", "-hb", "-c", "-mr", "-r", "-l", "-ml", "-nr"}
    assert used <= declared, used - declared


def test_the_converters_own_parser_reads_our_commands_as_meant():
    parser = converter_parser(converter_source())
    measure, quant = all_commands()[:2]
    m = parser.parse_args(converter_argv(measure))
    assert (m.in_dir, m.out_dir, m.output_measurement) == (HF, f"{X}/work-measure", f"{X}/measurement.json.partial")
    assert m.compile_full is None and m.measurement is None and m.no_resume is False  # -om xor -cf (line 62)
    q = parser.parse_args(converter_argv(quant))
    assert (q.out_dir, q.compile_full, q.measurement) == (
        f"{X}/work-4.0bpw-h6",
        f"{X}/4.0bpw-h6.partial",
        f"{X}/measurement.json",
    )
    assert q.bits == 4.0 and q.head_bits == 6 and q.length == 2048 and q.output_measurement is None
    for cmd in all_commands():
        args = parser.parse_args(converter_argv(cmd))
        assert not (args.output_measurement and args.compile_full)
        assert args.no_resume == ("-nr" in converter_argv(cmd))
    cal = parser.parse_args(converter_argv(all_commands()[3]))  # the quant with -c
    assert (cal.cal_dataset, cal.dataset_rows, cal.bits, cal.head_bits) == ("/srv/c.parquet", 100, 2.25, 8)


def test_the_head_bits_we_allow_are_the_converters():
    """qparams_headoptions (conversion/qparams.py) is what convert_exl2.py 58-60 checks -hb against."""
    with zipfile.ZipFile(exllamav2_wheel()) as z:
        tree = ast.parse(z.read("exllamav2/conversion/qparams.py").decode())
    (node,) = [
        n.value
        for n in tree.body
        if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "qparams_headoptions" for t in n.targets)
    ]
    assert isinstance(node, ast.Dict)
    assert tuple(k.value for k in node.keys if isinstance(k, ast.Constant)) == HEAD_BITS_OPTIONS


def test_python_m_finds_the_converter_in_the_installed_wheel(tmp_path):
    """The wheel really installed (pip, --no-deps) into a venv, and the module lookup that
    ``python -m`` makes (runpy: importlib.util.find_spec) run there. Only ``exllamav2``'s own
    ``__init__`` is skipped (it imports torch, which a CUDA host has): ``exllamav2.conversion``
    resolves as a namespace package (no __init__.py) and the converter as a source module."""
    venv = install_wheel_venv(tmp_path)
    code = (
        "import importlib.machinery as m, importlib.util as u, sys; "
        "pkg = m.PathFinder.find_spec('exllamav2'); sys.modules['exllamav2'] = u.module_from_spec(pkg); "
        "spec = u.find_spec('exllamav2.conversion.convert_exl2'); "
        "print(sys.modules['exllamav2.conversion'].__spec__.origin, spec.origin)"
    )
    out = subprocess.run([venv / "bin/python", "-c", code], capture_output=True, text=True, check=True).stdout
    conv_origin, mod_origin = out.split()
    assert conv_origin == "None"  # a namespace package
    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    assert mod_origin == str(site / "exllamav2/conversion/convert_exl2.py")
    # no __main__ guard: it converts at import, so `-m` and convert.py run the same code
    assert "__main__" not in converter_source()


def install_wheel_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), "install", "-q", "--no-deps",
         "--no-index", "--disable-pip-version-check", str(exllamav2_wheel())],
        check=True,
        timeout=300,
    )  # fmt: skip
    return venv


# ------------------------------------------------------------------------------------------
# for real: facts, proof, stamp, rename on this machine (the converter itself needs a GPU)
# ------------------------------------------------------------------------------------------


def test_probes_refuse_what_a_failed_converter_leaves(tmp_path):
    """convert_exl2.py exits 0 on its own errors: the probes are what tell."""
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    (work / "job_new.json").write_text(json.dumps({"progress": "quant"}))
    r = subprocess.run(
        [sys.executable, "-c", VERIFY_QUANT, work, out, "4.0", "6"], capture_output=True, text=True, check=False
    )
    assert r.returncode == 1 and "the converter stopped at 'quant'" in r.stderr
    (work / "job_new.json").write_text(json.dumps({"progress": "finished"}))
    (out / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "exl2", "bits": 3.0}}))
    r = subprocess.run(
        [sys.executable, "-c", VERIFY_QUANT, work, out, "4.0", "6"], capture_output=True, text=True, check=False
    )
    assert r.returncode == 1 and "want {'quant_method': 'exl2', 'bits': 4.0, 'head_bits': 6}" in r.stderr
    (work / "m.json").write_text("{}")
    r = subprocess.run(
        [sys.executable, "-c", VERIFY_MEASUREMENT, work, work / "m.json"], capture_output=True, text=True
    )
    assert r.returncode == 1 and "is not a measurement" in r.stderr


def finished_converter_files(work: Path, partial: Path | None, measurement: Path | None) -> None:
    """What convert_exl2.py leaves when done: job_new.json at "finished" (311-312); for -om the
    measurement (measure.py 724-734); for -cf the shards, the source's files and config.json
    with quantization_config (compile.py 223-293)."""
    work.mkdir(parents=True)
    (work / "job_new.json").write_text(json.dumps({"progress": "finished", "measurement": {}}, indent=4))
    if measurement:
        (work / "measurement.json").write_text(json.dumps({"measurement": {"m.0": []}, "last_module_idx": 3}))
        measurement.write_text((work / "measurement.json").read_text())
    if partial:
        partial.mkdir(parents=True)
        (partial / "output.safetensors").write_bytes(b"\0" * 64)
        (partial / "tokenizer.json").write_text("{}")
        qcfg = {"quant_method": "exl2", "version": "0.3.2", "bits": 4.0, "head_bits": 6,
                "calibration": {"rows": 115, "length": 2048, "dataset": "(default)"}}  # fmt: skip
        (partial / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qcfg}))


def test_a_finished_conversion_is_proven_stamped_and_renamed_on_a_real_host(tmp_path):
    from playbooks.host import LocalHost

    venv = install_wheel_venv(tmp_path)  # the real exllamav2 0.3.2 metadata: the version fact reads it
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    (hf / "model.safetensors").write_bytes(b"\0" * 100)
    root = tmp_path / "models" / "tiny"
    host = LocalHost()
    host.printer.quiet = True
    o = EnsureExl2Quant(str(venv), str(hf), str(root), 4.0, 6, gpu_available=True)
    # exllamav2 without the build step's exllamav2_ext: the converter would JIT-compile it (a
    # lent H200's did, for minutes): refused before it runs
    assert not o.read(host).ext_built
    with pytest.raises(OperationError, match=r"has exllamav2 but not the exllamav2_ext `invoke build` builds"):
        o.decide(o.read(host))
    # where EnsureExllamav2 installs it (a file of that name is all this fact reads)
    (site,) = venv.glob("lib/python3*/site-packages")
    (site / "exllamav2_ext.so").write_bytes(b"")
    f = o.read(host)
    assert (
        f.ext_built
        and f.exllamav2 == "0.3.2"
        and f.model is not None
        and f.model.weights == (("model.safetensors", 100),)
    )
    assert f.measure_job == exl2.JobState() and f.paths == dict.fromkeys(o.watched, "-")
    fresh = o.decide(f)
    # both jobs ran to the end (as a GPU host would) for the inputs the markers name
    for upload in (c for c in fresh.commands if isinstance(c, Upload)):
        Path(upload.path).parent.mkdir(parents=True, exist_ok=True)
        Path(upload.path).write_bytes(upload.content)
    lay = Exl2Layout(str(root))
    finished_converter_files(Path(lay.measure_work), None, Path(lay.measurement_partial))
    finished_converter_files(Path(lay.work("4.0bpw-h6")), Path(lay.partial("4.0bpw-h6")), None)
    f = o.read(host)
    assert f.measure_job == exl2.JobState(True, "finished") and f.quant_job.finished
    d = o.decide(f)
    assert not any(CONVERTER in s for s in shells(d)), "a finished job is not run again"
    (change,) = run_ops(host, [o])
    assert change.status == "changed", change.why
    out = root / "exl2" / "4.0bpw-h6"
    stamp = json.loads((out / STAMP_NAME).read_text())
    assert stamp["shards"] == ["output.safetensors"] and stamp["exllamav2"] == "0.3.2" and stamp["bpw"] == 4.0
    assert json.loads((root / "exl2" / f"measurement.{STAMP_NAME}").read_text())["last_module_idx"] == 3
    left = sorted(p.name for p in (root / "exl2").iterdir())
    assert left == ["4.0bpw-h6", "measurement.json", f"measurement.{STAMP_NAME}"]  # no work dirs, no .partial
    (again,) = run_ops(host, [o])
    assert again.status == "ok" and again.why.startswith(f"artifact present: {out} (EXL2 4.0 bpw, head 6")
    # the next bpw on the same host: the measurement is reused, nothing measures again
    nxt = EnsureExl2Quant(str(venv), str(hf), str(root), 3.0, 6, gpu_available=True)
    d = nxt.decide(nxt.read(host))
    assert "reused" in d.reason and [s for s in shells(d) if "-om" in s] == []
