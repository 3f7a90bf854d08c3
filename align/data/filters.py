"""Pre-registered row filters with per-reason counts.

Nothing is dropped silently: every removal is counted under its reason, and the
manifest reconciles read = kept + sum(removed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

from align.config import FilterConfig
from align.data.formats import PreferenceRecord

REASONS = (
    "status_excluded",
    "chosen_score_below_min",
    "in_gsm8k_train",
    "empty_response",
    "chosen_equals_rejected",
    "duplicate_pair",
)


def rejection_reason(record: PreferenceRecord, cfg: FilterConfig) -> str | None:
    """The first pre-registered reason to drop `record`, or None to keep it."""
    meta = record.meta
    if cfg.exclude_status and meta.get("status") in cfg.exclude_status:
        return "status_excluded"
    if cfg.min_chosen_score is not None:
        score = meta.get("chosen_score")
        if score is None or score < cfg.min_chosen_score:
            return "chosen_score_below_min"
    if cfg.exclude_in_gsm8k_train and meta.get("in_gsm8k_train"):
        return "in_gsm8k_train"
    if not record.chosen.strip() or not record.rejected.strip():
        return "empty_response"
    if record.chosen == record.rejected:
        return "chosen_equals_rejected"
    return None


class FilterCounts:
    """Counts of rows read, kept and removed by reason."""

    def __init__(self) -> None:
        self.read = 0
        self.kept = 0
        self.removed: Counter[str] = Counter()

    def as_dict(self) -> dict:
        return {"read": self.read, "kept": self.kept, "removed": dict(sorted(self.removed.items()))}

    def check_reconciles(self) -> None:
        total = self.kept + sum(self.removed.values())
        if total != self.read:
            raise AssertionError(
                f"filter counts do not reconcile: read {self.read} != kept + removed {total}"
            )


def apply_filters(
    records: Iterable[PreferenceRecord], cfg: FilterConfig, counts: FilterCounts
) -> Iterator[PreferenceRecord]:
    """Yield kept records; count every removal, exact duplicate pairs included."""
    seen: set[int] = set()
    for record in records:
        counts.read += 1
        reason = rejection_reason(record, cfg)
        if reason is None:
            key = hash((record.prompt, record.chosen, record.rejected))
            if key in seen:
                reason = "duplicate_pair"
            else:
                seen.add(key)
        if reason is None:
            counts.kept += 1
            yield record
        else:
            counts.removed[reason] += 1


def remove(counts: FilterCounts, reason: str) -> None:
    """Move one kept row to `reason` (for filters that need tokens, applied after this pass)."""
    counts.kept -= 1
    counts.removed[reason] += 1
