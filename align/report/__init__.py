"""The run report: the summary gathered from receipts, and its figures."""
