"""Which models of a set can be resident together (issue 55).

llama-server without a model is a router: it starts one child llama-server per model on demand
and, past ``--models-max`` children, stops the least recently used. It counts models, not
memory: with the count too high a second child runs out of memory and every request for that
model fails (llama.cpp PR #25326, issue #23668). This module turns each member's own plan into
what it holds alone and finds the count for which the count bound implies the memory bound:
the largest k such that the k largest members fit together beside the router's own share.
Any k members then fit, whichever the requests load. Pure: bytes in, bytes and counts out.

What a member holds: its plan's bytes on the card that decides (``Option.vram_bytes``: the
weights, KV cache and compute buffers, its own CUDA context and the margin; a split's worst
card); on a CPU the child's process base too (config/model_set.member_of). A set on several
cards is judged with every member's worst card on one card: exact for one card, conservative
for several.

A sleeping child (``--sleep-idle-seconds``) still counts toward ``--models-max`` and, on a GPU,
keeps its CUDA context; k children at their full size bound any mix of sleeping and awake ones.

The router's own share (``parent``): on a GPU one CUDA context per card (some builds have
initialised one in the parent, llama.cpp #23120, #20582; counted, not measured at our pin);
on a CPU its resident memory without a model (the figure beside the engine that runs routers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from playbooks.plan.gpus import mem_text


@dataclass(frozen=True)
class Member:
    """One model of a set: its served name, its recipe and quant, and what it holds alone
    (``held``, bytes) with the parts that make it up (name -> bytes)."""

    name: str
    recipe: str
    quant: str
    held: int
    parts: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Residency:
    """A set's members against the memory the router's children share (``capacity``, bytes,
    of which ``parent`` is the router's own)."""

    members: tuple[Member, ...]
    capacity: int
    parent: int

    @property
    def room(self) -> int:
        """What the children share: the capacity less the router's own share."""
        return self.capacity - self.parent

    @property
    def too_large(self) -> tuple[Member, ...]:
        """Members that do not fit even alone: the set is refused while one is in it."""
        return tuple(m for m in self.members if m.held > self.room)

    @property
    def largest_first(self) -> tuple[Member, ...]:
        return tuple(sorted(self.members, key=lambda m: (-m.held, m.name)))

    @property
    def models_max(self) -> int:
        """The largest k for which the k largest members fit together (0: one does not fit
        alone). ``--models-max`` at this count keeps every mix of resident children in memory."""
        return _prefix_fit(self.largest_first, self.room)

    @property
    def most_together(self) -> int:
        """The most members that can be resident at once at all: the smallest ones."""
        return _prefix_fit(tuple(reversed(self.largest_first)), self.room)

    @property
    def peak(self) -> int:
        """What the k = models_max largest hold with the router: the most a set ever holds."""
        return self.parent + sum(m.held for m in self.largest_first[: self.models_max])

    def grouping(self) -> str | None:
        """Where the count bound wastes (more of the small ones could be resident than the
        largest allow), what taking the largest out of the set would give; None where it does
        not waste."""
        k = self.models_max
        if not k or self.most_together <= k:
            return None
        order = self.largest_first
        for j in range(1, len(order)):
            rest = Residency(order[j:], self.capacity, self.parent)
            if rest.models_max == len(rest.members):
                out = ", ".join(m.name for m in order[:j])
                return (
                    f"--models-max {k} is set by the largest; up to {self.most_together} of the smallest fit "
                    f"together: with {out} served apart (a set of its own on other cards), the other "
                    f"{len(rest.members)} are all resident at once"
                )
        return None


def _prefix_fit(order: Sequence[Member], room: int) -> int:
    """How many of ``order``'s first members fit together in ``room``."""
    used = 0
    for n, m in enumerate(order):
        used += m.held
        if used > room:
            return n
    return len(order)


def refusal(r: Residency, where: str) -> str | None:
    """The one line that refuses the set (None: every member fits alone)."""
    big = r.too_large
    if not big:
        return None
    what = "; ".join(
        f"{m.name} ({m.recipe}, {m.quant}) holds {mem_text(m.held)} alone ("
        + ", ".join(f"{part} {mem_text(b)}" for part, b in m.parts)
        + ")"
        for m in big
    )
    shared = f"the {mem_text(r.room)} the set's children share on {where}"
    return f"{what}: more than {shared} (beside the router's {mem_text(r.parent)})"
