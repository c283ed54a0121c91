"""Where a model's files live on the host (``<prefix>/models/<model id>/``), what the sample
of calibration text is, and where each artifact's manifest is: what every weights step and
the deploy step agree on (the package's description, steps/weights/__init__.py, has the whole tree)."""

from __future__ import annotations

from dataclasses import dataclass

SOURCE_MANIFEST = ".voltaforge-source.json"
#: how many 128-token chunks imatrix and the KL divergence read (a small, fixed sample)
CALIBRATION_CHUNKS = 20
CALIBRATION_CTX = 128


@dataclass(frozen=True)
class ModelLayout:
    prefix: str
    model_id: str

    @property
    def root(self) -> str:
        return f"{self.prefix}/models/{self.model_id}"

    @property
    def hf(self) -> str:
        return f"{self.root}/hf"

    @property
    def gguf_dir(self) -> str:
        return f"{self.root}/gguf"

    def gguf(self, quant: str) -> str:
        return f"{self.gguf_dir}/{self.model_id}-{quant}.gguf"

    @property
    def imatrix(self) -> str:
        return f"{self.gguf_dir}/imatrix.gguf"

    @property
    def calibration(self) -> str:
        return f"{self.root}/calibration.txt"

    @property
    def prompt(self) -> str:
        return f"{self.root}/prompt.txt"

    @property
    def kld_base(self) -> str:
        return f"{self.gguf_dir}/F16.kld"


def manifest_path(artifact: str) -> str:
    return f"{artifact}.manifest.json"
