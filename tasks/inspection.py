"""The embedded default's task: automated optical inspection (AOI) and its monthly rule book.

Each record is a board on which the AOI flagged one defect type with its measurement (plus identifiers
and the reflow temperature, which no rule reads), and the verdict follows the month's rule book. A rule
(one per defect type) compares the measurement with a threshold and gives one verdict below it and
another at or above. Every month the rule book changes a few rules and keeps the rest, so the base
model, trained on an earlier month, gets the changed rules wrong while the unchanged ones form a
regression set.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tasks.records import DataError, Example

RULEBOOK = "rulebook.json"


# Each AOI defect type comes with the one measurement its rule reads (0-99 in its unit).
MEASUREMENT_OF = {
    "cosmetic": "mark_mm2",
    "bridge": "solder_pct",
    "tombstone": "tilt_deg",
    "shift": "offset_um",
    "void": "void_pct",
    "scratch": "depth_um",
    "crack": "crack_um",
    "lifted": "lift_um",
}


DEFECTS = tuple(MEASUREMENT_OF)


THRESHOLDS = tuple(range(20, 90, 10))


# The rule book history starts here; every later month is this book plus monthly edits.
EPOCH_MONTH = "2026-01"


@dataclass(frozen=True)
class Rule:
    defect: str
    threshold: int
    below: str
    at_or_above: str

    def verdict(self, measurement: int) -> str:
        return self.at_or_above if measurement >= self.threshold else self.below


def _verdicts(defect: str) -> tuple[str, ...]:
    return ("PASS", "REWORK", "HOLD", f"FAIL:{defect}")


def _month_index(month: str) -> int:
    year, mon = (int(p) for p in month.split("-"))
    return year * 12 + mon - 1


def _month_name(index: int) -> str:
    return f"{index // 12:04d}-{index % 12 + 1:02d}"


def _epoch_rulebook(seed: int) -> dict[str, Rule]:
    rng = random.Random(f"rulebook:{seed}")
    book = {}
    for defect in DEFECTS:
        below, above = rng.sample(_verdicts(defect), 2)
        book[defect] = Rule(defect, rng.choice(THRESHOLDS), below, above)
    return book


def _edit_rule(rule: Rule, rng: random.Random) -> Rule:
    # The new verdicts are the two the old rule never gave, so every record the rule
    # governs changes its answer: a model that learned the old book is wrong on all of them.
    unused = [v for v in _verdicts(rule.defect) if v not in (rule.below, rule.at_or_above)]
    below, above = rng.sample(unused, 2)
    return Rule(rule.defect, rng.choice(THRESHOLDS), below, above)


def rulebook(month: str, seed: int, rules_changed_per_month: int) -> dict[str, Rule]:
    """The rule book in force in ``month``: the epoch book with every monthly edit applied."""
    book = _epoch_rulebook(seed)
    start = _month_index(EPOCH_MONTH)
    end = _month_index(month)
    if end < start:
        raise DataError(f"month {month} is before the first rule book ({EPOCH_MONTH})")
    for index in range(start + 1, end + 1):
        rng = random.Random(f"edits:{seed}:{_month_name(index)}")
        for defect in rng.sample(DEFECTS, rules_changed_per_month):
            book[defect] = _edit_rule(book[defect], rng)
    return book


def changed_rules(month: str, since: str, seed: int, rules_changed_per_month: int) -> list[str]:
    """Defect types whose rule differs between the book of ``since`` and that of ``month``."""
    new = rulebook(month, seed, rules_changed_per_month)
    old = rulebook(since, seed, rules_changed_per_month)
    return sorted(d for d in DEFECTS if new[d] != old[d])


def render_prompt(board: str, line: str, part: str, temp_c: int, defect: str, measurement: int) -> str:
    return (
        f"inspect board={board} line={line} part={part} temp_c={temp_c} "
        f"defect={defect} {MEASUREMENT_OF[defect]}={measurement} verdict:"
    )


def sample_examples(
    book: dict[str, Rule], n: int, rng: random.Random, changed: set[str] | None = None
) -> list[Example]:
    examples = []
    for i in range(n):
        # Cycle through the defect types so every rule is equally represented in every split.
        defect = DEFECTS[i % len(DEFECTS)]
        measurement = rng.randrange(100)
        prompt = render_prompt(
            board=f"PCB-{rng.randrange(10000):04d}",
            line=f"L{rng.randrange(1, 5)}",
            part=f"{rng.choice('RCUQJ')}{rng.randrange(1, 100)}",
            temp_c=rng.randrange(180, 260),
            defect=defect,
            measurement=measurement,
        )
        examples.append(
            Example(
                prompt=prompt,
                completion=" " + book[defect].verdict(measurement),
                rule=defect,
                changed=None if changed is None else defect in changed,
            )
        )
    rng.shuffle(examples)
    return examples
