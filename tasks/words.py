"""The word lists of the natural-language tasks (tasks.language), kept apart so that tasks.samples can name
their label words without importing the generators. Every word is one token, with its leading space, under
SmolLM2's tokenizer; KEYS and VARIABLES also at the start of a line."""
from __future__ import annotations

NAMES = ("Mary", "John", "Tom", "James", "Anna", "Sarah", "David", "Michael", "Emma", "Lisa", "Paul", "Mark", "Kate",
         "Jack", "Alice", "Bob", "Peter", "Laura", "Daniel", "Rachel", "Chris", "Steve", "Linda", "Susan", "Robert",
         "Kevin", "Amy", "Ben", "Tim", "Sam", "Max", "Ryan", "Eric", "Adam", "Emily", "Grace", "Helen", "Jane", "Joe",
         "Mike")
WORDS = ("apple", "river", "chair", "cloud", "garden", "window", "pencil", "mountain", "bottle", "candle", "forest",
         "letter", "mirror", "rocket", "silver", "tiger", "basket", "castle", "desert", "engine", "island", "jacket",
         "ladder", "marble", "needle", "orange", "planet", "rabbit", "saddle", "tunnel", "violin", "wagon", "anchor",
         "bridge", "camera", "dragon", "feather", "guitar", "hammer", "kettle", "lemon")
# One token at the start of a line too (lookup's table keys).
KEYS = ("apple", "river", "chair", "cloud", "window", "forest", "letter", "castle", "engine", "orange", "planet",
        "anchor", "bridge", "camera")
VARIABLES = tuple("abcdefghjkmnpqrstuvwxyz")  # no i, l, o (read as digits)
DIGITS = tuple(str(d) for d in range(10))

LANGUAGE_TASKS = ("induction", "ioi", "lookup", "binding")
LANGUAGE_LABEL_WORDS = {"induction": WORDS, "ioi": NAMES, "lookup": DIGITS, "binding": DIGITS}
ANSWER_SEP = {"lookup": "", "binding": ""}  # the text between prompt and answer (default " ")
