"""HELD-OUT shapes for the compute-buffer replay (playbooks/plan/compute_buffer.py).

The replay's allocation sequence was transcribed from allocator traces of the same shapes its
loads check (tests/data/compute_buffers.yaml). These shapes were drawn by a fixed seed, by the
rules below, and committed (tests/data/compute_buffers_held_out.yaml) before any of them was
loaded, so that nothing in the replay was shaped on them. tests/test_compute_buffer.py checks
that the committed list is still exactly what this draws, then holds the replay to real loads
of them (the pinned llama-server, CPU only, the way the 34 llama-server loads were made).

Rules (fixed before the draw): the dense archs voltaforge plans (llama, qwen2, qwen3, gemma2,
gemma3); head_dim 64/96/128/256 (a multiple of 32, so q8_0/q4_0 caches can hold a head);
query heads 4-48, KV heads a divisor of them; hidden = heads x head_dim, or one third of the
time a multiple of 256 that is not (as Mistral Nemo and Qwen3 4B); FFN 2-4.5 x hidden in
steps of 64; 2-6 layers (gemma2: an even count, its pattern alternates; gemma3: 6 or 12, one
full-attention layer in 6; real models of those archs have the same patterns); vocabulary from
real models'; n_ctx 512-32768 (8192 at most without flash attention: the KQ matrix), a third
of the time not a multiple of 256; n_ubatch 128-2048 and no more than a slot's context; 1, 2
or 4 slots; without flash attention the V cache stays F16 (llama.cpp refuses a quantized one).

    python -m tests.tools.held_out_shapes > tests/data/compute_buffers_held_out.yaml

Then the loads, each with tests/llamacpp_tools.reserve_compute_buffer (the pinned llama-server
CPU-only, as every compute-buffer load of tests/fixtures is made), into their fixture:

    python -m tests.tools.held_out_shapes --capture DIR > tests/fixtures/HELD_OUT_FIXTURE

and with tests/tools/cbuf (as the cbuf fixture's loads: the allocator's byte totals, CPU only
and with every layer on an in-process RPC device, the stand-in for a full CUDA offload):

    python -m tests.tools.held_out_shapes --capture-cbuf DIR > tests/fixtures/HELD_OUT_CBUF_FIXTURE
"""

from __future__ import annotations

import datetime
import random
import sys
from pathlib import Path

import yaml

SEED = 20261201
N = 12
HELD_OUT_FIXTURE = "thishost-llamacpp-0c1e570-compute-buffer-llama-server-cpu-held-out.log"
HELD_OUT_CBUF_FIXTURE = "thishost-llamacpp-0c1e570-compute-buffer-cbuf-bytes-held-out.log"
ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
VOCABS = (32000, 32768, 49152, 128256, 151936, 152064, 256000, 262144)
HEADER = """\
# HELD-OUT compute-buffer shapes: drawn by tests/tools/held_out_shapes.py (seed {seed}, {n}
# shapes), committed before any was loaded and before any change to the replay; do not edit by
# hand (tests/test_compute_buffer.py checks this file is exactly what the generator draws).
# model: a tests/sparse_gguf.py file name (the name is the shape); args: llama-server's.
"""


