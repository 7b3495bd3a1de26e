"""Synthetic probing tasks (SPEC section 3): completion, memory and multi_register.

Every prompt ends with the same final token ":"; samples come in pairs differing only in what
determines the label; ``group_id`` is the cross-validation group held out as a whole.
"""
from .generators import dataset_fingerprint, make_dataset
from .samples import DISTRACTOR_COUNTS, LABEL_WORDS, TASKS, Sample
from .tokenizer import build_tokenizer, label_token_ids, tokenize_samples

__all__ = [
    "TASKS",
    "DISTRACTOR_COUNTS",
    "LABEL_WORDS",
    "Sample",
    "make_dataset",
    "dataset_fingerprint",
    "build_tokenizer",
    "tokenize_samples",
    "label_token_ids",
]
