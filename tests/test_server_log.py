"""facts/server_log: a started server's load log, parsed and judged against the plan.

Every number asserted is the one printed in a real log (tests/fixtures, each file's header
names its source). SOURCES of the fixtures copied from /work/shared/fixtures for this module:
- llamacpp-load-v100-pcie-16gb-full-offload-b4343.log, -b4916.log: ggml-org/ci V100 runs
  (llama.cpp build 4343 / 4916), -ngl 99, 33/33 layers;
- llamacpp-load-partial-offload-39of41-journald.log: ollama/ollama#3711, journald prefixes;
- llamacpp-load-zero-offload-0of33.log: ggml-org/llama.cpp#6787;
- llamacpp-no-kernel-image-ggml-compute-forward.log: boneylizard/llama-cpp-python-cu128-gemma3#6;
- llamacpp-no-kernel-image-old-format-2023.log: ggml-org/llama.cpp#4215;
- llamacpp-no-device-code-for-arch-abort.log: nextcloud/llm2#52;
- llamacpp-not-compiled-for-arch-banner.log: ggml-org/llama.cpp#15589 (the abort line itself is
  truncated in the store; its text is taken from the issue, quoted in the fixture's header);
- llamacpp-oom-cudamalloc-model-load.log: ggml-org/llama.cpp#20431;
- llama-server-oom-compute-buffer-exit.log: ggml-org/llama.cpp#16725 (ROCm build);
- llama-server-startup-banner-recent.log: ggml-org/llama.cpp#22718;
- llama-server-startup-listening-slots-orin.log: lkk688/edgeAI jetson/jetson-llm_README.md;
- tabbyapi-startup-listening.log: theroyallab/tabbyAPI#356;
- tabbyapi-exllamav2-load-progress-then-paged-attn-assert.log: theroyallab/tabbyAPI#120;
- exllamav2-flashattention-ampere-only-error.log: theroyallab/tabbyAPI#135.
Captured on this machine at the pinned ref (0c1e570): thishost-llamacpp-0c1e570-llama-server-
cpu-load-lv4.log and -default-verbosity.log (one whole llama-server start each), and
thishost-llamacpp-0c1e570-compute-buffer-llama-server-cpu.log (34 CPU loads' compute lines).
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from playbooks.facts.server_log import (
    LoadLog,
    is_host_buffer,
    journal_command,
    judge_load,
    parse_load_log,
)
from tests.helpers import fixture_body

V100_B4916 = "llamacpp-load-v100-pcie-16gb-full-offload-b4916.log"
V100_B4343 = "llamacpp-load-v100-pcie-16gb-full-offload-b4343.log"
PARTIAL = "llamacpp-load-partial-offload-39of41-journald.log"
ZERO = "llamacpp-load-zero-offload-0of33.log"
PINNED_LV4 = "thishost-llamacpp-0c1e570-llama-server-cpu-load-lv4.log"
PINNED_DEFAULT = "thishost-llamacpp-0c1e570-llama-server-cpu-load-default-verbosity.log"
CPU_RUNS = "thishost-llamacpp-0c1e570-compute-buffer-llama-server-cpu.log"


def parsed(name: str) -> LoadLog:
    return parse_load_log(fixture_body(name))


def judge(log: LoadLog, expect_layers=None, kv=None, compute=None, **kw) -> list[str]:
    return judge_load(log, expect_layers=expect_layers, planned_kv_mib=kv, planned_compute_mib=compute, **kw)


# --- parsing: real V100 loads of two llama.cpp generations --------------------------------


@pytest.mark.parametrize("name, build", [(V100_B4343, "4343 (0006f5a74)"), (V100_B4916, "4916 (c6af2161b)")])
def test_v100_full_offload(name, build):
    log = parsed(name)
    assert log.offloaded == (33, 33)
    assert log.kv_mib == {"CUDA0": 640.0}
    assert log.compute_mib == {"CUDA0": 162.0, "CUDA_Host": 9.01}
    assert log.model_mib == {"CUDA0": 5049.71, "CPU_Mapped": 245.62}
    assert (log.kv_total_mib, log.compute_device_mib, round(sum(log.model_mib.values()), 2)) == (
        640.0,
        162.0,
        5295.33,
    )
    assert log.build == build
    assert log.problems == ()
    assert (log.listening, log.loaded) == (None, False)  # llama-cli: no server lines
    # the output buffer ('CUDA_Host  output buffer size = 0.19 MiB') is none of the three kinds
    assert 0.19 not in {*log.kv_mib.values(), *log.compute_mib.values(), *log.model_mib.values()}


def test_v100_full_offload_judged_good_against_its_plan():
    log = parsed(V100_B4916)
    assert judge(log, expect_layers=99, kv=640.0, compute=162.0) == []
    assert judge(log, expect_layers=33, kv=600.0, compute=150.0) == []  # within 10%


def test_kv_and_compute_over_the_plan():
    log = parsed(V100_B4916)
    assert judge(log, expect_layers=99, kv=580.0, compute=147.0) == [
        "the KV cache is 640.00 MiB, over the plan's 580.00 MiB by more than 10% (CUDA0 640.00 MiB)",
        "the compute buffer is 162.00 MiB, over the plan's 147.00 MiB by more than 10% "
        "(CUDA0 162.00 MiB, CUDA_Host 9.01 MiB)",
    ]
    # the margin is the caller's
    assert judge(log, kv=580.0, compute=147.0, margin=0.11) == []
    assert len(judge(log, kv=639.0, compute=161.0, margin=0.0)) == 2


# --- layers left on the CPU ---------------------------------------------------------------


def test_partial_offload_journald():
    log = parsed(PARTIAL)
    assert log.offloaded == (39, 41)
    # the old spelling without 'model': 'llm_load_tensors:        CPU buffer size = ...'
    assert log.model_mib == {"CPU": 70752.49, "CUDA0": 45460.59}
    assert log.kv_mib == {} and log.compute_mib == {}
    assert judge(log, expect_layers=99) == [
        "39/41 layers offloaded to the GPU: 2 left on the CPU (the plan puts all on the GPU)"
    ]
    assert judge(log, expect_layers=41) == judge(log, expect_layers=99)
    # a planned partial offload is not a failure; fewer than planned is
    assert judge(log, expect_layers=39) == []
    assert judge(log, expect_layers=30) == []
    log_short = dataclasses.replace(log, offloaded=(25, 41))
    assert judge(log_short, expect_layers=30) == [
        "25/41 layers offloaded to the GPU: 16 left on the CPU (the plan puts 30 on the GPU)"
    ]


def test_zero_offload():
    log = parsed(ZERO)
    assert log.offloaded == (0, 33)
    assert log.model_mib == {"CPU": 5459.93}
    assert judge(log, expect_layers=99) == [
        "0/33 layers offloaded to the GPU: 33 left on the CPU (the plan puts all on the GPU)"
    ]
    # a CPU-only recipe does not judge layers
    assert judge(log, expect_layers=None) == []


# --- the pinned ref, on this machine ------------------------------------------------------


def test_pinned_llama_server_cpu_load_lv4():
    log = parsed(PINNED_LV4)
    assert log == LoadLog(
        offloaded=None,
        kv_mib={"CPU": 4.0},
        compute_mib={"CPU": 8.14},
        model_mib={"CPU_Mapped": 7.63},
        problems=(),
        build="1 (0c1e570)",
        listening="http://127.0.0.1:18080",
        loaded=True,
    )
    # CPU-only: the CPU compute buffer is the one planned
    assert log.compute_device_mib == 8.14
    assert judge(log, expect_layers=None, kv=4.0, compute=8.14) == []
    assert judge(log, expect_layers=None, kv=3.0, compute=7.0) == [
        "the KV cache is 4.00 MiB, over the plan's 3.00 MiB by more than 10% (CPU 4.00 MiB)",
        "the compute buffer is 8.14 MiB, over the plan's 7.00 MiB by more than 10% (CPU 8.14 MiB)",
    ]


def test_pinned_default_verbosity_cannot_be_judged():
    """Without -lv 4 the pinned llama-server prints none of the load lines: asking for a
    check then fails instead of passing silently."""
    log = parsed(PINNED_DEFAULT)
    assert (log.loaded, log.listening, log.build, log.offloaded) == (True, "http://127.0.0.1:18080", None, None)
    assert log.kv_mib == log.compute_mib == log.model_mib == {}
    assert judge(log) == []
    reasons = judge(log, expect_layers=99, kv=4.0, compute=8.14)
    assert len(reasons) == 3
    assert all(r.endswith("(llama-server prints it from -lv 4 on)") for r in reasons)
    assert reasons[0].startswith("the log has no 'offloaded N/M layers to GPU' line")


def test_pinned_cpu_compute_buffers_one_run_at_a_time():
    """34 real CPU loads: each run's compute buffer, and the sum when the lines share a log."""
    body = fixture_body(CPU_RUNS)
    runs = re.split(r"^\$ .*\n", body, flags=re.MULTILINE)[1:]
    assert len(runs) == 34
    expected = [float(m) for m in re.findall(r"CPU compute buffer size =\s+([\d.]+) MiB", body)]
    assert [parse_load_log(run).compute_mib for run in runs] == [{"CPU": mib} for mib in expected]
    assert expected[:3] == [23.01, 8.14, 6.64]
    whole = parse_load_log(body)
    assert whole.compute_mib == {"CPU": 6457.82} == {"CPU": round(sum(expected), 2)}
    assert whole.problems == () and whole.offloaded is None


