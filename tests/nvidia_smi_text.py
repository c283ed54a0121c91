"""nvidia-smi's human output, the table and ``-q``, read into the same GpuFacts the product
reads from NVML and the CSV query (playbooks/facts/gpu.py).

voltaforge never runs these forms on a host: it asks NVML (the probe) and ``--query-gpu``. But
the real V100 captures in tests/fixtures (AWS p3, DGX-1, SXM2 and PCIe boards on drivers 384
to 580, from ../shared/fixtures with their sources) are tables and ``-q`` dumps, because that is
what people paste. This reader turns them into facts so the preflight judge is held to real
cards rather than to facts shaped by hand.
"""

from __future__ import annotations

import re

from playbooks.facts import lines
from playbooks.facts.gpu import (
    ARCH_TO_CC,
    GpuFacts,
    GpuInfo,
    cell,
    cell_bool,
    cell_int,
    compute_capability_from_name,
    leading_number,
    nvidia_smi_failure,
)


def major_minor(value: str | None) -> tuple[int, int] | None:
    """ "12.2" (nvidia-smi's CUDA Version cell) as (12, 2)."""
    m = re.match(r"(\d+)\.(\d+)", cell(value) or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _normalise_reason(label: str) -> str:
    """nvidia-smi -q label -> the same id as the bitmask decoder ('SW Power Cap' -> 'sw_power_cap')."""
    return re.sub(r"[^a-z0-9]+", "_", label.strip().lower()).strip("_")


_TABLE_HEADER_DRIVER = re.compile(r"Driver Version:\s*(\S+)")
_TABLE_HEADER_CUDA = re.compile(r"CUDA Version:\s*(\d+\.\d+)")
_TABLE_ROW1 = re.compile(r"^\s*(\d+)\s+(.*?)\s+(On|Off|N/A)\s*$")
_TABLE_BUS = re.compile(r"([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])")
_TABLE_ROW2 = re.compile(
    r"^\s*(?P<fan>\S+)\s+(?P<temp>\d+C|N/A)\s+(?P<perf>P\d+|N/A)\s+"
    r"(?P<draw>\d+(?:\.\d+)?W|N/A)\s*/\s*(?P<cap>\d+(?:\.\d+)?W|N/A)\s*$"
)
_TABLE_MEM = re.compile(r"(\d+)MiB\s*/\s*(\d+)MiB")


def parse_nvidia_smi_table(text: str) -> GpuFacts:
    """Parse the default `nvidia-smi` table (R384 DGX-1 layout, 2020-2023 layout, R570+ layout).

    Reads the header (driver, max CUDA), then per GPU the first row (index, name,
    persistence, bus id) and the second (temperature, power draw/cap, memory used/total).
    Long names come truncated ('Tesla V100-SXM2...'); the compute capability is inferred from
    the name. A table that ends inside the GPU section sets truncated=True.
    """
    failure = nvidia_smi_failure(text)
    if failure is not None:
        return failure
    driver = cuda = None
    gpus: list[dict] = []
    state = "header"  # header -> gpus -> done
    closed = True
    for line in lines(text):
        stripped = line.strip()
        if state == "header":
            if driver is None and (m := _TABLE_HEADER_DRIVER.search(line)):
                driver = m.group(1)
                if c := _TABLE_HEADER_CUDA.search(line):
                    cuda = major_minor(c.group(1))
            if stripped.startswith("|=") and driver is not None:
                state = "gpus"
            continue
        if state == "done":
            break
        if stripped.startswith("+"):
            closed = True
            continue
        if not stripped.startswith("|") or "Processes:" in stripped:
            state = "done"
            continue
        cells = stripped.strip("|").split("|")
        if (m := _TABLE_ROW1.match(cells[0])) and len(cells) >= 2:
            bus = _TABLE_BUS.search(cells[1])
            name = m.group(2).strip()
            gpus.append(
                {
                    "index": int(m.group(1)),
                    "name": name[:-3].rstrip() if name.endswith("...") else name,
                    "name_truncated": name.endswith("..."),
                    "persistence_mode": cell_bool(m.group(3)),
                    "pci_bus_id": bus.group(1) if bus else None,
                    "driver_version": driver,
                }
            )
            closed = False
            continue
        if gpus and (m := _TABLE_ROW2.match(cells[0])):
            gpu = gpus[-1]
            gpu["temperature_c"] = cell_int(m.group("temp"))
            gpu["power_draw_w"] = leading_number(m.group("draw"))
            gpu["power_limit_w"] = leading_number(m.group("cap"))
            if len(cells) >= 2 and (mem := _TABLE_MEM.search(cells[1])):
                used, total = int(mem.group(1)), int(mem.group(2))
                gpu.update(memory_used_mib=used, memory_total_mib=total, memory_free_mib=total - used)
    if driver is None:
        first = next((ln.strip() for ln in lines(text) if ln.strip()), "")
        return GpuFacts(available=False, source="nvidia-smi", reason=f"no nvidia-smi table header in output: {first}")
    infos = []
    for gpu in gpus:
        name = gpu["name"]
        infos.append(GpuInfo(compute_capability=compute_capability_from_name(name), **gpu))
    # A complete table closes every GPU block with a '+---' border line.
    truncated = bool(gpus) and not closed
    warnings = ("output ends inside the GPU section (truncated): more GPUs may exist",) if truncated else ()
    return GpuFacts(
        available=bool(infos),
        reason="" if infos else "nvidia-smi table lists no GPU",
        source="nvidia-smi",
        gpus=tuple(infos),
        driver_version=driver,
        cuda_driver_version=cuda,
        truncated=truncated,
        warnings=warnings,
    )


# --------------------------------------------------------------------------- nvidia-smi -q

_Q_GPU_HEADER = re.compile(r"^GPU\s+([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+\.[0-9A-Fa-f])\s*$")
_Q_KEY_VALUE = re.compile(r"^(?P<indent> *)(?P<key>[^:]*?[^:\s])\s*:\s?(?P<value>.*)$")
_REASON_SECTIONS = ("Clocks Event Reasons", "Clocks Throttle Reasons")


def _q_gpu(values: dict[tuple[str, ...], str], index: int, bus: str | None, driver: str | None) -> GpuInfo:
    def get(*paths: tuple[str, ...]) -> str | None:
        for path in paths:
            if path in values:
                return values[path]
        return None

    name = cell(get(("Product Name",)))
    arch = cell(get(("Product Architecture",)))
    cc = compute_capability_from_name(name) or ARCH_TO_CC.get((arch or "").lower())
    reasons: tuple[str, ...] | None = None
    for section in _REASON_SECTIONS:
        entries = [(p[1], v) for p, v in values.items() if len(p) == 2 and p[0] == section]
        if entries:
            reasons = tuple(_normalise_reason(k) for k, v in entries if v.strip().lower() == "active")
            break
    power = ("Power Readings", "GPU Power Readings")
    return GpuInfo(
        index=index,
        name=name,
        uuid=cell(get(("GPU UUID",))),
        pci_bus_id=bus or cell(get(("PCI", "Bus Id"))),
        compute_capability=cc,
        architecture=arch,
        memory_total_mib=cell_int(get(("FB Memory Usage", "Total"))),
        memory_used_mib=cell_int(get(("FB Memory Usage", "Used"))),
        memory_free_mib=cell_int(get(("FB Memory Usage", "Free"))),
        driver_version=driver,
        temperature_c=cell_int(get(("Temperature", "GPU Current Temp"))),
        power_draw_w=leading_number(
            get(*[(s, k) for s in power for k in ("Power Draw", "Instantaneous Power Draw", "Average Power Draw")])
        ),
        power_limit_w=leading_number(
            get(*[(s, k) for s in power for k in ("Enforced Power Limit", "Current Power Limit", "Power Limit")])
        ),
        power_min_limit_w=leading_number(get(*[(s, "Min Power Limit") for s in power])),
        power_max_limit_w=leading_number(get(*[(s, "Max Power Limit") for s in power])),
        sm_clock_mhz=cell_int(get(("Clocks", "SM"))),
        max_sm_clock_mhz=cell_int(get(("Max Clocks", "SM"))),
        mem_clock_mhz=cell_int(get(("Clocks", "Memory"))),
        max_mem_clock_mhz=cell_int(get(("Max Clocks", "Memory"))),
        persistence_mode=cell_bool(get(("Persistence Mode",))),
        pcie_gen=cell_int(get(("PCI", "GPU Link Info", "PCIe Generation", "Current"))),
        pcie_width=cell_int(get(("PCI", "GPU Link Info", "Link Width", "Current"))),
        clocks_event_reasons=reasons,
    )


def parse_nvidia_smi_q(text: str) -> GpuFacts:
    """Parse `nvidia-smi -q`: indentation-nested 'Key : Value' blocks, one per 'GPU <bus id>'.

    Knows both section names for throttling ('Clocks Throttle Reasons', renamed 'Clocks Event
    Reasons' in R535+) and lists the reasons that are 'Active'. Lines injected by a vGPU shim
    (HAMi's '[HAMI-core Msg(...)]') are skipped and reported in warnings. An excerpt with no
    'GPU <bus id>' line is read as one GPU with index 0.
    """
    failure = nvidia_smi_failure(text)
    if failure is not None:
        return failure
    top: dict[str, str] = {}
    blocks: list[tuple[str | None, dict[tuple[str, ...], str]]] = []
    stack: list[tuple[int, str]] = []
    warnings: list[str] = []
    for line in lines(text):
        if not line.strip() or line.strip().startswith("====="):
            continue
        if line.lstrip().startswith("["):
            what = "HAMi vGPU shim line" if "HAMI" in line.upper() else "foreign line"
            warnings.append(f"{what} in nvidia-smi -q output (skipped): {line.strip()}")
            continue
        if m := _Q_GPU_HEADER.match(line):
            blocks.append((m.group(1), {}))
            stack = []
            continue
        indent = len(line) - len(line.lstrip(" "))
        kv = _Q_KEY_VALUE.match(line)
        if indent == 0:
            if kv:
                top.setdefault(kv.group("key"), kv.group("value").strip())
            continue
        if not blocks:
            blocks.append((None, {}))
            warnings.append("no 'GPU <bus id>' line: read as an excerpt of one GPU")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if kv:
            path = tuple(name for _, name in stack) + (kv.group("key"),)
            blocks[-1][1].setdefault(path, kv.group("value").strip())
        else:
            stack.append((indent, line.strip()))
    driver = cell(top.get("Driver Version"))
    gpus = tuple(_q_gpu(values, i, bus, driver) for i, (bus, values) in enumerate(blocks))
    return GpuFacts(
        available=bool(gpus),
        reason="" if gpus else "no GPU section in nvidia-smi -q output",
        source="nvidia-smi",
        gpus=gpus,
        driver_version=driver,
        cuda_driver_version=major_minor(top.get("CUDA Version")),
        warnings=tuple(warnings),
    )
