"""A byte-level BPE tokenizer trained on the corpus, wrapped for `transformers`.

Byte-level means every string encodes (no `<unk>` in practice) and decodes back to itself,
non-ASCII included. Like Llama's tokenizer, encoding a text prepends `<s>` (the models are
trained on documents that start with it); `add_special_tokens=False` leaves it off, and
`decode(..., skip_special_tokens=True)` drops it again.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
# The trainer gives special tokens the first ids in this order: <s>=0, </s>=1, <unk>=2, <pad>=3.
SPECIAL_TOKENS = (BOS, EOS, UNK, PAD)


def train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE model of `vocab_size` entries (special tokens included)."""
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols from the start, so any text is representable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
    )
    return tokenizer


def wrap_for_transformers(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """A `transformers` tokenizer that `save_pretrained` / `AutoTokenizer` round-trip."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        # Clean-up rewrites " ." to "." and would break decode(encode(x)) == x (transformers
        # 5 skips it for BPE, with a warning; older versions apply it).
        clean_up_tokenization_spaces=False,
    )


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    return wrap_for_transformers(train_bpe(texts, vocab_size))
