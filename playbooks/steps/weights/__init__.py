"""The weights stage. `invoke quantize`, GGUF: the weights fetched once, converted to F16, quantized from the
current build, each file verified before it counts and described by a manifest.

On the host, under ``<prefix>/models/<model id>/``:

- ``hf/``: the original weights and ``.voltaforge-source.json`` (every file's size and sha256,
  where they came from). A generated tiny model (``model.generate``) or a directory on the
  controller (``model.path``) is pushed file by file, checksummed, into ``hf.partial/`` and
  renamed when complete.
- ``gguf/<id>-F16.gguf``: ``convert_hf_to_gguf.py --outtype f16`` from the llama.cpp tree the
  current build came from, run by the toolchain venv; verified against the original weights
  (the same token ids through llama-cpp-python and through transformers: top-1 agreement and
  the largest logit difference).
- ``gguf/imatrix.gguf``: ``llama-imatrix`` on the calibration text, when ``planner.imatrix``.
- ``gguf/<id>-<TYPE>.gguf``: ``llama-quantize [--imatrix] F16 out TYPE``; verified against the
  F16 file with ``llama-perplexity --kl-divergence`` (mean KLD, same top token) and by loading
  it through llama-cpp-python and generating (finite logits, output).

Every artifact is written as ``<file>.partial`` and renamed only after its verification, then
described by ``<file>.manifest.json`` (inputs, tools, bytes, sha256, the planner's predicted
bytes, the verification figures). A file without a manifest does not count. The same inputs
again are ``ok (artifact present)`` after a ``stat``: size and mtime against the manifest, no
re-hash (``--verify`` re-hashes).

Modules: model_layout (where), sources (the weights on the controller), fetch (onto the
host), fp16_range, gguf (convert, quantize, verify), reference (the F16 base, imatrix, texts),
exl2_convert (EXL2), artifact_copy (between hosts).
"""