def test_buffers_of_one_name_add_up():
    """An iSWA model (Gemma) logs two KV caches on one device; the newer spellings too."""
    log = parse_load_log(
        "llama_kv_cache_unified:      CUDA0 KV buffer size =   512.00 MiB\n"
        "llama_kv_cache:      CUDA0 KV buffer size =    96.50 MiB\n"
        "llama_kv_cache:        CPU KV buffer size =     8.00 MiB\n"
        "sched_reserve:      CUDA0 compute buffer size =   300.01 MiB\n"
        "sched_reserve:  CUDA_Host compute buffer size =    20.02 MiB\n"
        "sched_reserve:        CPU compute buffer size =     1.00 MiB\n"
    )
    assert log.kv_mib == {"CUDA0": 608.5, "CPU": 8.0}
    assert log.kv_total_mib == 616.5
    assert log.compute_device_mib == 300.01 and round(sum(log.compute_mib.values()), 2) == 321.03


def test_host_buffers():
    assert [is_host_buffer(n) for n in ("CPU", "CPU_Mapped", "CPU_REPACK", "CUDA_Host", "CUDA0", "ROCm0")] == [
        True,
        True,
        True,
        True,
        False,
        False,
    ]
    assert is_host_buffer("RPC[127.0.0.1:50052]") is False


