"""Recipes: every shipped one loads and plans; every bad one gets one clear message."""

import json
import textwrap

import pytest

from playbooks.cli.plan import run_plan
from playbooks.config.planning import plan_recipe
from playbooks.config.recipe import RECIPES_DIR, list_recipes, load_recipe
from playbooks.errors import RecipeError
from playbooks.steps.serve.engine_llamacpp import llama_server_argv
from playbooks.steps.serve.units import ServerLayout

SHIPPED = [p.stem for p in list_recipes()]


def test_the_required_recipes_ship():
    for name in (
        "seed-llamacpp-q4km-v100-16gb",
        "seed-exl2-4.0-v100-16gb",
        "seed-exl2-3.3-v100-16gb",
        "qwen2.5-32b-v100-16gb",
        "qwen2.5-32b-v100-32gb",
        "qwen2.5-14b-v100-16gb",
        "qwen2.5-14b-v100-32gb",
        "tiny-cpu",
    ):
        assert name in SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipe_plans_and_fits(name):
    loaded = load_recipe(name)
    assert loaded.path.read_text().startswith("#"), "every recipe starts with a usage comment"
    assert "Usage:" in loaded.path.read_text().split("\n\n")[0]
    plan = plan_recipe(loaded)
    assert plan.chosen.fits, f"{name} ships a configuration that does not fit: {plan.chosen}"


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipe_json_and_table(name, capsys):
    import io

    buf = io.StringIO()
    assert run_plan(recipe=name, as_json=True, out=buf) == 0
    data = json.loads(buf.getvalue())
    assert data["kv_bytes_per_token"] > 0 and data["quants"]
    buf = io.StringIO()
    run_plan(recipe=name, out=buf)
    assert "Fit table" in buf.getvalue() and "Recommendation:" in buf.getvalue()


def _write(tmp_path, body, name="r.yaml"):
    (tmp_path / "models").mkdir(exist_ok=True)
    (tmp_path / "models" / "q.json").write_text((RECIPES_DIR / "models/qwen2.5-14b-instruct.config.json").read_text())
    (tmp_path / "models" / "small.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 512,
                "intermediate_size": 1024,
                "num_hidden_layers": 2,
                "num_attention_heads": 8,
                "vocab_size": 32000,
            }
        )
    )
    p = tmp_path / name
    p.write_text(body)
    return p


GOOD = textwrap.dedent("""\
    model:
      repo: Qwen/Qwen2.5-14B-Instruct
      revision: main
      config: models/q.json
    gpu: v100-16gb
    backend: llamacpp
    quant: Q4_K_M
    context: 4096
""")


