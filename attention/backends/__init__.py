"""Attention backends: each has `forward(layer, q, k, v, kv_cache, attn_metadata) -> out`
and `cudagraph_support`: whether its decode path can be captured in a CUDA graph."""
