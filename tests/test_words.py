"""playbooks/words.clip: a reason cut at a word with an ellipsis, never inside one (issue 52:
"nothing was ch" in a roll's summary)."""

import pytest

from playbooks.words import clip

ROLL = (
    "the roll stopped at local-18100 (HAProxy's runtime API at /opt/vf/deploy/voltaforge-lb/admin.sock did "
    "not answer (ConnectionRefusedError: [Errno 111] Connection refused); nothing was changed)"
)


@pytest.mark.parametrize("limit", [20, 60, 100, 160, 171])
def test_a_cut_ends_at_a_word_with_an_ellipsis(limit):
    out = clip(ROLL, limit)
    assert len(out) <= limit and out.endswith("…")
    kept = out.removesuffix("…").rstrip(" ,;:(")
    assert ROLL.startswith(kept) and ROLL[len(kept)] in " ,;:()", out  # the next character ends a word


def test_what_fits_is_kept_whole_and_spaces_collapse():
    assert clip(ROLL, len(ROLL)) == ROLL
    assert clip("a\n  b", 10) == "a b"


def test_one_word_longer_than_the_limit_is_cut_inside_it():
    assert clip("x" * 50, 10) == "x" * 9 + "…"
