"""playbooks.facts.speculation.acceptance: speculative decoding's drafted and accepted tokens
summed from llama-server's per-response timings (the keys as the pinned server writes them,
tools/server/server-common.cpp:99-102)."""

import json
import math

from playbooks.facts.speculation import acceptance

# one response each, as the pinned llama-server writes `timings` (abridged): with a draft model
# (47 of 47 kept), and a server without speculation, where the keys are absent
DRAFTED = json.loads(
    '{"cache_n": 0, "prompt_n": 6, "predicted_n": 64, "predicted_per_second": 246.1,'
    ' "draft_n": 47, "draft_n_accepted": 47}'
)
PLAIN = json.loads('{"cache_n": 0, "prompt_n": 6, "predicted_n": 64, "predicted_per_second": 98.3}')


def test_sums_over_responses_and_divides():
    other = {"draft_n": 13, "draft_n_accepted": 1}
    assert acceptance([DRAFTED, other]) == {"drafted": 60, "accepted": 48, "rate": 0.8}


def test_nothing_drafted_has_no_rate_rather_than_zero():
    assert acceptance([PLAIN, PLAIN]) == {"drafted": 0, "accepted": 0, "rate": None}
    assert acceptance([]) == {"drafted": 0, "accepted": 0, "rate": None}


def test_a_response_that_drafted_nothing_still_counts_in_the_sum():
    assert acceptance([DRAFTED, PLAIN]) == {"drafted": 47, "accepted": 47, "rate": 1.0}


def test_all_rejected_is_a_rate_of_zero():
    assert acceptance([{"draft_n": 183, "draft_n_accepted": 0}]) == {"drafted": 183, "accepted": 0, "rate": 0.0}


def test_counts_read_from_json_floats():
    assert acceptance([{"draft_n": 30.0, "draft_n_accepted": 27.0}]) == {"drafted": 30, "accepted": 27, "rate": 0.9}


def test_garbage_adds_nothing_and_never_raises():
    junk = [
        None,
        "timings",
        {"draft_n": "12", "draft_n_accepted": None},
        {"draft_n": -4, "draft_n_accepted": True},
        {"draft_n": math.nan, "draft_n_accepted": math.inf},
        {"draft_n": 10, "draft_n_accepted": 5},
    ]
    got = acceptance(junk)
    assert got["drafted"] == 10
    assert got["accepted"] == 5 and got["rate"] == 0.5
