"""Preference and likelihood objectives."""