def draw(seed: int = SEED, n: int = N) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        arch = rng.choice(ARCHS)
        d = rng.choice((64, 96, 128, 256))
        h = rng.randint(4, 48)
        k = rng.choice([x for x in (1, 2, 4, 8, h) if h % x == 0])
        e = h * d if rng.random() < 2 / 3 else 256 * rng.randint(4, 24)
        f = 64 * round(e * rng.uniform(2.0, 4.5) / 64)
        layers = {"gemma2": (2, 4, 6), "gemma3": (6, 12)}.get(arch, (2, 3, 4, 5, 6))
        n_layers = rng.choice(layers)
        v = rng.choice(VOCABS)
        w = rng.choice((512, 1024, 4096)) if arch.startswith("gemma") else 0
        fa = rng.choice(("on", "off"))
        c = rng.randint(512, 32768 if fa == "on" else 8192)
        if rng.random() >= 1 / 3:
            c = max(512, c // 256 * 256)
        np_ = rng.choice((1, 2, 4))
        ub = rng.choice([u for u in (128, 256, 512, 1024, 2048) if u <= c // np_] or [128])
        ctk = rng.choice(("f16", "q8_0", "q4_0"))
        ctv = rng.choice(("f16", "q8_0", "q4_0")) if fa == "on" else "f16"
        wpart = f"-W{w}" if w else ""
        model = f"{arch}-E{e}-F{f}-L{n_layers}-H{h}-K{k}-D{d}-V{v}{wpart}.gguf"
        args = f"-c {c} -ub {ub} -fa {fa} -np {np_} -ctk {ctk} -ctv {ctv}"
        out.append({"model": model, "args": args})
    return out


def render(seed: int = SEED, n: int = N) -> str:
    body = yaml.safe_dump({"seed": seed, "shapes": draw(seed, n)}, sort_keys=False, width=200)
    return HEADER.format(seed=seed, n=n) + body


def capture(work: Path) -> str:
    """The fixture: every drawn shape loaded once, its reserve lines kept."""
    from tests import llamacpp_tools, sparse_gguf

    shapes = draw()
    out = [
        f"# source: this machine (Debian 12, 2 cores, no GPU), {datetime.date.today()}: llama-server of the pinned "
        "static CPU build (llama.cpp 0c1e570 from the llama-cpp-python 0.3.36 sdist, built by "
        "tests/llamacpp_tools.py), each model a GGUF written by tests/sparse_gguf.py (the file name is the shape), "
        "each run `llama-server <args shown> --fit off -t 1 --host 127.0.0.1 --port P -lv 4` "
        "(tests/llamacpp_tools.reserve_compute_buffer), stopped once the reserve was logged; lines kept: compute "
        "buffer size, graph nodes, the loader's error and any failure (time and level cut); written by "
        "`python -m tests.tools.held_out_shapes --capture DIR`",
        f"# what: the CPU compute buffer of the {len(shapes)} HELD-OUT shapes of "
        f"tests/data/compute_buffers_held_out.yaml (seed {SEED}), loaded after that list was committed",
        "# ---",
    ]
    for shape in shapes:
        model = sparse_gguf.write(work, sparse_gguf.shape_of(shape["model"]))
        out.append(f"$ llama-server -m {shape['model']} {shape['args']}")
        out += llamacpp_tools.reserve_compute_buffer(model, shape["args"].split())
        model.unlink()
    return "\n".join(out) + "\n"


def cbuf_args(shape: dict[str, str], rpc_port: int | None) -> list[str]:
    """A held-out load's llama-server arguments in cbuf's spelling: -fa 1/0, llama-server's
    logits rows (one per slot), and for a split the RPC device (sizes only, --no-alloc)."""
    a = shape["args"].split()
    a[a.index("-fa") + 1] = "1" if a[a.index("-fa") + 1] == "on" else "0"
    a[a.index("-np") + 2 : a.index("-np") + 2] = ["--n-out", a[a.index("-np") + 1]]
    return a + ([] if rpc_port is None else ["--rpc", f"127.0.0.1:{rpc_port}", "--no-alloc"])


def capture_cbuf(work: Path) -> str:
    """The byte fixture: every drawn shape as a full-offload RPC split, then CPU only."""
    from tests import llamacpp_tools, sparse_gguf

    cbuf = llamacpp_tools.build_cbuf(work / "cbuf-tool")
    shapes = draw()
    out = [
        f"# source: this machine (Debian 12, 2 cores, no GPU), {datetime.date.today()}: tests/tools/cbuf/cbuf.cpp "
        "built by tests/tools/cbuf/build.sh against the pinned static CPU build (llama.cpp 0c1e570), "
        "`CBUF_TRACE=trace.txt cbuf <args shown>` in the directory of the tests/sparse_gguf.py models "
        "(tests/llamacpp_tools.cbuf_reserve), the same way as the cbuf fixture's loads; --rpc starts a ggml RPC "
        "server on the CPU backend in the process and offloads every layer to it (device RPC0), --no-alloc sizes "
        "without allocating, --n-out N reserves N logits rows as llama-server does for N slots; kept: the compute "
        "buffer lines, graph nodes, the loader's error, and the allocator's own totals in bytes (the S| lines of "
        "the last reserve in CBUF_TRACE: buffer, name, bytes, alignment); written by "
        "`python -m tests.tools.held_out_shapes --capture-cbuf DIR`",
        f"# what: the {len(shapes)} HELD-OUT shapes of tests/data/compute_buffers_held_out.yaml (seed {SEED}), "
        "each as a full-offload split (RPC0: the device's buffer) and CPU only, loaded after that list was committed",
        "# ---",
    ]
    for i, shape in enumerate(shapes):
        model = sparse_gguf.write(work, sparse_gguf.shape_of(shape["model"]))
        for port in (55100 + i, None):
            args = cbuf_args(shape, port)
            out.append(f"$ CBUF_TRACE=trace.txt cbuf -m {shape['model']} {' '.join(args)}")
            out += llamacpp_tools.cbuf_reserve(cbuf, model, args)
        model.unlink()
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--capture"]:
        sys.stdout.write(capture(Path(sys.argv[2])))
    elif sys.argv[1:2] == ["--capture-cbuf"]:
        sys.stdout.write(capture_cbuf(Path(sys.argv[2])))
    else:
        sys.stdout.write(render())
