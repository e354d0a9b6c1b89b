"""What an attention backend knows of one attention layer."""

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention, as every backend reads it: this rank's query and KV heads,
    the head size, the softmax scale, the sliding window (None: full attention) and the KV
    cache's dtype ("auto": the model's)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.kv_cache_dtype != "auto":
            raise NotImplementedError(f"KV cache dtype {self.kv_cache_dtype!r}: only auto")
