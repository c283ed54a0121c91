"""A long reason cut for a one-line column or a summary: at a word, never inside one, with an
ellipsis saying something was left out (the whole text goes to the log)."""

from __future__ import annotations

ELLIPSIS = "…"


def clip(text: str, limit: int) -> str:
    """``text`` whole when it fits in ``limit`` characters, else its words that fit and "…"
    (a single word longer than the limit is cut, as nothing else would show any of it)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    room = max(limit - len(ELLIPSIS), 1)
    cut = text[: room + 1].rsplit(" ", 1)[0] if " " in text[: room + 1] else text[:room]
    return cut[:room].rstrip(" ,;:(") + ELLIPSIS
