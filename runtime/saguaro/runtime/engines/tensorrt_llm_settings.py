"""The settings of a TensorRT-LLM target, as the build config and the manifest hold them.

Apart from `tensorrt_llm_target` so that the build config can read them without loading
the decoding loops.
"""
from __future__ import annotations

from dataclasses import dataclass

DRAFT_BACKENDS = ("onnxruntime", "tensorrt")


@dataclass(frozen=True)
class TensorRTLLMSettings:
    """The build config's `tensorrt_llm` section: how the draft is built, and the `LLM`'s
    arguments. `single_process` keeps TensorRT-LLM's executor (and so the drafter) in the
    calling process, so the drafter's SSD figures (cache hits, draft time) reach the
    caller; otherwise TensorRT-LLM pickles the drafter into its worker process, where it
    loads the draft engine again, and only the target's own figures come back."""

    draft_backend: str = "tensorrt"
    max_batch_size: int = 8
    kv_cache_free_gpu_memory_fraction: float = 0.5
    single_process: bool = True

    def __post_init__(self):
        if self.draft_backend not in DRAFT_BACKENDS:
            raise ValueError(f"tensorrt_llm.draft_backend={self.draft_backend!r} is not one of "
                             f"{', '.join(DRAFT_BACKENDS)}")
        if not (isinstance(self.max_batch_size, int) and self.max_batch_size >= 1):
            raise ValueError(f"tensorrt_llm.max_batch_size={self.max_batch_size!r} must be an integer >= 1")
        if not 0 < self.kv_cache_free_gpu_memory_fraction <= 1:
            raise ValueError(f"tensorrt_llm.kv_cache_free_gpu_memory_fraction="
                             f"{self.kv_cache_free_gpu_memory_fraction!r} must be in (0, 1]")

    @classmethod
    def from_manifest(cls, manifest: dict) -> "TensorRTLLMSettings":
        return cls(**manifest["build"]["tensorrt_llm"])
