"""Patch a copy of ggml/src/ggml-alloc.c (pinned ref) to log the allocator's walk to $CBUF_TRACE:
A|buffer|tensor|op|bytes|offset|flags (allocate), R|buffer|tensor|op|parent (reuse in place),
F|buffer|tensor|bytes|offset (free), G|nodes|leafs|buffers (a reserve starts), S|buffer|name|size|alignment."""

import sys

path = sys.argv[1]
with open(path) as f:
    s = f.read()


def sub(old: str, new: str) -> None:
    global s
    assert old in s, old
    s = s.replace(old, new, 1)


sub(
    "#define AT_PRINTF(...)\n",
    """#define AT_PRINTF(...)
static FILE * cbuf_trace_file(void) {
    static FILE * f = NULL; static int init = 0;
    if (!init) { init = 1; const char * p = getenv("CBUF_TRACE"); if (p) f = fopen(p, "w"); }
    return f;
}
#define TRACE(...) do { FILE * _f = cbuf_trace_file(); if (_f) { fprintf(_f, __VA_ARGS__); fflush(_f);} } while (0)
""",
)
old = "        hn->buffer_id = buffer_id;\n        hn->addr = ggml_dyn_tallocr_alloc(alloc, size, node);\n"
sub(
    old,
    old
    + '        TRACE("A|%d|%s|%s|%zu|%zu|%d\\n", buffer_id, node->name, ggml_op_desc(node), size, hn->addr.offset, (int)node->flags);\n',
)
old = '                        AT_PRINTF("reusing parent %s for %s\\n", parent->name, node->name);'
sub(
    old,
    old
    + '\n                        TRACE("R|%d|%s|%s|%s\\n", p_hn->buffer_id, node->name, ggml_op_desc(node), parent->name);',
)
old = '                            AT_PRINTF("reusing view parent %s (%s) for %s\\n", parent->name, view_src->name, node->name);'
sub(
    old,
    old
    + '\n                            TRACE("R|%d|%s|%s|%s\\n", p_hn->buffer_id, node->name, ggml_op_desc(node), view_src->name);',
)
old = "    ggml_dyn_tallocr_free_bytes(alloc, hn->addr, size);\n    hn->allocated = false;"
sub(old, '    TRACE("F|%d|%s|%zu|%zu\\n", buffer_id, node->name, size, hn->addr.offset);\n' + old)
old = (
    "    // allocate in hash table\n    ggml_gallocr_alloc_graph_impl(galloc, graph, node_buffer_ids, leaf_buffer_ids);"
)
sub(
    old,
    '    TRACE("G|%d|%d|%d\\n", graph->n_nodes, graph->n_leafs, galloc->n_buffers);\n'
    + old
    + """
    for (int i = 0; i < galloc->n_buffers; i++) {
        size_t tot = 0;
        for (int c = 0; c < galloc->buf_tallocs[i]->n_chunks; c++) tot += galloc->buf_tallocs[i]->chunks[c]->max_size;
        TRACE("S|%d|%s|%zu|%zu\\n", i, ggml_backend_buft_name(galloc->bufts[i]), tot, galloc->buf_tallocs[i]->alignment);
    }""",
)
with open(path, "w") as f:
    f.write(s)
