"""llama.cpp's server on a host (its plan half: plan/engine_llamacpp.py): llama-server loads
the quant's GGUF through the unit's model link, its load log is held to the plan (layers on
the devices, KV cache and compute buffer, a MoE's experts, a split's devices), and as a managed
process it reads the API key from a private copy where systemd's LoadCredential= would put it.
Its unit: steps/serve/units.py (llama_server_argv); its build: steps/build/build.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from playbooks.plan.engine_llamacpp import LLAMACPP
from playbooks.plan.gpus import get_gpu
from playbooks.steps.serve.deploy import DeployLayout, Expectations
from playbooks.steps.serve.engine_base import ServerEngine
from playbooks.steps.serve.secrets import EnsureCredentialCopy
from playbooks.steps.weights.model_layout import manifest_path

if TYPE_CHECKING:
    from playbooks.config.recipe import LoadedRecipe, Recipe
    from playbooks.host import Host
    from playbooks.host.ops import Operation
    from playbooks.plan.serving import Option
    from playbooks.steps.serve.units import ServerLayout
    from playbooks.steps.weights.model_layout import ModelLayout


class LlamaServer(ServerEngine):
    engine = LLAMACPP

    def artifact(self, r: Recipe, model: ModelLayout, server: ServerLayout) -> tuple[str, str, str]:
        gguf = model.gguf(r.quant_name)
        return gguf, manifest_path(gguf), server.model_file(r)

    def expectations(self, loaded: LoadedRecipe, option: Option | None) -> Expectations:
        r = loaded.recipe
        gpu = not get_gpu(r.gpu).is_cpu
        return Expectations(
            # every layer on a device: the GPU's, or the RPC workers' (a CPU recipe split over them)
            layers=loaded.shape.num_hidden_layers + 1 if gpu or r.rpc else None,
            # a draft model's KV cache and compute buffer are printed beside the target's (summed)
            kv_mib=option.loaded_kv_bytes / 2**20 if option else None,
            compute_mib=option.loaded_compute_bytes / 2**20 if option else None,
            # a MoE: the experts in host RAM are exactly the planned ones (the layer count cannot tell)
            device_model_mib=(option.gpu_weights_bytes + option.draft_weights_bytes) / 2**20
            if option and gpu and loaded.shape.is_moe and not r.split
            else None,
            devices=tuple((d.weights_bytes / 2**20, d.kv_bytes / 2**20) for d in option.devices) if option else (),
        )

    def key_ops(self, secret: str | None, states: Sequence[DeployLayout], host: Host, systemd: bool) -> list[Operation]:
        if not secret or systemd:
            return []
        # systemd's LoadCredential= as a process gets it: a private copy where %d points
        # (service_manager.process_argv), owned by the user the process runs as
        return [EnsureCredentialCopy(secret, f"{state.state_dir}/credentials/api-key", host.user) for state in states]


LLAMACPP_SERVER = LlamaServer()
