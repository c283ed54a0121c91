"""The recipe's schema: what one YAML file of a deployable configuration may say, each field
validated by pydantic (its type, its range, and the refusals that need only the recipe itself:
a quant the engine cannot make, a split the planner does not plan). Loading it (merging over
recipes/defaults.yaml, resolving names and the model's shape, the checks that need the shape)
is config/recipe.py, which is where callers import these names from."""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from playbooks.config.inventory import HOST_NAME_RE, check_bind
from playbooks.config.secret_names import check_secret_ref
from playbooks.plan.engines import engine
from playbooks.plan.exl2_size import EXL2_BPW_RANGE, HEAD_BITS_OPTIONS, exl2_quant_name
from playbooks.plan.gguf_size import FILE_TYPES
from playbooks.plan.gpus import get_gpu, gpu_names
from playbooks.plan.objective import MIN_BPW, MIN_TOK_S
from playbooks.plan.split import device_count, split_mode_refusal

#: the prompt length of gate.workload: long when the recipe names none
LONG_PROMPT_TOKENS = 2048
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_REV_RE = re.compile(r"^[0-9a-f]{40}$")
_REF_RE = re.compile(r"^[A-Za-z0-9._/+-]{1,100}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSource(_Strict):
    """Where the weights come from and what shape they have."""

    repo: str | None = Field(None, description="Hugging Face repo id, e.g. Qwen/Qwen2.5-32B-Instruct")
    revision: str | None = Field(None, description="pinned commit sha (40 hex) of the repo")
    path: str | None = Field(None, description="local directory with the weights instead of a repo")
    config: str | dict[str, Any] | None = Field(
        None, description="config.json: a file (relative to the recipe) or the JSON inline"
    )
    generate: Literal["tiny-llama"] | None = Field(
        None, description="generate a tiny random model (tests and the demo)"
    )
    fp16_overflow: Literal["refuse", "clamp"] = Field(
        "refuse",
        description="BF16 weights beyond FP16's range (V100 has no BF16): refuse, or clamp them to the largest "
        "FP16-safe value before conversion",
    )
    token_file: str | None = Field(
        None,
        description="a file on the host holding a Hugging Face token (mode 0600), for gated or private repos: "
        "an absolute path, or ~/... in the SSH user's home",
    )
    calibration: str | None = Field(
        None,
        description="the text llama-imatrix and the KL divergence read: a file on the controller, relative to "
        "the recipe (default: the shipped recipes/calibration/general.txt; the tiny model: its own words)",
    )

    @field_validator("token_file")
    @classmethod
    def _token_file(cls, v):
        if v is not None and not re.fullmatch(r"(/|~/)[A-Za-z0-9._/-]+", v):
            raise ValueError("must be an absolute path (or ~/... on the host) of letters, digits and . _ / -")
        return v

    @field_validator("repo")
    @classmethod
    def _repo(cls, v):
        if v is not None and not _REPO_RE.match(v):
            raise ValueError("must look like 'owner/name' (letters, digits, . _ -)")
        return v

    @field_validator("revision")
    @classmethod
    def _revision(cls, v):
        if v is not None and not _REF_RE.match(v):
            raise ValueError("must be a commit sha, tag or branch (letters, digits, . _ / -)")
        return v

    @property
    def pinned(self) -> bool:
        """A 40-hex commit sha pins the weights; a branch such as 'main' moves."""
        return self.revision is not None and bool(_REV_RE.match(self.revision))

    @model_validator(mode="after")
    def _one_source(self):
        sources = [s for s in ("repo", "path", "generate") if getattr(self, s)]
        if len(sources) != 1:
            raise ValueError("give exactly one of repo (with revision), path or generate")
        if self.repo and not self.revision:
            raise ValueError(
                "repo needs a revision: a 40-hex commit sha pins it (a branch name is accepted and flagged)"
            )
        if self.config is None:
            raise ValueError("config is required: a config.json file or the config inline, so plans need no download")
        return self


class Exl2Quant(_Strict):
    bpw: float = Field(description="EXL2 bits per weight, 2.0-8.0")
    head_bits: int = 6

    @field_validator("bpw")
    @classmethod
    def _bpw(cls, v):
        lo, hi = EXL2_BPW_RANGE
        if not lo <= v <= hi:
            raise ValueError(f"EXL2 bpw must be between {lo} and {hi}")
        return v

    @field_validator("head_bits")
    @classmethod
    def _head_bits(cls, v):
        if v not in HEAD_BITS_OPTIONS:
            raise ValueError(f"head_bits must be one of {', '.join(map(str, HEAD_BITS_OPTIONS))}")
        return v

    @property
    def name(self) -> str:
        return exl2_quant_name(self.bpw)


class Cache(_Strict):
    k: str = "f16"
    v: str = "f16"


class Draft(_Strict):
    model: ModelSource
    quant: str = "Q8_0"


class Toolchain(_Strict):
    cuda: str = "11.8"
    torch: str = "2.7.1+cu118"
    torch_index: str = "https://download.pytorch.org/whl/cu118"
    torch_find_links: str | None = Field(None, description="a local wheel directory (offline hosts, tests)")
    llamacpp_ref: str = "0c1e570"
    llamacpp_sdist: str = "llama-cpp-python==0.3.36"
    exllamav2: str = "0.3.2"
    # TabbyAPI (the OpenAI-compatible server for EXL2): the last commit with its ExLlamaV2
    # backend (2026-06-27; c8b9a8f of 2026-07-14 removed it). A full sha: hosts fetch it by sha.
    tabbyapi_repo: str = "https://github.com/theroyallab/tabbyAPI"
    tabbyapi_ref: str = "79126f904c2e00aece026b36bb70bbb87e4892b2"
    cuda_arch: str = "70"

    @field_validator("cuda")
    @classmethod
    def _cuda(cls, v):
        m = re.fullmatch(r"(\d+)\.(\d+)", v)
        if not m:
            raise ValueError("must be MAJOR.MINOR, e.g. '11.8'")
        return v

    @field_validator("torch_index", "tabbyapi_repo")
    @classmethod
    def _index(cls, v):
        if v and not re.fullmatch(r"https?://[A-Za-z0-9._~:/?#@!$&()*+,;=%-]+", v):
            raise ValueError("must be an http(s) URL")
        return v

    @field_validator("torch_find_links")
    @classmethod
    def _find_links(cls, v):
        if v is not None and not re.fullmatch(r"/[A-Za-z0-9._/-]*", v):
            raise ValueError("must be an absolute path of letters, digits and . _ / -")
        return v

    @field_validator("llamacpp_ref", "exllamav2", "torch", "cuda_arch", "tabbyapi_ref")
    @classmethod
    def _ref(cls, v):
        if not _REF_RE.match(v):
            raise ValueError("may hold only letters, digits and . _ / + - (it reaches a shell)")
        return v


#: a served model name every backend can carry: llama-server's --alias, TabbyAPI's model
#: directory (a file name), an OpenAI model id in a URL path
SERVED_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def served_name_of(model: ModelSource, chosen: str | None) -> str:
    """The model's name as clients see it: ``chosen``, else the last part of the repo id, the
    generated model's name, or the local directory's name (characters outside the served set
    become ``-``)."""
    if chosen:
        return chosen
    if model.repo:
        name = model.repo.rsplit("/", 1)[-1]
    elif model.generate:
        name = model.generate
    else:
        name = (model.path or "model").rstrip("/").rsplit("/", 1)[-1]
    name = re.sub(r"[^A-Za-z0-9._-]", "-", name).strip(".-")[:128]
    return name or "model"


#: the addresses a server may bind (Service._reachable_on_loopback says why these)
SERVER_BINDS = ("127.0.0.1", "0.0.0.0")


class Service(_Strict):
    bind: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    api_key_ref: str | None = Field(None, description="name of a secret file on the host (never the key itself)")
    model_name: str | None = Field(
        None,
        description="the name clients ask for (/v1/models, every answer's `model`); unset: the last part of "
        "the Hugging Face repo id, the generated model's name, or the local directory's name",
    )

    @field_validator("bind")
    @classmethod
    def _bind(cls, v):
        return check_bind(v)

    @field_validator("api_key_ref")
    @classmethod
    def _api_key_ref(cls, v):
        return check_secret_ref(v)

    @field_validator("model_name")
    @classmethod
    def _model_name(cls, v):
        # llama-server's --alias, TabbyAPI's model directory name and a URL-safe id alike
        if v is not None and not SERVED_NAME_RE.fullmatch(v):
            raise ValueError(
                f"{v!r} cannot be served as a model name: use letters, digits, . _ and - "
                "(at most 128, not starting with . or -)"
            )
        return v

    @model_validator(mode="after")
    def _reachable_on_loopback(self):
        # deploy's /health, the gate's port forward, the no-op and `invoke status` reach a server
        # at 127.0.0.1 on its host: one bound to another single address would not answer them
        if self.bind not in SERVER_BINDS:
            raise ValueError(
                f"bind {self.bind}: a server binds 127.0.0.1 (its host only) or 0.0.0.0 (the network, with "
                "api_key_ref); voltaforge checks it at 127.0.0.1 on its host, which one other address would not answer"
            )
        return self

    @model_validator(mode="after")
    def _exposed_needs_key(self):
        if not ipaddress.ip_address(self.bind).is_loopback and not self.api_key_ref:
            raise ValueError(f"binding {self.bind} (not loopback) needs api_key_ref: an open port without a key")
        return self


class RpcWorker(_Strict):
    """One llama.cpp RPC server that holds layers of this recipe's model (llama-server --rpc).

    The RPC protocol has no authentication and no encryption: whoever reaches the port can
    read and write the worker's memory. So the worker binds to exactly `endpoint`'s address
    (never 0.0.0.0 or ::), and its unit accepts connections only from loopback and from the
    addresses in `allow_from` (systemd's IPAddressAllow); a worker on another address must
    name the main server's address there."""

    endpoint: str = Field(description="ADDRESS:PORT the worker listens on and llama-server dials")
    worker: str | None = Field(
        None,
        description="the inventory host that runs it (`invoke rpc-worker --host NAME`); unset: started by hand",
    )
    allow_from: list[str] = Field(
        default_factory=list, description="addresses besides loopback allowed to connect (the main server's)"
    )
    gpu: int = Field(0, ge=0, le=63, description="the worker host's GPU index it serves (a GPU recipe)")

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v):
        addr, sep, port = v.rpartition(":")
        addr = addr.strip("[]")
        try:
            ip = ipaddress.ip_address(addr)
        except ValueError:
            raise ValueError("must be IP:PORT, e.g. 127.0.0.1:50052 or [fd00::2]:50052") from None
        if not sep or not port.isdigit() or not 1024 <= int(port) <= 65535:
            raise ValueError("needs a port from 1024 to 65535, e.g. 127.0.0.1:50052")
        if ip.is_unspecified:
            raise ValueError("must be one address, not 0.0.0.0 or :: (the RPC protocol has no authentication)")
        return v

    @field_validator("worker")
    @classmethod
    def _worker(cls, v):
        if v is not None and not HOST_NAME_RE.match(v):
            raise ValueError("must be an inventory host name (letters, digits, . _ -)")
        return v

    @field_validator("allow_from")
    @classmethod
    def _allow_from(cls, v):
        for a in v:
            try:
                ipaddress.ip_network(a, strict=False)
            except ValueError:
                raise ValueError(f"{a!r} is not an IP address or network") from None
        return v

    @model_validator(mode="after")
    def _reachable_only_by_the_server(self):
        if not self.ip.is_loopback and not self.allow_from:
            raise ValueError(
                f"a worker on {self.address} (not loopback) needs allow_from: the main server's address "
                "(the RPC protocol has no authentication)"
            )
        return self

    @property
    def address(self) -> str:
        return self.endpoint.rpartition(":")[0].strip("[]")

    @property
    def ip(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        return ipaddress.ip_address(self.address)

    @property
    def port(self) -> int:
        return int(self.endpoint.rpartition(":")[2])


class Gate(_Strict):
    min_tok_s: float = Field(0, ge=0, description="minimum single-stream decode tok/s")
    min_roofline_fraction: float = Field(0, ge=0, le=1, description="minimum measured/roofline ratio (MBU)")
    min_aggregate_tok_s: float = Field(0, ge=0)
    at_concurrency: int = Field(4, ge=1)
    max_ttft_ms: float = Field(0, ge=0, description="0: not gated")
    # the sweep `invoke bench` runs
    levels: list[int] = Field([1, 2, 4, 8], min_length=1, description="concurrency levels, rising")
    prompt_tokens: int = Field(128, ge=8, le=32768, description="tokens of each prompt")
    max_tokens: int = Field(64, ge=8, le=8192, description="tokens generated per request (EOS ignored)")
    # each level repeats rounds (one request per stream) after a warm-up round, until the 95%
    # confidence half-width of its per-stream decode is within ci_target of the mean, between
    # these two counts
    requests_per_level: int = Field(
        0, ge=0, description="fewest requests per level; 0: twice the concurrency, at least 4"
    )
    max_requests_per_level: int = Field(
        0, ge=0, le=4096, description="most requests per level; 0: 8 x the concurrency, at least 16"
    )
    ci_target: float = Field(
        0.02, gt=0, le=1, description="stop repeating at this 95% half-width, as a share of the mean decode"
    )
    run_noise: float | None = Field(
        None,
        ge=0,
        le=1,
        description="how far a run's mean moves between runs of an unchanged server, as a share (relative "
        "standard deviation); `bench --compare` and tune count it in every comparison of runs. Default: the "
        "host's own figure, pooled from its bench history (`invoke bench --noise 6` measures it)",
    )
    workload: Literal["chat", "code", "long"] = Field(
        "chat",
        description="what the prompts are cut from: chat (prose, dialogue and questions, words), code "
        "(source files, laid out), long (the prose laid out, prompts of 2048 tokens unless prompt_tokens "
        "says otherwise); speculation pays most on code and repeated text",
    )

    @model_validator(mode="before")
    @classmethod
    def _long_prompts(cls, data):
        # a long-context workload: long prompts unless the recipe named a length
        if isinstance(data, dict) and data.get("workload") == "long" and "prompt_tokens" not in data:
            data = {**data, "prompt_tokens": LONG_PROMPT_TOKENS}
        return data

    @field_validator("levels")
    @classmethod
    def _levels(cls, v):
        if any(c < 1 or c > 256 for c in v) or sorted(set(v)) != v:
            raise ValueError("must be rising concurrency levels from 1 to 256, e.g. [1, 2, 4, 8]")
        return v


class PlannerSettings(_Strict):
    cuda_context_mib: int = Field(400, ge=0)
    margin_mib: int = Field(256, ge=0)
    n_ubatch: int = Field(512, gt=0)
    min_bpw: float = Field(MIN_BPW, gt=0, description="the recommendation's quality floor in bits per weight")
    min_tok_s: float | None = Field(
        MIN_TOK_S,
        gt=0,
        le=1e9,
        description="the recommendation's speed floor: the best quality whose single-stream decode roofline "
        "reaches this many tok/s; null: no floor, the fastest quant of at least min_bpw",
    )
    imatrix: bool = True
    max_kld: float | None = Field(
        None, gt=0, description="refuse a GGUF quant whose mean KL divergence against its F16 file is above this"
    )
    # MoE expert offload (n_cpu_moe): what the host side of the plan rests on when the host
    # itself is not asked (preflight measures the RAM; a bare `invoke plan` cannot)
    host_membw_gb_s: float | None = Field(
        None,
        gt=0,
        le=100000,
        description="host memory bandwidth in GB/s (1e9 B/s) for the two-sided roofline of experts kept in "
        "host RAM; unset: 50, the seed host's DDR4 figure",
    )
    host_ram_gib: float | None = Field(
        None, gt=0, le=1048576, description="host RAM (GiB) the offloaded experts + token_embd must fit; unset: unknown"
    )
    rpc_rtt_ms: float | None = Field(
        None,
        ge=0,
        le=10000,
        description="a split over RPC workers: the network round trip (ms) each worker adds to every token; "
        "unset: not counted by `invoke plan` (preflight measures it from the server's host)",
    )


class Recipe(_Strict):
    name: str
    description: str = ""
    model: ModelSource
    gpu: str
    gpu_count: int = Field(
        1,
        ge=1,
        le=16,
        description="cards of that kind one server spreads the model over (llama-server --split-mode layer; "
        "an EXL2 recipe: TabbyAPI's gpu_split, planned)",
    )
    split_mode: str = Field(
        "layer",
        description="how llama-server splits the model over the cards: layer (the one planned; row and "
        "tensor are refused with the reason, plan/split.py)",
    )
    tensor_split: list[float] | None = Field(
        None,
        description="each device's share of the layers (llama-server --tensor-split), RPC workers first; "
        "an EXL2 recipe: each card's share of the weights its gpu_split is planned for; unset: equal shares",
    )
    rpc: list[RpcWorker] = Field(
        default_factory=list,
        description="llama.cpp RPC servers that hold layers too (llama-server --rpc), each one device of the "
        "recipe's gpu kind, ahead of the local cards",
    )
    backend: Literal["llamacpp", "exllamav2"]
    quant: Exl2Quant | str
    context: int = Field(gt=0, description="tokens per slot")
    parallel: int = Field(1, gt=0)
    cache: Cache = Cache()
    flash_attn: bool = True
    n_cpu_moe: int | Literal["auto"] | None = Field(
        None,
        description="mixture-of-experts models, llama.cpp: keep the experts of the first N layers in host RAM "
        "(llama-server --n-cpu-moe N); auto: the smallest N that fits the GPU; unset: none",
    )
    batch: int | None = Field(
        None,
        gt=0,
        description="llama.cpp's logical batch (-b); unset: 2048, llama.cpp's default, which the planner assumes. "
        "The physical batch (-ub) is planner.n_ubatch: the value the compute buffer was planned with",
    )
    threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="llama.cpp's CPU threads for generation and for batches (-t and -tb; a draft model's too); "
        "unset: llama.cpp's default (every core, which on a busy or small host can wait on a descheduled one)",
    )
    draft: Draft | None = None
    # llama-server --spec-type (the pinned llama.cpp's common/speculative.cpp names): the
    # draft-free n-gram types need no weights; draft-simple needs `draft:`; draft-mtp a model
    # with its own multi-token-prediction layers. Unset: llama-server's own default (draft-simple
    # when a draft is given, else none).
    spec_type: (
        Literal["ngram-mod", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "draft-simple", "draft-mtp"] | None
    ) = None
    toolchain: Toolchain = Toolchain()
    service: Service = Service()
    gate: Gate = Gate()
    planner: PlannerSettings = PlannerSettings()

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        # the name becomes part of paths on the host (model directory, file names)
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}", v):
            raise ValueError("may hold letters, digits and . _ - (it names files on the host)")
        return v

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, v):
        try:
            get_gpu(v)
        except Exception:
            raise ValueError(f"unknown GPU; known: {', '.join(gpu_names())}") from None
        return v

    @field_validator("n_cpu_moe", mode="before")
    @classmethod
    def _n_cpu_moe(cls, v):
        # before pydantic: `true` would pass as 1 and "12" as 12
        if v is None or v == "auto":
            return v
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError("must be a number of layers (0 or more) or auto")
        return v

    @field_validator("quant", mode="before")
    @classmethod
    def _quant_shape(cls, v):
        if isinstance(v, (int, float)):
            raise ValueError("give a GGUF type (e.g. Q4_K_M) or {bpw: 3.3, head_bits: 6} for EXL2")
        return v

    @model_validator(mode="after")
    def _backend_consistency(self):
        # what differs between engines is each engine's to say (plan/engine_*.py)
        if why := engine(self.backend).recipe_refusal(self):
            raise ValueError(why)
        self._check_split()
        g = self.gate
        if g.prompt_tokens + g.max_tokens > self.context:
            long = " (workload long: 2048 unless gate.prompt_tokens says)" if g.workload == "long" else ""
            raise ValueError(
                f"gate: a prompt of {g.prompt_tokens} tokens and {g.max_tokens} out do not fit a slot of "
                f"{self.context} tokens (context){long}"
            )
        if self.batch is not None and self.batch < self.planner.n_ubatch:
            raise ValueError(
                f"batch: {self.batch} is below planner.n_ubatch {self.planner.n_ubatch}; llama.cpp needs -ub <= -b"
            )
        if self.draft is not None and self.draft.quant not in FILE_TYPES:
            raise ValueError(f"draft.quant: unknown GGUF quant {self.draft.quant!r}; allowed: {', '.join(FILE_TYPES)}")
        return self

    def _check_split(self) -> None:
        """gpu_count, rpc and tensor_split: what voltaforge plans and renders a split for."""
        cpu = get_gpu(self.gpu).is_cpu
        refusal = split_mode_refusal(self.split_mode)
        if refusal:
            raise ValueError(f"split_mode: {refusal}")
        if cpu and self.gpu_count > 1:
            raise ValueError(f"gpu_count: {self.gpu_count} cards of {self.gpu}: a CPU target has no cards to split")
        if self.tensor_split is not None and len(self.tensor_split) != self.device_count:
            raise ValueError(
                f"tensor_split: {len(self.tensor_split)} share(s) for {self.device_count} device(s) "
                "(one per RPC worker, then one per local card)"
            )
        if self.tensor_split is not None and (any(x < 0 for x in self.tensor_split) or not any(self.tensor_split)):
            raise ValueError("tensor_split: want non-negative shares, at least one above 0")
        endpoints = [w.endpoint for w in self.rpc]
        if len(set(endpoints)) != len(endpoints):
            raise ValueError("rpc: an endpoint is listed twice")
        if not self.split:
            return
        key = "rpc" if self.rpc else "gpu_count"
        served = engine(self.backend)
        if self.rpc and not served.takes_rpc:
            raise ValueError(
                f"rpc: RPC workers are llama.cpp's (an {served.weights_format} recipe splits over "
                "local cards: gpu_count)"
            )
        if self.draft is not None:
            raise ValueError(f"{key}: a draft model beside a split is not planned (remove draft:)")

    @property
    def device_count(self) -> int:
        """The devices llama.cpp spreads the layers over: the RPC workers, then the local cards
        (none on a CPU target)."""
        return device_count(len(self.rpc), self.gpu_count, get_gpu(self.gpu).is_cpu)

    @property
    def split(self) -> bool:
        """The model is split by layers: over several local cards, or onto RPC workers."""
        return self.gpu_count > 1 or bool(self.rpc)

    @property
    def quant_name(self) -> str:
        return self.quant if isinstance(self.quant, str) else self.quant.name

    @property
    def served_name(self) -> str:
        """The model's name on the API (service.model_name, else one from the model's source)."""
        return served_name_of(self.model, self.service.model_name)