def _error(tmp_path, body) -> str:
    with pytest.raises(RecipeError) as exc:
        load_recipe(_write(tmp_path, body))
    msg = str(exc.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_good_recipe_loads(tmp_path):
    assert load_recipe(_write(tmp_path, GOOD)).recipe.quant_name == "Q4_K_M"


def test_yaml_syntax_error_names_line(tmp_path):
    msg = _error(tmp_path, GOOD + "cache: {k: q8_0\n")
    assert "r.yaml:10" in msg and "invalid YAML" in msg


def test_unknown_key(tmp_path):
    msg = _error(tmp_path, GOOD + "contxt: 2048\n")
    assert "r.yaml:9" in msg and "unknown key 'contxt'" in msg and "context" in msg


def test_unknown_nested_key(tmp_path):
    msg = _error(tmp_path, GOOD + "service:\n  hostt: 0.0.0.0\n")
    assert "r.yaml:10" in msg and "service.hostt" in msg and "bind" in msg


def test_unknown_quant(tmp_path):
    msg = _error(tmp_path, GOOD.replace("Q4_K_M", "Q4_K_X"))
    assert "r.yaml:7" in msg and "'Q4_K_X'" in msg and "Q4_K_M" in msg and "IQ4_XS" in msg


def test_bpw_out_of_range(tmp_path):
    body = GOOD.replace("backend: llamacpp", "backend: exllamav2").replace("quant: Q4_K_M", "quant: {bpw: 9.5}")
    msg = _error(tmp_path, body + "cache: {k: Q8, v: Q8}\n")
    assert "r.yaml:7" in msg and "quant.bpw" in msg and "between 2.0 and 8.0" in msg and "9.5" in msg


def test_head_bits_not_an_option(tmp_path):
    body = GOOD.replace("backend: llamacpp", "backend: exllamav2").replace(
        "quant: Q4_K_M", "quant: {bpw: 4.0, head_bits: 7}"
    )
    msg = _error(tmp_path, body + "cache: {k: Q8, v: Q8}\n")
    assert "head_bits" in msg and "2, 3, 4, 5, 6, 8" in msg


@pytest.mark.parametrize("ctx", ["0", "-5"])
def test_non_positive_context(tmp_path, ctx):
    msg = _error(tmp_path, GOOD.replace("context: 4096", f"context: {ctx}"))
    assert "r.yaml:8" in msg and "context" in msg and "greater than 0" in msg


def test_context_above_model_maximum(tmp_path):
    msg = _error(tmp_path, GOOD.replace("context: 4096", "context: 65536"))
    assert "r.yaml:8" in msg and "65536" in msg and "max_position_embeddings 32768" in msg


def test_missing_model(tmp_path):
    body = "\n".join(ln for ln in GOOD.splitlines() if not ln.startswith(("model:", "  "))) + "\n"
    msg = _error(tmp_path, body)
    assert "model: missing" in msg


def test_model_without_config(tmp_path):
    msg = _error(tmp_path, GOOD.replace("  config: models/q.json\n", ""))
    assert "r.yaml:1" in msg and "config is required" in msg


def test_model_config_file_missing(tmp_path):
    msg = _error(tmp_path, GOOD.replace("models/q.json", "models/nope.json"))
    assert "r.yaml:4" in msg and "'models/nope.json' not found" in msg


def test_model_config_bad_json(tmp_path):
    p = _write(tmp_path, GOOD)
    (tmp_path / "models/q.json").write_text('{"model_type": "qwen2",\n  "hidden_size": }')
    with pytest.raises(RecipeError) as exc:
        load_recipe(p)
    assert "q.json:2: invalid JSON" in str(exc.value)


def test_two_model_sources(tmp_path):
    msg = _error(tmp_path, GOOD.replace("  config:", "  path: /srv/m\n  config:"))
    assert "exactly one of repo" in msg


def test_repo_id_shape(tmp_path):
    msg = _error(tmp_path, GOOD.replace("Qwen/Qwen2.5-14B-Instruct", "Qwen/Qwen2.5; rm -rf /"))
    assert "model.repo" in msg and "owner/name" in msg


def test_unknown_gpu(tmp_path):
    msg = _error(tmp_path, GOOD.replace("v100-16gb", "v100-64gb"))
    assert "r.yaml:5" in msg and "unknown GPU" in msg and "v100-32gb" in msg


def test_draft_with_different_vocabulary(tmp_path):
    msg = _error(tmp_path, GOOD + "draft:\n  model:\n    path: /srv/d\n    config: models/small.json\n")
    assert "r.yaml:9" in msg and "vocabulary 32000" in msg and "152064" in msg and "at most 128" in msg


def test_quantized_v_cache_needs_flash_attention(tmp_path):
    msg = _error(tmp_path, GOOD + "cache: {k: q8_0, v: q8_0}\nflash_attn: false\n")
    assert "cache.v" in msg and "flash_attn" in msg


def test_exl2_cache_mode(tmp_path):
    body = GOOD.replace("backend: llamacpp", "backend: exllamav2").replace("quant: Q4_K_M", "quant: {bpw: 4.0}")
    msg = _error(tmp_path, body + "cache: {k: q8_0, v: q8_0}\n")
    assert "FP16, Q8, Q6, Q4" in msg


def test_open_bind_needs_api_key(tmp_path):
    msg = _error(tmp_path, GOOD + "service:\n  bind: 0.0.0.0\n")
    assert "service" in msg and "api_key_ref" in msg


def test_empty_recipe(tmp_path):
    with pytest.raises(RecipeError, match="empty"):
        load_recipe(_write(tmp_path, ""))


def test_unknown_recipe_name_lists_shipped():
    with pytest.raises(RecipeError, match="tiny-cpu"):
        load_recipe("no-such-recipe")


def test_exl2_quant_with_the_llamacpp_backend(tmp_path):
    msg = _error(tmp_path, GOOD.replace("quant: Q4_K_M", "quant: {bpw: 4.0}"))
    assert "r.yaml:7" in msg and "EXL2 quant" in msg and "Q4_K_M" in msg and "Exl2Quant(" not in msg


def test_recipe_name_reaches_paths_so_it_is_checked(tmp_path):
    msg = _error(tmp_path, "name: ../../etc/x\n" + GOOD)
    assert "r.yaml:1" in msg and "name" in msg and "letters, digits" in msg


def test_defaults_file_and_schema_defaults_agree():
    """A recipe outside recipes/ gets the schema's defaults, one inside gets defaults.yaml:
    they must be the same values, so where a recipe lives does not change what it means."""
    import yaml

    from playbooks.config.recipe import Recipe

    defaults = yaml.safe_load((RECIPES_DIR / "defaults.yaml").read_text())

    def check(model, values, where):
        for key, value in values.items():
            field = model.model_fields[key]
            if isinstance(value, dict):
                check(type(field.default), value, f"{where}{key}.")
            else:
                assert field.default == value, f"{where}{key}: schema {field.default!r} vs defaults.yaml {value!r}"

    check(Recipe, defaults, "")


def test_speculation_types_are_llama_servers_own(tmp_path):
    """spec_type reaches llama-server's --spec-type: only the pinned ref's names, a draft for
    draft-simple, and llama.cpp recipes only."""
    from playbooks.steps.serve.engine_llamacpp import llama_server_argv
    from playbooks.steps.serve.units import ServerLayout

    ok = load_recipe(_write(tmp_path, GOOD + "spec_type: ngram-mod\n")).recipe
    argv = llama_server_argv(ok, ServerLayout(prefix="/opt/vf"))[0]
    assert argv[argv.index("--spec-type") + 1] == "ngram-mod"
    assert "--spec-type" not in llama_server_argv(load_recipe(_write(tmp_path, GOOD)).recipe, ServerLayout())[0]
    msg = _error(tmp_path, GOOD + "spec_type: ngram-magic\n")
    assert "r.yaml:9" in msg and "spec_type" in msg and "ngram-mod" in msg
    assert "draft-simple needs a draft model" in _error(tmp_path, GOOD + "spec_type: draft-simple\n")
    body = GOOD.replace("backend: llamacpp", "backend: exllamav2").replace("quant: Q4_K_M", "quant: {bpw: 4.0}")
    msg = _error(tmp_path, body + "cache: {k: Q8, v: Q8}\nspec_type: ngram-mod\n")
    assert "speculative decoding is llama-server's" in msg
    # a draft beside an n-gram type would be loaded and never used
    draft = "draft: {model: {repo: a/b, revision: " + "a" * 40 + ", config: {model_type: llama}}}\n"
    msg = _error(tmp_path, GOOD + draft + "spec_type: ngram-mod\n")
    assert "a draft model is used by spec_type draft-simple, not ngram-mod" in msg


def test_threads_reach_llama_server_and_its_draft(tmp_path):
    """threads: -t and -tb (and the draft's own pair when there is a draft); llama.cpp only."""
    from playbooks.steps.serve.engine_llamacpp import llama_server_argv
    from playbooks.steps.serve.units import ServerLayout

    argv = llama_server_argv(load_recipe(_write(tmp_path, GOOD + "threads: 3\n")).recipe, ServerLayout())[0]
    assert argv[argv.index("--threads") + 1] == argv[argv.index("--threads-batch") + 1] == "3"
    assert "--spec-draft-threads" not in argv
    assert "--threads" not in llama_server_argv(load_recipe(_write(tmp_path, GOOD)).recipe, ServerLayout())[0]
    assert "threads: Input should be greater than or equal to 1" in _error(tmp_path, GOOD + "threads: 0\n")
    body = GOOD.replace("backend: llamacpp", "backend: exllamav2").replace("quant: Q4_K_M", "quant: {bpw: 4.0}")
    assert "threads: is llama.cpp's -t" in _error(tmp_path, body + "cache: {k: Q8, v: Q8}\nthreads: 2\n")


def test_a_draft_with_another_tokenizer_is_refused_before_anything_is_made(tmp_path):
    """llama.cpp's own rule (common/speculative.cpp: vocabularies within 128 tokens): a Llama
    draft (vocabulary 32000) for Qwen2.5-14B (152064) is one line at load, before any step;
    Qwen2.5-0.5B (151936, the same tokenizer, a smaller padded embedding) is accepted."""
    (tmp_path / "models").mkdir(exist_ok=True)
    (tmp_path / "models" / "d.json").write_text((RECIPES_DIR / "models/qwen2.5-0.5b-instruct.config.json").read_text())
    draft = "draft:\n  model:\n    path: /srv/draft\n    config: models/{}\n  quant: Q8_0\nspec_type: draft-simple\n"
    ok = load_recipe(_write(tmp_path, GOOD + draft.format("d.json")))
    assert ok.draft_shape is not None and ok.draft_shape.vocab_size == 151936
    msg = _error(tmp_path, GOOD + draft.format("small.json"))
    assert "r.yaml:9" in msg and "vocabulary" in msg and "llama.cpp allows at most 128" in msg


def test_a_model_is_served_by_a_name_a_person_recognises(tmp_path):
    """The served name (llama-server --alias, TabbyAPI's model directory): the repo's last part,
    the generated model's name, a local directory's name made safe, or the recipe's own."""
    assert load_recipe(_write(tmp_path, GOOD)).recipe.served_name == "Qwen2.5-14B-Instruct"
    assert load_recipe("tiny-cpu").recipe.served_name == "tiny-llama"
    local = GOOD.replace(
        "  repo: Qwen/Qwen2.5-14B-Instruct\n  revision: main\n", "  path: /srv/models/My Model (v2)/\n"
    )
    assert load_recipe(_write(tmp_path, local)).recipe.served_name == "My-Model--v2"
    named = load_recipe(_write(tmp_path, GOOD + "service:\n  model_name: qwen14b.lab_1\n")).recipe
    assert named.served_name == "qwen14b.lab_1"
    assert "--alias qwen14b.lab_1 " in " ".join(llama_server_argv(named, ServerLayout())[0]) + " "


@pytest.mark.parametrize("name", ["qwen/14b", "../up", "-dash", "a b", "x" * 129, "ümlaut"])
def test_a_served_name_a_backend_cannot_carry_is_one_line(tmp_path, name):
    msg = _error(tmp_path, GOOD + f"service:\n  model_name: {json.dumps(name)}\n")
    assert "service.model_name" in msg and "cannot be served as a model name" in msg, msg


@pytest.mark.parametrize("bind", ["10.0.0.5", "127.0.0.2", "::"])
def test_a_server_binds_loopback_or_every_address(tmp_path, bind):
    """deploy, the gate and status reach a server at 127.0.0.1 on its host: one other address
    would leave them unanswered (the deploy would roll back after its /health wait)."""
    msg = _error(tmp_path, GOOD + f"service:\n  bind: '{bind}'\n  api_key_ref: k\n")
    assert f"bind {bind}: a server binds 127.0.0.1 (its host only) or 0.0.0.0" in msg, msg
