"""Synthetic tasks (docs/design.md, Tasks): the probing tasks completion, memory and multi_register (``TASKS``),
the state-tracking tasks parity and shell_game (``TRACKING_TASKS``, issue 21) and the natural-language tasks
induction, ioi, lookup and binding for pretrained LMs (``LANGUAGE_TASKS``, issue 39; tasks.language);
``ALL_TASKS`` is all of them.

Every prompt of a task ends with the same final token (":" for the synthetic tasks); samples come in pairs
differing only in what determines the label; ``group_id`` is the cross-validation group held out as a whole.
"""
from .generators import dataset_fingerprint, make_dataset
from .samples import (ALL_TASKS, DISTRACTOR_COUNTS, LABEL_WORDS, LANGUAGE_TASKS, TASKS, TRACKING_TASKS, Sample,
                      copies_across_groups, pair_roles, probe_labels, probe_target)
from .tokenizer import (build_tokenizer, key_token_positions, label_token_ids, prompt_ids, prompt_prefix,
                        prompt_prefix_tokens, tokenize_samples)
from .custom import TaskSource, resolve_task  # bring-your-own tasks (docs/tasks.md)

__all__ = [
    "TASKS",
    "copies_across_groups",
    "TRACKING_TASKS",
    "LANGUAGE_TASKS",
    "ALL_TASKS",
    "DISTRACTOR_COUNTS",
    "LABEL_WORDS",
    "Sample",
    "make_dataset",
    "dataset_fingerprint",
    "build_tokenizer",
    "tokenize_samples",
    "prompt_prefix",
    "prompt_ids",
    "prompt_prefix_tokens",
    "label_token_ids",
    "key_token_positions",
    "pair_roles",
    "probe_labels",
    "probe_target",
]
