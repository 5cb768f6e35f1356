"""Checks that an imported GGUF checkpoint is the model in the file, run after every import.

- round trip: `decode(encode(text)) == text` on a large text (every Python's pydoc topics
  plus scripts, emoji, digits and odd whitespace), with no unknown-token ids;
- chat template: a conversation renders, encodes and decodes back to the rendered text;
- logits: the checkpoint, run by this project's runtime, against a direct float64 forward
  on the GGUF's own dequantised tensors in llama.cpp's layout (q/k rows still permuted,
  RoPE rotating adjacent pairs), so the comparison also checks the un-permutation.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from saguaro.modelmaker.gguf_import import Inspected, dequantize
from saguaro.runtime.models.checkpoint import load_checkpoint, load_tokenizer

UNICODE_TEXT = (
    "naïve café, Straße, İstanbul, ΑΒΓ αβγ, Русский, עברית, العربية. 北京是中国的首都。東京は日本の首都です。"
    "서울은 한국의 수도. Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨ Digits: 1234567890 3.14159 ١٢٣٤ ½ Ⅻ ０１２\n"
    "Whitespace:  two  spaces,\tone tab,\t\ttwo,\n\n   \n trailing \r\n CRLF \u00a0nbsp \u2003em \u3000ideo.\n"
    "Contractions: it's I'm we'll they'd IT'S. Combining: e\u0301 a\u0308; zero width a\u200bb\u200dc\ufeffd.\n"
    "def f(x):\n    return x**2  # comment\n~!@#$%^&*()_+-={}[]|\\:\";'<>?,./ «» „“ — … €\n")
CHAT_QUESTION = "What is the capital of France?"
LOGITS_TOLERANCE = 1e-3  # float32 runtime against a float64 reference, logits of size ~30


def check_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics)) + "\n" + UNICODE_TEXT * 3


def round_trip(tokenizer, text: str) -> dict:
    started = time.perf_counter()
    ids = tokenizer.encode(text, add_special_tokens=False, verbose=False)  # longer than the context: fine here
    back = tokenizer.decode(ids)
    unknown = tokenizer.unk_token_id
    return {"characters": len(text), "tokens": len(ids), "equal": back == text,
            "first_difference": next((i for i, (a, b) in enumerate(zip(text, back)) if a != b),
                                     None if back == text else min(len(text), len(back))),
            "unknown_ids": ids.count(unknown) if unknown is not None else 0,
            "seconds": round(time.perf_counter() - started, 3)}


def chat_messages(question: str = CHAT_QUESTION) -> list[dict]:
    return [{"role": "user", "content": question}]


def chat_template(tokenizer) -> dict:
    """Render the template with a generation prompt; its ids must decode back to the text."""
    if not tokenizer.chat_template:
        return {"present": False}
    text = tokenizer.apply_chat_template(chat_messages(), add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return {"present": True, "rendered": text, "tokens": len(ids), "contains_question": CHAT_QUESTION in text,
            "round_trip": tokenizer.decode(ids) == text}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_adjacent_pairs(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's RoPE (mode 0): rotate the pairs (2i, 2i+1) of `x` `[n, heads, dim]`."""
    dim = x.shape[-1]
    angles = positions[:, None].double() * theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = even * cos - odd * sin, even * sin + odd * cos
    return out


def reference_logits(source: Inspected, ids: list[int]) -> np.ndarray:
    """Logits `[n, vocab]` of a float64 forward straight on the GGUF's tensors."""
    hp, tensors = source.hp, {t.name: t for t in source.reader.tensors}

    def weight(name: str) -> torch.Tensor:
        return torch.from_numpy(dequantize(tensors[name])).double()

    n, heads, kv_heads, dim = len(ids), hp.num_heads, hp.num_kv_heads, hp.head_dim
    positions = torch.arange(n)
    future = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
    x = weight("token_embd.weight")[torch.tensor(ids)]
    for layer in range(hp.num_layers):
        p = f"blk.{layer}."
        h = rms_norm(x, weight(p + "attn_norm.weight"), hp.rms_norm_eps)
        q = rope_adjacent_pairs((h @ weight(p + "attn_q.weight").T).view(n, heads, dim), positions, hp.rope_theta)
        k = rope_adjacent_pairs((h @ weight(p + "attn_k.weight").T).view(n, kv_heads, dim), positions, hp.rope_theta)
        v = (h @ weight(p + "attn_v.weight").T).view(n, kv_heads, dim)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / dim ** 0.5 + future
        attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * dim)
        x = x + attended @ weight(p + "attn_output.weight").T
        h = rms_norm(x, weight(p + "ffn_norm.weight"), hp.rms_norm_eps)
        gated = torch.nn.functional.silu(h @ weight(p + "ffn_gate.weight").T) * (h @ weight(p + "ffn_up.weight").T)
        x = x + gated @ weight(p + "ffn_down.weight").T
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    return (rms_norm(x, weight("output_norm.weight"), hp.rms_norm_eps) @ weight(head).T).numpy()


def runtime_logits(checkpoint_dir: Path, ids: list[int]) -> np.ndarray:
    """Logits of the imported checkpoint as this project's runtime computes them."""
    model = load_checkpoint(checkpoint_dir).model
    return model.forward_sequence(torch.tensor(ids)).numpy()


def compare_logits(source: Inspected, checkpoint_dir: Path, ids: list[int]) -> dict:
    started = time.perf_counter()
    got, expected = runtime_logits(checkpoint_dir, ids), reference_logits(source, ids)
    difference = np.abs(got - expected)
    return {"tokens": len(ids), "max_abs_difference": float(difference.max()),
            "mean_abs_difference": float(difference.mean()),
            "argmax_agreement": float((got.argmax(-1) == expected.argmax(-1)).mean()),
            "within_tolerance": bool(difference.max() <= LOGITS_TOLERANCE),
            "seconds": round(time.perf_counter() - started, 3)}


def check_import(source: Inspected, checkpoint_dir: Path) -> dict:
    """All three checks; `passed` says whether every one held."""
    tokenizer = load_tokenizer(checkpoint_dir)
    chat = chat_template(tokenizer)
    prompt = chat["rendered"] if chat["present"] else CHAT_QUESTION
    checks: dict[str, Any] = {
        "round_trip": round_trip(tokenizer, check_text()), "chat_template": chat,
        "logits": compare_logits(source, checkpoint_dir, tokenizer.encode(prompt, add_special_tokens=False))}
    checks["passed"] = (checks["round_trip"]["equal"] and not checks["round_trip"]["unknown_ids"]
                        and (not chat["present"] or chat["round_trip"]) and checks["logits"]["within_tolerance"])
    return checks
