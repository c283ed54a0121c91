"""llama.cpp's compute buffer: voltaforge's replay of ggml-alloc against real loads.

The replay (playbooks/plan/compute_buffer.py) has no fitted term, so it is held to equality:
every real number below must come out to the 0.01 MiB llama.cpp prints.
- pinned ref (0c1e570): a real llama-server's CPU-only loads of generated models (fixture;
  the slow test reruns half of them), and the device buffer of a full offload split (an
  in-process RPC device standing in for CUDA) with the allocator's byte totals (fixture);
- older builds' real CUDA logs: reproduced exactly by a llama.cpp of their era with the same
  RPC split (so the split is a faithful stand-in), and for the llama-family ones by the replay
  with the settings those front-ends used.

The replay's sequence was transcribed from allocator traces of the pinned shapes above, so
equality on them is not a held-out result. HELD-OUT: 12 shapes drawn by a fixed seed
(tests/tools/held_out_shapes.py), committed before any was loaded, then loaded the same ways
(llama-server CPU-only: tests/llamacpp_tools.reserve_compute_buffer; cbuf's byte totals, CPU
only and as a full-offload RPC split: tests/llamacpp_tools.cbuf_reserve); the replay's error on
them is reported apart (test_replay_on_the_held_out_shapes*), with the shapes llama.cpp refused
to load named.
"""

from __future__ import annotations

import dataclasses
import re
import statistics

import pytest
import yaml

from playbooks.plan.compute_buffer import Graph, _Allocator, replay, worst_case_graph
from playbooks.plan.engine_llamacpp import llamacpp_compute_buffer_bytes
from playbooks.plan.gpus import MIB
from playbooks.plan.model_config import shape_from_config
from tests import llamacpp_tools, sparse_gguf
from tests.helpers import ROOT, fixture_body
from tests.tools import held_out_shapes

DATA = yaml.safe_load((ROOT / "tests/data/compute_buffers.yaml").read_text())
RUN = re.compile(r"^\$ (?P<tool>\S+) (?P<args>.*)$", re.MULTILINE)
BUFFER = re.compile(r"(?P<buffer>\S+) compute buffer size =\s+(?P<mib>[\d.]+) MiB")
TOTAL = re.compile(
    r"^CBUF_TRACE last reserve: S\|(?P<id>\d+)\|(?P<buffer>[^|\[]+)[^|]*\|(?P<bytes>\d+)\|", re.MULTILINE
)


def runs(fixture: str) -> list[tuple[dict, dict[str, float]]]:
    """(arguments, {buffer: MiB}) for each `$ command` of a captured fixture."""
    body = fixture_body(fixture)
    starts = list(RUN.finditer(body))
    out = []
    for i, m in enumerate(starts):
        chunk = body[m.end() : starts[i + 1].start() if i + 1 < len(starts) else len(body)]
        words = m["args"].split()
        args = {
            w: (words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("-") else True)
            for i, w in enumerate(words)
            if w.startswith("-")
        }
        sizes = {b["buffer"].split("[")[0]: float(b["mib"]) for b in BUFFER.finditer(chunk)}
        sizes |= {t["buffer"] + " bytes": int(t["bytes"]) for t in TOTAL.finditer(chunk)}
        out.append((args | {"flags": words}, sizes))
    return out


def graph_for(args: dict, device: bool) -> Graph:
    shape = shape_from_config(sparse_gguf.shape_of(args["-m"]).hf_config())
    n_seq = int(args.get("-np", 1))
    return worst_case_graph(
        shape,
        int(args["-c"]),
        int(args["-ub"]),
        args["-fa"] in ("on", "1"),
        n_seq=n_seq,
        cache_k=args.get("-ctk", "f16"),
        cache_v=args.get("-ctv", "f16"),
        device=device,
        n_outputs=int(args.get("--n-out", n_seq)),
    )


def run_id(run: tuple[dict, dict]) -> str:
    a = run[0]
    return " ".join(f"{k} {a[k]}" for k in ("-m", "-c", "-ub", "-fa", "-np", "-ctk", "-ctv") if k in a)


def mib(n_bytes: int) -> str:
    return f"{n_bytes / MIB:.2f}"  # llama.cpp prints %8.2f MiB


CPU_RUNS = runs(DATA["pinned"]["cpu_fixture"])
CBUF_RUNS = runs(DATA["pinned"]["cbuf_fixture"])
SPLIT_RUNS = [r for r in CBUF_RUNS if "--rpc" in r[0]]


