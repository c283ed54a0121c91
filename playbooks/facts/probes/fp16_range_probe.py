#!/usr/bin/env python3
"""voltaforge FP16 range probe: pushed to the host that holds the weights, run with its venv python.

Why: a V100 has no BF16, so BF16 checkpoints are converted to FP16 before serving. FP16's
largest finite value is 65504; a BF16 (or F32) value beyond it silently becomes +/-inf in the
conversion and then poisons every activation it touches (NaN logits, empty answers). So,
before converting, this probe counts those values, tensor by tensor, shard by shard.

It reads only the safetensors header and then each tensor's bytes in bounded chunks (default
16 MiB, --chunk-bytes), so a 10 GB shard never needs 10 GB of RAM: the host serving a 32B
model may not have the model's size in free memory, and the GPU is not used at all.

    python fp16_range_probe.py [--chunk-bytes N] [--clamp OUT_DIR] [--] PATH [PATH ...]

PATH is a .safetensors file or a directory (all *.safetensors in it, sorted). It prints
exactly ONE line of JSON on stdout and exits 0, whatever happens:

    {"probe": "voltaforge-fp16-range", "probe_version": 1, "files": ["/m/a.safetensors"],
     "dtypes": {"BF16": 290}, "values_checked": 7615616,
     "overflow": [{"tensor": "lm_head.weight", "file": "a.safetensors", "dtype": "BF16",
                   "count": 1, "max_abs": 100352.0}],
     "nonfinite": [{"tensor": "...", "file": "...", "dtype": "BF16", "count": 2,
                    "max_abs": null, "nan": 1, "inf": 1}],
     "chunk_bytes": 16777216, "reads": 291}
    {"probe": "voltaforge-fp16-range", "probe_version": 1, "error": "<what> <which file>", ...}

"overflow" are finite values that become inf in FP16; "nonfinite" are NaN/inf already in the
checkpoint (FP16 keeps them as they are; they are a different problem, reported apart). The
two never count the same value. F16 tensors are already FP16 and other dtypes (I8, U8,
F8_E4M3, ...) are not converted: they are counted in "dtypes" only. "values_checked" counts
the BF16 and F32 values examined.

--clamp OUT_DIR writes a copy of every shard into OUT_DIR (same file name, same header,
same bytes) where each overflowing value is replaced by the largest value of its dtype that
FP16 holds, sign kept; NaN/inf are left alone (no finite value is "right" for them). Each
copy is written under a temporary name and renamed when complete, so a half-written shard
never carries the real name. The JSON then also has "clamp_dir", "written" (the paths) and
"clamped_values". Counts always describe the input.

Only the standard library and numpy (present in the serving venv) are used. Keep it Python
3.8 compatible: no `match`, no `X | Y` annotations, no 3.9+ APIs, nothing from recent numpy.
"""

import argparse
import json
import os
import struct
import sys

PROBE = "voltaforge-fp16-range"
PROBE_VERSION = 1

# Bounded reads. The buffer plus numpy's temporaries per chunk (magnitudes, masks) come to
# about 3x the chunk: measured on a 128 MB shard, 78 MB peak RSS at this default (numpy alone
# is 26 MB) and 32 MB at 1 MiB chunks, whatever the shard size.
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024

# safetensors itself refuses headers above 100 MB: a bigger length means a corrupt file, and
# reading it would be the whole-file read this probe exists to avoid.
MAX_HEADER_BYTES = 100 * 1000 * 1000

ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

