"""KV cache memory one long request holds, with KV cache groups (window layers keep only
their window) against every layer holding every block (what a full-attention-only cache
does). Runs the engine's own grouping and KVCacheManager; no weights are loaded.

    python -m benchmarks.kv_memory_bench [--block-size 16] [--chunk 2048]

For each model shape, one request is prefilled in chunks and decoded; at each listed
length the bytes held are (live blocks over all groups) x (bytes per block id, i.e.
group_size layers' pages of bf16 K and V).
"""

from __future__ import annotations

import argparse

from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config

from ipc.utils import cdiv
from kv_cache import KVCacheManager
from models import layer_sliding_windows
from worker.kv_cache_groups import group_layers, group_size

LENGTHS = [1024, 4096, 8192, 16384, 32768]
SHAPES = {
    "Gemma 3 1B (26 layers, 5 local:1 global, window 512)": Gemma3TextConfig(
        num_hidden_layers=26,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=512,
        architectures=["Gemma3ForCausalLM"],
    ),
    "Mistral 7B v0.1 (32 layers, window 4096)": MistralConfig(
        num_hidden_layers=32,
        num_key_value_heads=8,
        head_dim=128,
        sliding_window=4096,
        architectures=["MistralForCausalLM"],
    ),
    "Qwen2 7B, use_sliding_window (28 layers, 4 full, window 4096)": Qwen2Config(
        num_hidden_layers=28,
        num_key_value_heads=4,
        hidden_size=3584,
        num_attention_heads=28,
        use_sliding_window=True,
        sliding_window=4096,
        max_window_layers=4,
        architectures=["Qwen2ForCausalLM"],
    ),
}


class _Request:
    def __init__(self) -> None:
        self.request_id = "long"
        self.num_tokens = 0
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []


def held_bytes(config, block_size: int, chunk: int) -> list[tuple[int, float, float]]:
    """(length, MiB held with groups, MiB with every layer full) at each of LENGTHS."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    page = 2 * block_size * config.num_key_value_heads * head_dim * 2  # K and V, bf16
    groups = group_layers(layer_sliding_windows(config))
    manager = KVCacheManager(
        10**6, block_size, LENGTHS[-1], False, group_windows=[g.sliding_window for g in groups]
    )
    request, rows = _Request(), []
    for length in LENGTHS:
        while request.num_computed_tokens < length:
            step = min(chunk, length - request.num_computed_tokens)
            request.num_tokens = request.num_computed_tokens + step
            assert manager.allocate_slots(request, step) is not None
            request.num_computed_tokens += step
        live = sum(b != 0 for ids in manager.get_block_ids(request.request_id) for b in ids)
        grouped = live * group_size(groups) * page
        full = cdiv(length, block_size) * config.num_hidden_layers * page
        rows.append((length, grouped / 2**20, full / 2**20))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    args = parser.parse_args()
    for name, config in SHAPES.items():
        print(f"\n{name}")
        print(f"{'tokens':>8} {'groups MiB':>11} {'all-full MiB':>13} {'ratio':>6}")
        for length, grouped, full in held_bytes(config, args.block_size, args.chunk):
            print(f"{length:>8} {grouped:>11.1f} {full:>13.1f} {grouped / full:>6.2f}")


if __name__ == "__main__":
    main()