@pytest.mark.parametrize("args, sizes", CPU_RUNS, ids=map(run_id, CPU_RUNS))
def test_replay_equals_pinned_llama_server_cpu_only(args, sizes):
    shape = shape_from_config(sparse_gguf.shape_of(args["-m"]).hf_config())
    est = llamacpp_compute_buffer_bytes(
        shape,
        int(args["-c"]),
        int(args["-ub"]),
        args["-fa"] == "on",
        n_seq=int(args["-np"]),
        cache_k=args["-ctk"],
        cache_v=args["-ctv"],
        device=False,
    )
    assert mib(est) == f"{sizes['CPU']:.2f}"


@pytest.mark.parametrize("args, sizes", SPLIT_RUNS, ids=map(run_id, SPLIT_RUNS))
def test_replay_equals_pinned_device_buffer_of_a_full_offload(args, sizes):
    """The RPC device's buffer, with the CPU backend's 32-byte alignment and plain sizes (the
    remote is a CPU backend); CUDA differs in those two only (test_cuda_differences)."""
    g = dataclasses.replace(graph_for(args, device=True), alignment=32, fa_extra=0)
    assert mib(replay(g)) == f"{sizes['RPC0']:.2f}"


@pytest.mark.parametrize("args, sizes", CBUF_RUNS, ids=map(run_id, CBUF_RUNS))
def test_replay_equals_the_allocators_byte_total(args, sizes):
    """Byte for byte: the allocator's own total (ggml-alloc.c, traced) for the buffer that
    holds the layers - RPC0 of a split, CPU of a CPU-only run."""
    split = "--rpc" in args
    g = graph_for(args, device=split)
    if split:
        g = dataclasses.replace(g, alignment=32, fa_extra=0)
    assert replay(g) == sizes["RPC0 bytes" if split else "CPU bytes"]


def test_the_fixtures_cover_what_the_planner_varies():
    seen = {(a["-fa"], a["-np"] != "1", a["-ctk"] != "f16", a["-m"].split("-")[0]) for a, _ in CPU_RUNS}
    assert {fa for fa, *_ in seen} == {"on", "off"} and {np for _, np, *_ in seen} == {True, False}
    assert {q for *_, q, _ in seen} == {True, False} and {arch for *_, arch in seen} == {
        "llama",
        "qwen2",
        "qwen3",
        "gemma2",
        "gemma3",
    }
    assert len(CPU_RUNS) >= 20 and len(SPLIT_RUNS) >= 12 and len(CBUF_RUNS) - len(SPLIT_RUNS) >= 8


# --- older builds' real CUDA logs --------------------------------------------------------

OLDER = DATA["older_builds"]
REPRODUCED = runs(DATA["reproduction_fixture"])


@pytest.mark.parametrize("entry", OLDER, ids=lambda e: e["fixture"])
def test_older_cuda_logs_are_reproduced_by_an_rpc_split_of_their_era(entry):
    """The numbers are read back from the real log, then from the reproduction on this host."""
    log = fixture_body(entry["fixture"])
    assert float(re.search(r"CUDA0 compute buffer size =\s+([\d.]+) MiB", log)[1]) == entry["compute_mib"]
    assert float(re.search(r"CUDA_Host compute buffer size =\s+([\d.]+) MiB", log)[1]) == entry["host_mib"]
    args, sizes = REPRODUCED[entry["reproduced"]["run"] - 1]
    assert (int(args["-c"]), int(args["-ub"]), args["-fa"] == "1") == (
        entry["n_ctx"],
        entry["n_ubatch"],
        entry["flash_attn"],
    )
    assert sizes == {"RPC": entry["compute_mib"], "CPU": entry["host_mib"]}


@pytest.mark.parametrize("entry", [e for e in OLDER if "replay" in e], ids=lambda e: e["fixture"])
def test_older_llama_family_logs_by_the_replay(entry):
    """One KV stream each (the R1 log's 4 slots share one unified cache, as builds of its time did)."""
    knobs = dict(entry["replay"])
    g = worst_case_graph(
        shape_from_config(entry["shape"]),
        entry["n_ctx"],
        entry["n_ubatch"],
        entry["flash_attn"],
        n_outputs=knobs.pop("n_outputs"),
    )
    assert mib(replay(dataclasses.replace(g, **knobs))) == f"{entry['compute_mib']:.2f}"


