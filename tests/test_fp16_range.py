"""The FP16 range probe on real safetensors files, run as the host runs it (no mocks).

Every file here is written with the tiny model's own safetensors writer and BF16 rounding
(playbooks/modelgen/tinymodel.py), the probe runs as a subprocess of this very python through
the shell command that `fp16_range_command` builds, and its one JSON line goes through
`parse_fp16_range`. The expected counts come from reasoning about the formats, and are
cross-checked against numpy's own float16 conversion (round-to-nearest-even, like torch's).
"""

from __future__ import annotations

import ast
import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from playbooks.facts.weights import (
    FP16_RANGE_PROBE_PATH,
    Fp16Range,
    TensorCount,
    fp16_range_command,
    parse_fp16_range,
)
from playbooks.modelgen.tinymodel import _bf16_bytes, write_safetensors

DOWN = "model.layers.0.mlp.down_proj.weight"
HEAD = "lm_head.weight"
NORM = "model.norm.weight"


def bf16(values: list[float]) -> bytes:
    return _bf16_bytes(np.array(values, dtype=np.float32))


def bf16_value(bits: int) -> float:
    """The float a BF16 bit pattern stands for (its upper half of a float32)."""
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def numpy_fp16_verdict(raw: bytes, dtype: str) -> tuple[int, int]:
    """(values that become inf in FP16, values already NaN/inf) by numpy's own conversion."""
    if dtype == "BF16":
        f32 = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        f32 = np.frombuffer(raw, dtype="<f4")
    with np.errstate(over="ignore", invalid="ignore"):
        f16 = f32.astype(np.float16)
    finite = np.isfinite(f32)
    return int(np.count_nonzero(np.isinf(f16) & finite)), int(np.count_nonzero(~finite))


def run_probe(
    paths: list[Path],
    *,
    clamp_dir: Path | None = None,
    chunk_bytes: int | None = None,
    probe: Path = FP16_RANGE_PROBE_PATH,
    python: str = sys.executable,
) -> tuple[Fp16Range, dict]:
    """Run the probe through the shell exactly as the command builder writes it for a host."""
    command = fp16_range_command(
        python,
        str(probe),
        [str(p) for p in paths],
        clamp_dir=None if clamp_dir is None else str(clamp_dir),
        chunk_bytes=chunk_bytes,
    )
    run = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run
    assert run.stderr == ""  # 2>&1 in the command: everything is on stdout
    out = [ln for ln in run.stdout.splitlines() if ln.strip()]
    assert len(out) == 1, run.stdout  # exactly one JSON line, even on errors
    return parse_fp16_range(run.stdout), json.loads(out[0])


# --------------------------------------------------------------------------- the threshold


def test_bf16_cannot_hold_65504_and_rounds_it_to_65536_which_overflows_fp16():
    # FP16's largest finite value is 65504. BF16 values between 2**15 and 2**16 are
    # 2**(15-7) = 256 apart: 65024, 65280, 65536. 65504 is 224 above 65280 and 32 below 65536,
    # so BF16 rounds it UP to 65536 = 2**16 (bits 0x4780): a "max FP16" value saved as BF16 is
    # already out of FP16's range.
    assert bf16([65504.0]) == struct.pack("<H", 0x4780) and bf16_value(0x4780) == 65536.0
    # The largest BF16 that FP16 holds is 65280 (0x477F); 65407 still rounds down to it, 65408
    # is the midpoint and ties go to the even mantissa: 0x4780, i.e. 65536, overflow.
    assert bf16([65280.0, 65407.0]) == struct.pack("<HH", 0x477F, 0x477F)
    assert bf16([65408.0]) == struct.pack("<H", 0x4780)
    # FP16's own rounding edge: 65519.99 -> 65504, 65520 (the midpoint to 2**16) -> inf.
    with np.errstate(over="ignore"):
        assert np.float32(65519.996).astype(np.float16) == 65504
        assert np.isinf(np.float32(65520.0).astype(np.float16))


