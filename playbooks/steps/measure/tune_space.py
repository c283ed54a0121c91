"""`invoke tune`'s search space (pure): the served configurations worth measuring, what the
physics and the card rule out (and how many each rule removed), and the order to try the rest.

The space is the product of the levers a recipe leaves open: the GGUF quant, the KV cache
types, flash attention, the slots (``--parallel``), the physical batch (``-ub``) and the
speculative decoding type. Before anything runs, each candidate is planned (the same planner
as `invoke plan`) and dropped, with its reason counted, when:

- a quantized V cache runs without flash attention (llama.cpp refuses it at load);
- on a CUDA card the K/V pair has no flash-attention kernel in a default build (the pinned
  llama.cpp's ggml-cuda/fattn.cu compiles f16/f16, q4_0/q4_0, q8_0/q4_0, q8_0/q8_0 and
  bf16/bf16 without GGML_CUDA_FA_ALL_QUANTS), or asks for bf16 on a card without BF16 (Volta);
- the quant is below the quality floor (bits per weight);
- the backend cannot batch there (ExLlamaV2 on Volta runs one sequence: slots are no lever);
- it does not fit the card at the context asked for (the plan's VRAM budget);
- it is the same configuration as another (a duplicate from the lists given).

The survivors are ordered by predicted speed for the objective (the single-stream roofline;
for the aggregate, plan/aggregate.py's ceiling at the candidate's slots: one decode step reads
the weights once for every stream, and each stream's own KV cache), fastest first, so a short
budget measures the promising ones. Speculation's
gain is not predicted: its acceptance is measured, never assumed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Literal

from playbooks.config.planning import draft_from_recipe, serving_from_recipe
from playbooks.config.recipe import LoadedRecipe
from playbooks.plan.aggregate import aggregate_tok_s
from playbooks.plan.engines import engine
from playbooks.plan.evaluate import evaluate
from playbooks.plan.gpus import get_gpu
from playbooks.plan.refusals import bf16_refusal
from playbooks.plan.serving import Option

Objective = Literal["single", "aggregate", "latency"]
OBJECTIVES: tuple[Objective, ...] = ("single", "aggregate", "latency")

#: K/V pairs with a flash-attention kernel in a default CUDA build at the pinned ref
FA_CUDA_PAIRS = frozenset({("f16", "f16"), ("q4_0", "q4_0"), ("q8_0", "q4_0"), ("q8_0", "q8_0"), ("bf16", "bf16")})
#: the physical batch llama.cpp and the planner assume when nothing is said
DEFAULT_UBATCH = 512


@dataclass(frozen=True, order=True)
class Candidate:
    """One served configuration: every lever tune may move."""

    quant: str
    cache_k: str = "f16"
    cache_v: str = "f16"
    flash_attn: bool = True
    parallel: int = 1
    ubatch: int = DEFAULT_UBATCH
    spec_type: str | None = None  # llama-server --spec-type (None: no speculation)
    threads: int | None = None  # llama.cpp -t/-tb (None: its default, every core)

    def key(self) -> str:
        """A short stable name: the same configuration always gets the same one."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]

    def label(self) -> str:
        parts = [self.quant, f"kv {self.cache_k}/{self.cache_v}", "fa" if self.flash_attn else "no-fa"]
        parts += [f"np {self.parallel}", f"ub {self.ubatch}"]
        if self.spec_type:
            parts.append(f"spec {self.spec_type}")
        if self.threads:
            parts.append(f"t {self.threads}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Planned:
    """A candidate that survived the pruning, with the plan it was judged by."""

    candidate: Candidate
    option: Option
    predicted_tok_s: float
    single_tok_s: float = 0.0  # the single-stream roofline (the host's measured bandwidth on a CPU)


@dataclass(frozen=True)
class Space:
    survivors: list[Planned]
    pruned: dict[str, int]  # reason -> how many candidates it removed
    total: int

    def why_empty(self) -> str:
        """One line naming the constraint(s) that emptied the space."""
        if self.survivors:
            return ""
        worst = ", ".join(f"{n} by {why}" for why, n in sorted(self.pruned.items(), key=lambda kv: -kv[1]))
        return f"nothing left to measure: all {self.total} candidates were pruned ({worst})"


def base_candidate(loaded: LoadedRecipe) -> Candidate:
    """The recipe as it is, as a candidate (the search always includes it: the baseline)."""
    r = loaded.recipe
    return Candidate(
        quant=r.quant_name,
        cache_k=r.cache.k,
        cache_v=r.cache.v,
        flash_attn=r.flash_attn,
        parallel=r.parallel,
        ubatch=r.planner.n_ubatch,
        # a recipe with a draft and no type speculates with it (llama-server's own default)
        spec_type=r.spec_type or ("draft-simple" if r.draft is not None else None),
        threads=r.threads,
    )


def enumerate_space(
    base: Candidate,
    quants: Sequence[str] = (),
    caches: Sequence[tuple[str, str]] = (),
    flash_attn: Sequence[bool] = (),
    slots: Sequence[int] = (),
    ubatches: Sequence[int] = (),
    spec_types: Sequence[str | None] = (),
    threads: Sequence[int | None] = (),
) -> list[Candidate]:
    """Every combination of the levers given (a lever not given stays at the base's value),
    the base first, no duplicates."""
    dims = (
        quants or [base.quant],
        caches or [(base.cache_k, base.cache_v)],
        flash_attn or [base.flash_attn],
        slots or [base.parallel],
        ubatches or [base.ubatch],
        spec_types or [base.spec_type],
        threads or [base.threads],
    )
    out = [base]
    for q, (k, v), fa, np_, ub, spec, t in itertools.product(*dims):
        c = Candidate(q, k, v, fa, np_, ub, spec, t)
        if c not in out:
            out.append(c)
    return out


def rule_out(c: Candidate, gpu_name: str, backend: str, min_bpw: float | None, option: Option | None) -> str | None:
    """Why this candidate cannot or should not run (None: it can). Pure: the plan is given."""
    gpu = get_gpu(gpu_name)
    if c.cache_v not in ("f16", "f32", "bf16") and not c.flash_attn:
        return "a quantized V cache needs flash attention"
    if not gpu.is_cpu:
        if c.flash_attn and (c.cache_k, c.cache_v) not in FA_CUDA_PAIRS:
            return "no flash-attention kernel for this K/V pair in a default CUDA build"
        if why := bf16_refusal(gpu, c.quant, (c.cache_k, c.cache_v)):
            return why  # the planner's rule, so plan, render and tune say the same
        if c.parallel > 1 and not engine(backend).batches(gpu.compute_capability):
            return f"{engine(backend).label} on this GPU runs one sequence (slots are no lever)"
    if option is None:
        return "the planner has no such quant"
    if option.unfit_reason:
        return option.unfit_reason
    if min_bpw is not None and option.bpw < min_bpw:
        return f"below the quality floor of {min_bpw:g} bits per weight"
    if not option.fits:
        return f"does not fit {gpu.name}"
    return None


def plan_candidate(loaded: LoadedRecipe, c: Candidate, context: int) -> Option:
    """The planner's verdict on one candidate: the recipe's model and card, the candidate's
    serving settings, ``context`` tokens per slot."""
    s = replace(
        serving_from_recipe(loaded),
        context=context,
        parallel=c.parallel,
        cache_k=c.cache_k,
        cache_v=c.cache_v,
        flash_attn=c.flash_attn,
        n_ubatch=c.ubatch,
    )
    # the draft's weights and cache count only where the candidate loads it
    draft = draft_from_recipe(loaded) if c.spec_type == "draft-simple" else None
    return evaluate(loaded.shape, c.quant, get_gpu(loaded.recipe.gpu), s, draft)


def predicted(
    option: Option, c: Candidate, objective: Objective, bandwidth_gb_s: float | None = None, cached_tokens: int = 0
) -> float:
    """The ordering figure: the single-stream roofline (over ``bandwidth_gb_s`` when given: a
    CPU host's measured copy rate); for the aggregate, plan/aggregate.py's ceiling at the
    candidate's slots, each stream holding ``cached_tokens`` (the plan prints the same)."""
    single = (bandwidth_gb_s * 1e9 / option.streamed_bytes) if bandwidth_gb_s else option.roofline_tok_s
    if objective != "aggregate":
        return single
    bw = bandwidth_gb_s or single * option.streamed_bytes / 1e9
    return aggregate_tok_s(single, bw, option.kv_bytes_per_token, c.parallel, cached_tokens)


def prune(
    loaded: LoadedRecipe,
    candidates: Iterable[Candidate],
    objective: Objective = "single",
    min_ctx: int | None = None,
    min_bpw: float | None = None,
    bandwidth_gb_s: float | None = None,
) -> Space:
    """Plan every candidate, drop what cannot or should not run (counting why), order the rest
    by predicted speed, fastest first (ties: the simpler first, :func:`simplicity`)."""
    r = loaded.recipe
    context = max(r.context, min_ctx or 0)
    reasons: Counter[str] = Counter()
    kept: list[Planned] = []
    seen: set[Candidate] = set()
    total = 0
    for c in candidates:
        total += 1
        if c in seen:
            reasons["a duplicate"] += 1
            continue
        seen.add(c)
        try:
            option: Option | None = plan_candidate(loaded, c, context)
        except (KeyError, ValueError):
            option = None
        why = rule_out(c, r.gpu, r.backend, min_bpw, option)
        if c.spec_type == "draft-simple" and r.draft is None:
            why = "draft-simple needs a draft model in the recipe (draft: {model: ..., quant: ...})"
        if why or option is None:
            reasons[why or "the planner has no such quant"] += 1
            continue
        single = predicted(option, c, "single", bandwidth_gb_s)
        # the bench's streams hold their prompt and their answer by the end of a request
        cached = r.gate.prompt_tokens + r.gate.max_tokens
        kept.append(Planned(c, option, predicted(option, c, objective, bandwidth_gb_s, cached), single))
    kept.sort(key=lambda p: (-round(p.predicted_tok_s, 6), simplicity(p.candidate, p.option)))
    return Space(kept, dict(reasons), total)


def simplicity(c: Candidate, option: Option | None = None) -> tuple:
    """Smaller is simpler and safer, the order a tie is broken in: no speculation, an f16 cache,
    the larger quant (more bits per weight), the default batch, flash attention as llama.cpp
    defaults it (on), fewer slots."""
    bits = -(option.bpw if option else 0.0)
    return (
        c.spec_type is not None,
        (c.cache_k, c.cache_v) != ("f16", "f16"),
        round(bits, 3),
        c.ubatch != DEFAULT_UBATCH,
        not c.flash_attn,
        c.parallel,
        c.threads is not None,
        c.quant,
    )