# --- the threshold, worked out --------------------------------------------------------------
# FP16: 5 exponent bits, 10 mantissa bits. Its largest finite value is (2 - 2**-10) * 2**15 =
# 65504; at that exponent FP16 values are 32 apart, and the next step up, 65536 = 2**16, does
# not exist (exponent overflow, i.e. inf). Converting with round-to-nearest-even (what torch,
# numpy and llama.cpp's converters do), a value rounds down to 65504 while it is below the
# midpoint 65504 + 16 = 65520; exactly 65520 is a tie, and ties go to the even mantissa: 65504
# has mantissa 0x3FF (odd), the "65536" above it is even, so 65520 becomes inf. Hence: a value
# becomes inf in FP16 exactly when |x| >= 65520.
#
# BF16: 8 exponent bits, 7 mantissa bits. Between 2**15 and 2**16 BF16 values are
# 2**(15 - 7) = 256 apart: ..., 65024, 65280, then 65536. No BF16 lies in (65280, 65536), so
# for BF16 "|x| >= 65520" is "|x| >= 65536", i.e. magnitude bits (sign cleared) >= 0x4780
# (65536 = 2**16: biased exponent 16 + 127 = 143 = 0x8F, mantissa 0 -> 0 10001111 0000000).
# Magnitudes >= 0x7F80 are inf (== 0x7F80) or NaN (> 0x7F80): nonfinite, not overflow.
BF16_OVERFLOW_BITS = 0x4780
BF16_INF_BITS = 0x7F80
# F32: 65520.0 is 0x477FF000 (biased exponent 142, mantissa 0x7FF000); inf is 0x7F800000.
F32_OVERFLOW_BITS = 0x477FF000
F32_INF_BITS = 0x7F800000

# --- the clamp values -------------------------------------------------------------------------
# "Clamp to 65504" is not representable in BF16 (it would round to 65536, itself overflow).
# The largest BF16 that FP16 holds is 65280 = 0x477F (0 10001110 1111111 = 2**15 * (1 + 127/128)),
# and 65280 is exact in FP16 too (a multiple of 32 at that exponent), so the clamped value
# survives the conversion unchanged. F32 represents 65504 exactly (0x477FE000): clamp to that.
BF16_CLAMP_BITS = 0x477F  # 65280.0
F32_CLAMP_BITS = 0x477FE000  # 65504.0
CLAMP_VALUES = {"BF16": 65280.0, "F32": 65504.0}


class ProbeError(Exception):
    """A problem to report in the JSON line's "error" (the message names the file)."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting 2: the caller reads JSON."""

    def error(self, message):
        raise ProbeError("bad arguments: " + message)


def _emit(obj):
    obj.setdefault("probe", PROBE)
    obj.setdefault("probe_version", PROBE_VERSION)
    # allow_nan=False: strict JSON only (every float here is finite by construction).
    sys.stdout.write(json.dumps(obj, sort_keys=True, allow_nan=False) + "\n")
    sys.stdout.flush()


def _shards(paths):
    """The safetensors files named by PATH arguments: files as given, directories expanded."""
    files: list = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
            if not found:
                raise ProbeError("no *.safetensors file in directory " + path)
            files.extend(os.path.join(path, n) for n in found)
        elif os.path.exists(path):
            files.append(path)
        else:
            raise ProbeError("no such file: " + path)
    return files


def _read_exact(f, n, path, what):
    data = f.read(n)
    if len(data) != n:
        raise ProbeError(f"truncated file {path}: {what} is {n} bytes, only {len(data)} there")
    return data


