#!/usr/bin/env python3
"""voltaforge memory-bandwidth probe: a STREAM-like copy on the host's CPU memory.

    python3 membw_probe.py [--mib N] [--repeats 10] [--method auto|numpy|python] [--threads N]

Why: a CPU roofline (and the seed's 4 tok/s with 17 GB of weights read from DDR4) needs this
host's copy bandwidth, measured in the same run as the figure it is compared with: on a
shared 2-core machine it moved between 16 and 24 GB/s from one run to the next.

Method, as STREAM reports it: copy a buffer into another, --repeats times (STREAM's NTIMES,
10), and keep the fastest; a copy reads and writes the buffer, so bytes moved = 2 x buffer.
The buffer (--mib, default) is four times the sum of the host's last-level caches and at
least 256 MiB, STREAM's rule for leaving the caches; every trial's figure is reported too.
With numpy this is np.copyto (a memcpy, close to STREAM's Copy), split over --threads threads
(default: every CPU), since llama.cpp reads weights with every core: on a lent H200 host one
thread copied 20.7 GB/s while llama.cpp's decode read experts from host RAM at 41.6 GB/s (numpy
releases the GIL while it copies, so the threads really run at once). Without numpy it falls
back to memoryview slice assignment between bytearrays, also a memcpy underneath but with
first-touch and interpreter overhead nearer the loop: its figure is a lower bound ("lower_bound": true).

One JSON line on stdout, exit 0 always:
    {"probe": "voltaforge-membw", "copy_gb_s": 21.3, "method": "numpy", "bytes": 536870912,
     "repeats": 5, "lower_bound": false}
    {"probe": "voltaforge-membw", "error": "...", "kind": "no-memory"|"bad-arguments"|...}
GB here is 1e9 bytes. Python 3.8+, stdlib and optional numpy; no 3.9+ syntax.
"""

import argparse
import json
import os
import sys
import time

PROBE = "voltaforge-membw"
MIB = 1024 * 1024


def _emit(obj):
    obj["probe"] = PROBE
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


def _copy_seconds(copy, repeats):
    """Every trial's seconds, after one warm-up copy (page faults of first touch are not
    bandwidth)."""
    copy()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        copy()
        times.append(time.perf_counter() - start)
    return times


def _size_bytes(text):
    text = text.strip().upper()
    scale = {"K": 1024, "M": 1024 * 1024, "G": 1024 * 1024 * 1024}.get(text[-1:], 1)
    digits = text.rstrip("KMG")
    return int(digits) * scale if digits.isdigit() else 0


def last_level_cache_bytes(root="/sys/devices/system/cpu"):
    """The sum of the host's last-level caches (each shared cache counted once), 0 if unknown."""
    seen = {}
    try:
        cpus = [d for d in os.listdir(root) if d.startswith("cpu") and d[3:].isdigit()]
    except OSError:
        return 0
    for cpu in cpus:
        cache = os.path.join(root, cpu, "cache")
        try:
            indexes = [d for d in os.listdir(cache) if d.startswith("index")]
        except OSError:
            continue
        best = None
        for index in indexes:
            try:
                with open(os.path.join(cache, index, "level")) as f:
                    level = int(f.read().strip())
                with open(os.path.join(cache, index, "size")) as f:
                    size = _size_bytes(f.read())
                with open(os.path.join(cache, index, "shared_cpu_list")) as f:
                    shared = f.read().strip()
            except (OSError, ValueError):
                continue
            if best is None or level > best[0]:
                best = (level, size, shared)
        if best:
            seen[(best[0], best[2])] = best[1]
    return sum(seen.values())


