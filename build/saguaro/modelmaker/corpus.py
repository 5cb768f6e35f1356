"""The text the model pair is trained on: the English reference topics every Python ships.

`pydoc_data.topics.topics` maps a topic name ("assignment", "formatstrings", ...) to the
text `help()` prints for it: about 465K characters of prose and code examples, no download
needed. Whole topics are held out (not random lines), so held-out prompts are prose the
models have never seen, not near-copies of training lines.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

# Every 10th topic (in sorted order) is held out: 7 of 79 topics on Python 3.11.
HELD_OUT_EVERY = 10


@dataclass(frozen=True)
class Corpus:
    """Topic name -> text, split into training and held-out topics."""

    train: dict[str, str]
    held_out: dict[str, str]

    def train_texts(self) -> list[str]:
        return list(self.train.values())

    def held_out_texts(self) -> list[str]:
        return list(self.held_out.values())


def load_topics() -> dict[str, str]:
    """All pydoc topics, keyed and ordered by name."""
    from pydoc_data.topics import topics

    return {name: topics[name] for name in sorted(topics)}


def split_by_topic(topics: dict[str, str], held_out_every: int = HELD_OUT_EVERY) -> Corpus:
    """Hold out every `held_out_every`-th topic of the sorted names; train on the rest."""
    train: dict[str, str] = {}
    held_out: dict[str, str] = {}
    for index, name in enumerate(sorted(topics)):
        is_held_out = index % held_out_every == held_out_every - 1
        (held_out if is_held_out else train)[name] = topics[name]
    return Corpus(train=train, held_out=held_out)


def load_corpus() -> Corpus:
    return split_by_topic(load_topics())


def fingerprint(corpus: Corpus) -> str:
    """Short hash of the split text: the topics differ between Python versions, and a pair
    is only reproducible from the same text."""
    digest = hashlib.sha256()
    for part in (corpus.train, corpus.held_out):
        for name, text in part.items():
            digest.update(name.encode() + b"\0" + text.encode() + b"\0")
        digest.update(b"\1")
    return digest.hexdigest()[:16]
