"""Process-level helpers: resource guards, distributed setup."""
