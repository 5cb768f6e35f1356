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
# None of `bench.py --chat`'s questions' subjects (`CHAT_PROMPTS`: France, rainbows, the
# sea, Python, the sky, prime numbers, cats, vaccines): they had been training subjects,
# and the benchmark favoured the head that had learnt their answers.
SUBJECTS = (
    "photosynthesis", "the French Revolution", "black holes", "the water cycle",
    "machine learning", "the Roman Empire", "climate change", "the stock market",
    "the Pythagorean theorem", "jazz music", "volcanoes", "the internet", "democracy", "coffee",
    "the human heart", "electric cars", "Shakespeare", "recursion", "the Moon", "honey bees",
    "inflation", "the Great Wall of China", "gravity", "sleep", "chess", "DNA",
    "sorting algorithms", "renewable energy", "the printing press", "origami",
    "the Amazon rainforest", "bread baking", "solar panels", "earthquakes",
    "the Renaissance", "dogs", "the immune system", "rivers", "ancient Egypt", "bicycles",
    "the piano", "cloud computing", "blockchain", "the periodic table", "photography", "gardening",
    "the solar system", "World War II", "the brain", "public speaking", "meditation", "pizza",
    "the Eiffel Tower", "spiders", "airplanes", "the Industrial Revolution", "linear algebra", "poetry",
    "databases", "the human skeleton", "recycling", "football", "time management", "dinosaurs",
    "the Silk Road", "hurricanes", "chocolate", "robots", "the Mona Lisa", "electricity", "yoga",
    "social media", "the printing of money", "glaciers", "opera", "the Nile", "computer viruses",
    "vitamins", "the Cold War", "marathons", "nuclear power", "the alphabet", "operating systems",
    "coral reefs", "the telephone", "friendship", "budgeting", "tsunamis", "mushrooms",
    # more subjects, so that each is asked about a few times rather than a dozen: with 96,
    # the head agreed with the target on 0.66 of training-question tokens and 0.41 of
    # held-out-question tokens (it learnt each subject's answers)
    "the French language", "Japanese cuisine", "the Vikings", "ancient Greece", "the Aztecs", "the Incas",
    "the Ottoman Empire", "the Byzantine Empire", "the Mongol Empire", "the American Civil War",
    "the Russian Revolution", "the Reformation", "the Enlightenment", "the Space Race", "the Apollo missions",
    "the Hubble telescope", "Mars", "Jupiter", "comets", "asteroids", "galaxies", "the Big Bang",
    "neutron stars", "gravity waves", "magnetism", "friction", "thermodynamics", "sound waves", "light",
    "lasers", "semiconductors", "transistors", "batteries", "wind turbines", "hydroelectric dams",
    "steam engines", "jet engines", "rockets", "submarines", "trains", "bridges", "skyscrapers", "tunnels",
    "roads", "canals", "lighthouses", "castles", "cathedrals", "pyramids", "museums", "libraries",
    "universities", "kindergarten", "homework", "exams", "learning a language", "grammar", "punctuation",
    "dictionaries", "novels", "short stories", "fairy tales", "mythology", "Greek gods", "Norse myths",
    "comic books", "animation", "film editing", "theatre", "ballet", "hip hop", "rock music", "classical music",
    "the guitar", "drums", "singing", "painting", "sculpture", "pottery", "knitting", "woodworking",
    "calligraphy", "architecture", "interior design", "fashion", "perfume", "jewellery", "tattoos",
    "fungi", "ferns", "oak trees", "cacti", "bamboo", "flowers", "seeds",
    "soil", "compost", "fertiliser", "irrigation", "farming", "cattle", "sheep", "horses", "chickens",
    "whales", "dolphins", "sharks", "octopuses", "jellyfish", "salmon", "frogs", "snakes", "lizards",
    "turtles", "crocodiles", "owls", "eagles", "parrots", "bats", "wolves", "bears", "elephants", "giraffes",
    "lions", "tigers", "monkeys", "gorillas", "ants", "butterflies", "mosquitoes", "bacteria", "viruses",
    "cells", "evolution", "genetics", "proteins", "enzymes", "hormones", "the lungs", "the liver",
    "the kidneys", "the eye", "the ear", "teeth", "skin", "muscles", "bones", "blood", "nutrition",
    "diabetes", "allergies", "the common cold", "antibiotics", "surgery", "nursing", "first aid",
    "exercise", "running", "swimming", "cycling", "tennis", "basketball", "baseball", "cricket", "golf",
    "skiing", "surfing", "rock climbing", "martial arts", "board games", "video games",
    "puzzles", "magic tricks", "cooking pasta", "baking cakes", "soup", "rice", "cheese", "olive oil",
    "spices", "sugar", "salt", "fermentation", "wine making", "breakfast", "vegetarian diets", "restaurants",
    "supermarkets", "shopping", "advertising", "marketing", "economics", "taxes", "banks", "loans",
    "insurance", "interest rates", "trade", "globalisation", "startups", "management", "leadership",
    "teamwork", "negotiation", "job interviews", "writing a resume", "emails", "remote work", "productivity",
    "habits", "motivation", "happiness", "stress", "emotions", "memory", "dreams", "creativity",
    "philosophy", "ethics", "logic", "Socrates", "Plato", "Aristotle", "Confucius", "Buddhism",
    "human rights", "elections", "the United Nations", "laws", "courts", "the police", "journalism",
    "newspapers", "radio", "television", "podcasts", "smartphones", "keyboards", "printers",
    "the world wide web", "search engines", "email spam", "passwords", "encryption", "cybersecurity",
    "programming", "JavaScript", "SQL", "Linux", "version control", "unit testing", "debugging",
    "compilers", "data structures", "graphs", "trees in computer science", "binary numbers", "algorithms",
    "artificial intelligence", "neural networks", "robotics", "self-driving cars", "drones", "3D printing",
    "virtual reality", "satellites", "GPS", "maps", "weather forecasts", "clouds", "rain", "snow",
    "thunderstorms", "tornadoes", "wildfires", "droughts", "floods", "forests", "lakes", "islands", "caves",
    "the Arctic", "Africa", "South America", "Australia",
    "India", "China", "Japan", "Brazil", "Canada", "Mexico", "Egypt", "Italy", "Spain", "Germany",
    "London", "New York", "Tokyo", "Rome", "Venice", "the Alps", "time zones",
    "calendars", "clocks", "money", "coins", "stamps", "postcards", "birthdays", "weddings", "holidays",
    "New Year celebrations", "festivals", "fireworks", "camping", "travel", "airports", "hotels",
    "learning to drive", "traffic", "public transport", "cities", "villages", "neighbours", "pets",
    "parenting", "grandparents", "childhood", "old age", "volunteering", "charity", "kindness",
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
    lengths = [len(text) for text in usable]
    while usable and len(windows) < count:
        # a text by its length: short topics drawn as often as long ones had their windows
        # overlap, the target's same answer learnt several times
        text = rng.choices(usable, weights=lengths)[0]
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