def _mem_total_bytes():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def default_mib():
    """4 x the last-level caches, at least 256 MiB (STREAM's rule: the arrays leave the caches),
    at most 1 GiB and an eighth of the memory (two buffers). The cap matters in VMs that report
    the host's whole L3 (480 MiB on the development machine): 1 GiB is already twice that."""
    llc = last_level_cache_bytes()
    want = max(256, -(-4 * llc // MIB))
    total = _mem_total_bytes()
    cap = min(1024, total // (8 * MIB)) if total else 1024
    return max(1, min(want, cap))


def measure_numpy(nbytes, repeats, threads=1):
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    if threads <= 1:
        seconds = _copy_seconds(lambda: np.copyto(dst, src), repeats)
    else:
        from concurrent.futures import ThreadPoolExecutor

        step = -(-nbytes // threads)
        parts = [(dst[i : i + step], src[i : i + step]) for i in range(0, nbytes, step)]
        with ThreadPoolExecutor(max_workers=len(parts)) as pool:

            def copy():
                list(pool.map(lambda part: np.copyto(*part), parts))

            seconds = _copy_seconds(copy, repeats)
    if not bool(dst[-1] == 1):  # the copy really happened
        raise RuntimeError("np.copyto left the destination unchanged")
    return seconds


def measure_python(nbytes, repeats):
    src = bytearray(b"\x01") * nbytes
    dst = bytearray(nbytes)
    src_view, dst_view = memoryview(src), memoryview(dst)

    def copy():
        dst_view[:] = src_view

    seconds = _copy_seconds(copy, repeats)
    if dst[-1] != 1:
        raise RuntimeError("memoryview copy left the destination unchanged")
    return seconds


def measure_cuda(nbytes, repeats):
    """A device-to-device copy on GPU 0 with torch, timed with CUDA events: the GPU's own copy
    rate, reported beside its datasheet figure (which stays the roofline's ceiling)."""
    import torch

    if not torch.cuda.is_available():
        raise LookupError("torch sees no CUDA device")
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    dst.copy_(src)  # warm-up
    torch.cuda.synchronize()
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    if int(dst[-1].item()) != 1:
        raise RuntimeError("the device copy left the destination unchanged")
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(prog="membw_probe.py")
    parser.add_argument("--mib", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--method", choices=("auto", "numpy", "python"), default="auto")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")

    class _Bad(Exception):
        pass

    def fail(message):
        raise _Bad(message)

    parser.error = fail  # type: ignore[method-assign]  # an error line, not usage text and exit 2
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except _Bad as exc:
        _emit({"error": str(exc), "kind": "bad-arguments"})
        return 0
    if args.mib is None:
        args.mib = 1024 if args.device == "cuda" else default_mib()
    if not 1 <= args.mib <= 65536 or not 1 <= args.repeats <= 1000 or not 1 <= args.threads <= 1024:
        _emit({"error": "--mib must be 1..65536, --repeats 1..1000, --threads 1..1024", "kind": "bad-arguments"})
        return 0

    method = args.method
    if args.device == "cuda":
        method = "torch-cuda"
    elif method == "auto":
        try:
            import numpy  # noqa: F401

            method = "numpy"
        except Exception:  # ImportError, or a broken install raising anything else
            method = "python"
    nbytes = args.mib * MIB
    try:
        if method == "torch-cuda":
            seconds = measure_cuda(nbytes, args.repeats)
        elif method == "numpy":
            seconds = measure_numpy(nbytes, args.repeats, args.threads)
        else:
            seconds = measure_python(nbytes, args.repeats)
    except MemoryError:
        _emit({"error": f"cannot allocate 2 x {args.mib} MiB", "kind": "no-memory", "method": method})
        return 0
    except ImportError as exc:
        what, kind = ("torch", "no-torch") if method == "torch-cuda" else ("numpy", "no-numpy")
        _emit({"error": f"{what} not importable: {exc}", "kind": kind, "method": method})
        return 0
    except LookupError as exc:
        _emit({"error": str(exc), "kind": "no-cuda", "method": method})
        return 0
    moved = 2 * nbytes  # read + write
    best = min(seconds)
    _emit(
        {
            "copy_gb_s": round(moved / best / 1e9, 3),
            "trials_gb_s": [round(moved / t / 1e9, 3) for t in seconds],
            "method": method,
            "bytes": moved,
            "buffer_bytes": nbytes,
            "repeats": args.repeats,
            "threads": args.threads if method == "numpy" else 1,
            "device": args.device,
            "best_s": best,
            "lower_bound": method == "python",
        }
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # never a traceback: the controller parses stdout as JSON
        _emit({"error": f"{exc.__class__.__name__}: {exc}", "kind": "probe-crashed"})
        sys.exit(0)
