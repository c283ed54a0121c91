"""The quantize step's operations: the recipe's weights (and its draft model's) to verified GGUF
files with manifests, or an EXL2 rate; where each model's weights come from; what a quantize
run leaves for a server (the artifacts `--on` copies); a quant the plan says cannot fit is
refused before hours of work."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path

from playbooks.config.planning import plan_recipe
from playbooks.config.recipe import LoadedRecipe, ModelSource
from playbooks.errors import UsageError, VoltaforgeError
from playbooks.host.ops import EnsureDirectory, Operation
from playbooks.plan.engines import engine
from playbooks.plan.evaluate import evaluate
from playbooks.plan.exl2_size import exl2_quant_name
from playbooks.plan.gguf_size import FILE_TYPES
from playbooks.plan.model_config import ModelShape
from playbooks.plan.serving import serving_for
from playbooks.plan.tensors import parameter_count
from playbooks.steps.build.build import BuildLayout
from playbooks.steps.build.llamacpp_source import source_cache_dir
from playbooks.steps.build.toolchain import venv_path
from playbooks.steps.weights.artifact_copy import Artifact
from playbooks.steps.weights.exl2_convert import STAMP_NAME as EXL2_STAMP
from playbooks.steps.weights.exl2_convert import Exl2Layout, exl2_ops
from playbooks.steps.weights.exl2_tokenizer import EnsureTokenizerJson
from playbooks.steps.weights.fetch import EnsureHubWeights, EnsureWeights
from playbooks.steps.weights.fp16_range import EnsureFp16Range
from playbooks.steps.weights.gguf import EnsureConvertDeps, EnsureGguf
from playbooks.steps.weights.model_layout import ModelLayout
from playbooks.steps.weights.reference import EnsureReference, EnsureTexts
from playbooks.steps.weights.sources import HubWeights, LocalWeights, calibration_text, generated_weights, path_weights

#: the fixed prompt every GGUF is run on (words of the tiny model's syllables are real text to
#: a real tokenizer too)
TEST_PROMPT = "kalo mine ruta vosi dega"


def parse_quants(value: str | None, recipe_quant: str) -> list[str]:
    """--quant Q4_K_M[,Q8_0...]: GGUF types, checked against llama-quantize's list (the
    recipe's quant when the flag is not given; given, it names at least one)."""
    quants = list(dict.fromkeys(q.strip() for q in (recipe_quant if value is None else value).split(",") if q.strip()))
    allowed = [t for t in FILE_TYPES if t not in ("F16", "BF16")]  # F16 is always made; V100 has no BF16
    if not quants:
        raise UsageError(f"--quant {value!r}: give GGUF types separated by commas, e.g. Q4_K_M,Q8_0")
    unknown = [q for q in quants if q not in allowed]
    if unknown:
        raise VoltaforgeError(f"--quant {unknown[0]!r}: not a GGUF quant type; allowed: {', '.join(allowed)}")
    return quants


def source_weights(model: ModelSource, recipe_path: Path, key: str = "model") -> LocalWeights | HubWeights:
    """Where a model's weights come from (a path relative to the recipe's directory)."""
    cache = source_cache_dir().parent / "models"
    if model.generate:
        if not isinstance(model.config, dict):
            raise VoltaforgeError(f"{recipe_path}: {key}.generate needs {key}.config inline")
        return generated_weights(model.config, cache)
    if model.path:
        where = Path(model.path).expanduser()
        return path_weights(where if where.is_absolute() else recipe_path.parent / where)
    assert model.repo and model.revision  # the recipe schema: exactly one source, a repo with its revision
    return HubWeights(model.repo, model.revision, model.token_file)


def recipe_weights(loaded: LoadedRecipe) -> LocalWeights | HubWeights:
    return source_weights(loaded.recipe.model, loaded.path)


def draft_weights(loaded: LoadedRecipe) -> LocalWeights | HubWeights | None:
    """The draft model's weights (llama-server --model-draft), or None without one."""
    draft = loaded.recipe.draft
    return source_weights(draft.model, loaded.path, "draft.model") if draft is not None else None


def draft_artifact(loaded: LoadedRecipe, prefix: str) -> str | None:
    """Where the draft's GGUF lives on a host (the draft's own model directory), or None."""
    weights, draft = draft_weights(loaded), loaded.recipe.draft
    if weights is None or draft is None:
        return None
    return ModelLayout(prefix, weights.model_id).gguf(draft.quant)