def test_bf16_values_counted_exactly_with_tensors_named(tmp_path):
    down = [1.0, 65280.0, 65407.0, 65504.0, -65520.0, 0.5, math.nan]  # 2 overflow (65504, -65520), 1 NaN
    head = [1e5, -3e38, math.inf, -math.inf, 65408.0, -0.0]  # 3 overflow, 2 inf
    norm = [1.0, -65280.0, 2.0, 3.0]  # -65280 fits exactly
    shard = tmp_path / "model.safetensors"
    write_safetensors(shard, {DOWN: ((7,), bf16(down)), HEAD: ((2, 3), bf16(head)), NORM: ((4,), bf16(norm))})

    facts, raw = run_probe([shard])

    assert facts.ok and facts.error is None
    assert facts.files == (str(shard),)
    assert facts.dtypes == {"BF16": 3}
    assert facts.values_checked == 7 + 6 + 4
    assert facts.overflow == (
        TensorCount(tensor=DOWN, file="model.safetensors", dtype="BF16", count=2, max_abs=65536.0),
        TensorCount(tensor=HEAD, file="model.safetensors", dtype="BF16", count=3, max_abs=bf16_value(0x7F62)),
    )
    assert bf16([-3e38]) == struct.pack("<H", 0xFF62)  # max_abs above: |-3e38| as BF16
    assert facts.nonfinite == (
        TensorCount(tensor=DOWN, file="model.safetensors", dtype="BF16", count=1, nan=1, inf=0),
        TensorCount(tensor=HEAD, file="model.safetensors", dtype="BF16", count=2, nan=0, inf=2),
    )
    assert raw["nonfinite"][0]["max_abs"] is None
    assert (facts.overflow_values, facts.nonfinite_values, bool(facts.overflow)) == (5, 3, True)
    assert facts.summary == (
        f"5 BF16 values beyond FP16's range in 2 tensors ({HEAD}: 3, {DOWN}: 2); "
        f"3 NaN/inf values already in the checkpoint in 2 tensors ({HEAD}: 2, {DOWN}: 1)"
    )
    # the same verdict as numpy's own FP16 conversion, tensor by tensor
    assert numpy_fp16_verdict(bf16(down), "BF16") == (2, 1)
    assert numpy_fp16_verdict(bf16(head), "BF16") == (3, 2)
    assert numpy_fp16_verdict(bf16(norm), "BF16") == (0, 0)


def test_every_bf16_bit_pattern_agrees_with_numpys_fp16_conversion(tmp_path):
    raw = np.arange(65536, dtype="<u2").tobytes()  # all 2**16 BF16 values, 128 KiB
    shard = tmp_path / "all.safetensors"
    write_safetensors(shard, {"all": ((65536,), raw)})
    overflow, nonfinite = numpy_fp16_verdict(raw, "BF16")
    # per sign: magnitudes 0x4780..0x7F7F overflow (0x3800 patterns), 0x7F80 is inf, 0x7F81..0x7FFF NaN
    assert (overflow, nonfinite) == (2 * 0x3800, 2 * 0x80)

    for chunk in (None, 4096, 8):
        facts, _ = run_probe([shard], chunk_bytes=chunk)
        assert facts.values_checked == 65536
        (o,) = facts.overflow
        assert (o.count, o.max_abs) == (overflow, bf16_value(0x7F7F))  # the largest finite BF16
        (n,) = facts.nonfinite
        assert (n.count, n.inf, n.nan) == (nonfinite, 2, nonfinite - 2)


