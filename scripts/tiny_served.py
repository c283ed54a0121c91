"""The server the bench scripts measure (bench_stability, bench_noise, bench_proof): one
generated Llama large enough to be memory-bound on a CPU (8 layers, hidden 1024, random
weights, Q8_0, about 100 MB), served by `invoke deploy` as a managed process on a `local: true`
inventory entry with its own prefix in a fresh work directory.

    with served("stab", parallel=4, levels=(1, 2, 4), recipe_name="bench-stability") as s:
        run_bench("stab", str(s.recipe), settings=s.settings)

Each script keeps its own measuring; this module is only the set-up and the clean-up they
share, so the three measure the same server.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from playbooks.cli.deploy import run_deploy, run_stop  # noqa: E402
from playbooks.conduct.settings import Settings  # noqa: E402
from playbooks.host.local import LocalHost  # noqa: E402
from playbooks.modelgen.tinymodel import write_tiny_llama  # noqa: E402
from tests import llamacpp_tools  # noqa: E402
from tests.helpers import stage_served_model  # noqa: E402
from tests.testhosts import free_port  # noqa: E402

MODEL = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
         "num_key_value_heads": 8}  # fmt: skip
#: what the scripts' notes say of it
DESCRIPTION = "8-layer hidden-1024 Llama, random weights, Q8_0, llama-server as a managed process on this machine"


@dataclass
class Served:
    name: str  # the inventory entry
    work: Path
    prefix: str
    port: int
    inventory: Path
    settings: Settings
    parallel: int
    levels: tuple[int, ...]
    recipe_name: str  # the recipe's file name, and so its name in reports and histories
    recipe: Path = Path()
    model_mb: float = 0.0
    f16: Path = Path()  # the converted model every quant is made from
    staged: set[str] = field(default_factory=set)  # the quants staged under the prefix

    def write_recipe(
        self, threads: int | None = None, quant: str = "Q8_0", other: bool = False, layers: int | None = None
    ) -> Path:
        """The served recipe (``threads``, ``quant``: a changed one, written over the same file;
        ``other``: a recipe of its own beside it, named for its quant, for `bench --against`;
        ``layers``: the model that deep instead)."""
        data = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())
        data["model"]["config"] |= MODEL | ({"num_hidden_layers": layers} if layers else {})
        data |= {"quant": quant, "parallel": self.parallel, "service": {"port": self.port}}
        if threads:
            data["threads"] = threads
        data["gate"] = {"levels": list(self.levels), "prompt_tokens": 64, "max_tokens": 64, "min_tok_s": 1.0}
        where = self.work / "against" if other else self.work
        where.mkdir(exist_ok=True)
        (where / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
        tag = f"{quant.lower()}" + (f"-{layers}l" if layers else "")
        path = where / (f"{self.recipe_name}-{tag}.yaml" if other else f"{self.recipe_name}.yaml")
        path.write_text(yaml.safe_dump(data))
        if not other:
            self.recipe = path
        return path

    def other(self, quant: str) -> Path:
        """A recipe of its own at ``quant`` (staged), for `bench --against` beside the served one."""
        self.stage(quant)
        return self.write_recipe(quant=quant, other=True)

    def shallower(self, layers: int, quant: str = "Q8_0") -> Path:
        """A recipe of its own whose model is ``layers`` deep (made and staged once), for `bench
        --against`: a change whose size the depth fixes on any machine (a token's bytes and work
        alike), where a change of quant is sized by the CPU (Q6_K reads 0.77x Q8_0's bytes and
        costs more to unpack)."""
        recipe = self.write_recipe(quant=quant, other=True, layers=layers)
        key = f"{quant}-{layers}l"
        if key not in self.staged:
            config = yaml.safe_load(recipe.read_text())["model"]["config"]
            work = self.work / key
            f16 = llamacpp_tools.convert_to_gguf(write_tiny_llama(work / "hf", config), work / "f16.gguf")
            gguf = llamacpp_tools.quantize(f16, work / f"m-{quant}.gguf", quant)
            with LocalHost() as host:
                stage_served_model(host, self.prefix, recipe, gguf, quant, tools=False)
            self.staged.add(key)
        return recipe

    def stage(self, quant: str) -> float:
        """``quant`` made from the F16 model (llama-quantize) and staged as `invoke quantize`
        leaves it, once; its size in MB."""
        gguf = self.work / f"m-{quant}.gguf"
        if quant not in self.staged:
            llamacpp_tools.quantize(self.f16, gguf, quant)
            with LocalHost() as host:  # the tools once: replaced under a running server, its stop would not know it
                first = not self.staged
                stage_served_model(host, self.prefix, self.write_recipe(quant=quant), gguf, quant, tools=first)
            self.staged.add(quant)
        return gguf.stat().st_size / 1e6

    def deploy(self, threads: int | None = None, quant: str = "Q8_0") -> None:
        self.stage(quant)
        with contextlib.redirect_stdout(io.StringIO()):
            assert run_deploy(self.name, str(self.write_recipe(threads, quant)), settings=self.settings) == 0


@contextlib.contextmanager
def served(name: str, parallel: int, levels: Sequence[int], recipe_name: str, keep: bool = False) -> Iterator[Served]:
    """The model made, staged and deployed; stopped and its work directory removed at the end
    (``keep``: the directory stays)."""
    work = Path(tempfile.mkdtemp(prefix=f"vf-{name}-"))
    prefix = str(work / "vf")
    inventory = work / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {name: {"host": "127.0.0.1", "local": True, "prefix": prefix}}}))
    s = Served(
        name, work, prefix, free_port(), inventory, Settings(inventory=inventory), parallel, tuple(levels), recipe_name
    )
    recipe = s.write_recipe()
    try:
        t0 = time.monotonic()
        config = yaml.safe_load(recipe.read_text())["model"]["config"]
        s.f16 = llamacpp_tools.convert_to_gguf(write_tiny_llama(work / "hf", config), work / "f16.gguf")
        s.model_mb = s.stage("Q8_0")
        print(f"model: {s.model_mb:.1f} MB Q8_0 ({time.monotonic() - t0:.0f} s to make)", flush=True)
        s.deploy()
        yield s
    finally:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(Exception):
            run_stop(name, str(s.recipe), settings=s.settings)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
