"""Pre-registered row filters and the counts that reconcile them.

Nothing is dropped silently: every removal is counted under its reason, in total,
per source file and per split, and each level reconciles
read = kept + sum(removed by reason). The filters declared in `data.filters`
(argilla's status, chosen score and GSM8K overlap) refuse a row that lacks the
column they read; the universal ones (empty response, chosen identical to
rejected, exact duplicate pair, row over the length limit) apply to every arm, and the
prompt's token budget to every arm that sets `data.max_prompt_tokens`.

`row_over_length` removes, before tokenization, a pair whose rendered prompt and longer
response hold more characters than the row limit of align.data.bounds: it has more than
16 x seq_len tokens, so the build could keep only a fragment of it, and tokenizing it
whole could exhaust memory.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

from align.config import DataConfig, FilterConfig
from align.data.formats import PreferenceRecord
from align.data.split import pair_digest
from align.exit_codes import BadInputData

REASONS = (
    "status_excluded",
    "chosen_score_below_min",
    "in_gsm8k_train",
    "empty_response",
    "chosen_equals_rejected",
    "duplicate_pair",
    "row_over_length",
    "prompt_over_budget",
)
UNIVERSAL_REASONS = (
    "empty_response",
    "chosen_equals_rejected",
    "duplicate_pair",
    "row_over_length",
)


def active_reasons(data: DataConfig) -> tuple[str, ...]:
    """The reasons an arm's pre-registration applies, in REASONS order."""
    f = data.filters
    declared = {
        "status_excluded": bool(f.exclude_status),
        "chosen_score_below_min": f.min_chosen_score is not None,
        "in_gsm8k_train": f.exclude_in_gsm8k_train,
        "prompt_over_budget": data.max_prompt_tokens is not None,
    }
    return tuple(r for r in REASONS if r in UNIVERSAL_REASONS or declared.get(r, False))


def _meta(record: PreferenceRecord, column: str, key: str):
    if column not in record.meta:
        raise BadInputData(
            f"{record.where()}: filter data.filters.{key} needs column {column!r}, which the row lacks"
        )
    return record.meta[column]


def rejection_reason(record: PreferenceRecord, cfg: FilterConfig) -> str | None:
    """The first pre-registered reason to drop `record` on its text alone, or None to keep it."""
    if cfg.exclude_status and _meta(record, "status", "exclude_status") in cfg.exclude_status:
        return "status_excluded"
    if cfg.min_chosen_score is not None:
        score = _meta(record, "chosen_score", "min_chosen_score")
        # A null score is no evidence the pair clears the bar (the readers refuse a NaN).
        if score is None or not score >= cfg.min_chosen_score:
            return "chosen_score_below_min"
    if cfg.exclude_in_gsm8k_train and _meta(record, "in_gsm8k_train", "exclude_in_gsm8k_train"):
        return "in_gsm8k_train"
    if not record.chosen.strip() or not record.rejected.strip():
        return "empty_response"
    if record.chosen == record.rejected:
        return "chosen_equals_rejected"
    return None


def pair_chars(prompt_text: str, record: PreferenceRecord) -> int:
    """Characters of the longest sequence a pair makes: its rendered prompt and longer response."""
    return len(prompt_text) + max(len(record.chosen), len(record.rejected))


def prompt_over_budget(prompt_tokens: int, max_prompt_tokens: int | None) -> bool:
    """The filter applied after tokenization: the rendered prompt alone exceeds the budget."""
    return max_prompt_tokens is not None and prompt_tokens > max_prompt_tokens


def classify(
    records: Iterable[PreferenceRecord], cfg: FilterConfig
) -> Iterator[tuple[PreferenceRecord, str | None]]:
    """Every record with its reason to be dropped (None: kept so far), exact duplicates included.

    A later copy of a kept pair is a duplicate; a copy of a dropped one keeps that reason.
    """
    seen: set[bytes] = set()
    for record in records:
        reason = rejection_reason(record, cfg)
        if reason is None:
            digest = pair_digest(record.prompt, record.chosen, record.rejected)
            if digest in seen:
                reason = "duplicate_pair"
            else:
                seen.add(digest)
        yield record, reason


def _known(reason: str) -> str:
    if reason not in REASONS:
        raise ValueError(f"unknown filter reason {reason!r} (known: {', '.join(REASONS)})")
    return reason


class Tally:
    """Rows read, kept and removed by reason, for one group of rows."""

    def __init__(self, reasons: Iterable[str] = ()) -> None:
        self.read = 0
        self.kept = 0
        self.removed: Counter[str] = Counter({reason: 0 for reason in reasons})

    def add(self, reason: str | None) -> None:
        self.read += 1
        if reason is None:
            self.kept += 1
        else:
            self.removed[_known(reason)] += 1

    def as_dict(self) -> dict:
        return {
            "read": self.read,
            "kept": self.kept,
            "removed": {r: self.removed[r] for r in sorted(self.removed)},
        }

    def check_reconciles(self, label: str = "filter counts") -> None:
        total = self.kept + sum(self.removed.values())
        if total != self.read:
            raise AssertionError(
                f"{label} do not reconcile: read {self.read} != kept + removed {total}"
            )


class FilterCounts(Tally):
    """The total tally, plus one per source file and one per split when rows name them."""

    def __init__(self, reasons: Iterable[str] = ()) -> None:
        self.reasons = tuple(reasons)
        super().__init__(self.reasons)
        self.by_source: dict[str, Tally] = {}
        self.by_split: dict[str, Tally] = {}

    def _groups(self, source: str | None, split: str | None) -> list[Tally]:
        groups = []
        for name, tallies in ((source, self.by_source), (split, self.by_split)):
            if name is not None:
                if name not in tallies:
                    tallies[name] = Tally(self.reasons)
                groups.append(tallies[name])
        return groups

    def add(self, reason: str | None, source: str | None = None, split: str | None = None) -> None:
        """One row read, kept (reason None) or removed under `reason`."""
        super().add(reason)
        for tally in self._groups(source, split):
            tally.add(reason)

    def check_reconciles(self, label: str = "filter counts") -> None:
        super().check_reconciles(label)
        for kind, groups in (("source", self.by_source), ("split", self.by_split)):
            for name, tally in groups.items():
                tally.check_reconciles(f"{label} of {kind} {name}")
            if groups and sum(t.read for t in groups.values()) != self.read:
                raise AssertionError(f"{label}: rows read per {kind} do not sum to {self.read}")
