"""Every file `invoke deploy` installs for a recipe, as its engine renders them
(steps/serve/engine_llamacpp.py: llama-server's unit or instance template and environment
files; steps/serve/engine_exllamav2.py: TabbyAPI's unit and config.yml), with what the recipe's
plan decides (a MoE's --n-cpu-moe, an EXL2 split's gpu_split). Pure: no I/O but reading the
templates."""

from __future__ import annotations

from playbooks.config.planning import resolve_gpu_split, resolve_n_cpu_moe
from playbooks.config.recipe import LoadedRecipe, Recipe
from playbooks.errors import VoltaforgeError
from playbooks.steps.serve.engines import server_engine
from playbooks.steps.serve.units import RenderedFile, ServerLayout, check_gpu_indexes, default_gpu_indexes


def render_service_files(
    recipe: Recipe,
    layout: ServerLayout = ServerLayout(),
    gpu_indexes: tuple[int, ...] | None = None,
    n_cpu_moe: int = 0,
    gpu_split: tuple[float, ...] = (),
) -> list[RenderedFile]:
    """Every file deploy installs for a recipe (not the secrets, nor the links in serve_dir).
    ``n_cpu_moe``: the resolved --n-cpu-moe of a MoE recipe (llama_server_argv); ``gpu_split``:
    the planned allotments of an EXL2 recipe over several cards (render_tabbyapi_config).

    The recipe's engine renders them (steps/serve/engine_*.py: ``render_files``). No indexes:
    default_gpu_indexes.
    """
    gpu_indexes = default_gpu_indexes(recipe) if gpu_indexes is None else gpu_indexes
    check_gpu_indexes(gpu_indexes)
    if recipe.gpu_count > 1:
        if len(gpu_indexes) != recipe.gpu_count:
            raise VoltaforgeError(
                f"recipe {recipe.name} splits one server over {recipe.gpu_count} GPUs: give {recipe.gpu_count} GPU "
                f"indexes (--gpus {','.join(map(str, range(recipe.gpu_count)))}), not {len(gpu_indexes)}"
            )
    return server_engine(recipe.backend).render_files(recipe, layout, gpu_indexes, n_cpu_moe, gpu_split)


def planned_service_files(
    loaded: LoadedRecipe, layout: ServerLayout = ServerLayout(), gpu_indexes: tuple[int, ...] | None = None
) -> list[RenderedFile]:
    """render_service_files with what the recipe's plan decides: a MoE's --n-cpu-moe, an EXL2
    split's gpu_split."""
    return render_service_files(
        loaded.recipe, layout, gpu_indexes, resolve_n_cpu_moe(loaded), resolve_gpu_split(loaded)
    )
