#!/bin/sh
# How the thishost-llamacpp-*-compute-buffer-* fixtures were made: a small program (cbuf.cpp)
# that loads a GGUF with llama.cpp and prints what llama_context reserves, linked statically
# against the objects of the pinned CPU build that tests/llamacpp_tools.py makes (the fixtures
# were made with a static build of the same tree: the same code, without -fPIC). With --rpc it starts an RPC
# server on the CPU backend inside the process and offloads every layer to it, so the graph
# is split the way a full CUDA offload splits it (inputs and token embeddings on the host, the
# rest on the "device"); --no-alloc only sizes the buffers. ggml-rpc is compiled here (its
# objects in the build are a library of their own, not among those archived below). CBUF_TRACE=file logs every allocation of the
# graph allocator (ggml-alloc.c patched by trace_patch.py) for reading the peak.
# cbuf9.cpp is the same for the llama.cpp tree in the llama-cpp-python 0.3.9 sdist
# (llama.cpp 8733e0c, May 2025), built with -DGGML_RPC=ON, for the older CUDA logs.
set -e
SRC=${SRC:-$HOME/.cache/voltaforge/llama-cpp-python-0.3.36/src/llama_cpp_python-0.3.36/vendor/llama.cpp}
B=${B:-$HOME/.cache/voltaforge/llama-cpp-0c1e570-tools/llama.cpp/current}
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
# the build is of shared libraries: its objects, archived here, link statically as the static
# build's libraries did (an archive member is pulled only for a symbol still missing, so the
# traced allocator above replaces ggml-alloc's own)
for lib in llama:src ggml:ggml/src ggml-cpu:ggml/src ggml-base:ggml/src; do
  name=${lib%%:*}; dir=$B/${lib#*:}/CMakeFiles/$name.dir
  rm -f "$OUT/lib$name.a"
  find "$dir" -name '*.o' | sort | xargs ar rcs "$OUT/lib$name.a"
done
c++ -o "$OUT/cbuf" "$OUT/cbuf.o" "$OUT/ggml-alloc-trace.o" "$OUT/ggml-rpc.o" "$OUT/transport.o" \
    "$OUT/libllama.a" "$OUT/libggml.a" "$OUT/libggml-cpu.a" "$OUT/libggml-base.a" -lpthread -lm
echo "$OUT/cbuf"
