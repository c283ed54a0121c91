"""A started server's load log, read back and judged against the plan.

A llama-server that comes up is not yet a server that does what was planned: llama.cpp
leaves layers on the CPU without failing (`offloaded 39/41 layers to GPU`), its `--fit`
(on by default at the pinned ref) shrinks what was left unset, a build without sm_70 starts
and dies at the first kernel, and a PTX-only build starts slowly and runs slow generic code.
All of that is in the log and nowhere else, so `invoke deploy` reads it once the service is
up: `journalctl -o cat` of the unit's current invocation, or the process's log file.

The parser is pure and total (garbage gives an empty :class:`LoadLog`, never an exception);
:func:`judge_load` turns a parsed log and the plan's numbers into failure reasons.

At the pinned ref (0c1e570) llama's own load lines (offload, buffer sizes, build) are printed
only from `-lv 4` on: at the default verbosity the log says "model loaded" and nothing to
judge (tests/fixtures/thishost-llamacpp-0c1e570-llama-server-cpu-load-default-verbosity.log),
so a deploy that checks its load must start llama-server with `-lv 4`. At `-lv 5` the trial
loads of `--fit` show their buffers too and would be counted twice.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from playbooks.facts import lines

#: longest quote of a log line in a problem sentence
QUOTE_CHARS = 300


def journal_command(unit: str) -> str:
    """The unit's messages of its current run only (an earlier start's buffers would add up
    with this one's); the whole unit's journal of this boot when systemd names no run."""
    u = shlex.quote(unit)
    return (
        f"inv=$(systemctl show -p InvocationID --value {u} 2>/dev/null); "
        f'if [ -n "$inv" ]; then journalctl --no-pager -o cat _SYSTEMD_INVOCATION_ID="$inv"; '
        f"else journalctl --no-pager -o cat -b -u {u}; fi 2>/dev/null || true"
    )


@dataclass(frozen=True)
class LoadLog:
    """What a load log says. Buffer sizes are MiB per buffer name as llama.cpp prints it
    ('CUDA0', 'CUDA_Host', 'CPU', 'CPU_Mapped', 'ROCm0', 'RPC[host:port]'); a name printed
    twice is summed (an iSWA model's two KV caches, a draft model beside the target)."""

    offloaded: tuple[int, int] | None = None  # (N, M) of the last 'offloaded N/M layers to GPU'
    kv_mib: dict[str, float] = field(default_factory=dict)
    compute_mib: dict[str, float] = field(default_factory=dict)
    model_mib: dict[str, float] = field(default_factory=dict)
    problems: tuple[str, ...] = ()  # one sentence each, quoting the line
    build: str | None = None  # 'NUMBER (COMMIT)', e.g. '4916 (c6af2161b)'
    listening: str | None = None  # the last address the server said it listens on
    loaded: bool = False  # llama-server's 'model loaded' or TabbyAPI's 'Model successfully loaded'
    # tensor -> buffer type, from the 'buffer type overridden' lines (--n-cpu-moe, -ot); llama.cpp
    # prints them at debug verbosity (-lv 5) only, so a -lv 4 log has none
    overridden: dict[str, str] = field(default_factory=dict)

    @property
    def kv_total_mib(self) -> float:
        return round(sum(self.kv_mib.values()), 2)

    @property
    def model_device_mib(self) -> float:
        """The weights on accelerators (CUDA0, ...): what --n-cpu-moe and any offload change."""
        return round(sum(v for k, v in self.model_mib.items() if not is_host_buffer(k)), 2)

    @property
    def compute_device_mib(self) -> float:
        """The compute buffers on accelerators (the plan's compute term is the GPU's buffer;
        CUDA_Host is a small pinned staging buffer in RAM); a CPU-only run's CPU buffer."""
        device = {k: v for k, v in self.compute_mib.items() if not is_host_buffer(k)}
        return round(sum((device or self.compute_mib).values()), 2)


def is_host_buffer(name: str) -> bool:
    """A buffer in host memory: CPU, CPU_Mapped, CPU_REPACK, CUDA_Host, ROCm_Host..."""
    return name.startswith("CPU") or name.endswith("_Host")


_MIB = r"=\s*(\d+(?:\.\d+)?) MiB"
_OFFLOADED = re.compile(r"\boffloaded (\d+)/(\d+) layers to GPU")
_KV = re.compile(r"(\S+) KV buffer size " + _MIB)
_COMPUTE = re.compile(r"(\S+) compute buffer size " + _MIB)
# 'load_tensors:   CPU_Mapped model buffer size' (2024-); 'llm_load_tensors:  CPU buffer size' before
_MODEL = re.compile(r"(?:(\S+) model|load_tensors:\s+(\S+)) buffer size " + _MIB)
_BUILD = (
    re.compile(r"\b(?:build|version): (\d+) \(([0-9a-f]+|unknown)\)"),  # 'build: 4916 (c6af2161b) with cc'
    re.compile(
        r"\bbuild (\d+) \(([0-9a-f]+|unknown)\) with "
    ),  # pinned: 'common_params_print_info: build 1 (0c1e570) with'
    re.compile(r"\bversion: \S+ \(build (\d+), commit ([0-9a-f]+|unknown)\)"),  # pinned --version
    re.compile(r"\bbuild_info: b(\d+)-(\S+)"),
)
_LISTENING = (
    re.compile(r"\blistening on (\S+)"),  # 'server is listening on URL - starting...' / pinned 'listening on URL'
    re.compile(r"\bHTTP server is listening, hostname: ([^,\s]+), port: (\d+)"),  # 2024-25, before the load
    re.compile(r"\bUvicorn running on (\S+)"),  # TabbyAPI
)
_OVERRIDE = re.compile(r"\btensor (\S+) \(\d+ MiB \S+\) buffer type overridden to (\S+)")
_LOADED = re.compile(r"\bmodel loaded\b|\bModel successfully loaded\b")
_DEVICE = re.compile(r"\bDevice \d+: .*?, compute capability (\d+)\.(\d+)")
_ARCHS = re.compile(r"\bCUDA : ARCHS = (\d+(?:,\d+)*)")

# (pattern, why): the first that matches a line names its problem
_PROBLEMS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"no kernel image is available", re.I),
        "the CUDA binary has no kernel for this GPU's arch (built without it)",
    ),
    (
        re.compile(r"has no device code compatible with CUDA arch (\d+)"),
        "a CUDA kernel has no code for this GPU's arch (built without it)",
    ),
    (
        re.compile(r"\bnot compiled (?:with any CUDA arch|for\b)", re.I),
        "the build was not compiled for this GPU's arch",
    ),
    (
        # exllamav2 found no exllamav2_ext to import and compiles one (minutes): the build step
        # installs it into the venv, so a start that prints this has a venv the step did not make
        re.compile(r"Loading exllamav2_ext extension \(JIT\)|Building C\+\+/CUDA extension"),
        "the server was compiling exllamav2's extension at start: its venv has no exllamav2_ext "
        "built by `invoke build` (run it, then deploy again)",
    ),
    (
        re.compile(r"PTX JIT|JIT compil|PTX was compiled with an unsupported toolchain", re.I),
        "the driver JIT-compiles PTX for this GPU (a build without its real cubins)",
    ),
    (
        re.compile(r"cudaMalloc failed|out of memory|failed to allocate", re.I),
        "memory ran out",
    ),
    (
        re.compile(
            r"error loading model|failed to load model|exiting due to model loading error"
            r"|failed to (?:initialize|create) (?:the )?context",
            re.I,
        ),
        "the model failed to load",
    ),
    (re.compile(r"\bCUDA error\b"), "CUDA reported an error"),
    (re.compile(r"^\s*(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception): "), "the server raised an exception"),
)
#: 'failed to allocate' lines that are not a failure: llama.cpp falls back and goes on
_BENIGN = re.compile(r"pinned memory|async uploads|failed to allocate graph, reserving")
_TRACEBACK = re.compile(r"^\s*Traceback \(most recent call last\):")


