// cbuf: load a GGUF with the pinned llama.cpp and print the compute buffer sizes llama_context reserves.
// Optional: --rpc HOST:PORT starts an in-process RPC server on the CPU backend and offloads every
// layer to it, so the graph is split the way a full GPU offload splits it (inputs and token
// embeddings on the CPU, the rest on the "device").
#include "llama.h"
#include "ggml-backend.h"
#include "ggml-rpc.h"
#include "ggml-cpu.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <chrono>
#include <vector>
#include <unistd.h>

static void log_cb(ggml_log_level level, const char * text, void *) {
    static bool dbg = getenv("CBUF_DEBUG") != nullptr;
    if (level == GGML_LOG_LEVEL_DEBUG && !dbg) return;
    fputs(text, stderr);
}

int main(int argc, char ** argv) {
    std::string model, rpc;
    int no_alloc = 0;
    int n_ctx = 2048, n_ub = 512, n_b = 2048, fa = 0, n_out = 1, n_seq = 1, kvu = 0;
    std::string ctk = "f16", ctv = "f16";
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        auto nx = [&]() { return std::string(argv[++i]); };
        if (a == "-m") model = nx();
        else if (a == "-c") n_ctx = atoi(nx().c_str());
        else if (a == "-ub") n_ub = atoi(nx().c_str());
        else if (a == "-b") n_b = atoi(nx().c_str());
        else if (a == "-fa") fa = atoi(nx().c_str());
        else if (a == "--n-out") n_out = atoi(nx().c_str());
        else if (a == "-np") n_seq = atoi(nx().c_str());
        else if (a == "-kvu") kvu = 1;
        else if (a == "-ctk") ctk = nx();
        else if (a == "-ctv") ctv = nx();
        else if (a == "--rpc") rpc = nx();
        else if (a == "--no-alloc") no_alloc = 1;
        else { fprintf(stderr, "unknown arg %s\n", a.c_str()); return 2; }
    }
    llama_log_set(log_cb, nullptr);
    ggml_log_set(log_cb, nullptr);
    llama_backend_init();

    std::vector<ggml_backend_dev_t> devs;
    if (!rpc.empty()) {
        ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        std::thread([rpc, cpu]() {
            ggml_backend_dev_t d[1] = {cpu};
            ggml_backend_rpc_start_server(rpc.c_str(), nullptr, 1, 1, d);
        }).detach();
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        ggml_backend_reg_t reg = ggml_backend_rpc_add_server(rpc.c_str());
        if (!reg) { fprintf(stderr, "rpc add server failed\n"); return 1; }
        devs.push_back(ggml_backend_reg_dev_get(reg, 0));
    }
    devs.push_back(nullptr);

    auto mp = llama_model_default_params();
    if (!rpc.empty()) { mp.devices = devs.data(); mp.n_gpu_layers = 999; }
    else { mp.n_gpu_layers = 0; }
    mp.use_extra_bufts = false;
    mp.no_alloc = no_alloc;
    if (no_alloc) mp.load_mode = LLAMA_LOAD_MODE_NONE;
    llama_model * m = llama_model_load_from_file(model.c_str(), mp);
    if (!m) { fprintf(stderr, "load failed\n"); return 1; }

    auto type_of = [](const std::string & s) {
        if (s == "f16") return GGML_TYPE_F16;
        if (s == "q8_0") return GGML_TYPE_Q8_0;
        if (s == "q4_0") return GGML_TYPE_Q4_0;
        if (s == "f32") return GGML_TYPE_F32;
        fprintf(stderr, "bad cache type %s\n", s.c_str()); exit(2);
    };
    auto cp = llama_context_default_params();
    cp.n_ctx = n_ctx; cp.n_batch = n_b; cp.n_ubatch = n_ub; cp.n_seq_max = n_seq;
    cp.n_outputs_max = n_out; cp.n_outputs_max_per_seq = 1;
    cp.flash_attn_type = fa ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.kv_unified = kvu;
    cp.swa_full = false;  // llama-server's default (common_params::swa_full)
    cp.type_k = type_of(ctk); cp.type_v = type_of(ctv);
    cp.n_threads = 1; cp.n_threads_batch = 1;
    llama_context * ctx = llama_init_from_model(m, cp);
    if (!ctx) { fprintf(stderr, "context failed\n"); return 1; }
    llama_free(ctx);
    llama_model_free(m);
    fflush(stderr);
    _exit(0);  // the RPC server thread never returns
}
