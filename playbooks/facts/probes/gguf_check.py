#!/usr/bin/env python3
"""voltaforge GGUF check: pushed to a host and run there by the toolchain venv's python.

    gguf_check.py run GGUF PROMPT_FILE
        load GGUF through llama-cpp-python (the build step's bindings), evaluate the prompt and
        generate 16 tokens greedily: are the logits finite, is there output?
    gguf_check.py compare GGUF HF_DIR PROMPT_FILE
        the same token ids through the GGUF (llama-cpp-python) and through the original weights
        (transformers, float32 on the CPU): top-1 agreement over every position and the largest
        absolute logit difference.

It prints exactly ONE line of JSON on stdout and exits 0 whatever happens (an "error" key
says what went wrong), so the caller parses instead of guessing from a traceback.
Python 3.8 compatible; numpy, llama_cpp and (compare) torch + transformers from the venv.
"""

import json
import math
import os
import sys

PROBE_VERSION = 1
N_GENERATE = 16
MAX_PROMPT_TOKENS = 64


def _prompt(path):
    with open(path, "rb") as fh:
        return fh.read()


def _load(gguf, logits_all):
    import llama_cpp

    return llama_cpp.Llama(
        model_path=gguf,
        n_ctx=256,
        n_threads=max(1, (os.cpu_count() or 2)),
        logits_all=logits_all,
        verbose=False,
        seed=0,
    )


def run(gguf, prompt_file):
    import numpy as np

    llm = _load(gguf, logits_all=False)
    tokens = llm.tokenize(_prompt(prompt_file), add_bos=True)[:MAX_PROMPT_TOKENS]
    out = []
    finite = True
    for token in llm.generate(tokens, temp=0.0, top_k=1, reset=True):
        logits = np.asarray(llm.eval_logits[-1], dtype=np.float32)
        finite = finite and bool(np.isfinite(logits).all())
        out.append(int(token))
        if len(out) >= N_GENERATE:
            break
    text = llm.detokenize(out).decode("utf-8", "replace")
    return {
        "prompt_tokens": len(tokens),
        "tokens_out": len(out),
        "distinct_out": len(set(out)),
        "finite": finite,
        "text": text[:200],
    }


def _mem_available():
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def compare(gguf, hf_dir, prompt_file):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    llm = _load(gguf, logits_all=True)
    tokens = llm.tokenize(_prompt(prompt_file), add_bos=True)[:MAX_PROMPT_TOKENS]
    llm.reset()
    llm.eval(tokens)
    ours = np.asarray(llm.scores[: len(tokens)], dtype=np.float32)
    # the reference runs on the CPU: float32 where RAM allows, else bfloat16 (the checkpoint's
    # own precision); a model that does not fit RAM even so is reported as not compared
    stored = sum(os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    available = _mem_available()
    dtype = torch.float32
    if available is not None and stored * 2 > available * 0.7:
        dtype = torch.bfloat16
        if stored > available * 0.7:
            return {
                "positions": len(tokens),
                "finite": bool(np.isfinite(ours).all()),
                "skipped": f"the original needs {stored // 10**6} MB of RAM, "
                f"the host has {available // 10**6} MB available",
            }
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=dtype)
    model.eval()
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].float().numpy()
    finite = bool(np.isfinite(ours).all())
    agree = int((ours.argmax(axis=-1) == ref.argmax(axis=-1)).sum())
    diff = float(np.abs(ours - ref).max()) if finite else math.inf
    return {
        "positions": len(tokens),
        "top1_agreement": agree / len(tokens),
        "max_abs_logit_diff": diff,
        "ref_logit_range": float(np.abs(ref).max()),
        "reference_dtype": str(dtype).replace("torch.", ""),
        "finite": finite,
    }


def main(argv):
    result = {"probe": "voltaforge-gguf-check", "probe_version": PROBE_VERSION}
    try:
        if len(argv) == 3 and argv[0] == "run":
            result.update(mode="run", **run(argv[1], argv[2]))
        elif len(argv) == 4 and argv[0] == "compare":
            result.update(mode="compare", **compare(argv[1], argv[2], argv[3]))
        else:
            result["error"] = "usage: gguf_check.py run GGUF PROMPT | compare GGUF HF_DIR PROMPT"
    except Exception as exc:  # noqa: BLE001 - reported, never raised: the caller reads JSON
        result["error"] = "{}: {}".format(type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
