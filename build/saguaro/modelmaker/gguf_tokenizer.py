"""The tokenizer a GGUF file describes, rebuilt as a Hugging Face fast tokenizer.

A GGUF carries its vocabulary as metadata: `tokenizer.ggml.tokens` (byte-level BPE pieces,
`Ġ` for a space), `token_type`, `merges`, the special ids, the pre-tokenizer's name
(`tokenizer.ggml.pre`) and the chat template. llama.cpp is the reference for what these
mean, so the pre-tokenizer is the regex list llama.cpp uses for that name, applied with
llama.cpp's split semantics (a match and the text between matches are both pieces), and
CONTROL tokens are special (matched in text, skipped when decoding) as llama.cpp parses
them with `special=True`. Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is
handled; anything else is refused with its name.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast


class GGUFTokenizerError(ValueError):
    """The GGUF's vocabulary is of a kind this importer does not rebuild."""


# gguf.TokenType values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4

# llama.cpp's regexes (src/llama-vocab.cpp) by `tokenizer.ggml.pre`, with whether BPE
# looks a whole pre-token up in the vocabulary before merging (llama 3's `ignore_merges`).
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DIGITS_THEN_GPT2 = ([r"\p{N}", GPT2_REGEX], False)  # every digit a piece of its own first
PRE_TOKENIZERS: dict[str, tuple[list[str], bool]] = {
    "smollm": DIGITS_THEN_GPT2, "refact": DIGITS_THEN_GPT2, "command-r": DIGITS_THEN_GPT2,
    "codeshell": DIGITS_THEN_GPT2, "exaone": DIGITS_THEN_GPT2, "minerva-7b": DIGITS_THEN_GPT2,
    "gpt-2": ([GPT2_REGEX], False), "phi-2": ([GPT2_REGEX], False), "starcoder": ([GPT2_REGEX], False),
    "llama3": ([LLAMA3_REGEX], True), "llama-v3": ([LLAMA3_REGEX], True), "llama-bpe": ([LLAMA3_REGEX], True),
}
# Tokens llama.cpp treats as end of generation by their text, besides the declared EOS/EOT.
END_OF_GENERATION_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                           "<|eom_id|>", "<EOT>", "<|end_of_text|>", "<end_of_utterance>")


@dataclass
class GGUFTokenizer:
    """The rebuilt tokenizer and the ids a checkpoint's configs need."""

    tokenizer: Tokenizer
    tokens: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    end_of_generation_ids: list[int]  # the EOS first, then every other end-of-turn token
    add_bos: bool
    chat_template: str | None
    pre_tokenizer: str

    def text_of(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


def check_tokenizer_kind(metadata: dict) -> None:
    """Refuse, naming the key and value, a vocabulary this module cannot rebuild."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFTokenizerError(f"tokenizer.ggml.model {kind!r} is not handled: only 'gpt2' "
                                 "(byte-level BPE) vocabularies are rebuilt")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFTokenizerError(f"tokenizer.ggml.pre {pre!r} is not handled (known: {', '.join(PRE_TOKENIZERS)})")
    if not metadata.get("tokenizer.ggml.tokens"):
        raise GGUFTokenizerError("tokenizer.ggml.tokens is missing or empty")


def vocabulary(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for token_id, text in enumerate(tokens):
        if text in vocab:
            raise GGUFTokenizerError(f"tokenizer.ggml.tokens: {text!r} appears at ids {vocab[text]} and {token_id}")
        vocab[text] = token_id
    return vocab


def merge_pairs(merges: list[str]) -> list[tuple[str, str]]:
    """Byte-level pieces never hold a literal space (it is `Ġ`), so each merge is two pieces."""
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise GGUFTokenizerError(f"tokenizer.ggml.merges: {merge!r} is not two pieces separated by a space")
        pairs.append((parts[0], parts[1]))
    return pairs


def pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    regexes, _ = PRE_TOKENIZERS[name]
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in regexes]
    return pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def add_special_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """CONTROL and UNKNOWN tokens become special, USER_DEFINED ones plain added tokens; all
    already exist in the vocabulary, so their ids stay the GGUF's."""
    def added(text: str, special: bool) -> AddedToken:
        return AddedToken(text, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)

    special = [added(t, True) for t, kind in zip(tokens, types) if kind in (CONTROL, UNKNOWN)]
    user = [added(t, False) for t, kind in zip(tokens, types) if kind == USER_DEFINED]
    if special:
        tokenizer.add_special_tokens(special)
    if user:
        tokenizer.add_tokens(user)


def post_processor(bos: str | None, bos_id: int | None, add_bos: bool) -> processors.PostProcessor:
    if add_bos and bos is not None:
        return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                             special_tokens=[(bos, bos_id)])
    return processors.ByteLevel(trim_offsets=False)


