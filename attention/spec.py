"""What an attention backend knows of one attention layer."""

from dataclasses import dataclass

from ipc.config import KV_CACHE_DTYPES


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention, as every backend reads it: this rank's query and KV heads,
    the head size, the softmax scale, the sliding window (None: full attention), the KV
    cache's dtype ("auto": the model's; fp8 names: see attention/kv_cache_dtype.py) and the
    layer's K and V scales of fp8 pages (unused by 16-bit caches)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None
    kv_cache_dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}"
            )
