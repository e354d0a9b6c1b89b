"""Attention metadata, the forward context, the rotary + store-KV step and the backends."""

from attention.backends.base import AttentionBackend
from attention.forward_context import ForwardContext, get_forward_context, set_forward_context
from attention.kv_cache_dtype import kv_cache_torch_dtype
from attention.layer import Attention, kv_scale_target
from attention.metadata import AttentionMetadata, CommonAttentionMetadata
from attention.rotation import RopeTables, Rotation
from attention.selector import BACKEND_NAMES, get_attn_backend
from attention.spec import AttentionSpec

__all__ = [
    "BACKEND_NAMES",
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionSpec",
    "CommonAttentionMetadata",
    "ForwardContext",
    "RopeTables",
    "Rotation",
    "get_attn_backend",
    "get_forward_context",
    "kv_cache_torch_dtype",
    "kv_scale_target",
    "set_forward_context",
]