def test_f32_uses_the_same_rule_at_fp16s_rounding_edge(tmp_path):
    values = [65504.0, 65519.996, 65520.0, -65520.0, 1e30, math.nan, -math.inf, 3.4e38, 1.0]
    raw = np.array(values, dtype="<f4").tobytes()
    shard = tmp_path / "f32.safetensors"
    write_safetensors(shard, {"w": ((9,), raw)}, dtype="F32")
    facts, _ = run_probe([shard])
    assert facts.dtypes == {"F32": 1} and facts.values_checked == 9
    assert facts.overflow == (
        TensorCount(tensor="w", file="f32.safetensors", dtype="F32", count=4, max_abs=float(np.float32(3.4e38))),
    )
    assert facts.nonfinite == (TensorCount(tensor="w", file="f32.safetensors", dtype="F32", count=2, nan=1, inf=1),)
    assert numpy_fp16_verdict(raw, "F32") == (4, 2)
    assert facts.summary.startswith("4 F32 values beyond FP16's range in 1 tensor (w: 4)")


def test_f16_and_integer_tensors_are_reported_by_dtype_only(tmp_path):
    f16 = tmp_path / "half.safetensors"
    write_safetensors(
        f16, {"a": ((3,), np.array([65504, np.inf, np.nan], dtype="<f2").tobytes()), "b": ((1,), b"\0\0")}, dtype="F16"
    )
    i8 = tmp_path / "quant.safetensors"
    write_safetensors(i8, {"q": ((4,), bytes([0, 127, 128, 255]))}, dtype="I8")
    facts, _ = run_probe([f16, i8])
    assert facts.ok and facts.dtypes == {"F16": 2, "I8": 1}
    assert (facts.overflow, facts.nonfinite, facts.values_checked) == ((), (), 0)
    assert facts.ok and not facts.overflow
    assert facts.summary == "no value beyond FP16's range (0 values checked)"


# --------------------------------------------------------------------------- shards


