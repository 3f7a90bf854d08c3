"""Preference and SFT data: raw formats, filters, tokenization, split, shards, loader."""
