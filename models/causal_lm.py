"""What every decoder-only model here shares around its decoder stack: the LM head
(tied to the embedding or not), logits, the list of attention layers, and loading
Hugging Face checkpoints into fused, tensor-parallel parameters."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from attention import Attention, kv_scale_target
from models.layers.embedding import ParallelLMHead
from models.layers.utils import default_weight_loader, full_weight


class CausalLM(nn.Module):
    """model(input_ids [T], positions [T]) -> hidden [T, hidden_size];
    compute_logits(hidden [N, hidden_size]) -> logits [N, vocab_size] in the model's
    dtype, on every rank.

    A subclass builds the decoder stack (`build_model`: `embed_tokens` and `layers`, each
    layer with `self_attn.attn`) and says each layer's sliding window
    (`layer_sliding_windows`, also what the KV cache is grouped by).
    """

    # HF checkpoint projections that are fused here: (fused param, HF name, shard id).
    stacked_params_mapping: tuple[tuple[str, str, str | int], ...] = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )
    # Checkpoint tensors that are not parameters here.
    skipped_weight_suffixes: tuple[str, ...] = (
        "rotary_emb.inv_freq",
        "rotary_emb.cos_cached",
        "rotary_emb.sin_cached",
    )

    @classmethod
    def layer_sliding_windows(cls, config: Any) -> list[int | None]:
        """Each layer's sliding window (None = full attention) for `config`."""
        raise NotImplementedError

    def build_model(self, config: Any) -> nn.Module:
        raise NotImplementedError

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = self.build_model(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def attention_layers(self) -> list[Attention]:
        """This rank's Attention modules in layer order (the runner binds `kv_cache`)."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load HF-named checkpoint tensors (or lazy safetensors slices); each parameter
        copies only this rank's shard. Returns the names of the parameters fully loaded
        (a fused parameter once all its shards are)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        expected_shards: dict[str, set[str | int]] = {}
        for param_name, _, shard_id in self.stacked_params_mapping:
            expected_shards.setdefault(param_name, set()).add(shard_id)
        shards_seen: dict[str, set[str | int]] = {}
        for name, weight in weights:
            if name.endswith(self.skipped_weight_suffixes):
                continue
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue  # shares model.embed_tokens.weight
            kv_scale = kv_scale_target(name)
            if kv_scale is not None:  # not a parameter: read by an fp8 KV cache
                module, which = kv_scale
                self.get_submodule(module).load_kv_scale(which, full_weight(weight))
                continue
            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                if f".{weight_name}." not in name:
                    continue
                fused = name.replace(f".{weight_name}.", f".{param_name}.")
                param = self._param(params, fused, name)
                param.weight_loader(param, weight, shard_id)
                shards_seen.setdefault(fused, set()).add(shard_id)
                if shards_seen[fused] >= expected_shards[param_name]:
                    loaded.add(fused)
                break
            else:
                param = self._param(params, name, name)
                getattr(param, "weight_loader", default_weight_loader)(param, weight)
                loaded.add(name)
        return loaded

    @staticmethod
    def _param(params: dict[str, nn.Parameter], name: str, checkpoint_name: str) -> nn.Parameter:
        if name not in params:
            raise KeyError(f"checkpoint tensor {checkpoint_name!r} matches no model parameter")
        return params[name]