def recipe_calibration(loaded: LoadedRecipe) -> Path | None:
    named = loaded.recipe.model.calibration
    if named is None:
        return None
    path = Path(named).expanduser()
    return path if path.is_absolute() else loaded.path.parent / path


def weights_op(layout: ModelLayout, weights: LocalWeights | HubWeights, venv: str, shape: ModelShape) -> Operation:
    if isinstance(weights, HubWeights):
        # the BF16 weights and the F16 file: about 4 bytes per parameter, plus a tenth for scratch
        return EnsureHubWeights(layout, weights, venv, int(parameter_count(shape) * 4 * 1.1))
    return EnsureWeights(layout, weights)


def refuse_unfit(loaded: LoadedRecipe, quant: str, force: bool) -> None:
    """A quant the planner says cannot fit the recipe's GPU is refused before hours of work."""
    plan = plan_recipe(loaded)
    option = next((o for o in plan.options if o.quant == quant), None)
    if option is None:  # an EXL2 rate off the planner's ladder, e.g. 3.7 bpw
        option = evaluate(loaded.shape, quant, plan.gpu, serving_for(quant, plan.serving))
    if option.fits or (force and not option.unfit_reason):
        return
    better = f"; the plan recommends {plan.recommendation.quant}" if plan.recommendation else ""
    raise VoltaforgeError(
        f"{quant} does not fit {plan.gpu.name} at {plan.serving.context} tokens x {plan.serving.parallel}: "
        f"needs {option.vram_bytes / 2**30:.2f} GiB of {option.gpu_bytes / 2**30:.2f} GiB (weights "
        f"{option.gpu_weights_bytes / 2**30:.2f}, KV {option.kv_bytes / 2**30:.2f}, compute "
        f"{option.compute_bytes / 2**30:.2f}){better}; --force makes it anyway"
        if not option.unfit_reason
        else f"{quant} cannot be made for {plan.gpu.name}: {option.unfit_reason}"
    )


def parse_bpw(value: str) -> float:
    try:
        bpw = float(value)
    except ValueError:
        raise VoltaforgeError(f"--bpw {value!r}: want bits per weight, a number from 2.0 to 8.0") from None
    if not 2.0 <= bpw <= 8.0:
        raise VoltaforgeError(f"--bpw {value}: outside 2.0-8.0, what ExLlamaV2's converter can make")
    return bpw


def quantize_step(
    loaded: LoadedRecipe,
    prefix: str,
    quant: str | None = None,
    bpw: str | None = None,
    force: bool = False,
    verify: bool = False,
) -> list[Operation]:
    """The quantize operations for one host: the recipe's quant (or ``quant``'s GGUF types,
    or an EXL2 rate with ``bpw``), refused before any work when the plan says it cannot fit."""
    r = loaded.recipe
    if bpw is not None and quant is not None:
        raise VoltaforgeError("--bpw makes an EXL2 quant and --quant GGUF types: give one")
    if bpw is not None or engine(r.backend).continuous_rate:  # an EXL2 rate
        return _exl2_step(loaded, prefix, bpw, force)
    quants = parse_quants(quant, r.quant_name)
    for q in quants:
        refuse_unfit(loaded, q, force)
    weights = recipe_weights(loaded)
    layout = ModelLayout(prefix, weights.model_id)
    build = BuildLayout(prefix)
    venv = venv_path(prefix)
    imatrix = r.planner.imatrix
    recipe_hash = hashlib.sha256(loaded.path.read_bytes()).hexdigest()
    ceiling = r.planner.max_kld

    def gguf(q: str) -> EnsureGguf:
        return EnsureGguf(
            layout,
            build,
            venv,
            weights,
            loaded.shape,
            q,
            imatrix=imatrix,
            kld_ceiling=ceiling,
            verify=verify,
            recipe_sha256=recipe_hash,
        )

    ops: list[Operation] = [
        EnsureDirectory(f"{prefix}/models", 0o755),
        EnsureDirectory(layout.root, 0o755),
        # the converter's packages first: huggingface_hub (a download) comes with transformers
        EnsureConvertDeps(venv, r.toolchain),
        *_gguf_chain(loaded, layout, weights, loaded.shape, r.model.fp16_overflow, gguf, imatrix, quants),
    ]
    return ops + _draft_ops(loaded, prefix, recipe_hash)


