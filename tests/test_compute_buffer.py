"""llama.cpp's compute buffer: voltaforge's replay of ggml-alloc against real loads.

The replay (playbooks/plan/compute_buffer.py) has no fitted term, so it is held to equality:
every real number below must come out to the 0.01 MiB llama.cpp prints.
- pinned ref (0c1e570): a real llama-server's CPU-only loads of generated models (fixture;
  the slow test reruns half of them), and the device buffer of a full offload split (an
  in-process RPC device standing in for CUDA) with the allocator's byte totals (fixture);
- older builds' real CUDA logs: reproduced exactly by a llama.cpp of their era with the same
  RPC split (so the split is a faithful stand-in), and for the llama-family ones by the replay
  with the settings those front-ends used.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import signal
import subprocess

import pytest
import yaml

from playbooks.plan.compute_buffer import Graph, _Allocator, replay, worst_case_graph
from playbooks.plan.gpus import MIB
from playbooks.plan.model_config import shape_from_config
from playbooks.plan.planner import llamacpp_compute_buffer_bytes
from tests import llamacpp_tools, sparse_gguf
from tests.helpers import ROOT, fixture_body

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


@pytest.mark.slow
def test_pinned_llama_server_reserves_what_the_replay_says(tmp_path):
    """Every other run of the CPU fixture again, with the pinned llama-server and freshly
    written models (sparse files: no disk, no download)."""
    server = llamacpp_tools.llama_server()
    for args, sizes in SLOW_RUNS:
        model = sparse_gguf.write(tmp_path, sparse_gguf.shape_of(args["-m"]))
        cmd = [
            str(server),
            *args["flags"],
            "--fit",
            "off",
            "-t",
            "1",
            "--host",
            "127.0.0.1",
            "--port",
            str(30000 + random.randrange(20000)),
            "-lv",
            "4",
        ]
        cmd[cmd.index("-m") + 1] = str(model)
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        real = None
        try:
            for line in p.stdout:
                if m := BUFFER.search(line):
                    real = float(m["mib"])
                if "graph: nodes" in line or "failed" in line:
                    break
        finally:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=30)
        assert real == sizes["CPU"], (args["flags"], real)
        assert mib(replay(graph_for(args, device=False))) == f"{real:.2f}"
