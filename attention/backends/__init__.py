"""Attention backends: each has `forward(layer, q, k, v, kv_cache, attn_metadata) -> out`."""
