// cbuf9: like cbuf, for the llama.cpp tree vendored by llama-cpp-python 0.3.9 (spring 2025)
#include "llama.h"
#include "ggml-backend.h"
#include "ggml-rpc.h"
#include "ggml-cpu.h"
#include <cstdio>
#include <cstdlib>
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
    int n_ctx = 2048, n_ub = 512, n_b = 2048, fa = 0, n_seq = 1, embd = 0;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        auto nx = [&]() { return std::string(argv[++i]); };
        if (a == "-m") model = nx();
        else if (a == "-c") n_ctx = atoi(nx().c_str());
        else if (a == "-ub") n_ub = atoi(nx().c_str());
        else if (a == "-b") n_b = atoi(nx().c_str());
        else if (a == "-fa") fa = atoi(nx().c_str());
        else if (a == "-np") n_seq = atoi(nx().c_str());
        else if (a == "--embd") embd = 1;
        else if (a == "--rpc") rpc = nx();
        else { fprintf(stderr, "unknown arg %s\n", a.c_str()); return 2; }
    }
    llama_log_set(log_cb, nullptr);
    ggml_log_set(log_cb, nullptr);
    llama_backend_init();
    std::vector<ggml_backend_dev_t> devs;
    if (!rpc.empty()) {
        std::thread([rpc]() {
            ggml_backend_t cpu = ggml_backend_cpu_init();
            ggml_backend_rpc_start_server(cpu, rpc.c_str(), nullptr, (size_t) 20 << 30, (size_t) 20 << 30);
        }).detach();
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        ggml_backend_dev_t d = ggml_backend_rpc_add_device(rpc.c_str());
        if (!d) { fprintf(stderr, "rpc add device failed\n"); return 1; }
        devs.push_back(d);
    }
    devs.push_back(nullptr);
    auto mp = llama_model_default_params();
    if (!rpc.empty()) { mp.devices = devs.data(); mp.n_gpu_layers = 999; } else { mp.n_gpu_layers = 0; }
    llama_model * m = llama_model_load_from_file(model.c_str(), mp);
    if (!m) { fprintf(stderr, "load failed\n"); return 1; }
    auto cp = llama_context_default_params();
    cp.n_ctx = n_ctx; cp.n_batch = n_b; cp.n_ubatch = n_ub; cp.n_seq_max = n_seq;
    cp.flash_attn = fa; cp.embeddings = embd; cp.n_threads = 1; cp.n_threads_batch = 1;
    llama_context * ctx = llama_init_from_model(m, cp);
    if (!ctx) { fprintf(stderr, "context failed\n"); return 1; }
    fflush(stderr);
    _exit(0);
}
