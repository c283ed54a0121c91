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
#: "kl_divergence: computing over 20 chunks, ..." (an info line, after a timestamp prefix)
_KLD_CHUNKS = re.compile(r"kl_divergence: computing over (\d+) chunks")
#: a chunk's row: its number, then five running "value ± uncertainty" columns over every token
#: so far: PPL(Q), ln(PPL(Q)/PPL(base)), KL divergence, Δp RMS (%), same top p (%)
_KLD_ROW = re.compile(r"^\s*(\d+)" + r"\s+(\S+)\s+±\s+\S+(?:\s*%)?" * 5 + r"\s*$")


def parse_kld(output: str) -> dict[str, float] | None:
    """`llama-perplexity --kl-divergence`'s statistics: mean and max KLD, the share of tokens
    whose most likely token is the same as the base's (percent), both perplexities. None when
    the run printed no KLD statistics.

    Where the closing statistics are missing but the row of the last chunk is there, the figures
    come from that row: each row prints the running PPL(Q), mean KLD and same-top share over all
    tokens so far, so the last chunk's row holds the same mean KLD (to 5 decimals, not 6) and
    same top p as the statistics (the maximum KLD and the base's PPL are then absent). Why: at
    the pin, llama.cpp's log is written by a thread of a logger it leaks on purpose
    (common/log.cpp, common_log_main), so lines still queued when main() returns are lost: cold
    test runs under load have lost exactly the statistics block, the output ending at a row.
    The row counts only when its number is the run's chunk count ("computing over N chunks"),
    so a run cut short is never read as finished."""
    found: dict[str, float] = {}
    chunks: int | None = None
    last: tuple[int, list[str]] | None = None
    for line in lines(output):
        if chunks is None and (c := _KLD_CHUNKS.search(line)):
            chunks = int(c.group(1))
        if r := _KLD_ROW.match(line):
            last = (int(r.group(1)), list(r.groups()[1:]))
        for key, rx in _KLD.items():
            m = rx.match(line.strip())
            if m and key not in found:
                found[key] = _float(m.group(1))
    if "mean_kld" in found and "same_top_p" in found:
        return found
    if chunks is not None and last is not None and last[0] == chunks:
        ppl_q, _ratio, mean_kld, _p_rms, same_top_p = last[1]
        return {"mean_kld": _float(mean_kld), "same_top_p": _float(same_top_p), "ppl_q": _float(ppl_q)}
    return None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")


def parse_hub_fetch(output: str) -> dict[str, Any]:
    """The download script's one JSON line; anything else is an error value."""
    data = last_json_line(output, "voltaforge-hub-fetch")
    if data is not None:
        return data
    first = next(iter(lines(output)), "")
    return {"error": "other", "message": f"the download printed no result: {first[:200]}" if first else "no output"}