def _quote(line: str) -> str:
    text = line.strip()
    return repr(text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "...")


def _add(sizes: dict[str, float], name: str, mib: str) -> None:
    sizes[name] = round(sizes.get(name, 0.0) + float(mib), 2)


def _arch_problems(device_ccs: dict[int, str], archs: list[int], archs_line: str) -> list[str]:
    """A device whose compute capability the build's CUDA arch list (system_info's ARCHS)
    does not cover. A cubin runs on its own major version from its minor on, so with no arch
    of the device's major at or below it, an older arch runs only as PTX the driver
    JIT-compiles at start (the cubins of another major cannot run); with no older arch at
    all, every kernel fails with "no kernel image is available". The list cannot tell a real
    arch from a virtual one: that the 70 is a cubin is the build step's cuobjdump check."""
    out = []
    for cc, device_line in sorted(device_ccs.items()):
        if any(a // 100 == cc // 100 and a <= cc for a in archs):
            continue
        where = f"{_quote(device_line)} with {_quote(archs_line)}"
        if any(a < cc for a in archs):
            out.append(
                f"the build has no code for compute capability {cc / 100:.1f}: the driver JIT-compiles "
                f"older PTX at every start (slow start, generic kernels): {where}"
            )
        else:
            out.append(
                f"the build was not compiled for compute capability {cc / 100:.1f}: every CUDA kernel "
                f"will fail with 'no kernel image is available': {where}"
            )
    return out


def parse_load_log(text: str) -> LoadLog:
    """Everything the load log of a llama-server (any 2023-2026 spelling: journald or
    timestamp prefixes, llm_load_tensors/load_tensors, llama_kv_cache_init/init/llama_kv_cache)
    or of TabbyAPI says about the load. Lines are matched anywhere, so prefixes do not matter."""
    offloaded = build = listening = None
    loaded = False
    kv: dict[str, float] = {}
    compute: dict[str, float] = {}
    model: dict[str, float] = {}
    overridden: dict[str, str] = {}
    problems: list[str] = []
    device_ccs: dict[int, str] = {}
    archs: list[int] = []
    archs_line = ""
    traceback_open = ""  # the traceback line of an exception whose last line has not come yet
    last_line = ""

    for line in lines(text if isinstance(text, str) else None):
        if not line.strip():
            continue
        last_line = line
        if m := _OFFLOADED.search(line):
            offloaded = (int(m.group(1)), int(m.group(2)))
        if m := _KV.search(line):
            _add(kv, m.group(1), m.group(2))
        if m := _COMPUTE.search(line):
            _add(compute, m.group(1), m.group(2))
        if m := _MODEL.search(line):
            _add(model, m.group(1) or m.group(2), m.group(3))
        if m := _OVERRIDE.search(line):
            overridden[m.group(1)] = m.group(2)
        if build is None:
            for rx in _BUILD:
                if m := rx.search(line):
                    build = f"{m.group(1)} ({m.group(2)})"
                    break
        for i, rx in enumerate(_LISTENING):
            if m := rx.search(line):
                listening = f"http://{m.group(1)}:{m.group(2)}" if i == 1 else m.group(1)
                break
        if _LOADED.search(line):
            loaded = True
        if m := _DEVICE.search(line):
            device_ccs.setdefault(int(m.group(1)) * 100 + int(m.group(2)) * 10, line)
        if m := _ARCHS.search(line):
            archs, archs_line = [int(a) for a in m.group(1).split(",")], line
        if _TRACEBACK.search(line):
            traceback_open = line
            continue
        for rx, why in _PROBLEMS:
            if rx.search(line) and not (why == "memory ran out" and _BENIGN.search(line)):
                problems.append(f"{why}: {_quote(line)}")
                if why == "the server raised an exception":
                    traceback_open = ""
                break

    if traceback_open:
        problems.append(f"the server raised an exception (its last line is missing): {_quote(last_line)}")
    if archs:
        problems.extend(_arch_problems(device_ccs, archs, archs_line))
    return LoadLog(
        offloaded=offloaded,
        kv_mib=kv,
        compute_mib=compute,
        model_mib=model,
        problems=tuple(dict.fromkeys(problems)),
        build=build,
        listening=listening,
        loaded=loaded,
        overridden=overridden,
    )


#: a split device's weights and KV cache against the plan: the plan is exact up to the MiB
#: the log rounds to, and one layer moved between two cards of a 41-layer split is 2.4%
SPLIT_TOLERANCE = 0.005
SPLIT_SLACK_MIB = 0.02


def device_buffers(sizes: dict[str, float]) -> list[tuple[str, float]]:
    """The device (not host) buffers of one kind, in the order the log printed them."""
    return [(k, v) for k, v in sizes.items() if not is_host_buffer(k)]


def judge_split(log: LoadLog, planned: tuple[tuple[float, float], ...]) -> list[str]:
    """Each device's weights and KV cache against its planned share (see judge_load)."""
    reasons = []
    for kind, sizes, column in (("weights", log.model_mib, 0), ("KV cache", log.kv_mib, 1)):
        got = device_buffers(sizes)
        if len(got) != len(planned):
            reasons.append(
                f"the plan splits the model over {len(planned)} devices, the log shows {kind} on {len(got)} "
                f"({_breakdown(sizes) or 'none'})"
            )
            continue
        for i, ((name, actual), want) in enumerate(zip(got, planned, strict=True)):
            mib = want[column]
            if abs(actual - mib) > max(mib * SPLIT_TOLERANCE, SPLIT_SLACK_MIB):
                reasons.append(
                    f"device {i} ({name}) holds {actual:.2f} MiB of {kind}, the plan {mib:.2f} MiB: the layers "
                    "were not split as planned"
                )
    return reasons


def _breakdown(sizes: dict[str, float]) -> str:
    return ", ".join(f"{name} {mib:.2f} MiB" for name, mib in sizes.items())


def judge_load(
    log: LoadLog,
    *,
    expect_layers: int | None,
    planned_kv_mib: float | None,
    planned_compute_mib: float | None,
    margin: float = 0.10,
    planned_device_model_mib: float | None = None,
    model_margin: float = 0.03,
    planned_devices: tuple[tuple[float, float], ...] = (),
) -> list[str]:
    """Why this load is not the planned one (empty: it is).

    `expect_layers`: the layers the plan puts on the GPU (any number >= M, like -ngl 99,
    means all); None for a CPU-only recipe, whose layers are not judged. `planned_*_mib`: the
    plan's KV cache (all buffers together) and compute buffer (the GPU's: see
    LoadLog.compute_device_mib); None skips the check. A check that was asked for and finds
    no line in the log fails: a server started without `-lv 4` cannot be verified, and a
    silent pass would hide the CPU offload it exists to catch.

    `planned_device_model_mib`: the weights the plan puts on the GPU (a MoE recipe with
    --n-cpu-moe N: all but token_embd and the first N layers' experts). The GPU's model
    buffers must hold that within `model_margin` (tensor alignment): less means more than the
    planned experts stayed in host RAM (or something else did), more means fewer did.

    `planned_devices`: a split over several devices, (weights MiB, KV MiB) of each device in
    llama.cpp's device order (RPC workers first, then local GPUs), held to the device buffers
    the log prints, in the order it prints them (judge_split).
    """
    reasons = list(log.problems)
    if planned_devices:
        reasons += judge_split(log, planned_devices)
    if expect_layers is not None:
        if log.offloaded is None:
            reasons.append(
                "the log has no 'offloaded N/M layers to GPU' line, so the offload cannot be checked "
                "(llama-server prints it from -lv 4 on)"
            )
        else:
            n, m = log.offloaded
            planned = min(expect_layers, m)
            if n < planned:
                reasons.append(
                    f"{n}/{m} layers offloaded to the GPU: {m - n} left on the CPU "
                    f"(the plan puts {'all' if planned == m else planned} on the GPU)"
                )
    if planned_device_model_mib is not None:
        actual = log.model_device_mib
        if not any(not is_host_buffer(k) for k in log.model_mib):
            reasons.append("the log has no GPU model buffer size line, so the weights on the GPU cannot be checked")
        elif actual < planned_device_model_mib * (1 - model_margin):
            reasons.append(
                f"the GPU holds {actual:.2f} MiB of weights, under the plan's {planned_device_model_mib:.2f} MiB: "
                f"more than the planned experts stayed in host memory ({_breakdown(log.model_mib)})"
            )
        elif actual > planned_device_model_mib * (1 + model_margin):
            reasons.append(
                f"the GPU holds {actual:.2f} MiB of weights, over the plan's {planned_device_model_mib:.2f} MiB: "
                f"fewer experts stayed in host memory than planned ({_breakdown(log.model_mib)})"
            )
    for kind, planned_mib, actual, sizes in (
        ("KV cache", planned_kv_mib, log.kv_total_mib, log.kv_mib),
        ("compute buffer", planned_compute_mib, log.compute_device_mib, log.compute_mib),
    ):
        if planned_mib is None:
            continue
        if not sizes:
            reasons.append(
                f"the log has no {kind} size line, so the {kind} cannot be checked against the plan "
                "(llama-server prints it from -lv 4 on)"
            )
        elif actual > planned_mib * (1 + margin):
            reasons.append(
                f"the {kind} is {actual:.2f} MiB, over the plan's {planned_mib:.2f} MiB by more than "
                f"{margin:.0%} ({_breakdown(sizes)})"
            )
    return reasons
