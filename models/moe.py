"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE and Mixtral. Each is its dense
family's decoder with a sparse MLP block (models/layers/fused_moe.py) in some or all
layers; attention, norms and the KV cache are the dense model's.

Checkpoints name each expert's projections (`...experts.{e}.gate_proj.weight`, Mixtral's
`w1`/`w3`/`w2`; an fp8 checkpoint's `weight_scale` and `input_scale` beside them), as
transformers and llm-compressor write them, or hold them stacked
(`...experts.gate_up_proj` [E, 2 I, H], `...experts.down_proj` [E, H, I]; a GGUF file's
`...experts.gate_proj` / `up_proj` / `down_proj`); all load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from torch import nn

from models.layers.fused_moe import FusedMoE, SparseMoeBlock
from models.llama import LlamaMLP
from models.mistral import MistralForCausalLM
from models.qwen2 import Qwen2ForCausalLM
from models.qwen3 import Qwen3ForCausalLM

_EXPERT = re.compile(
    r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
    r"\.(weight|weight_scale|input_scale|qweight|qzeros|scales|g_idx|weight_packed"
    r"|weight_zero_point|weight_g_idx|weight_shape)$"
)
_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$")
_PROJECTION = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up"}
_PROJECTION |= {"down_proj": "down", "w2": "down"}


class MoEWeightsMixin:
    """Expert tensors go to their FusedMoE; the rest load as the dense model's."""

    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        experts: dict[str, FusedMoE] = {}

        def dense(weights: Iterable[tuple[str, Any]]):
            for name, weight in weights:
                for old, new in self.checkpoint_renames:
                    name = name.replace(old, new)
                if match := _EXPERT.match(name):
                    module, expert, projection, kind = match.groups()
                    moe = experts.setdefault(module, self.get_submodule(module))
                    moe.load_expert(int(expert), _PROJECTION[projection], weight, kind)
                elif match := _STACKED.match(name):
                    module, projection = match.groups()
                    moe = experts.setdefault(module, self.get_submodule(module))
                    moe.load_stacked(projection.removesuffix("_proj"), weight)
                else:
                    yield name, weight

        loaded = super().load_weights(dense(weights))
        for module, moe in experts.items():
            if moe.fully_loaded():
                loaded |= {f"{module}.{name}" for name, _ in moe.named_parameters()}
        return loaded


def _qwen_sparse_block(
    config: Any, layer_index: int, prefix: str, *, norm_default: bool, shared_expert: bool
) -> nn.Module | None:
    """A Qwen MoE layer's sparse block, None where transformers keeps the layer dense (in
    mlp_only_layers, or not every decoder_sparse_step-th); with `shared_expert`, Qwen2-MoE's
    shared expert beside the experts."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = layer_index in (getattr(config, "mlp_only_layers", None) or [])
    if not config.num_experts or dense or (layer_index + 1) % step:
        return None
    shared = None
    if shared_expert and getattr(config, "shared_expert_intermediate_size", 0):
        shared = LlamaMLP(
            config.hidden_size,
            config.shared_expert_intermediate_size,
            config.hidden_act,
            bias=False,
            prefix=f"{prefix}.shared_expert",
        )
    return SparseMoeBlock(
        config.hidden_size,
        config.num_experts,
        config.num_experts_per_tok,
        config.moe_intermediate_size,
        renormalize=bool(getattr(config, "norm_topk_prob", norm_default)),
        prefix=prefix,
        shared_expert=shared,
    )


class Qwen3MoeForCausalLM(MoEWeightsMixin, Qwen3ForCausalLM):
    def build_mlp(self, layer_index: int, prefix: str) -> nn.Module | None:
        return _qwen_sparse_block(
            self.config, layer_index, prefix, norm_default=True, shared_expert=False
        )


class Qwen2MoeForCausalLM(MoEWeightsMixin, Qwen2ForCausalLM):
    """Qwen2's attention (q/k/v bias), and beside the experts a shared expert."""

    def build_mlp(self, layer_index: int, prefix: str) -> nn.Module | None:
        return _qwen_sparse_block(
            self.config, layer_index, prefix, norm_default=False, shared_expert=True
        )


class MixtralForCausalLM(MoEWeightsMixin, MistralForCausalLM):
    """Mistral's attention (its sliding window, if any), every layer sparse, the top-k
    weights always renormalised."""

    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)

    def build_mlp(self, layer_index: int, prefix: str) -> nn.Module | None:
        config = self.config
        return SparseMoeBlock(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            renormalize=True,
            prefix=prefix,
        )
