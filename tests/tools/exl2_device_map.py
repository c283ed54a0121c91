"""ExLlamaV2's own placement of a checkpoint over GPU allotments, run without a GPU.

Run by tests/test_exl2_split.py under a Python that has torch (the CPU build) and the pinned
exllamav2 wheel's package on its path. Two parts of ExLlamaV2 need a GPU and are replaced, and
nothing else is: the compiled extension (``exllamav2.ext``: kernels, which the placement never
calls) and ``ExLlamaV2DeviceContext`` (it opens a CUDA stream per card; here it records the
scratch size set_device_map gives it). Everything else is ExLlamaV2 0.3.2 as shipped:
ExLlamaV2Config reads the checkpoint's config.json and safetensors headers, ExLlamaV2 builds
its modules, and ``set_device_map`` places them.

stdin: a JSON list of cases {model_dir, max_seq_len, max_input_len, allocation}.
argv[1]: where to write a JSON list of results {modules: [...], free, fixed, cache_map} or {error}.
"""

from __future__ import annotations

import json
import sys
import types

ext = types.ModuleType("exllamav2.ext")


class _NoKernels:
    def __getattr__(self, name):
        raise RuntimeError(f"exllamav2_ext.{name}: no GPU kernels here")


ext.exllamav2_ext = _NoKernels()
ext.none_tensor = None
sys.modules["exllamav2.ext"] = ext

import exllamav2.model as model_module  # noqa: E402
from exllamav2.config import ExLlamaV2Config  # noqa: E402


class RecordedContext:
    def __init__(self, model, device_idx, scratch_bytes):
        self.device_idx = device_idx
        self.scratch_bytes = scratch_bytes


model_module.ExLlamaV2DeviceContext = RecordedContext


def place(case: dict) -> dict:
    config = ExLlamaV2Config(case["model_dir"])
    config.max_seq_len = case["max_seq_len"]
    config.max_input_len = case["max_input_len"]
    config.max_attention_size = case["max_input_len"] ** 2
    model = model_module.ExLlamaV2(config, lazy_load=True)
    try:
        free = model.set_device_map(case["allocation"])
    except AssertionError as e:
        last = next(m for m in model.modules if getattr(m, "device_idx", None) is None)
        return {"error": str(e), "module": last.key, "kind": type(last).__name__}
    modules = []
    for m in model.modules:
        modules.append(
            {
                "key": m.key,
                "kind": type(m).__name__,
                "device": m.device_idx,
                "footprint": m.weight_footprint(),
                "scratch": m.scratch_space(),
                "scratch_fixed": m.scratch_space_fixed(),
                "attention": m.temp_attn_size() if hasattr(m, "temp_attn_size") else 0,
            }
        )
    fixed = [c.scratch_bytes if c is not None else 0 for c in model.device_context]
    cache_map = {str(k): v for k, v in model.cache_map.items()}
    return {"modules": modules, "free": free, "fixed": fixed, "cache_map": cache_map}


# ExLlamaV2 prints a warning to stdout on a torch without CUDA: the results go to a file
with open(sys.argv[1], "w") as out:
    json.dump([place(c) for c in json.load(sys.stdin)], out)