def test_kv_buffer_of_a_real_v100_load_log():
    from playbooks.plan.kv_cache import llamacpp_kv_bytes

    log = fixture_body("llamacpp-load-v100-pcie-16gb-full-offload-b4916.log")
    kv = float(re.search(r"CUDA0 KV buffer size =\s+([\d.]+) MiB", log).group(1)) * MIB
    pythia = shape_from_config(
        {  # Pythia 2.8B: 32 layers, 32 heads of 80, n_ctx 2048 in the log
            "model_type": "llama",
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "vocab_size": 50304,
        }
    )
    assert llamacpp_kv_bytes(pythia, 2048) == kv


# --- the allocator and the CUDA-only terms -----------------------------------------------


def test_allocator_best_fit_below_the_top_and_merging():
    a = _Allocator(32)
    x, y, z = a.alloc(100), a.alloc(64), a.alloc(64)
    assert (x, y, z) == (0, 128, 192) and a.peak == 256  # sizes rounded up to the alignment
    a.free(x, 100)
    a.free(z, 64)  # the top block grows back down to y's end
    assert a.alloc(96) == 0  # the freed hole below the top fits
    assert a.alloc(40) == 192 and a.peak == 256  # nothing fits below: the top
    a.free(0, 96)
    a.free(192, 64)
    a.free(128, 64)
    assert a.blocks == [[0, a.blocks[0][1]]]  # all merged back into one block
    b = _Allocator(32)
    p, _, q, _ = b.alloc(64), b.alloc(32), b.alloc(64), b.alloc(32)
    b.free(p, 64)
    b.free(q, 64)
    assert b.alloc(64) == q  # equal holes: the last one wins (ggml_dyn_tallocr_alloc's <=)


QWEN14 = shape_from_config(
    {
        "model_type": "qwen2",
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
    }
)


def test_cuda_differences():
    """What a CUDA0 buffer adds over the RPC stand-in, from ggml-cuda's source (no GPU here):
    128-byte alignment, and in each flash-attention node room for F16 copies of a non-F16 K/V
    (ggml_cuda_flash_attn_ext_get_alloc_size) - the whole cache, per layer, while it runs."""
    g = worst_case_graph(QWEN14, 16384, 512, True, n_seq=2, cache_k="q8_0", cache_v="q8_0")
    assert g.alignment == 128 and g.fa_extra == 2 * 1024 * 8192 * 2 * 2  # K and V, 2 streams of 8192 cells
    assert worst_case_graph(QWEN14, 16384, 512, True, n_seq=2).fa_extra == 0  # an f16 cache is used as it is
    assert worst_case_graph(QWEN14, 16384, 512, True, n_seq=2, cache_k="q8_0", device=False).fa_extra == 0
    long = worst_case_graph(QWEN14, 65536, 512, True, cache_k="q8_0", cache_v="q8_0")
    assert replay(long) - replay(dataclasses.replace(long, fa_extra=0)) > 100 * MIB  # it can decide the peak


def test_what_the_planner_gets_for_the_shipped_recipe_shapes():
    """Qwen2.5-14B, 2 x 8192 tokens, q8_0 cache, flash attention: the FFN (gate, up and their
    SwiGLU product: 3 x 27 MiB) with the inputs and three hidden-state slots below it; the old
    full-logits term (512 x 152064 x 4 = 297 MiB) is not reserved by the pinned llama-server."""
    b = llamacpp_compute_buffer_bytes(QWEN14, 16384, 512, True, n_seq=2, cache_k="q8_0", cache_v="q8_0")
    assert mib(b) == "119.09"
    assert llamacpp_compute_buffer_bytes(QWEN14, 16384, 512, True, n_seq=2, n_outputs=512) > 297 * MIB


# --- the real thing, rerun -------------------------------------------------------------

SLOW_RUNS = CPU_RUNS[::2]


def _load_args(args: dict) -> list[str]:
    """A fixture run's arguments without `-m NAME` (the model is written anew) and, in a cbuf
    fixture (`$ CBUF_TRACE=trace.txt cbuf ARGS`), without the program's name."""
    words = args["flags"][1:] if args["flags"][:1] == ["cbuf"] else args["flags"]
    i = words.index("-m")
    return words[:i] + words[i + 2 :]


