"""Hand-written request templates that widen thin domains in the training set.

Everything here was written for this project. Templates are filled only with
passages and questions from the training side of the split
(:mod:`router.corpus`), and template examples never appear in a held-out set.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from router.corpus import Example

TOPICS = (
    "autumn in the city", "my grandmother's kitchen", "a lost dog finding its way home",
    "the first day at a new job", "learning to play the guitar", "a rainy afternoon",
    "friendship", "moving to another country", "the ocean at night", "a robot who wants to paint",
    "climate change", "a small bakery", "a mountain hike", "starting a podcast", "coffee",
    "a birthday surprise", "working from home", "the future of cities", "a haunted lighthouse",
    "running a marathon", "my cat", "a summer road trip", "gardening", "space exploration",
)
PEOPLE = ("my boss", "my landlord", "a friend I haven't seen in years", "my sister",
          "a new client", "my neighbour", "my professor", "the hiring manager", "my team")
CHARACTERS = ("Sherlock Holmes", "a pirate captain", "Albert Einstein", "a medieval knight",
              "a friendly barista", "Yoda", "a tour guide in Rome", "Marie Curie",
              "a grumpy wizard", "a sports commentator")
FEELINGS = ("stressed", "bored", "anxious", "excited", "lonely", "unmotivated", "happy")

CHAT = (
    "Write a short poem about {topic}.",
    "Compose a heartfelt blog post about {topic}.",
    "Tell me a funny story about {topic}.",
    "Can you help me write an email to {person} about {topic}?",
    "Draft a polite message to {person} saying I can't make it on Friday.",
    "Pretend you are {character}. What do you think about {topic}?",
    "Act as {character} for the rest of this conversation. Introduce yourself.",
    "I'm feeling {feeling} today. Any advice?",
    "hi! how are you doing today?",
    "Let's chat about {topic}. What's your favourite thing about it?",
    "Write a limerick about {topic}.",
    "Give me five creative names for a blog about {topic}.",
    "Write a persuasive speech about {topic} for a school assembly.",
    "Rewrite your previous answer in the style of {character}.",
    "Can you make that shorter and more casual?",
    "Write a short dialogue between {character} and {person}.",
    "What should I say to {person} to apologise for being late?",
    "Describe {topic} as if you were {character}.",
    "I need a catchy slogan for a campaign about {topic}.",
    "Write the opening paragraph of a mystery novel set during {topic}.",
    "Thanks, that was great! Can you add a joke at the end?",
    "Roleplay: you are {character} and I am a journalist. First question: why {topic}?",
    "Write a thank-you note to {person}.",
    "Tell me something interesting to cheer me up, I'm {feeling}.",
)

EXTRACTION = (
    "Extract all person names, organisations and places from the text below. "
    "Return JSON with keys people, organisations, places.\n\n{passage}",
    "From the following text, list every number and what it refers to:\n{passage}",
    "Identify all dates mentioned in this passage and output them as a bullet list:\n\n{passage}",
    "Read the text and fill in the table: name | role | location.\n{passage}",
    "Parse the following into a JSON object with fields \"who\", \"what\", \"when\":\n{passage}",
    "{passage}\n\nExtract the key entities from the text above as a comma-separated list.",
    "Classify the sentiment of each sentence in the following text as positive, neutral or "
    "negative, and return a JSON array:\n{passage}",
    "Given the categories Sports, Politics, Business, Science: assign the following text to one "
    "category and output only the category name.\n{passage}",
)

SUMMARIZATION = (
    "Summarize the following article in three sentences:\n\n{passage}",
    "TL;DR:\n{passage}",
    "{passage}\n\nWrite a one-paragraph summary of the article above.",
    "Give me the key points of this text as bullets:\n{passage}",
    "Condense this news story into a headline and a two-line summary: {passage}",
)

TRANSLATION = (
    "Translate to French: {sentence}",
    "Translate English to German: {sentence}",
    "How do you say this in Spanish? \"{sentence}\"",
    "Please translate the following sentence into Japanese:\n{sentence}",
    "Translate into Italian, keeping the tone informal: {sentence}",
    "Übersetze ins Englische: {sentence}",
)


def _fill(tpl: str, rng: random.Random, **extra: str) -> str:
    return tpl.format(topic=rng.choice(TOPICS), person=rng.choice(PEOPLE),
                      character=rng.choice(CHARACTERS), feeling=rng.choice(FEELINGS), **extra)


def chat(rng: random.Random, n: int) -> Iterator[Example]:
    for i in range(n):
        j = i % len(CHAT)
        yield Example(_fill(CHAT[j], rng), "chat", "template", f"template:chat:{j}")


def from_passages(passages: Sequence[str], sentences: Sequence[str], rng: random.Random,
                  n_each: int) -> Iterator[Example]:
    """Extraction / summarization / translation requests over training-side text."""
    for i in range(n_each):
        passage = _cut(rng.choice(passages), rng)
        yield Example(EXTRACTION[i % len(EXTRACTION)].format(passage=passage), "extraction",
                      "template", f"template:extraction:{i % len(EXTRACTION)}")
        yield Example(SUMMARIZATION[i % len(SUMMARIZATION)].format(passage=passage),
                      "summarization", "template", f"template:summ:{i % len(SUMMARIZATION)}")
        yield Example(TRANSLATION[i % len(TRANSLATION)].format(sentence=rng.choice(sentences)),
                      "translation", "template", f"template:transl:{i % len(TRANSLATION)}")


def rag(passages: Sequence[str], questions: Sequence[str], rng: random.Random,
        n: int) -> Iterator[Example]:
    """Context passage followed by a short question: the Spec-Bench RAG layout."""
    for i in range(n):
        passage = _cut(rng.choice(passages), rng, lo=800, hi=3000)
        yield Example(f"{passage}\n{rng.choice(questions)}", "rag", "template", f"template:rag:{i}")


def _cut(passage: str, rng: random.Random, lo: int = 200, hi: int = 1500) -> str:
    return passage[: rng.randint(lo, hi)]

CONCEPTS = ("photosynthesis", "inflation", "the French Revolution", "black holes", "DNA replication",
            "the Renaissance", "supply and demand", "plate tectonics", "the immune system",
            "quantum entanglement", "the Cold War", "natural selection", "compound interest",
            "the water cycle", "impressionism", "the electoral college", "machine learning",
            "the Silk Road", "vaccines", "the greenhouse effect", "stoicism", "the printing press")
THINGS = ("the telephone", "the world wide web", "penicillin", "the light bulb", "the steam engine",
          "the periodic table", "the theory of relativity", "the first airplane", "the bicycle")
PLACES = ("Canada", "Kenya", "Peru", "Japan", "Norway", "Egypt", "Australia", "Portugal",
          "Vietnam", "Chile", "Morocco", "Finland")

QA = (
    "What is {concept}?",
    "Explain how {concept} works in simple terms.",
    "Who invented {thing}?",
    "When was {thing} invented?",
    "what is the capital of {place}",
    "What language is spoken in {place}?",
    "Why is {concept} important?",
    "how did {concept} affect society",
    "What is the population of {place}?",
    "Who discovered {thing}?",
    "What are the main causes of {concept}?",
    "Describe the relationship between {concept} and {concept2}.",
    "where is {place} located",
    "Which country is larger, {place} or {place2}?",
)


def qa(rng: random.Random, n: int) -> Iterator[Example]:
    for i in range(n):
        j = i % len(QA)
        text = QA[j].format(concept=rng.choice(CONCEPTS), concept2=rng.choice(CONCEPTS),
                            thing=rng.choice(THINGS), place=rng.choice(PLACES),
                            place2=rng.choice(PLACES))
        yield Example(text, "qa", "template", f"template:qa:{j}")

LANGS = ("Python", "JavaScript", "C++", "Rust", "Go", "Java", "TypeScript", "Bash", "SQL", "HTML/CSS")
TASKS = ("reads a CSV file and prints the average of each column",
         "finds the longest common subsequence of two strings",
         "implements a binary search tree with insert and delete",
         "counts the most frequent words in all text files under a directory",
         "serves a web page with a button that shows a random quote",
         "merges two sorted arrays in linear time", "parses command-line flags",
         "checks whether a string is a palindrome", "computes the n-th Fibonacci number with memoization",
         "implements an LRU cache", "downloads a URL and retries on failure",
         "returns the k largest elements of a list using a heap", "validates an email address",
         "detects a cycle in a linked list", "renders a to-do list with add and remove buttons")
CODE = (
    "Write a {lang} program that {task}.",
    "Implement a function in {lang} which {task}. Use O(n) extra space at most.",
    "How do I write {lang} code that {task}?",
    "Develop a {lang} script that {task}, and explain its time complexity.",
    "Give me a {lang} class that {task}, with unit tests.",
)
MATH = (
    "Solve for x: {a}x + {b} = {c}",
    "Given that f(x) = {a}x^2 - {b}x + {c}, find the value of f({d}).",
    "What is the area of a triangle with vertices at (0, 0), ({a}, {b}) and ({c}, {d})?",
    "Find the derivative of {a}x^3 + {b}x - {c}.",
    "If x + y = {a} and x - y = {b}, what are x and y?",
    "What is {a}% of {c}?",
    "How many positive integers less than {c} are divisible by {a} or {b}?",
    "Compute the sum of all integers from {a} to {c}.",
)


def code_and_math(rng: random.Random, n: int) -> Iterator[Example]:
    for i in range(n):
        j = i % len(CODE)
        yield Example(CODE[j].format(lang=rng.choice(LANGS), task=rng.choice(TASKS)), "code",
                      "template", f"template:code:{j}")
        k = i % len(MATH)
        a, b, d = (rng.randint(2, 20) for _ in range(3))
        yield Example(MATH[k].format(a=a, b=b, c=rng.randint(21, 500), d=d), "math", "template",
                      f"template:math:{k}")
