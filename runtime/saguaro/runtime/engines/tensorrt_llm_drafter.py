"""`SsdDrafter` as TensorRT-LLM's `Drafter` (imported only where `tensorrt_llm` is installed).

A module of its own so that the class is importable by name: TensorRT-LLM pickles the
`LLM`'s arguments, the drafter among them, into its worker process unless the executor
runs in the calling process.

`Drafter` is imported from `tensorrt_llm._torch.speculative.drafter`: no public module of
any admitted version exports it (`tensorrt_llm_api` says which versions, and how its
constructor differs between them).
"""
from __future__ import annotations

from tensorrt_llm._torch.speculative.drafter import Drafter

from saguaro.runtime.engines.tensorrt_llm_api import init_drafter_base


class TensorRTLLMDrafter(Drafter):
    """Hands each scheduled generation-phase request to `SsdDrafter.prepare`."""

    # Verified by TensorRT-LLM's TorchSampler, whose KV rewind follows the padded draft
    # length (as for its own host-side drafters). The drafter always gives K tokens, so
    # the padding to the maximum adds none. (Read by the versions that have it.)
    _needs_padding_kv_extension = True

    def __init__(self, ssd):
        init_drafter_base(self, Drafter, ssd.k)
        self.ssd = ssd

    def prepare_draft_tokens(self, scheduled_requests, resource_manager=None) -> None:
        self.ssd.prepare(scheduled_requests.generation_requests)
