"""What each process holds on the host's cards, as nvidia-smi says it: one read-only command
(exit 0 whatever the host has; no nvidia-smi, no card: no output) and a pure parser.

``nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv`` prints a header
(``pid, process_name, used_gpu_memory [MiB]``) and one line per process per card that holds a
CUDA context (``52114, /usr/bin/python3, 6294 MiB``); a process on two cards is two lines, and
a value the driver cannot give is ``[N/A]`` (or ``[Not Supported]``). The pid is the host's: a
child in a container's pid namespace would not match (voltaforge runs its servers on the host).
The parser is held to captures transcribed from public pages (tests/fixtures/, each says its
source); no card here has run it.
"""

from __future__ import annotations

#: the per-process query (header and units kept: the parser reads the unit it is given)
COMPUTE_APPS_COMMAND = (
    "command -v nvidia-smi >/dev/null 2>&1 && "
    "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv 2>/dev/null; true"
)

#: nvidia-smi's units (facts sit below the plan: its MIB is not imported here)
MIB = 1024 * 1024
_UNITS = {"MiB": MIB, "GiB": 1024 * MIB, "KiB": 1024, "B": 1}


def parse_compute_apps(text: str) -> dict[int, int]:
    """Each process's memory on the cards, in bytes, summed over the cards it holds; a line
    without a pid or a readable figure (the header, ``[N/A]``, garbage) counts for nothing.
    The process name may hold commas: the pid is the first field, the memory the last."""
    held: dict[int, int] = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 2 or not fields[0].isdigit():
            continue
        words = fields[-1].split()
        if not words or not words[0].isdigit():
            continue
        # `--format=csv` writes the unit; `nounits` would not: MiB, as the header says
        unit = _UNITS.get(words[1]) if len(words) > 1 else MIB
        if unit is None:
            continue
        pid = int(fields[0])
        held[pid] = held.get(pid, 0) + int(words[0]) * unit
    return held
