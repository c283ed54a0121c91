"""`invoke plan`: load a recipe (or a bare config.json), plan it, print a table or JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

from playbooks.cli.flags import name_or_path, word
from playbooks.cli.render import console, plan_json, render_plan
from playbooks.config.planning import (
    SpeedFloor,
    host_from_recipe,
    objective_for,
    plan_recipe,
    planner_defaults,
    with_overrides,
)
from playbooks.config.recipe import RECIPES_DIR, load_recipe
from playbooks.errors import UsageError, VoltaforgeError
from playbooks.plan.engines import engine, engine_of_quant, parse_quant
from playbooks.plan.gpus import GIB, get_gpu
from playbooks.plan.kv_cache import LLAMACPP_CACHE_TYPES
from playbooks.plan.model_config import ModelShape, load_config_file
from playbooks.plan.moe import HOST_MEMBW_DEFAULT_GB_S, HostMemory
from playbooks.plan.planner import make_plan
from playbooks.plan.serving import Serving, quant_names, serving_for
from playbooks.plan.split import device_count, split_mode_refusal

#: --parallel: more llama-server slots than any GPU's memory serves (the planner's arithmetic
#: overflows a float long before a number of slots stops being a number)
MAX_SLOTS = 1024


def run_plan(
    recipe: str | None = None,
    gpu: str | None = None,
    model_config: str | None = None,
    ctx: int | None = None,
    parallel: int | None = None,
    quant: str | None = None,
    as_json: bool = False,
    out: TextIO | None = None,
    recipes_dir: Path | None = None,
    n_cpu_moe: int | str | None = None,
    host_membw_gb_s: float | None = None,
    host_ram_gib: float | None = None,
    cache_type_k: str | None = None,
    cache_type_v: str | None = None,
    min_tok_s: SpeedFloor = None,
    gpu_count: int | None = None,
    tensor_split: tuple[float, ...] | None = None,
    split_mode: str | None = None,
) -> int:
    """Returns the exit code: 0 when the planned configuration fits, 1 when it does not.

    n_cpu_moe (a MoE model's experts in host RAM: a number of layers or "auto"), host_membw_gb_s
    and host_ram_gib override the recipe's; with --model-config a MoE model plans "auto".
    cache_type_k/_v: llama-server's -ctk/-ctv for a --model-config plan (f16 unless given; EXL2
    rows get the matching ExLlamaV2 cache mode). min_tok_s: the recommendation's speed floor
    instead of planner.min_tok_s ("none": no floor). gpu_count / tensor_split: a layer split
    over that many cards of the GPU, instead of the recipe's. split_mode: layer, the one planned
    (another: one line saying why not, plan/split.py)."""
    out = out or sys.stdout
    refusal = split_mode_refusal(split_mode) if split_mode else None
    if refusal:
        raise UsageError(refusal)
    # given but empty is a mistake, not "use the default"
    model_config = name_or_path("--model-config", model_config)
    gpu = word("--gpu", gpu, "a GPU name, e.g. v100-16gb")
    quant = word("--quant", quant, "a quant type, e.g. Q4_K_M or EXL2-3.3")
    if parallel is not None and parallel > MAX_SLOTS:
        raise UsageError(f"--parallel must be at most {MAX_SLOTS} slots, got {parallel}")
    if bool(recipe) == bool(model_config):
        raise UsageError("give either --recipe NAME or --model-config path/to/config.json")
    if ctx is not None and ctx <= 0:
        raise VoltaforgeError(f"--ctx must be a positive number of tokens, got {ctx}")
    for flag, value in (("--cache-type-k", cache_type_k), ("--cache-type-v", cache_type_v)):
        if value is not None and value not in LLAMACPP_CACHE_TYPES:
            raise UsageError(f"{flag} {value!r}: want one of {', '.join(LLAMACPP_CACHE_TYPES)} (llama-server's types)")
    if quant is not None:
        quant = parse_quant(quant)
        if not engine_of_quant(quant).known_quant(quant):
            raise VoltaforgeError(f"--quant {quant!r} is not a known quant; allowed: {', '.join(quant_names())}")
    overridden: list[str] = []
    if recipe:
        # a what-if: the recipe's values are the defaults, the flags win (and are said)
        loaded, overridden = with_overrides(
            load_recipe(recipe, recipes_dir or RECIPES_DIR),
            parallel,
            quant,
            cache_type_k,
            cache_type_v,
        )
        if ctx and ctx > loaded.shape.max_position_embeddings:
            raise VoltaforgeError(
                f"--ctx {ctx} is above the model's maximum "
                f"(max_position_embeddings {loaded.shape.max_position_embeddings})"
            )
        _check_n_cpu_moe(n_cpu_moe, loaded.shape, loaded.recipe.name)
        if n_cpu_moe is not None and not (e := engine(loaded.recipe.backend)).offloads_experts:
            raise UsageError(f"--n-cpu-moe is llama-server's; {loaded.recipe.name} is an {e.label} recipe")
        ram = int(host_ram_gib * GIB) if host_ram_gib is not None else None
        host = host_from_recipe(loaded, host_membw_gb_s, ram)
        r = loaded.recipe
        count = gpu_count or r.gpu_count
        cpu = get_gpu(gpu or r.gpu).is_cpu
        if cpu and count > 1:
            raise UsageError(f"--gpu-count {count}: {r.gpu if gpu is None else gpu} is a CPU target, it has no cards")
        devices = device_count(len(r.rpc), count, cpu)
        split = _split(devices, tensor_split if tensor_split is not None else r.tensor_split)
        if (count > 1 or r.rpc) and loaded.shape.is_moe:
            # a split keeps every expert on a device (plan/split.py): the recipe's "auto" is moot
            if n_cpu_moe not in (None, 0):
                raise UsageError(
                    f"--n-cpu-moe {n_cpu_moe} beside a split is not planned: it keeps every expert on a device"
                )
            n_cpu_moe = 0
        plan = plan_recipe(
            loaded,
            gpu,
            ctx,
            n_cpu_moe=n_cpu_moe,  # type: ignore[arg-type]
            host=host,
            min_tok_s=min_tok_s,
            gpu_count=count,
            tensor_split=split,
        )
        if overridden:
            plan.notes.insert(0, f"a what-if, not the recipe as written: {'; '.join(overridden)}")
        label = loaded.recipe.name
    else:
        if gpu_count and gpu_count > 1 and get_gpu(gpu or "v100-16gb").is_cpu:
            raise UsageError(f"--gpu-count {gpu_count}: {gpu} is a CPU target, it has no cards")
        shape = load_config_file(Path(str(model_config)))
        context = ctx or min(4096, shape.max_position_embeddings)
        if context > shape.max_position_embeddings:
            raise VoltaforgeError(
                f"--ctx {context} is above the model's maximum "
                f"(max_position_embeddings {shape.max_position_embeddings})"
            )
        given = quant is not None
        quant = quant or "Q4_K_M"
        if why := engine_of_quant(quant).quant_refusal(shape, quant):
            if given:
                raise VoltaforgeError(f"--quant {quant}: {why}")
            quant = "MXFP4_MOE" if shape.mxfp4_experts else None  # the default cannot be made: plan what can
        _check_n_cpu_moe(n_cpu_moe, shape, str(model_config))
        if n_cpu_moe is None:
            n_cpu_moe = "auto" if shape.is_moe else 0
        # planned as a shipped recipe is: defaults.yaml's planner settings and objective
        settings = planner_defaults(recipes_dir or RECIPES_DIR)
        serving = serving_for(
            quant or "Q4_K_M",
            Serving(
                context=context,
                parallel=parallel or 1,
                # llama-server's own default for either side not given
                cache_k=cache_type_k or "f16",
                cache_v=cache_type_v or "f16",
                # model-config plans run llama.cpp's flash attention (on sm_70 too), which a
                # quantized V cache needs
                flash_attn=True,
                n_ubatch=settings.n_ubatch,
                cuda_context_mib=settings.cuda_context_mib,
                margin_mib=settings.margin_mib,
                imatrix=settings.imatrix,
                n_cpu_moe=n_cpu_moe,  # type: ignore[arg-type]
                gpu_count=gpu_count or 1,
                tensor_split=_split(gpu_count or 1, tensor_split),
            ),
        )
        host = HostMemory(
            membw_gb_s=host_membw_gb_s or HOST_MEMBW_DEFAULT_GB_S,
            membw_source="given" if host_membw_gb_s else "default",
            ram_bytes=int(host_ram_gib * GIB) if host_ram_gib is not None else None,
            ram_source="given" if host_ram_gib is not None else "unknown",
        )
        plan = make_plan(
            shape,
            get_gpu(gpu or "v100-16gb"),
            serving,
            quant=quant,
            objective=objective_for(settings, shape, min_tok_s),
            host=host,
        )
        label = str(model_config)
    if as_json:
        out.write(json.dumps(plan_json(plan, label), indent=2) + "\n")
    else:
        render_plan(plan, console(out), label)
    fits = plan.chosen.fits if plan.chosen else any(o.fits for o in plan.options)
    return 0 if fits else 1


def _split(devices: int, shares: tuple[float, ...] | list[float] | None) -> tuple[float, ...]:
    """--tensor-split against the number of devices: one share each, or none (equal shares)."""
    if not shares:
        return ()
    if devices <= 1:
        raise UsageError("--tensor-split goes with more than one device (--gpu-count N, or the recipe's cards)")
    if len(shares) != devices:
        raise UsageError(f"--tensor-split has {len(shares)} share(s) for {devices} devices (one per device)")
    return tuple(shares)


def _check_n_cpu_moe(n_cpu_moe: int | str | None, shape: ModelShape, label: str) -> None:
    """--n-cpu-moe against the model: a MoE, and at most its layers."""
    if n_cpu_moe is None:
        return
    if not shape.is_moe:
        raise UsageError(
            f"--n-cpu-moe {n_cpu_moe}: {label} is a dense model ({shape.model_type}): it has no experts to keep "
            "in host RAM"
        )
    if isinstance(n_cpu_moe, int) and n_cpu_moe > shape.num_hidden_layers:
        raise UsageError(
            f"--n-cpu-moe {n_cpu_moe} is more than the model's {shape.num_hidden_layers} layers "
            f"(all of them: {shape.num_hidden_layers}, or auto)"
        )