def test_a_directory_is_every_shard_in_it_sorted(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    # written out of order, beside files that are not shards
    write_safetensors(model / "model-00002-of-00002.safetensors", {HEAD: ((2,), bf16([1e5, 1.0]))})
    write_safetensors(
        model / "model-00001-of-00002.safetensors",
        {DOWN: ((3,), bf16([65520.0, -1e6, 0.0])), NORM: ((2,), bf16([1.0, math.nan]))},
    )
    (model / "config.json").write_text("{}")
    (model / "model.safetensors.index.json").write_text("{}")

    facts, _ = run_probe([model])

    assert facts.files == (
        str(model / "model-00001-of-00002.safetensors"),
        str(model / "model-00002-of-00002.safetensors"),
    )
    assert facts.dtypes == {"BF16": 3} and facts.values_checked == 7
    assert [(t.file, t.tensor, t.count) for t in facts.overflow] == [
        ("model-00001-of-00002.safetensors", DOWN, 2),
        ("model-00002-of-00002.safetensors", HEAD, 1),
    ]
    assert [(t.file, t.tensor, t.nan) for t in facts.nonfinite] == [("model-00001-of-00002.safetensors", NORM, 1)]
    assert facts.summary.startswith(f"3 BF16 values beyond FP16's range in 2 tensors ({DOWN}: 2, {HEAD}: 1); ")


def test_a_tensor_bigger_than_the_chunk_is_read_in_bounded_chunks_with_the_same_counts(tmp_path):
    rng = np.random.default_rng(0)
    values = rng.normal(0.0, 1.0, size=50_000).astype(np.float32)  # 100 KB of BF16
    # overflow on both sides of chunk boundaries (4096 bytes = 2048 values), and at the ends
    for i in (0, 2047, 2048, 4095, 4096, 30_001, 49_999):
        values[i] = 1e5 if i % 2 else -7e4
    values[12_345] = np.nan
    shard = tmp_path / "big.safetensors"
    write_safetensors(shard, {"big": ((50_000,), bf16(values.tolist())), "small": ((2,), bf16([1.0, 2e5]))})

    whole, whole_raw = run_probe([shard])
    chunked, chunked_raw = run_probe([shard], chunk_bytes=4096)

    assert [(t.tensor, t.count, t.max_abs) for t in whole.overflow] == [
        ("big", 7, bf16_value(0x47C3)),  # 1e5 as BF16: 99840
        ("small", 1, bf16_value(0x4843)),
    ]
    assert bf16_value(0x47C3) == 99840.0
    assert chunked.overflow == whole.overflow and chunked.nonfinite == whole.nonfinite
    assert chunked.values_checked == whole.values_checked == 50_002
    # the chunk size really bounded the reads: 100,000 bytes in 4096-byte reads is 25 reads
    assert chunked_raw["chunk_bytes"] == 4096
    assert chunked_raw["reads"] == math.ceil(100_000 / 4096) + 1
    assert whole_raw["reads"] == 2  # one read per tensor with the 16 MiB default
    # a chunk size that is no multiple of the value size is rounded down to whole values
    odd, odd_raw = run_probe([shard], chunk_bytes=4099)
    assert odd_raw["chunk_bytes"] == 4096 and odd.overflow == whole.overflow


# --------------------------------------------------------------------------- clamp


def test_clamp_writes_shards_with_no_overflow_and_every_other_byte_unchanged(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    down = [1.0, 65504.0, -65520.0, -3e38, math.nan, 65280.0, -0.5, math.inf]
    write_safetensors(src / "a.safetensors", {DOWN: ((8,), bf16(down)), NORM: ((2,), bf16([1.0, 2.0]))})
    f32 = [1e5, -65520.0, 65519.996, -math.inf, 3.0]
    write_safetensors(src / "b.safetensors", {"w": ((5,), np.array(f32, dtype="<f4").tobytes())}, dtype="F32")
    write_safetensors(src / "c.safetensors", {"q": ((3,), bytes([1, 2, 255]))}, dtype="I8")
    out = tmp_path / "clamped"

    before, raw = run_probe([src], clamp_dir=out, chunk_bytes=8)

    assert before.ok and raw["clamp_values"] == {"BF16": 65280.0, "F32": 65504.0}
    assert before.written == tuple(str(out / n) for n in ("a.safetensors", "b.safetensors", "c.safetensors"))
    assert before.overflow_values == 3 + 2 and before.clamped_values == 5  # counts describe the input
    assert sorted(p.name for p in out.iterdir()) == ["a.safetensors", "b.safetensors", "c.safetensors"]  # no temp

    after, _ = run_probe([out])
    assert after.ok and after.overflow == ()
    assert after.nonfinite == before.nonfinite  # NaN/inf are left alone
    assert after.values_checked == before.values_checked

    # BF16: only the overflowing values changed, to +/-65280 (0x477F / 0xC77F), sign kept
    a_in, a_out = (src / "a.safetensors").read_bytes(), (out / "a.safetensors").read_bytes()
    assert len(a_in) == len(a_out)
    start = len(a_in) - 2 * (8 + 2)  # the data region: 10 BF16 values at the end
    assert a_in[:start] == a_out[:start]  # header byte for byte
    v_in = np.frombuffer(a_in[start:], dtype="<u2")
    v_out = np.frombuffer(a_out[start:], dtype="<u2")
    changed = np.flatnonzero(v_in != v_out).tolist()
    assert changed == [1, 2, 3]  # 65504 (-> 65536 in BF16), -65520, -3e38
    assert v_out[changed].tolist() == [0x477F, 0xC77F, 0xC77F]
    assert bf16_value(0x477F) == 65280.0 and np.float32(65280.0).astype(np.float16) == 65280
    assert numpy_fp16_verdict(a_out[start:], "BF16") == (0, 2)

    # F32: clamped to +/-65504, which F32 and FP16 both hold exactly
    b_in, b_out = (src / "b.safetensors").read_bytes(), (out / "b.safetensors").read_bytes()
    start = len(b_in) - 4 * 5
    assert b_in[:start] == b_out[:start]
    assert np.frombuffer(b_out[start:], dtype="<f4")[:3].tolist() == [65504.0, -65504.0, np.float32(65519.996)]
    assert b_in[start + 8 :] == b_out[start + 8 :]
    assert (src / "c.safetensors").read_bytes() == (out / "c.safetensors").read_bytes()


def test_clamp_refuses_to_overwrite_its_input_and_leaves_no_temp_file(tmp_path):
    shard = tmp_path / "a.safetensors"
    write_safetensors(shard, {"x": ((1,), bf16([1e5]))})
    before = shard.read_bytes()
    facts, _ = run_probe([shard], clamp_dir=tmp_path)
    assert facts.error == f"--clamp would overwrite its input {shard}"
    assert shard.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["a.safetensors"]


def test_a_corrupt_shard_during_clamp_leaves_no_partial_file(tmp_path):
    good, bad = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    write_safetensors(good, {"x": ((2,), bf16([1e5, 1.0]))})
    write_safetensors(bad, {"y": ((2,), bf16([1.0, 1.0]))})
    bad.write_bytes(bad.read_bytes()[:-1])  # a copy cut short by one byte
    out = tmp_path / "out"
    facts, _ = run_probe([good, bad], clamp_dir=out)
    assert facts.error is not None and str(bad) in facts.error and "truncated" in facts.error
    assert [p.name for p in out.iterdir()] == ["a.safetensors"]  # the finished one only


# --------------------------------------------------------------------------- errors


def _valid(path: Path) -> Path:
    write_safetensors(path, {"x": ((4,), bf16([1.0, 2.0, 3.0, 4.0]))})
    return path


@pytest.mark.parametrize(
    "corrupt, expected",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-3]), "truncated file {p}: tensor 'x' ends at byte"),
        (lambda p: p.write_bytes(b"\x01\x00"), "truncated file {p}: 2 bytes"),
        (lambda p: p.write_bytes(struct.pack("<Q", 2**40) + b"{}"), "bad safetensors header in {p}: header length"),
        (lambda p: p.write_bytes(struct.pack("<Q", 8) + b"not json"), "bad safetensors header in {p}: not JSON"),
        (lambda p: p.write_bytes(struct.pack("<Q", 2) + b"[]"), "bad safetensors header in {p}: not a JSON object"),
        (
            lambda p: p.write_bytes(struct.pack("<Q", 38) + b'{"x": {"dtype": "BF16", "shape": [3]}}'),
            "bad safetensors header in {p}: tensor 'x' has no valid dtype/shape/data_offsets",
        ),
        (
            lambda p: write_safetensors(p, {"x": ((3,), bf16([1.0, 2.0]))}),
            "bad safetensors header in {p}: tensor 'x' is BF16 [3] by shape, 4 bytes by offsets",
        ),
        (lambda p: p.unlink(), "no such file: {p}"),
    ],
)
def test_a_broken_shard_is_one_json_line_naming_it(tmp_path, corrupt, expected):
    first = _valid(tmp_path / "model-00001-of-00002.safetensors")
    broken = _valid(tmp_path / "model-00002-of-00002.safetensors")
    corrupt(broken)
    facts, raw = run_probe([first, broken])
    assert facts.ok is False
    assert facts.error is not None and facts.error.startswith(expected.format(p=broken)), facts.error
    assert raw["probe"] == "voltaforge-fp16-range" and raw["probe_version"] == 1
    assert facts.overflow == () and facts.values_checked == 0  # partial counts are not kept
    assert facts.summary == f"FP16 range check failed: {facts.error}"


