"""Stage orchestration: the gates, then each stage (sft, ref precompute, dpo, select) that
runs after them. Every module here may use any layer below; nothing below imports it."""
