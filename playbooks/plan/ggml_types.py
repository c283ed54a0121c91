"""llama.cpp's tensor types and their block sizes, from the gguf package's constants alone.

``import gguf`` runs the package's ``__init__``, which imports numpy, the reader and the writer
(0.13-0.17 s on the 2-core controller), and every command paid it to check a recipe's quant
name. The type enum and the block sizes live in ``gguf/constants.py``, which imports the
standard library only: it is loaded here under its own name, ``gguf.constants``, so a later
``import gguf`` (the shaped-GGUF writer, the reader) takes this very module and its enum
objects, and the numbers stay the package's own, never a copy that could drift.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING


def _constants() -> ModuleType:
    loaded = sys.modules.get("gguf.constants")
    if loaded is not None:
        return loaded
    package = importlib.util.find_spec("gguf")  # finds the package without running its __init__
    if package is None or package.origin is None:
        raise ImportError("the gguf package is not installed (pip install -e .)")
    spec = importlib.util.spec_from_file_location("gguf.constants", Path(package.origin).with_name("constants.py"))
    if spec is None or spec.loader is None:
        raise ImportError(f"gguf.constants not found beside {package.origin}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gguf.constants"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["gguf.constants"]
        raise
    return module


if TYPE_CHECKING:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
else:
    _module = _constants()
    GGML_QUANT_SIZES = _module.GGML_QUANT_SIZES
    GGMLQuantizationType = _module.GGMLQuantizationType

__all__ = ["GGML_QUANT_SIZES", "GGMLQuantizationType"]
