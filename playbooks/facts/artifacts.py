"""Facts about model artifacts on a host: a file's size and mtime (the cheap identity a
manifest is checked against), and the outputs of the two verification tools, each a command
and a pure parser."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from playbooks.facts import last_json_line, lines

#: the check script pushed next to the model and run by the venv's python
GGUF_CHECK_PATH = Path(__file__).resolve().parent / "probes" / "gguf_check.py"
#: the download script run by the venv's python (huggingface_hub)
HUB_FETCH_PATH = Path(__file__).resolve().parent / "probes" / "hub_fetch.py"


def stat_size_mtime_command(path: str) -> str:
    return f"stat -c '%s %Y' -- {shlex.quote(path)} 2>/dev/null || true"


def parse_stat_size_mtime(output: str) -> tuple[int, int] | None:
    parts = output.split()
    if len(parts) == 2 and all(p.isdigit() for p in parts):
        return int(parts[0]), int(parts[1])
    return None


def parse_gguf_check(output: str) -> dict[str, Any]:
    """The check script's one JSON line (the last line starting with '{'); garbage becomes an
    error value, never an exception."""
    data = last_json_line(output, "voltaforge-gguf-check")
    if data is not None:
        return data
    first = next(iter(lines(output)), "")
    return {"error": f"the check printed no result: {first[:200]}" if first else "the check printed nothing"}


_KLD = {
    "mean_kld": re.compile(r"^Mean\s+KLD:\s+(\S+)"),
    "max_kld": re.compile(r"^Maximum KLD:\s+(\S+)"),
    "same_top_p": re.compile(r"^Same top p:\s+(\S+)\s*±"),
    "ppl_q": re.compile(r"^Mean PPL\(Q\)\s+:\s+(\S+)"),
    "ppl_base": re.compile(r"^Mean PPL\(base\)\s+:\s+(\S+)"),
}


def parse_kld(output: str) -> dict[str, float] | None:
    """`llama-perplexity --kl-divergence`'s statistics: mean and max KLD, the share of tokens
    whose most likely token is the same as the base's (percent), both perplexities. None when
    the run printed no KLD statistics."""
    found: dict[str, float] = {}
    for line in lines(output):
        for key, rx in _KLD.items():
            m = rx.match(line.strip())
            if m and key not in found:
                try:
                    found[key] = float(m.group(1))
                except ValueError:
                    found[key] = float("nan")
    return found if "mean_kld" in found and "same_top_p" in found else None


def parse_hub_fetch(output: str) -> dict[str, Any]:
    """The download script's one JSON line; anything else is an error value."""
    data = last_json_line(output, "voltaforge-hub-fetch")
    if data is not None:
        return data
    first = next(iter(lines(output)), "")
    return {"error": "other", "message": f"the download printed no result: {first[:200]}" if first else "no output"}
