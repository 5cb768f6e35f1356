"""A loaded draft/target pair and the one entry point that scripts and servers call.

`Pipeline.load` opens either two Hugging Face checkpoints (torch engines) or a built
engine directory; `Pipeline.generate` validates a request completely before any model
runs, then dispatches to the decoding loop of its mode.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from saguaro.runtime.checkpoint import check_pair_compatible
from saguaro.runtime.decoding import Cancelled, Generation, OnTokens, autoregressive_decode, speculative_decode
from saguaro.runtime.engines import load_engine_pair
from saguaro.runtime.engines.torch_engine import TorchEngine
from saguaro.runtime.options import DecodeOptions
from saguaro.runtime.prompts import PromptError, chat_messages, encode_chat, encode_text
from saguaro.runtime.sampling import SamplingParams


class RequestError(ValueError):
    """A request that cannot run, rejected before any work; the message names the input."""


@dataclass
class Pipeline:
    target: object  # an Engine
    draft: object   # an Engine

    @classmethod
    def load(cls, target: str | Path | None = None, draft: str | Path | None = None,
             engines: str | Path | None = None, threads: int | None = 1) -> "Pipeline":
        """Checkpoint folders (`target` and `draft`) or a built engine folder (`engines`).

        `threads` sets torch's intra-op threads: the target and the draft each run on one
        core, so a second thread each would oversubscribe a 2-core machine.
        """
        if threads:
            torch.set_num_threads(threads)
        if engines is not None:
            target_engine, draft_engine = load_engine_pair(engines)
        elif target is not None and draft is not None:
            target_engine, draft_engine = TorchEngine(target), TorchEngine(draft)
        else:
            raise RequestError("give either an engine folder or both target and draft checkpoints")
        check_pair_compatible(target_engine.info.vocab_size, draft_engine.info.vocab_size,
                              target_engine.info.tokenizer_fingerprint,
                              draft_engine.info.tokenizer_fingerprint)
        return cls(target_engine, draft_engine)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def max_context(self) -> int:
        return self.target.info.max_context

    def encode(self, text: str) -> list[int]:
        """A plain prompt, encoded as its tokenizer says (see `prompts`)."""
        try:
            return encode_text(self.tokenizer, text)
        except PromptError as error:
            raise RequestError(str(error)) from None

    def encode_chat(self, user: str, system: str | None = None) -> list[int]:
        """One user turn rendered with the checkpoint's chat template, assistant turn opened."""
        try:
            return encode_chat(self.tokenizer, chat_messages(user, system))
        except PromptError as error:
            raise RequestError(str(error)) from None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def check_request(self, prompt_ids: list[int], options: DecodeOptions) -> None:
        if not prompt_ids:
            raise RequestError("prompt is empty: give at least one token")
        if len(prompt_ids) >= self.max_context:
            raise RequestError(f"prompt of {len(prompt_ids)} tokens does not fit the context of "
                               f"{self.max_context} tokens (it must leave room for one new token)")
        vocab = self.target.info.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestError(f"prompt token ids must lie in [0, {vocab}); got {min(prompt_ids)}..{max(prompt_ids)}")
        limit = self.draft.info.max_draft_tokens
        if limit is not None and options.draft_tokens > limit:
            raise RequestError(f"num_draft_tokens {options.draft_tokens} exceeds the engines' built "
                               f"maximum {limit}")
        branches = self.draft.info.max_branches
        wanted = options.fanout_policy(branches).max_branches
        if branches is not None and options.prespeculating and wanted > branches:
            raise RequestError(f"{wanted} branches exceed the engines' built maximum {branches} "
                               f"(lower --fanout or --budget)")

    def generate(self, prompt_ids: list[int], options: DecodeOptions, sampling: SamplingParams,
                 on_tokens: OnTokens | None = None, cancelled: Cancelled = lambda: False) -> Generation:
        prompt_ids = [int(i) for i in prompt_ids]
        self.check_request(prompt_ids, options)
        stop_ids = self.stop_ids(options)
        if options.mode == "autoregressive":
            return autoregressive_decode(self.target, prompt_ids, options, sampling, stop_ids, on_tokens, cancelled)
        return speculative_decode(self.target, self.draft, prompt_ids, options, sampling, stop_ids,
                                  on_tokens, cancelled)

    def stop_ids(self, options: DecodeOptions) -> tuple[int, ...]:
        """The model's end-of-generation tokens, or the one a request names (-1: none)."""
        if options.eos_token_id is None:
            return self.target.info.eos_token_ids
        return () if options.eos_token_id == -1 else (options.eos_token_id,)