@pytest.mark.slow
def test_pinned_llama_server_reserves_what_the_replay_says(tmp_path):
    """Every other run of the CPU fixture again, with the pinned llama-server and freshly
    written models (sparse files: no disk, no download)."""
    for args, sizes in SLOW_RUNS:
        model = sparse_gguf.write(tmp_path, sparse_gguf.shape_of(args["-m"]))
        lines = llamacpp_tools.reserve_compute_buffer(model, _load_args(args))
        real = next((float(m["mib"]) for line in lines if (m := BUFFER.search(line))), None)
        assert real == sizes["CPU"], (args["flags"], lines)
        assert mib(replay(graph_for(args, device=False))) == f"{real:.2f}"


# --- held-out shapes: drawn by a seed, committed, then loaded ----------------------------

HELD_OUT_YAML = ROOT / "tests/data/compute_buffers_held_out.yaml"
HELD_OUT = yaml.safe_load(HELD_OUT_YAML.read_text())["shapes"]
HELD_OUT_RUNS = runs(held_out_shapes.HELD_OUT_FIXTURE)
HELD_OUT_CBUF_RUNS = runs(held_out_shapes.HELD_OUT_CBUF_FIXTURE)
# Drawn shapes the pinned llama.cpp refuses to load (no real number, so no error to count).
# The generator's rule "hidden != heads x head_dim a third of the time" holds for llama,
# qwen3 and gemma, not for llama.cpp's qwen2, whose loader wants attn_q to be n_embd x n_embd
# (real Qwen2 models always have hidden = heads x head_dim). The planner gives it 149.00 MiB.
UNLOADABLE = {
    "qwen2-E4096-F17088-L3-H44-K4-D256-V49152.gguf": "tensor 'blk.0.attn_q.weight' has wrong shape",
}
# The replay's misses on the held-out loads (not equal to the 0.01 MiB llama.cpp prints), with
# why. None was observed: the list is kept so that a miss is named here, not hidden in a bound.
MISSES: dict[str, str] = {}
# The bounds observed on the held-out loads: every llama-server number equal to the print (the
# replay within its rounding, half of 0.01 MiB: llama.cpp prints %8.2f MiB), and every
# allocator total, CPU-only and the device buffer of a split, equal to the byte.
HELD_OUT_BOUND_MIB = 0.005
HELD_OUT_BOUND_BYTES = 0


def test_the_held_out_list_is_what_its_seed_draws():
    """Not edited by hand since it was drawn (and committed before any load)."""
    assert HELD_OUT_YAML.read_text() == held_out_shapes.render()
    assert len(HELD_OUT) == held_out_shapes.N == 12


def test_the_held_out_fixture_loaded_exactly_the_drawn_shapes():
    loaded = [(args["-m"], " ".join(_load_args(args))) for args, _ in HELD_OUT_RUNS]
    assert loaded == [(s["model"], s["args"]) for s in HELD_OUT]
    cbuf = [(args["-m"], _load_args(args)) for args, _ in HELD_OUT_CBUF_RUNS]
    ports = [int(a[a.index("--rpc") + 1].rsplit(":", 1)[1]) for _, a in cbuf[::2]]
    assert cbuf == [
        (s["model"], held_out_shapes.cbuf_args(s, port))
        for s, p in zip(HELD_OUT, ports, strict=True)
        for port in (p, None)
    ]
    for fixture, held in (
        (held_out_shapes.HELD_OUT_FIXTURE, HELD_OUT_RUNS),
        (held_out_shapes.HELD_OUT_CBUF_FIXTURE, HELD_OUT_CBUF_RUNS),
    ):
        refused = {args["-m"] for args, sizes in held if "CPU" not in sizes}
        assert refused == set(UNLOADABLE) and all(why in fixture_body(fixture) for why in UNLOADABLE.values())


def held_out_errors() -> list[tuple[str, float, float]]:
    """(run, planned MiB, real MiB) for every held-out shape llama.cpp loaded."""
    out = []
    for args, sizes in HELD_OUT_RUNS:
        if "CPU" not in sizes:
            continue
        shape = shape_from_config(sparse_gguf.shape_of(args["-m"]).hf_config())
        est = llamacpp_compute_buffer_bytes(
            shape,
            int(args["-c"]),
            int(args["-ub"]),
            args["-fa"] == "on",
            n_seq=int(args["-np"]),
            cache_k=args["-ctk"],
            cache_v=args["-ctv"],
            device=False,
        )
        out.append((run_id((args, sizes)), est / MIB, sizes["CPU"]))
    return out


