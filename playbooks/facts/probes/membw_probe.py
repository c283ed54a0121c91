#!/usr/bin/env python3
"""voltaforge memory-bandwidth probe: a STREAM-like copy on the host's CPU memory.

    python3 membw_probe.py --mib 256 [--repeats 5] [--method auto|numpy|python] [--threads N]

Why: a CPU roofline (and the seed's 4 tok/s with 17 GB of weights read from DDR4) needs this
host's copy bandwidth, measured in the same run as the figure it is compared with: on a
shared 2-core machine it moved between 16 and 24 GB/s from one run to the next.

Method: copy a --mib MiB buffer into another, --repeats times, and keep the fastest; a copy
reads and writes the buffer, so bytes moved = 2 x buffer. With numpy this is np.copyto (a
memcpy, close to STREAM's Copy), split over --threads threads (default: every CPU), since
llama.cpp reads weights with every core: on a lent H200 host one thread copied 20.7 GB/s while
llama.cpp's decode read experts from host RAM at 41.6 GB/s (numpy releases the GIL while it
copies, so the threads really run at once). Without numpy it falls back to memoryview slice assignment
between bytearrays, also a memcpy underneath but with first-touch and interpreter overhead
nearer the loop: its figure is a lower bound ("lower_bound": true).

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


def _best_copy_seconds(copy, repeats):
    copy()  # warm-up: page faults of first touch are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        copy()
        best = min(best, time.perf_counter() - start)
    return best


def measure_numpy(nbytes, repeats, threads=1):
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    if threads <= 1:
        seconds = _best_copy_seconds(lambda: np.copyto(dst, src), repeats)
    else:
        from concurrent.futures import ThreadPoolExecutor

        step = -(-nbytes // threads)
        parts = [(dst[i : i + step], src[i : i + step]) for i in range(0, nbytes, step)]
        with ThreadPoolExecutor(max_workers=len(parts)) as pool:

            def copy():
                list(pool.map(lambda part: np.copyto(*part), parts))

            seconds = _best_copy_seconds(copy, repeats)
    if not bool(dst[-1] == 1):  # the copy really happened
        raise RuntimeError("np.copyto left the destination unchanged")
    return seconds


def measure_python(nbytes, repeats):
    src = bytearray(b"\x01") * nbytes
    dst = bytearray(nbytes)
    src_view, dst_view = memoryview(src), memoryview(dst)

    def copy():
        dst_view[:] = src_view

    seconds = _best_copy_seconds(copy, repeats)
    if dst[-1] != 1:
        raise RuntimeError("memoryview copy left the destination unchanged")
    return seconds


def main(argv=None):
    parser = argparse.ArgumentParser(prog="membw_probe.py")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--method", choices=("auto", "numpy", "python"), default="auto")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)

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
    if not 1 <= args.mib <= 65536 or not 1 <= args.repeats <= 1000 or not 1 <= args.threads <= 1024:
        _emit({"error": "--mib must be 1..65536, --repeats 1..1000, --threads 1..1024", "kind": "bad-arguments"})
        return 0

    method = args.method
    if method == "auto":
        try:
            import numpy  # noqa: F401

            method = "numpy"
        except Exception:  # ImportError, or a broken install raising anything else
            method = "python"
    nbytes = args.mib * MIB
    try:
        if method == "numpy":
            seconds = measure_numpy(nbytes, args.repeats, args.threads)
        else:
            seconds = measure_python(nbytes, args.repeats)
    except MemoryError:
        _emit({"error": f"cannot allocate 2 x {args.mib} MiB", "kind": "no-memory", "method": method})
        return 0
    except ImportError as exc:
        _emit({"error": f"numpy not importable: {exc}", "kind": "no-numpy", "method": method})
        return 0
    moved = 2 * nbytes  # read + write
    _emit(
        {
            "copy_gb_s": round(moved / seconds / 1e9, 3),
            "method": method,
            "bytes": moved,
            "buffer_bytes": nbytes,
            "repeats": args.repeats,
            "threads": args.threads if method == "numpy" else 1,
            "best_s": seconds,
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