def token_id(metadata: dict, key: str, size: int) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if not 0 <= int(value) < size:
        raise GGUFTokenizerError(f"{key} = {value} is outside the vocabulary of {size} tokens")
    return int(value)


def end_of_generation(tokens: list[str], eos_id: int | None, eot_id: int | None) -> list[int]:
    ids = [i for i in (eos_id, eot_id) if i is not None]
    ids += [i for i, text in enumerate(tokens) if text in END_OF_GENERATION_TEXTS]
    return list(dict.fromkeys(ids))  # in order, once each


def build_tokenizer(metadata: dict) -> GGUFTokenizer:
    """The GGUF's tokenizer; raises `GGUFTokenizerError` naming what it cannot rebuild."""
    check_tokenizer_kind(metadata)
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    pre = metadata.get("tokenizer.ggml.pre", "default")
    tokenizer = Tokenizer(models.BPE(vocab=vocabulary(tokens),
                                     merges=merge_pairs(list(metadata.get("tokenizer.ggml.merges") or [])),
                                     fuse_unk=False, byte_fallback=False, ignore_merges=PRE_TOKENIZERS[pre][1]))
    tokenizer.pre_tokenizer = pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    add_special_tokens(tokenizer, tokens, types)
    size = len(tokens)
    bos = token_id(metadata, "tokenizer.ggml.bos_token_id", size)
    eos = token_id(metadata, "tokenizer.ggml.eos_token_id", size)
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    tokenizer.post_processor = post_processor(tokens[bos] if bos is not None else None, bos, add_bos)
    return GGUFTokenizer(
        tokenizer=tokenizer, tokens=tokens, bos_token_id=bos, eos_token_id=eos,
        unk_token_id=token_id(metadata, "tokenizer.ggml.unknown_token_id", size),
        pad_token_id=token_id(metadata, "tokenizer.ggml.padding_token_id", size),
        end_of_generation_ids=end_of_generation(tokens, eos, token_id(metadata, "tokenizer.ggml.eot_token_id", size)),
        add_bos=add_bos, chat_template=metadata.get("tokenizer.chat_template"), pre_tokenizer=pre)


def for_transformers(spec: GGUFTokenizer, max_length: int) -> PreTrainedTokenizerFast:
    """The tokenizer `save_pretrained` writes (tokenizer.json, its config, the chat template).

    No clean-up of spaces: llama.cpp does none for these vocabularies, and clean-up would
    break decode(encode(text)) == text."""
    names = {"bos_token": spec.bos_token_id, "eos_token": spec.eos_token_id,
             "unk_token": spec.unk_token_id, "pad_token": spec.pad_token_id}
    special = {name: spec.text_of(i) for name, i in names.items() if i is not None}
    extra = {"chat_template": spec.chat_template} if spec.chat_template else {}
    return PreTrainedTokenizerFast(tokenizer_object=spec.tokenizer, clean_up_tokenization_spaces=False,
                                   model_max_length=max_length, **special, **extra)
