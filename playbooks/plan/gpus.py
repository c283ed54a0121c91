"""The GPU catalog: memory, bandwidth, compute capability, BF16.

Memory is in GiB (2^30 bytes), as the cards are sold ("16 GB" V100 = 16 GiB = 17.18 GB);
bandwidth in GB/s (1e9 bytes/s), as vendors state it. Figures are NVIDIA's datasheet values.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from playbooks.errors import VoltaforgeError

GIB = 1 << 30
MIB = 1 << 20


class Gpu(BaseModel):
    model_config = ConfigDict(frozen=True)

    key: str
    name: str
    memory_gib: float
    bandwidth_gb_s: float
    compute_capability: tuple[int, int]
    bf16: bool
    is_cpu: bool = False
    # dense FP16 tensor-core peak (TFLOPS, datasheet): the prefill ceiling's denominator; None
    # where voltaforge has no datasheet figure it trusts
    fp16_tensor_tflops: float | None = None

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    @property
    def sm(self) -> str:
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"


_CATALOG = [
    Gpu(
        key="v100-sxm2-16gb",
        name="Tesla V100-SXM2-16GB",
        memory_gib=16,
        bandwidth_gb_s=900,
        compute_capability=(7, 0),
        bf16=False,
        fp16_tensor_tflops=125,
    ),
    Gpu(
        key="v100-pcie-16gb",
        name="Tesla V100-PCIE-16GB",
        memory_gib=16,
        bandwidth_gb_s=900,
        compute_capability=(7, 0),
        bf16=False,
        fp16_tensor_tflops=112,
    ),
    Gpu(
        key="v100-sxm2-32gb",
        name="Tesla V100-SXM2-32GB",
        memory_gib=32,
        bandwidth_gb_s=900,
        compute_capability=(7, 0),
        bf16=False,
        fp16_tensor_tflops=125,
    ),
    Gpu(
        key="v100-pcie-32gb",
        name="Tesla V100-PCIE-32GB",
        memory_gib=32,
        bandwidth_gb_s=900,
        compute_capability=(7, 0),
        bf16=False,
        fp16_tensor_tflops=112,
    ),
    Gpu(
        key="p100-16gb",
        name="Tesla P100-PCIE-16GB",
        memory_gib=16,
        bandwidth_gb_s=732,
        compute_capability=(6, 0),
        bf16=False,
    ),
    Gpu(key="p40", name="Tesla P40", memory_gib=24, bandwidth_gb_s=347, compute_capability=(6, 1), bf16=False),
    Gpu(key="t4", name="Tesla T4", memory_gib=16, bandwidth_gb_s=320, compute_capability=(7, 5), bf16=False),
    Gpu(
        key="rtx-3090",
        name="NVIDIA GeForce RTX 3090",
        memory_gib=24,
        bandwidth_gb_s=936,
        compute_capability=(8, 6),
        bf16=True,
    ),
    Gpu(
        key="rtx-4090",
        name="NVIDIA GeForce RTX 4090",
        memory_gib=24,
        bandwidth_gb_s=1008,
        compute_capability=(8, 9),
        bf16=True,
    ),
    Gpu(
        key="a100-40gb",
        name="NVIDIA A100-SXM4-40GB",
        memory_gib=40,
        bandwidth_gb_s=1555,
        compute_capability=(8, 0),
        bf16=True,
        fp16_tensor_tflops=312,
    ),
    Gpu(
        key="a100-80gb",
        name="NVIDIA A100-SXM4-80GB",
        memory_gib=80,
        bandwidth_gb_s=2039,
        compute_capability=(8, 0),
        bf16=True,
        fp16_tensor_tflops=312,
    ),
    Gpu(
        key="h200",
        name="NVIDIA H200",
        memory_gib=141 * 1e9 / GIB,
        bandwidth_gb_s=4800,
        compute_capability=(9, 0),
        bf16=True,
    ),
    # Not a GPU: the budget of the tiny CPU recipe. 20 GB/s is what a 2-core Debian VM read
    # (16-24 GB/s, docs/knowledge.md section 8); memory is a budget, not the machine's RAM.
    Gpu(
        key="cpu",
        name="host CPU (llama.cpp CPU build)",
        memory_gib=4,
        bandwidth_gb_s=20,
        compute_capability=(0, 0),
        bf16=False,
        is_cpu=True,
    ),
]

# Short names a user types. V100 SXM2 and PCIe share memory size and bandwidth (900 GB/s).
# A name that would match cards of different memory ("v100": 16 or 32 GB; "a100": 40 or 80 GB)
# is no alias: get_gpu refuses it and lists the cards it could mean.
ALIASES = {
    "v100-16gb": "v100-sxm2-16gb",
    "v100-32gb": "v100-sxm2-32gb",
    "p100": "p100-16gb",
    "3090": "rtx-3090",
    "4090": "rtx-4090",
}

GPUS: dict[str, Gpu] = {g.key: g for g in _CATALOG}
#: nvidia-smi's names, lower case, with and without the vendor word ("tesla v100-pcie-32gb")
_BY_NAME: dict[str, Gpu] = {g.name.lower(): g for g in _CATALOG} | {
    g.name.lower().split(" ", 1)[-1]: g for g in _CATALOG
}


def gpu_names() -> list[str]:
    return sorted(set(GPUS) | set(ALIASES))


def get_gpu(name: str) -> Gpu:
    """A card by its key (``v100-pcie-32gb``), an alias (``v100-32gb``) or the name nvidia-smi
    prints (``Tesla V100-PCIE-32GB``, with or without the vendor word)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key in GPUS:
        return GPUS[key]
    if key.strip() in _BY_NAME:
        return _BY_NAME[key.strip()]
    candidates = [n for n in gpu_names() if key and key in n]
    if len(candidates) > 1:
        raise VoltaforgeError(f"GPU {name!r} matches several cards: {', '.join(candidates)}; name one of them")
    raise VoltaforgeError(f"unknown GPU {name!r}; known: {', '.join(gpu_names())}")


def gpu_from_nvidia_name(product_name: str, memory_mib: int | None = None) -> Gpu | None:
    """Match an nvidia-smi product name ('Tesla V100-SXM2-16GB') to the catalog."""
    wanted = product_name.strip().lower()
    for gpu in _CATALOG:
        if gpu.name.lower() == wanted:
            return gpu
    if "v100" in wanted:
        big = memory_mib is not None and memory_mib > 20000 or "32gb" in wanted
        form = "pcie" if "pcie" in wanted else "sxm2"
        return GPUS[f"v100-{form}-{'32' if big else '16'}gb"]
    return None


def mem_text(b: int) -> str:
    """Binary size with its unit, as memory is sold and reported: GiB for real models, MiB for
    the tiny ones."""
    return f"{b / GIB:.2f} GiB" if b >= 100 * MIB else f"{b / MIB:.1f} MiB"


def size_text(b: int) -> str:
    """Decimal size with its unit: GB for real models, MB for the tiny ones."""
    return f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.2f} MB"
