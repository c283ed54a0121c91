"""What a serving engine is, as the plan sees it: the interface each engine module fills
(plan/engine_llamacpp.py, plan/engine_exllamav2.py). The recipe names the engine (`backend:`); the
planner, the budget and the refusals ask it (:func:`playbooks.plan.engines.engine`,
:func:`playbooks.plan.engines.engine_of_quant`) instead of comparing its name.

Pure, like plan/: an engine's memory terms are its own arithmetic over the physics modules of
plan/ (kv_cache, compute_buffer, gguf_size, exl2_size, split, exl2_split), which know no
engine. Types of plan/serving are named for annotations only: serving imports the engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from playbooks.plan.gpus import MIB
from playbooks.plan.split import CPU_ALIGNMENT, CUDA_ALIGNMENT, Device

if TYPE_CHECKING:
    from playbooks.plan.gpus import Gpu
    from playbooks.plan.model_config import ModelShape
    from playbooks.plan.serving import DraftPlan, Serving
    from playbooks.plan.split import DeviceShare


class CacheFields(Protocol):
    @property
    def k(self) -> str: ...
    @property
    def v(self) -> str: ...


class RecipeFields(Protocol):
    """The recipe's settings an engine judges (config/recipe_schema.Recipe has them; plan/ lies
    below config/, so it names the fields, not the class)."""

    @property
    def quant(self) -> object: ...
    @property
    def cache(self) -> CacheFields: ...
    @property
    def flash_attn(self) -> bool: ...
    @property
    def spec_type(self) -> str | None: ...
    @property
    def draft(self) -> object | None: ...
    @property
    def threads(self) -> int | None: ...
    @property
    def n_cpu_moe(self) -> object | None: ...


@dataclass(frozen=True)
class SplitPlan:
    """One model over several devices as the engine places it: each device's share, why it
    cannot be served so ("": it can), and TabbyAPI's gpu_split where the engine renders one."""

    shares: tuple[DeviceShare, ...]
    refusal: str = ""
    gpu_split: tuple[float, ...] = ()


