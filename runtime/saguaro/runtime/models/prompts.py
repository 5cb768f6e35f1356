"""Prompt text to token ids: one rule for the runtime, the command lines and the server.

A plain prompt is encoded the way its tokenizer says (`add_special_tokens=True`, as
transformers and vLLM encode completions): a Llama tokenizer prepends `<s>`, a chat model
whose GGUF says `add_bos_token: false` (SmolLM2) prepends nothing. A chat prompt is the
checkpoint's chat template rendered with the generation prompt (the assistant's turn
opened), whose special tokens are already in the text, so nothing is added.
"""
from __future__ import annotations


class PromptError(ValueError):
    """A prompt that cannot be encoded; the message names what is wrong."""


def encode_text(tokenizer, text: str) -> list[int]:
    if not isinstance(text, str) or not text:
        raise PromptError("prompt is empty: give at least one character of text")
    return tokenizer.encode(text, add_special_tokens=True)


def chat_messages(user: str, system: str | None = None) -> list[dict[str, str]]:
    """One user turn, after an optional system prompt (else the template's own default)."""
    if not isinstance(user, str) or not user:
        raise PromptError("chat message is empty: give at least one character of text")
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer, messages: list[dict[str, str]]) -> str:
    if not has_chat_template(tokenizer):
        raise PromptError("this model has no chat template (its tokenizer files carry none): "
                          "send a plain prompt instead")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    return tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)


# Prompts the benchmarks and demos share: documentation-style text openings, and chat
# questions (a user turn each).
PROMPTS = ["The with statement is used to", "A class definition defines a class object",
           "Exceptions are raised by", "The import statement", "If the syntax",
           "Assignment statements are used to", "The for statement is used to iterate",
           "A function definition defines a user-defined function object"]
CHAT_PROMPTS = ["What is the capital of France?", "Explain how a rainbow forms.", "Write a haiku about the sea.",
                "Give me three tips for learning Python.", "Why is the sky blue?", "What is a prime number?",
                "Describe a cat to someone who has never seen one.", "How do vaccines work?"]
