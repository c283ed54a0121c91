#!/bin/sh
# How the thishost-llamacpp-*-compute-buffer-* fixtures were made: a small program (cbuf.cpp)
# that loads a GGUF with llama.cpp and prints what llama_context reserves, linked against the
# pinned static CPU build that tests/llamacpp_tools.py makes. With --rpc it starts an RPC
# server on the CPU backend inside the process and offloads every layer to it, so the graph
# is split the way a full CUDA offload splits it (inputs and token embeddings on the host, the
# rest on the "device"); --no-alloc only sizes the buffers. ggml-rpc is compiled here because
# the pinned build is configured without it. CBUF_TRACE=file logs every allocation of the
# graph allocator (ggml-alloc.c patched by trace_patch.py) for reading the peak.
# cbuf9.cpp is the same for the llama.cpp tree in the llama-cpp-python 0.3.9 sdist
# (llama.cpp 8733e0c, May 2025), built with -DGGML_RPC=ON, for the older CUDA logs.
set -e
SRC=${SRC:-$HOME/.cache/voltaforge/llama-cpp-python-0.3.36/src/llama_cpp_python-0.3.36/vendor/llama.cpp}
B=${B:-$HOME/.cache/voltaforge/llama-cpp-0c1e570-cpu-static}
OUT=${OUT:-/tmp/cbuf-tool}
mkdir -p "$OUT"
cp "$SRC/ggml/src/ggml-alloc.c" "$OUT/ggml-alloc-trace.c"
python3 "$(dirname "$0")/trace_patch.py" "$OUT/ggml-alloc-trace.c"
cc -D_GNU_SOURCE -D_XOPEN_SOURCE=600 -I"$SRC/ggml/src" -I"$SRC/ggml/include" -O2 -DNDEBUG -std=gnu11 \
   -c "$OUT/ggml-alloc-trace.c" -o "$OUT/ggml-alloc-trace.o"
for f in ggml-rpc transport; do
  c++ -std=gnu++17 -O2 -DNDEBUG -D_GNU_SOURCE -I"$SRC/ggml/src" -I"$SRC/ggml/include" \
      -c "$SRC/ggml/src/ggml-rpc/$f.cpp" -o "$OUT/$f.o"
done
c++ -std=gnu++17 -O2 -I"$SRC/include" -I"$SRC/ggml/include" -c "$(dirname "$0")/cbuf.cpp" -o "$OUT/cbuf.o"
c++ -o "$OUT/cbuf" "$OUT/cbuf.o" "$OUT/ggml-alloc-trace.o" "$OUT/ggml-rpc.o" "$OUT/transport.o" \
    "$B/src/libllama.a" "$B/ggml/src/libggml.a" "$B/ggml/src/libggml-cpu.a" "$B/ggml/src/libggml-base.a" -lpthread -lm
echo "$OUT/cbuf"