def _header(f, path, size):
    """(data_start, tensors sorted by offset) from a safetensors header.

    The format: u64 little-endian header length N, N bytes of JSON
    {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
    then the data; offsets are relative to the end of the header.
    """
    if size < 8:
        raise ProbeError(f"truncated file {path}: {size} bytes, not even the 8-byte header length")
    (length,) = struct.unpack("<Q", _read_exact(f, 8, path, "the header length"))
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise ProbeError(f"bad safetensors header in {path}: header length {length} for a {size}-byte file")
    raw = _read_exact(f, length, path, "the header")
    try:
        header = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError is a ValueError too
        raise ProbeError(f"bad safetensors header in {path}: not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ProbeError(f"bad safetensors header in {path}: not a JSON object")
    data_start = 8 + length
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = info["dtype"]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
            if not isinstance(dtype, str) or begin < 0 or end < begin or any(d < 0 for d in shape):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise ProbeError(
                f"bad safetensors header in {path}: tensor {name!r} has no valid dtype/shape/data_offsets"
            ) from None
        if data_start + end > size:
            raise ProbeError(
                f"truncated file {path}: tensor {name!r} ends at byte {data_start + end}, the file has {size}"
            )
        itemsize = ITEMSIZE.get(dtype)
        if itemsize is not None:
            count = 1
            for d in shape:
                count *= d
            if count * itemsize != end - begin:
                raise ProbeError(
                    f"bad safetensors header in {path}: tensor {name!r} is {dtype} {shape} by shape, "
                    f"{end - begin} bytes by offsets"
                )
        tensors.append((begin, end, name, dtype))
    tensors.sort()
    for previous, current in zip(tensors, tensors[1:]):
        if current[0] < previous[1]:
            raise ProbeError(f"bad safetensors header in {path}: tensors {previous[2]!r} and {current[2]!r} overlap")
    return data_start, tensors


class _Scan:
    """Counts for one tensor, accumulated chunk by chunk."""

    def __init__(self):
        self.values = 0
        self.overflow = 0
        self.max_bits = 0
        self.nan = 0
        self.inf = 0
        self.clamped = 0


def _check_chunk(np, buf, n, dtype, scan, clamp):
    """Count (and, with clamp, rewrite in place) one chunk of a BF16 or F32 tensor.

    Works on the bit patterns, never on float values: no float conversion of the data, no
    overflow warnings, and the thresholds are exact (see the constants above).
    """
    if dtype == "BF16":
        bits = np.frombuffer(buf, dtype="<u2", count=n // 2)
        magnitude = bits & 0x7FFF
        limit, inf, sign, clamp_bits = BF16_OVERFLOW_BITS, BF16_INF_BITS, 0x8000, BF16_CLAMP_BITS
    else:
        bits = np.frombuffer(buf, dtype="<u4", count=n // 4)
        magnitude = bits & 0x7FFFFFFF
        limit, inf, sign, clamp_bits = F32_OVERFLOW_BITS, F32_INF_BITS, 0x80000000, F32_CLAMP_BITS
    scan.values += bits.size
    at_or_above = int(np.count_nonzero(magnitude >= limit))
    if not at_or_above:  # the common case: a mask and a comparison per value, done
        return
    nonfinite = int(np.count_nonzero(magnitude >= inf))
    if nonfinite:
        nan = int(np.count_nonzero(magnitude > inf))
        scan.nan += nan
        scan.inf += nonfinite - nan
    overflow = at_or_above - nonfinite
    if overflow:
        mask = (magnitude >= limit) & (magnitude < inf)
        scan.overflow += overflow
        scan.max_bits = max(scan.max_bits, int(magnitude[mask].max()))
        if clamp:
            # bits views the bytearray: this rewrites the chunk that is written out next
            np.putmask(bits, mask, (bits & sign) | clamp_bits)
            scan.clamped += overflow


def _bits_to_float(dtype, bits):
    if dtype == "BF16":
        return struct.unpack("<f", struct.pack("<I", bits << 16))[0]
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _copy(f, out, length, buf, path):
    """Copy `length` bytes (header, gaps, unchecked tensors) from f to out in bounded reads."""
    view = memoryview(buf)
    while length > 0:
        n = min(length, len(buf))
        got = f.readinto(view[:n])
        if got != n:
            raise ProbeError(f"truncated file {path}: a read came back short")
        out.write(view[:n])
        length -= n


def _scan_file(np, path, result, state, clamp_dir):
    """Scan one shard; with clamp_dir, also write its clamped copy (temporary name, then rename)."""
    size = os.path.getsize(path)
    base = os.path.basename(path)
    out = None
    tmp = target = ""  # set when clamping
    renamed = False
    with open(path, "rb") as f:
        data_start, tensors = _header(f, path, size)
        if clamp_dir is not None:
            target = os.path.join(clamp_dir, base)
            if os.path.exists(target) and os.path.samefile(target, path):
                raise ProbeError("--clamp would overwrite its input " + path)
            if target in state["targets"]:
                raise ProbeError(f"--clamp: two inputs named {base} would both be written to {target}")
            state["targets"].add(target)
            tmp = os.path.join(clamp_dir, f".{base}.partial-{os.getpid()}")
            out = open(tmp, "wb")
        try:
            buf = state["buf"]
            if out is not None:
                f.seek(0)
                _copy(f, out, data_start, buf, path)
            position = data_start
            for begin, end, name, dtype in tensors:
                result["dtypes"][dtype] = result["dtypes"].get(dtype, 0) + 1
                start, stop = data_start + begin, data_start + end
                if out is not None and start > position:  # bytes between tensors: kept as they are
                    f.seek(position)
                    _copy(f, out, start - position, buf, path)
                if dtype not in ("BF16", "F32"):
                    if out is not None:
                        f.seek(start)
                        _copy(f, out, stop - start, buf, path)
                    position = stop
                    continue
                scan = _Scan()
                itemsize = ITEMSIZE[dtype]
                step = max(itemsize, len(buf) - len(buf) % itemsize)  # whole values per read
                view = memoryview(buf)
                f.seek(start)
                remaining = stop - start
                while remaining > 0:
                    n = min(remaining, step)
                    got = f.readinto(view[:n])
                    state["reads"] += 1
                    if got != n:
                        raise ProbeError(f"truncated file {path}: tensor {name!r} came back short")
                    _check_chunk(np, buf, n, dtype, scan, out is not None)
                    if out is not None:
                        out.write(view[:n])
                    remaining -= n
                position = stop
                result["values_checked"] += scan.values
                if scan.overflow:
                    result["overflow"].append(
                        {
                            "tensor": name,
                            "file": base,
                            "dtype": dtype,
                            "count": scan.overflow,
                            "max_abs": _bits_to_float(dtype, scan.max_bits),
                        }
                    )
                if scan.nan or scan.inf:
                    result["nonfinite"].append(
                        {
                            "tensor": name,
                            "file": base,
                            "dtype": dtype,
                            "count": scan.nan + scan.inf,
                            "max_abs": None,
                            "nan": scan.nan,
                            "inf": scan.inf,
                        }
                    )
                state["clamped"] += scan.clamped
            if out is not None:
                if size > position:  # anything after the last tensor, byte for byte
                    f.seek(position)
                    _copy(f, out, size - position, buf, path)
                out.flush()
                os.fsync(out.fileno())  # the data is on disk before the real name points at it
                out.close()
                os.replace(tmp, target)
                renamed = True
                result["written"].append(target)
        finally:
            if out is not None and not renamed:  # failed half way: no partial shard left behind
                out.close()
                try:
                    os.unlink(tmp)
                except OSError:
                    pass


def probe(argv, result):
    parser = _Parser(prog="fp16_range_probe.py", add_help=False)
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    parser.add_argument("--clamp", metavar="OUT_DIR", default=None)
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)
    if args.chunk_bytes < 8:
        raise ProbeError(f"bad arguments: --chunk-bytes must be at least 8, not {args.chunk_bytes}")
    try:
        import numpy as np
    except Exception as exc:  # ImportError, or a broken install raising anything else
        raise ProbeError(f"numpy not importable: {exc}") from None

    result.update({"dtypes": {}, "overflow": [], "nonfinite": [], "values_checked": 0})
    files = _shards(args.paths)
    result["files"] = files
    # chunk sizes are kept to multiples of 8 so a chunk always holds whole F32/BF16 values
    chunk = args.chunk_bytes - args.chunk_bytes % 8
    result["chunk_bytes"] = chunk
    result["reads"] = 0
    state: dict = {"buf": bytearray(chunk), "reads": 0, "clamped": 0, "targets": set()}
    if args.clamp is not None:
        result["clamp_dir"] = args.clamp
        result["clamp_values"] = dict(CLAMP_VALUES)
        result["written"] = []
        result["clamped_values"] = 0
    try:
        if args.clamp is not None:
            try:
                os.makedirs(args.clamp, exist_ok=True)
            except OSError as exc:
                raise ProbeError(f"cannot create --clamp directory {args.clamp}: {exc.strerror or exc}") from None
        for path in files:
            try:
                _scan_file(np, path, result, state, args.clamp)
            except OSError as exc:  # unreadable input, or a full disk while writing the clamped copy
                where = exc.filename or path
                raise ProbeError(f"I/O error on {where} (scanning {path}): {exc.strerror or exc}") from None
    finally:
        result["reads"] = state["reads"]
        if args.clamp is not None:
            result["clamped_values"] = state["clamped"]


def main(argv=None):
    result: dict = {}  # the JSON object printed: values of any type
    try:
        probe(sys.argv[1:] if argv is None else argv, result)
    except ProbeError as exc:
        result["error"] = str(exc)
    except BaseException as exc:  # never a traceback: the caller parses stdout as JSON
        result["error"] = f"probe crashed: {exc.__class__.__name__}: {exc}"
    try:
        _emit(result)
    except Exception as exc:
        _emit({"error": f"probe output not serialisable: {exc}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
