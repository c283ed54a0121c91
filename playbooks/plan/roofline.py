"""The bandwidth roofline (docs/knowledge.md, section 1): decode at small batch is bandwidth
bound, so one stream's tokens per second are at most bandwidth / bytes read per token."""

from __future__ import annotations


def roofline_tok_s(bandwidth_gb_s: float, bytes_per_token: float) -> float:
    """Upper bound on single-stream decode speed: every weight byte is read once per token."""
    return bandwidth_gb_s * 1e9 / bytes_per_token


def mbu(tok_s: float, bytes_per_token: float, bandwidth_gb_s: float) -> float:
    """Memory bandwidth utilisation: the fraction of peak bandwidth a measured speed uses."""
    return tok_s * bytes_per_token / (bandwidth_gb_s * 1e9)