def _gguf_chain(
    loaded: LoadedRecipe,
    layout: ModelLayout,
    weights: LocalWeights | HubWeights,
    shape: ModelShape,
    fp16_overflow: str,
    gguf: Callable[[str], EnsureGguf],
    imatrix: bool,
    quants: Sequence[str],
) -> list[Operation]:
    """One model's way to verified GGUFs (the recipe's model and its draft alike): its weights,
    the texts, the FP16 range, F16, the reference logits (and importance matrix), the quants."""
    build, venv = BuildLayout(layout.prefix), venv_path(layout.prefix)
    return [
        weights_op(layout, weights, venv, shape),
        EnsureTexts(layout, calibration_text(weights, recipe_calibration(loaded)), TEST_PROMPT),
        EnsureFp16Range(layout, venv, weights.source_sha256, clamp=fp16_overflow == "clamp"),
        gguf("F16"),
        EnsureReference(layout, build, imatrix),
        *(gguf(q) for q in quants),
    ]


def _draft_ops(loaded: LoadedRecipe, prefix: str, recipe_hash: str) -> list[Operation]:
    """The draft model's GGUF at its quant, made the same way in its own model directory (no
    importance matrix: a draft's errors cost only acceptance, which the bench measures)."""
    r, weights, shape = loaded.recipe, draft_weights(loaded), loaded.draft_shape
    if weights is None or r.draft is None or shape is None:
        return []
    layout = ModelLayout(prefix, weights.model_id)
    build, venv = BuildLayout(prefix), venv_path(prefix)

    def gguf(q: str) -> EnsureGguf:
        return EnsureGguf(layout, build, venv, weights, shape, q, recipe_sha256=recipe_hash)

    quants = [r.draft.quant] if r.draft.quant != "F16" else []
    return [
        EnsureDirectory(layout.root, 0o755),
        *_gguf_chain(loaded, layout, weights, shape, r.draft.model.fp16_overflow, gguf, False, quants),
    ]


def _exl2_step(loaded: LoadedRecipe, prefix: str, bpw: str | None, force: bool) -> list[Operation]:
    r = loaded.recipe
    recipe_bpw = None if isinstance(r.quant, str) else r.quant.bpw
    rate = parse_bpw(bpw) if bpw is not None else recipe_bpw
    if rate is None:
        raise VoltaforgeError(f"{loaded.path}: a GGUF recipe: give --bpw for an EXL2 quant of its model")
    head_bits = 6 if isinstance(r.quant, str) else r.quant.head_bits
    refuse_unfit(loaded, exl2_quant_name(rate), force)
    weights = recipe_weights(loaded)
    layout = ModelLayout(prefix, weights.model_id)
    venv = venv_path(prefix)
    return [
        EnsureDirectory(f"{prefix}/models", 0o755),
        EnsureDirectory(layout.root, 0o755),
        weights_op(layout, weights, venv, loaded.shape),
        EnsureFp16Range(layout, venv, weights.source_sha256, clamp=r.model.fp16_overflow == "clamp"),
        # before the GPU: exllamav2 reads tokenizer.json only
        EnsureTokenizerJson(layout, venv),
        *exl2_ops(venv, layout.hf, layout.root, [(rate, head_bits)], source_sha=weights.source_sha256),
    ]


def made_artifacts(loaded: LoadedRecipe, quant: str | None, bpw: str | None, prefix: str) -> list[Artifact]:
    """The artifacts a quantize run of this recipe leaves under ``prefix`` (what a server
    needs: the quants, not F16 or the measurement)."""
    r = loaded.recipe
    layout = ModelLayout(prefix, recipe_weights(loaded).model_id)
    if bpw is not None or engine(r.backend).continuous_rate:  # an EXL2 rate
        rate = parse_bpw(bpw) if bpw is not None else getattr(r.quant, "bpw", None)
        if rate is None:
            raise VoltaforgeError(f"{loaded.path}: a GGUF recipe: give --bpw for an EXL2 quant of its model")
        head_bits = 6 if isinstance(r.quant, str) else r.quant.head_bits
        out = Exl2Layout(layout.root).output(Exl2Layout.tag(rate, head_bits))
        return [Artifact.exl2(out, EXL2_STAMP)]
    made = [Artifact.gguf(layout.gguf(q)) for q in parse_quants(quant, r.quant_name)]
    draft = draft_artifact(loaded, prefix)
    return made + ([Artifact.gguf(draft)] if draft else [])
