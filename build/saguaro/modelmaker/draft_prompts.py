"""Prompts a draft is distilled on and measured on: chat questions and documentation text.

Two kinds, as a served model sees them: generic chat questions (rendered with the
target's chat template when it has one) and windows of Python's pydoc topics (plain
text). Held-out prompts share nothing with the training ones: their questions use other
subjects, and their text windows come from held-out topics (`corpus.split_by_topic`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from saguaro.modelmaker.corpus import load_corpus

QUESTION_FORMS = (
    "What is {}?", "Explain {} in simple terms.", "Give me three facts about {}.",
    "Write a short paragraph about {}.", "Why does {} matter?", "How would you describe {} to a child?",
    "What are the pros and cons of {}?", "Write a haiku about {}.", "Summarise the history of {}.",
    "What is a common misconception about {}?", "How do I get started with {}?",
    "Compare {} with something similar.",
    "Tell me about {}.", "What should a beginner know about {}?", "List five interesting things about {}.",
    "Can you explain how {} works?", "Write a short story involving {}.", "What are the main ideas behind {}?",
    "Give me a quick overview of {}.", "What questions do people often ask about {}?",
)
SUBJECTS = (
    "photosynthesis", "the French Revolution", "Python lists", "black holes", "the water cycle",
    "machine learning", "the Roman Empire", "climate change", "the stock market", "vaccines",
    "the Pythagorean theorem", "jazz music", "volcanoes", "the internet", "democracy", "coffee",
    "the human heart", "electric cars", "Shakespeare", "recursion", "the Moon", "honey bees",
    "inflation", "the Great Wall of China", "gravity", "sleep", "chess", "rainbows", "DNA", "Paris",
    "sorting algorithms", "the ocean tides", "renewable energy", "the printing press", "origami",
    "prime numbers", "the Amazon rainforest", "bread baking", "solar panels", "earthquakes",
    "the Renaissance", "cats", "dogs", "the immune system", "rivers", "ancient Egypt", "bicycles",
    "the piano", "cloud computing", "blockchain", "the periodic table", "photography", "gardening",
    "the solar system", "World War II", "the brain", "public speaking", "meditation", "pizza",
    "the Eiffel Tower", "spiders", "airplanes", "the Industrial Revolution", "linear algebra", "poetry",
    "databases", "the human skeleton", "recycling", "football", "time management", "dinosaurs",
    "the Silk Road", "hurricanes", "chocolate", "robots", "the Mona Lisa", "electricity", "yoga",
    "social media", "the printing of money", "glaciers", "opera", "the Nile", "computer viruses",
    "vitamins", "the Cold War", "marathons", "nuclear power", "the alphabet", "operating systems",
    "coral reefs", "the telephone", "friendship", "budgeting", "tsunamis", "mushrooms",
)
HELD_OUT_SUBJECTS = (
    "the capital of France", "penguins", "the theory of relativity", "tea", "the Olympic Games",
    "quantum computers", "mountains", "the violin", "deserts", "hash tables", "the Sun", "tomatoes",
)
TEXT_WINDOW_CHARACTERS = 200


@dataclass(frozen=True)
class Prompt:
    text: str
    chat: bool  # a user message to render with the chat template, else plain text


def questions(subjects: tuple[str, ...], count: int, seed: int) -> list[str]:
    pairs = [form.format(subject) for subject in subjects for form in QUESTION_FORMS]
    random.Random(seed).shuffle(pairs)
    return pairs[:count]


def text_windows(texts: list[str], count: int, seed: int) -> list[str]:
    """`count` windows of documentation text, each starting at a word boundary."""
    rng = random.Random(seed)
    windows: list[str] = []
    usable = [text for text in texts if len(text) > 2 * TEXT_WINDOW_CHARACTERS]
    while usable and len(windows) < count:
        text = rng.choice(usable)
        start = text.find(" ", rng.randrange(len(text) - TEXT_WINDOW_CHARACTERS)) + 1
        windows.append(text[start:start + TEXT_WINDOW_CHARACTERS].rsplit(" ", 1)[0])
    return windows


def prompt_set(count: int, chat_share: float, held_out: bool, seed: int) -> list[Prompt]:
    """`count` prompts, `chat_share` of them chat questions, interleaved."""
    corpus = load_corpus()
    chats = round(count * chat_share)
    subjects = HELD_OUT_SUBJECTS if held_out else SUBJECTS
    texts = corpus.held_out_texts() if held_out else corpus.train_texts()
    prompts = [Prompt(q, True) for q in questions(subjects, chats, seed)]  # at most forms x subjects
    prompts += [Prompt(t, False) for t in text_windows(texts, count - len(prompts), seed)]
    random.Random(seed + 1).shuffle(prompts)
    return prompts
