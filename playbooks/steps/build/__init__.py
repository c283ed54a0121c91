"""Building what serves: the toolchain (CUDA, the venv, torch), llama.cpp from the pinned source and its
proof, the Python bindings on its libraries, ExLlamaV2 and TabbyAPI, the fleet cache."""