# --- arch, JIT, OOM, load failures --------------------------------------------------------


def test_no_kernel_image_2025():
    log = parsed("llamacpp-no-kernel-image-ggml-compute-forward.log")
    assert log.problems[0] == (
        "the CUDA binary has no kernel for this GPU's arch (built without it): "
        "'CUDA error: no kernel image is available for execution on the device'"
    )
    assert log.problems[1].startswith("CUDA reported an error: ")
    assert log.problems[1].endswith("ggml-cuda.cu:75: CUDA error'")
    assert len(log.problems) == 2
    assert judge(log) == list(log.problems)


def test_no_kernel_image_2023():
    log = parsed("llamacpp-no-kernel-image-old-format-2023.log")
    assert log.problems == (
        "the CUDA binary has no kernel for this GPU's arch (built without it): 'CUDA error 209 at "
        "/home/user/Documents/devops/llama.cpp/ggml-cuda.cu:6701: no kernel image is available for "
        "execution on the device'",
    )


def test_no_device_code_for_arch():
    log = parsed("llamacpp-no-device-code-for-arch-abort.log")
    assert len(log.problems) == 2
    assert log.problems[0].startswith("a CUDA kernel has no code for this GPU's arch (built without it): '")
    assert "has no device code compatible with CUDA arch 520. ggml-cuda.cu was compiled for: 520'" in log.problems[0]
    assert log.problems[1] == "CUDA reported an error: 'CUDA error: unspecified launch failure'"


