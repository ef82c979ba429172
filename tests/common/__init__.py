"""Shared test helpers: tiny models, paths to the real data samples."""
