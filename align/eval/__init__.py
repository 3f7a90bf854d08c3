"""Held-out evaluation: preference accuracy with Wilson intervals, paired comparison."""
