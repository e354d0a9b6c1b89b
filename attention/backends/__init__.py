"""Attention backends: each implements `AttentionBackend` (backends/base.py)."""