def test_not_compiled_for_arch():
    # the banner alone (an A100 with a build for it) is fine...
    banner = fixture_body("llamacpp-not-compiled-for-arch-banner.log")
    assert parse_load_log(banner).problems == ()
    # ...the abort that followed it (text from the issue, see the fixture's header) is not
    abort = (
        "/root/llama.cpp/ggml/src/ggml-cuda/../ggml-cuda/common.cuh:112: "
        "ggml was not compiled with any CUDA arch <= 750"
    )
    assert parse_load_log(banner + abort + "\n").problems == (
        f"the build was not compiled for this GPU's arch: {abort!r}",
    )


def test_arch_list_against_the_device():
    """system_info's CUDA ARCHS against ggml_cuda_init's devices: the recent banner's build
    (750 and up) on its own 3090s is fine, on a V100 it has no kernel; a build of older PTX
    only would JIT."""
    banner = fixture_body("llama-server-startup-banner-recent.log")
    assert parse_load_log(banner).problems == ()
    assert parse_load_log(banner).build == "0 (unknown)"
    v100 = "  Device 0: Tesla V100-PCIE-16GB, compute capability 7.0, VMM: yes"  # from the b4916 fixture
    assert v100 in fixture_body(V100_B4916)
    (problem,) = parse_load_log(v100 + "\n" + banner).problems[-1:]
    assert problem.startswith(
        "the build was not compiled for compute capability 7.0: every CUDA kernel will fail with "
        f"'no kernel image is available': {v100.strip()!r} with 'system_info: n_threads = 128"
    )
    assert "ARCHS = 750,800,860,890,1200,1210" in problem
    assert len(parse_load_log(v100 + "\n" + banner).problems) == 1  # one per capability, not per device
    ptx = banner.replace("ARCHS = 750,", "ARCHS = 610,750,")
    (jit,) = parse_load_log(v100 + "\n" + ptx).problems
    assert jit.startswith("the build has no code for compute capability 7.0: the driver JIT-compiles older PTX")
    # the V100 logs' own builds (ARCHS = 700) are fine
    assert parsed(V100_B4343).problems == ()


def test_ptx_jit_error_line():
    # cudaGetErrorString of cudaErrorInvalidPtx / cudaErrorUnsupportedPtxVersion
    log = parse_load_log(
        "CUDA error: a PTX JIT compilation failed\n"
        "CUDA error: the provided PTX was compiled with an unsupported toolchain.\n"
    )
    assert [p.split(":")[0] for p in log.problems] == [
        "the driver JIT-compiles PTX for this GPU (a build without its real cubins)"
    ] * 2


def test_oom_at_model_load():
    log = parsed("llamacpp-oom-cudamalloc-model-load.log")
    assert log.problems == (
        "memory ran out: 'ggml_backend_cuda_buffer_type_alloc_buffer: allocating 144817.04 MiB on device 0: "
        "cudaMalloc failed: out of memory'",
        "memory ran out: 'alloc_tensor_range: failed to allocate CUDA0 buffer of size 151851674624'",
        "the model failed to load: 'llama_model_load: error loading model: unable to allocate CUDA0 buffer'",
    )
    assert log.loaded is False and log.offloaded is None


