"""Sample record and constants shared by the synthetic probing tasks (SPEC section 3).

Every prompt of every task ends with the same final token ``:`` so that, under standard prefill, the
layer-0 vector at the last position is identical for all samples and a layer-0 probe is at chance by
construction.
"""
from __future__ import annotations

from dataclasses import dataclass

TASKS = ("completion", "memory", "multi_register")
DISTRACTOR_COUNTS = (0, 8, 32, 128, 256)
# Index = label. multi_register answers with the bare bit so the answer is a digit token.
LABEL_WORDS = {"completion": ("MORE", "DONE"), "memory": ("ZERO", "ONE"), "multi_register": ("0", "1")}
WRITES_CHOICES = (2, 4, 8)
REGISTERS = ("A", "B", "C", "D", "E", "F", "G", "H")
FINAL_TOKEN = ":"


@dataclass(frozen=True)
class Sample:
    """One prompt with its binary label and the bookkeeping probes need (pair, CV group, N, length)."""

    task: str
    text: str  # the prompt; always ends with the final token ":"
    label: int  # 0/1, index into LABEL_WORDS[task]
    pair_id: int
    group_id: int  # cross-validation group: whole groups are held out together
    n_distractors: int
    writes: int = 0  # multi_register: writes per register (2, 4 or 8); 0 for other tasks
    n_tokens: int | None = None  # filled by tasks.tokenize_samples

    @property
    def answer(self) -> str:
        return LABEL_WORDS[self.task][self.label]

    @property
    def full_text(self) -> str:
        """Prompt plus answer: the text a model is trained on."""
        return self.text + " " + self.answer
