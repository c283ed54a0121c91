"""Small shared helpers for tests (no fixtures here: see conftest.py)."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parent.parent


def fixture_body(name: str) -> str:
    """A captured output without its '# source/# what' header (everything after '# ---')."""
    text = (FIXTURES / name).read_text()
    head, sep, body = text.partition("\n# ---\n")
    return body if sep else text