class Engine:
    """The plan's questions to a serving engine. ``name``: the recipe's `backend:` value;
    ``label``: how people name it; the flags say what it can serve at all."""

    name: str = ""
    label: str = ""
    #: the format of the weights it serves, as people name it (GGUF, EXL2)
    weights_format: str = ""
    #: a draft model beside the target (speculative decoding)
    takes_draft: bool = False
    #: layers on llama.cpp RPC workers
    takes_rpc: bool = False
    #: a MoE model planned expert by expert: its experts kept in host RAM (--n-cpu-moe), a token
    #: streaming its active experts only, the offloaded experts' device copy an estimate
    offloads_experts: bool = False
    #: its quants' rates are continuous (EXL2's bits per weight), placed on the quality curve
    #: rather than looked up as published types
    continuous_rate: bool = False

    #: the KV cache (K, V) a recipe of this engine gets where it names none, before the recipes'
    #: defaults file, whose cache is llama.cpp's; None: the defaults file's
    default_cache: tuple[str, str] | None = None

    # -- its server ----------------------------------------------------------------------------

    #: its server's name, as bench records and tune's measurements name it
    server: str = ""
    #: and as people name it
    server_label: str = ""
    #: the fields of a completion request that make it run to max_tokens, EOS ignored (the bench)
    ignore_eos: tuple[tuple[str, object], ...] = ()
    #: one server per host, not one per recipe (TabbyAPI's one unit): a host's layout places one
    #: recipe of this engine, as one instance (over all of its cards)
    one_server_per_host: bool = False
    #: its server is llama.cpp's build: the bench records which build, and runs llama-bench beside it
    serves_llamacpp_build: bool = False
    #: its server routes requests among several models by name, starting and stopping one child
    #: per model (a model set, plan/residency.py)
    routes_models: bool = False
    #: what one of its server processes holds on a CPU without a model (bytes): the router
    #: itself, and the base of each child beside the model's own terms
    process_cpu_bytes: int = 0
    #: where its server publishes Prometheus metrics (`invoke monitor` scrapes it); "" where it
    #: publishes none (TabbyAPI at our pin: the edge's per-backend counters and the GPU exporter
    #: cover it, docs/monitor.md)
    metrics_path: str = ""

    def batches(self, compute_capability: tuple[int, int]) -> bool:
        """Whether parallel slots batch on a GPU of this compute capability."""
        return True

    # -- quants ---------------------------------------------------------------------------------

    def owns_quant(self, quant: str) -> bool:
        raise NotImplementedError

    def quant_names(self) -> list[str]:
        raise NotImplementedError

    def parse_quant(self, text: str) -> str | None:
        """A --quant flag's text as this engine's quant name, None when it is not one of its
        names (raises VoltaforgeError when it is, but malformed)."""
        raise NotImplementedError

    def recipe_refusal(self, recipe: RecipeFields) -> str:
        """Why a recipe's settings are not this engine's to serve: its quant's form, its cache
        types, the options only another engine has ("": they are)."""
        return ""

    def known_quant(self, quant: str) -> bool:
        """Whether the planner knows ``quant`` (one of :meth:`quant_names`, or a rate it can plan)."""
        return quant in self.quant_names()

    def quant_refusal(self, shape: ModelShape, quant: str) -> str:
        """Why this engine cannot make ``quant`` of this model ("": it can)."""
        return ""

    def bpw(self, quant: str, weights_bytes: int, params: int) -> float:
        """Bits per weight of the quant, the quality measure the floor applies to."""
        return weights_bytes * 8 / params

    # -- memory ---------------------------------------------------------------------------------

    def weight_bytes(self, shape: ModelShape, quant: str, s: Serving) -> tuple[int, int, int]:
        """(file bytes, bytes on the GPU, bytes streamed per token)."""
        raise NotImplementedError

    def kv_bytes_per_token(self, shape: ModelShape, s: Serving) -> int:
        raise NotImplementedError

    def kv_and_compute(
        self, shape: ModelShape, s: Serving, ctx: int, gpu: Gpu, expert_copy: tuple[int, int, int] = (0, 0, 0)
    ) -> tuple[int, int]:
        """(KV cache, compute buffers) bytes at ``ctx`` tokens per slot."""
        raise NotImplementedError

    def draft_vram(self, draft: DraftPlan, s: Serving, ctx: int, gpu: Gpu) -> tuple[int, int, int]:
        """(weights on the GPU, KV cache, compute buffer) of a draft model beside the target;
        an engine without drafts counts none."""
        return 0, 0, 0

    # -- what it cannot serve -------------------------------------------------------------------

    def refusal(self, gpu: Gpu, shape: ModelShape | None, draft: DraftPlan | None) -> str:
        """Why it cannot serve on this target at all, memory aside ("": it can)."""
        return ""

    def split_refusal(self, shape: ModelShape, s: Serving) -> str:
        """Why it cannot split this model over the serving's devices ("": it can)."""
        return ""

    def plan_split(self, shape: ModelShape, quant: str, gpu: Gpu, s: Serving, ctx: int) -> SplitPlan:
        raise NotImplementedError

    def serving(self, s: Serving) -> Serving:
        """``s`` (another engine's serving settings) with its cache types in this engine's terms."""
        raise NotImplementedError

    def left_out(self, gpu: Gpu, s: Serving, draft: DraftPlan | None) -> tuple[str, bool]:
        """What the plan says of this engine's quants on this target: a note ("": none), and
        whether they leave the recommendation (still shown in the fit table)."""
        return "", False

    # -- the recipe's terms ------------------------------------------------------------------

    #: takes llama-server's cache types as a what-if (--cache-type-k/-v)
    takes_cache_flags: bool = False
    #: renders an allotment per card for a split (TabbyAPI's gpu_split)
    renders_gpu_split: bool = False

    def wrong_quant(self, recipe: str, quant: str) -> str:
        """What a what-if quant of another engine is told, for a recipe of this one."""
        raise NotImplementedError

    def recipe_quant(self, quant: str, given: object) -> object:
        """``quant`` as this engine's recipe writes it (``given``: the recipe's own value)."""
        return quant

    def serving_notes(self, s: Serving, gpu: Gpu) -> list[str]:
        """Notes on the served settings that are this engine's (a cache pair it runs slower)."""
        return []


def split_devices(gpu: Gpu, s: Serving) -> list[Device]:
    """The devices of a split in llama.cpp's order: the RPC workers, then the local cards; each
    of the recipe's GPU kind with its CUDA context and margin (a CPU-backed worker: the CPU
    budget, its 32-byte alignment, the margin only)."""
    overhead = ((0 if gpu.is_cpu else s.cuda_context_mib) + s.margin_mib) * MIB
    align = CPU_ALIGNMENT if gpu.is_cpu else CUDA_ALIGNMENT
    rpc = [Device(f"RPC {i}", gpu.memory_bytes, gpu.bandwidth_gb_s, align, overhead) for i in range(s.rpc_devices)]
    local = (
        []
        if gpu.is_cpu
        else [Device(f"GPU {i}", gpu.memory_bytes, gpu.bandwidth_gb_s, align, overhead) for i in range(s.gpu_count)]
    )
    return rpc + local