def test_an_empty_directory_and_bad_arguments_are_errors_too(tmp_path):
    facts, _ = run_probe([tmp_path])
    assert facts.error == f"no *.safetensors file in directory {tmp_path}"
    facts, _ = run_probe([_valid(tmp_path / "a.safetensors")], chunk_bytes=4)
    assert facts.error == "bad arguments: --chunk-bytes must be at least 8, not 4"


# --------------------------------------------------------------------------- the command


def test_the_command_quotes_every_path(tmp_path):
    where = tmp_path / "it's a dir"
    where.mkdir()
    probe = where / "fp16 range $probe.py"
    shutil.copy(FP16_RANGE_PROBE_PATH, probe)
    shard = where / "-dash `x` 'q' $HOME.safetensors"
    write_safetensors(shard, {"x": ((1,), bf16([7e4]))})
    out = where / "out dir;rm"
    facts, _ = run_probe([shard], probe=probe, clamp_dir=out)
    assert facts.ok and facts.files == (str(shard),) and facts.overflow[0].count == 1
    assert facts.written == (str(out / shard.name),)
    command = fp16_range_command("/v env/bin/python", "/tmp/p.py", ["-x.safetensors"])
    assert command == "'/v env/bin/python' /tmp/p.py -- -x.safetensors 2>&1 || true"
    with pytest.raises(ValueError):
        fp16_range_command("python3", "/tmp/p.py", [])


