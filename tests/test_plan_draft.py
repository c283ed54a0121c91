"""A recipe with a speculative decoding draft model (`draft:`, llama-server --model-draft),
through every command that uses its plan: `invoke plan`, preflight's fit check, and the
--n-cpu-moe that `invoke render` resolves for a MoE with `n_cpu_moe: auto`.

The draft's weights (at its own quant), its KV cache (the recipe's llama.cpp cache types: render
passes them as -ctkd/-ctvd) and its compute buffer, at the target's whole context (llama-server
gives the draft a context of llama_n_ctx(ctx_tgt), common/speculative.cpp at 0c1e570)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from playbooks.config.recipe import load_recipe
from playbooks.steps.preflight import judge
from tests.helpers import ROOT, recipe_with
from tests.test_preflight_judge import facts

# Qwen2.5-0.5B-Instruct's and Qwen3-0.6B's config.json (the usual drafts of the 14B/32B and 30B-A3B)
QWEN25_05B = (
    "{model_type: qwen2, hidden_size: 896, intermediate_size: 4864, num_hidden_layers: 24, "
    "num_attention_heads: 14, num_key_value_heads: 2, vocab_size: 151936, tie_word_embeddings: true, "
    "max_position_embeddings: 32768, torch_dtype: bfloat16}"
)
QWEN3_06B = (
    "{model_type: qwen3, hidden_size: 1024, intermediate_size: 3072, num_hidden_layers: 28, "
    "num_attention_heads: 16, num_key_value_heads: 8, head_dim: 128, vocab_size: 151936, "
    "tie_word_embeddings: true, max_position_embeddings: 40960, torch_dtype: bfloat16}"
)


def draft(config: str | Path, quant: str = "Q8_0") -> str:
    # a hub model: deploy names its artifact by repo and revision (a path draft is hashed on the
    # controller, so it would have to exist here)
    rev = "a" * 40
    model = f"    repo: Qwen/Qwen2.5-0.5B-Instruct\n    revision: {rev}\n    config: {config}\n"
    return f"draft:\n  model:\n{model}  quant: {quant}\n"


def invoke(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "invoke", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def plan_json(recipe: str | Path) -> dict:
    r = invoke("plan", "--recipe", str(recipe), "--json")
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout)


def test_invoke_plan_counts_the_draft_against_the_card(tmp_path):
    """Before: `unexpected KeyError: 'Q8'`, exit 70 (the EXL2 rows sized the draft's cache with
    ExLlamaV2's cache names)."""
    path = recipe_with(tmp_path, "qwen2.5-14b-v100-16gb", draft(QWEN25_05B))
    r = invoke("plan", "--recipe", str(path))
    assert r.returncode == 0, r.stderr
    assert "draft model" in r.stdout and "Note: EXL2 is left out: a draft is llama-server's" in r.stdout
    alone, paired = plan_json("qwen2.5-14b-v100-16gb"), plan_json(path)
    a, p = alone["chosen"], paired["chosen"]
    assert a["draft_bytes"] == 0 and p["draft_bytes"] > 0
    # q8_0 K and V (the recipe's), 24 layers x 2 KV heads x head_dim 64, at 8192 x 2 slots
    assert p["draft_kv_bytes"] == 2 * 24 * 2 * 64 * 34 // 32 * 16384
    assert p["draft_compute_bytes"] > 0
    assert p["vram_bytes"] == a["vram_bytes"] + p["draft_bytes"]
    assert p["max_ctx"] < a["max_ctx"]
    for q in paired["quants"]:
        if q["backend"] == "exllamav2":
            assert not q["fits"] and q["unfit_reason"] == "a draft is llama-server's"
        else:  # every GGUF row carries the draft
            assert q["draft_bytes"] == p["draft_bytes"] if q["quant"] == "Q4_K_M" else q["draft_bytes"] > 0


def test_a_draft_that_does_not_fit_beside_the_target_is_refused_by_preflight(tmp_path):
    """Qwen2.5-7B as a Q8_0 draft of the 14B on a 16 GB card: the 14B alone fits (10.3 GiB),
    the pair does not; preflight judged the target alone before."""
    cfg = ROOT / "recipes/models/qwen2.5-7b-instruct.config.json"
    path = recipe_with(tmp_path, "qwen2.5-14b-v100-16gb", draft(cfg))
    alone = judge(facts(), load_recipe("qwen2.5-14b-v100-16gb"), "/opt/voltaforge/models", "/opt/voltaforge")
    paired = judge(facts(), load_recipe(path), "/opt/voltaforge/models", "/opt/voltaforge")
    fit_alone = next(c for c in alone.checks if c.name == "fit")
    fit = next(c for c in paired.checks if c.name == "fit")
    assert fit_alone.status == "pass"
    assert fit.status == "fail" and fit.blocking and "does not fit by" in fit.detail and "draft" in fit.detail
    # the same numbers as `invoke plan`
    planned = plan_json(path)["chosen"]
    assert f"needs {planned['vram_bytes'] / 2**30:.2f} GiB" in fit.detail


def test_render_resolves_n_cpu_moe_with_the_draft_beside_the_target(tmp_path):
    """A MoE with n_cpu_moe: auto: the draft takes VRAM, so more layers' experts go to host RAM.
    Before: render stopped on the same KeyError."""
    path = recipe_with(tmp_path, "qwen3-30b-a3b-v100-16gb", draft(QWEN3_06B))
    out = {}
    for name, recipe in (("alone", "qwen3-30b-a3b-v100-16gb"), ("paired", str(path))):
        r = invoke("render", "--recipe", recipe, "--out", str(tmp_path / name))
        assert r.returncode == 0, r.stderr
        unit = next((tmp_path / name).rglob("*.service")).read_text()
        out[name] = int(unit.split("--n-cpu-moe ")[1].split()[0])
    assert out["alone"] == plan_json("qwen3-30b-a3b-v100-16gb")["chosen"]["n_cpu_moe"] == 7
    assert out["paired"] == plan_json(path)["chosen"]["n_cpu_moe"] > out["alone"]


def test_deploy_expects_the_drafts_buffers_in_the_load_log(tmp_path):
    """llama-server prints the draft context's KV and compute buffers under the same device
    name as the target's, and the load log check adds them up (facts/server_log.LoadLog): the
    plan's expectation carries both, else a correct load with a draft reads as over the plan."""
    from types import SimpleNamespace

    from playbooks.conduct.deploy import deploy_ops
    from playbooks.config.planning import plan_recipe

    class Box:
        """A host without systemd and without the model yet: facts only, never a change."""

        name = "box"

        def run(self, command, check=True, stream=True, **kw):
            assert "/run/systemd/system" in command or command.startswith("cat -- "), command
            out = "booted=no\nstate=offline\n" if "/run/systemd/system" in command else ""
            return SimpleNamespace(stdout=out, stderr="", exited=0)

    for base, cfg in (("qwen2.5-14b-v100-16gb", QWEN25_05B), ("qwen3-30b-a3b-v100-16gb", QWEN3_06B)):
        loaded = load_recipe(recipe_with(tmp_path, base, draft(cfg), name=base))
        option = plan_recipe(loaded).chosen
        assert option is not None and option.draft_bytes > 0
        ops = deploy_ops(loaded, Box(), "/opt/vf", "auto")
        expect = next(op.expect for op in ops if hasattr(op, "expect"))
        # the unit's --model-draft reads draft.gguf: deploy links it to the draft's own artifact
        links = {op.link: op.artifact for op in ops if type(op).__name__ == "EnsureModelLink"}
        draft_link = "/opt/vf/serve/voltaforge-llama-server/draft.gguf"
        assert links[draft_link].startswith("/opt/vf/models/Qwen--Qwen2.5-0.5B-Instruct-aaaa") and links[
            draft_link
        ].endswith("Q8_0.gguf"), links
        assert expect.kv_mib == (option.kv_bytes + option.draft_kv_bytes) / 2**20
        assert expect.compute_mib == (option.compute_bytes + option.draft_compute_bytes) / 2**20
        if loaded.shape.is_moe:
            weights = option.draft_bytes - option.draft_kv_bytes - option.draft_compute_bytes
            assert weights > 0 and expect.device_model_mib == (option.gpu_weights_bytes + weights) / 2**20


def test_quantize_makes_the_draft_in_its_own_model_directory(tmp_path):
    """`invoke quantize` of a recipe with a draft: the target's chain, then the draft's (its
    weights, F16 and its quant, no importance matrix) under the draft's own model id; the
    artifacts a copy (--on) carries include the draft."""
    from playbooks.conduct.quantize import made_artifacts, quantize_step

    loaded = load_recipe(recipe_with(tmp_path, "qwen2.5-14b-v100-16gb", draft(QWEN25_05B), name="paired"))
    names = [op.name for op in quantize_step(loaded, "/opt/vf")]
    draft_ops = [n for n in names if "qwen--qwen2.5-0.5b-instruct" in n.lower()]
    assert draft_ops and names.index(draft_ops[0]) > max(i for i, n in enumerate(names) if "Q4_K_M" in n), names
    assert any("Q8_0" in n for n in draft_ops) and any("F16" in n for n in draft_ops), draft_ops
    paths = [a.path for a in made_artifacts(loaded, None, None, "/opt/vf")]
    assert len(paths) == 2 and "qwen--qwen2.5-0.5b-instruct" in paths[1].lower() and paths[1].endswith("Q8_0.gguf")