def test_replay_on_the_held_out_shapes():
    """The planner's compute buffer against the held-out loads, reported apart from the pinned
    ones it was transcribed on: max and median |planned - real| printed (pytest -s), the
    misses named in MISSES, the rest within HELD_OUT_BOUND_MIB."""
    errors = held_out_errors()
    assert len(errors) == len(HELD_OUT) - len(UNLOADABLE) == 11
    abs_err = [abs(plan - real) for _, plan, real in errors]
    rel_err = [abs(plan - real) / real for _, plan, real in errors]
    print(
        f"held-out compute buffer, {len(errors)} loads: |planned - real| max {max(abs_err):.4f} MiB "
        f"({100 * max(rel_err):.3f}%), median {statistics.median(abs_err):.4f} MiB "
        f"({100 * statistics.median(rel_err):.3f}%); misses {len(MISSES)}; unloadable {len(UNLOADABLE)}"
    )
    missed = {run.split()[1] for run, plan, real in errors if f"{plan:.2f}" != f"{real:.2f}"}
    assert missed == set(MISSES), sorted(missed)
    kept = [e for (run, _, _), e in zip(errors, abs_err, strict=True) if run.split()[1] not in MISSES]
    assert max(kept) <= HELD_OUT_BOUND_MIB


def test_replay_on_the_held_out_shapes_to_the_byte():
    """The replay against the allocator's own totals of the held-out loads (cbuf): the CPU
    buffer of a CPU-only run and the device buffer (RPC0) of a full offload, which is what a
    GPU plan uses; max and median |planned - real| in bytes printed (pytest -s)."""
    errors = []
    for args, sizes in HELD_OUT_CBUF_RUNS:
        if "CPU" not in sizes:
            continue
        split = "--rpc" in args
        g = graph_for(args, device=split)
        if split:
            g = dataclasses.replace(g, alignment=32, fa_extra=0)
        errors.append(
            (args["-m"], "RPC0" if split else "CPU", replay(g) - sizes["RPC0 bytes" if split else "CPU bytes"])
        )
    assert len(errors) == 2 * (len(HELD_OUT) - len(UNLOADABLE)) == 22
    abs_err = [abs(e) for *_, e in errors]
    print(
        f"held-out allocator totals, {len(errors)} buffers (11 CPU-only, 11 device splits): |planned - real| "
        f"max {max(abs_err)} B, median {statistics.median(abs_err)} B"
    )
    assert {m for m, _, e in errors if e} == set(MISSES)
    assert max(abs(e) for m, _, e in errors if m not in MISSES) <= HELD_OUT_BOUND_BYTES


@pytest.mark.slow
def test_the_held_out_fixture_is_what_the_pinned_llama_server_reserves(tmp_path):
    """Every held-out load again, from freshly written models: the same lines (numbers,
    graph sizes, the loader's refusal) as the committed fixture."""
    body = fixture_body(held_out_shapes.HELD_OUT_FIXTURE)
    starts = list(RUN.finditer(body))
    for i, shape in enumerate(HELD_OUT):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(body)
        kept = body[starts[i].end() : end].strip("\n").splitlines()
        model = sparse_gguf.write(tmp_path, sparse_gguf.shape_of(shape["model"]))
        assert llamacpp_tools.reserve_compute_buffer(model, shape["args"].split()) == kept, shape
        model.unlink()


@pytest.mark.slow
def test_the_held_out_byte_fixture_is_what_cbuf_reserves(tmp_path):
    """Every held-out cbuf load again (the tool built from tests/tools/cbuf against the pinned
    build, seconds): the same lines and byte totals as the committed fixture, the RPC port aside."""
    from tests.testhosts import free_port

    cbuf = llamacpp_tools.build_cbuf(tmp_path / "cbuf-tool")
    body = fixture_body(held_out_shapes.HELD_OUT_CBUF_FIXTURE)
    starts = list(RUN.finditer(body))
    port = re.compile(r"127\.0\.0\.1:\d+")
    for i, (args, _) in enumerate(HELD_OUT_CBUF_RUNS):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(body)
        kept = body[starts[i].end() : end].strip("\n").splitlines()
        model = sparse_gguf.write(tmp_path, sparse_gguf.shape_of(args["-m"]))
        load = _load_args(args)
        if "--rpc" in load:
            load[load.index("--rpc") + 1] = f"127.0.0.1:{free_port()}"
        got = llamacpp_tools.cbuf_reserve(cbuf, model, load)
        assert [port.sub("P", x) for x in got] == [port.sub("P", x) for x in kept], load