def test_a_missing_python_is_an_error_not_an_exception(tmp_path):
    command = fp16_range_command("/nonexistent/venv/bin/python", str(FP16_RANGE_PROBE_PATH), [str(tmp_path)])
    run = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True)
    assert run.returncode == 0
    facts = parse_fp16_range(run.stdout)
    assert facts.error is not None and facts.error.startswith("FP16 range probe printed no JSON: ")
    assert "/nonexistent/venv/bin/python" in facts.error


# --------------------------------------------------------------------------- the parser


@pytest.mark.parametrize(
    "text, error",
    [
        ("", "FP16 range probe printed nothing"),
        ("Traceback (most recent call last):\n  File x", "FP16 range probe printed no JSON: Traceback"),
        ("[1, 2]", "FP16 range probe printed no JSON: [1, 2]"),
        ("{not json", "FP16 range probe output is not JSON: "),
        (
            '{"probe": "voltaforge-gpu", "source": "none"}',
            "not the FP16 range probe's output (probe: 'voltaforge-gpu')",
        ),
        ('{"probe": "voltaforge-fp16-range", "probe_version": 2}', "FP16 range probe version 2, expected 1"),
        (
            '{"probe": "voltaforge-fp16-range", "probe_version": 1, "overflow": [{"tensor": 1}]}',
            "FP16 range probe JSON unreadable: overflow.0.tensor: ",
        ),
        ('{"probe": "voltaforge-fp16-range", "probe_version": 1, "values_checked": "many"}', "FP16 range probe JSON"),
    ],
)
def test_garbage_parses_to_an_error(text, error):
    facts = parse_fp16_range(text)
    assert facts.error is not None and facts.error.startswith(error), facts.error
    assert not facts.ok


def test_the_last_json_line_wins_over_noise():
    line = json.dumps(
        {"probe": "voltaforge-fp16-range", "probe_version": 1, "dtypes": {"BF16": 1}, "values_checked": 4}
    )
    facts = parse_fp16_range(f"numpy/core/warnings: something\r\n{{half\n{line}\n\n")
    assert facts.ok and facts.dtypes == {"BF16": 1} and facts.values_checked == 4


def test_the_summary_names_five_tensors_then_counts_the_rest():
    overflow = tuple(TensorCount(tensor=f"t{i}", file="m.safetensors", count=i + 1) for i in range(7))
    facts = Fp16Range(overflow=overflow, values_checked=100)
    assert facts.summary == (
        "28 BF16 values beyond FP16's range in 7 tensors (t6: 7, t5: 6, t4: 5, t3: 4, t2: 3 and 2 more)"
    )
    one = Fp16Range(overflow=(TensorCount(tensor=HEAD, file="m.safetensors", count=1),))
    assert one.summary == f"1 BF16 value beyond FP16's range in 1 tensor ({HEAD}: 1)"


# --------------------------------------------------------------------------- the script itself


def test_the_probe_is_python38_stdlib_plus_numpy():
    source = FP16_RANGE_PROBE_PATH.read_text()
    tree = ast.parse(source, feature_version=(3, 8))  # the serving venv may be a 3.8
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported == {"argparse", "json", "os", "struct", "sys", "numpy"}
    assert FP16_RANGE_PROBE_PATH.parent.name == "probes"  # shipped by the probes/*.py package data