def test_oom_at_compute_reserve_then_exit():
    log = parsed("llama-server-oom-compute-buffer-exit.log")
    assert [p.split(":")[0] for p in log.problems] == ["memory ran out"] * 4 + ["the model failed to load"] * 3
    assert log.problems[-1] == "the model failed to load: 'main: exiting due to model loading error'"
    assert judge(log, expect_layers=None) == list(log.problems)


def test_benign_allocation_lines_are_not_problems():
    log = parse_load_log(
        "ggml_backend_cuda_host_buffer_type_alloc_buffer: "
        "failed to allocate 512.00 MiB of pinned memory: out of memory\n"
        "load_all_data: failed to allocate host buffer for async uploads for device CUDA0\n"
    )
    assert log.problems == ()


# --- server lines -------------------------------------------------------------------------


def test_listening_lines():
    orin = parsed("llama-server-startup-listening-slots-orin.log")
    assert orin.listening == "http://127.0.0.1:8080"
    assert orin.problems == ()
    # the 2024-25 line printed before the load, on its own
    early = parse_load_log("main: HTTP server is listening, hostname: 127.0.0.1, port: 18080, http threads: 5\n")
    assert early.listening == "http://127.0.0.1:18080" and early.loaded is False


def test_build_spellings():
    assert (
        parse_load_log("version: 0.5.0-dev (build 1, commit 0c1e570)\nbuilt with GNU 12.2.0\n").build == "1 (0c1e570)"
    )
    assert parse_load_log("version: 6123 (abcdef01)\n").build == "6123 (abcdef01)"


def test_tabbyapi():
    start = parsed("tabbyapi-startup-listening.log")
    assert (start.listening, start.loaded, start.problems) == ("http://0.0.0.0:5000", False, ())
    # tabbyAPI backends/exllamav2/model.py logs this once the model is up
    assert parse_load_log("2025-06-15 22:40:01.100 INFO:     Model successfully loaded.\n").loaded is True
    fa = parsed("exllamav2-flashattention-ampere-only-error.log")
    assert fa.problems == (
        "the server raised an exception: 'RuntimeError: FlashAttention only supports Ampere GPUs or newer.'",
    )
    cut = parsed("tabbyapi-exllamav2-load-progress-then-paged-attn-assert.log")
    assert cut.problems == (
        "the server raised an exception (its last line is missing): 'self.generator = ExLlamaV2DynamicGeneratorAsync('",
    )
    assert cut.loaded is False


# --- garbage and commands -----------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ["", "\x00\xff garbage \r\n\r", "offloaded x/y layers to GPU\nCUDA0 KV buffer size = lots MiB", None, b"bytes"],
)
def test_garbage_gives_an_empty_log(text):
    assert parse_load_log(text) == LoadLog()


def test_commands_are_read_only_and_quoted():
    cmd = journal_command("voltaforge-llama@a b.service")
    assert "journalctl --no-pager -o cat _SYSTEMD_INVOCATION_ID=" in cmd
    assert "'voltaforge-llama@a b.service'" in cmd


def test_a_start_that_compiles_exllamav2s_extension_is_named_as_the_cause():
    """TabbyAPI whose venv has no exllamav2_ext (the build step's) compiles it at start, for
    minutes, and the health wait ends first: the deploy step says why, from the log's own line
    (a lent H200's log ended with it), instead of a bare timeout."""
    log = (
        "INFO:     Using backend exllamav2\n"
        "Loading exllamav2_ext extension (JIT)...\n"
        "Building C++/CUDA extension \u2501\u2501\u2501\u2501 12% 0:01:53\n"
    )
    first, second = parse_load_log(log).problems  # each line quoted: the first is what _log_tail says
    why = "the server was compiling exllamav2's extension at start: its venv has no exllamav2_ext"
    assert first.startswith(why) and second.startswith(why)
    assert first.endswith("'Loading exllamav2_ext extension (JIT)...'")
