"""A Llama-style decoder's layers for a CPU decode step in one C++ call (cpu_decode_loop.cpp).

A single-stream decode step of a small model spends about as long in the Python between
its kernels (module calls, views, dispatch: ~100 us a layer) as in the kernels. The loop
runs the same kernels in the same order from C++, so its output is bitwise the Python
layers'. It takes a step when:
- the model: tensor parallel size 1, C++ kernels on, a neox rotary table, every layer a
  LlamaDecoderLayer with RMSNorm, SiLU-and-mul, no q/k norm, every linear layer computed
  by int8-activation kernels (a quantized weight: `LinearMethodBase.decode_weight`),
  dense in the model's dtype, or on a dense kernel (cpu_dense_linear.cpp: a bf16 weight of
  a float32 model too; cpu_bf16_linear.cpp; cpu_linear.cpp's AMX copy, up to its
  SMALL_BATCH_ROWS), all layers in one KV cache group;
- the step: on the CPU attention backend, every row a decode or a short row (at most
  cpu_backend.SHORT_QUERY_LEN query tokens, as a speculative step's verification), which
  the backend attends as one decode entry per query token; no padding, no more tokens
  than the row-layout quantized kernels take (strips take any).
Anything else runs the Python layers. SPLITSERVE_CPU_DECODE_LOOP=0 turns it off
(`KernelSet.decode_loop`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from attention import Attention
from attention.backends.cpu_backend import CPUAttentionBackend
from attention.forward_context import get_forward_context
from kernels import KernelSet
from kernels.libraries import DECODE_LOOP
from models.layers.activation import SiluAndMul
from models.layers.cpu_linear import PackedWeight
from models.layers.linear import LinearBase
from models.layers.norm import RMSNorm
from models.layers.rotary import RotaryEmbedding
from models.quantization.cpu_quant_linear import (
    INT8_ROWS,
    TILE_ROWS,
    PreparedQuantWeight,
)
from models.quantization.strips import StripQuantWeight

_UNBOUNDED = 1 << 62


def decode_loop_module(kernels: KernelSet) -> ModuleType | None:
    """The compiled loop for the set's ISA; None where the C++ kernels are off or fail."""
    return kernels.cpp(DECODE_LOOP)


class CPUDecodeLoop:
    """Built for a model once its layers hold their kernels (`build`); called with a
    step's embeddings, returns (hidden, residual) after the last layer, or None where it
    does not take the step."""

    def __init__(self, loop: Any, attention: list[Attention], max_rows: int) -> None:
        self._loop = loop
        self._attention = attention
        self.max_rows = max_rows

    @classmethod
    def build(cls, model: nn.Module, kernels: KernelSet, layer_type: type) -> CPUDecodeLoop | None:
        """The loop of a LlamaModel (`layers` of `layer_type`, `rotary_emb`) whose layers
        are bound to `kernels`; None where the model is not one it takes."""
        if not (kernels.cpu and kernels.decode_loop):
            return None
        module = decode_loop_module(kernels)
        rotary, layers = model.rotary_emb, list(model.layers)
        if module is None or not layers:
            return None
        if type(rotary) is not RotaryEmbedding or rotary.ops is None:
            return None
        first = layers[0].self_attn
        eps = layers[0].input_layernorm.variance_epsilon
        if not all(_takes_layer(layer, layer_type, first, eps) for layer in layers):
            return None
        dtype = layers[0].input_layernorm.weight.dtype
        linears = [_linears(layer, dtype) for layer in layers]
        if any(args is None for args in linears):
            return None
        lent = {id(m): m for _, _, used in linears for m in used}.values()  # the layers' kernels
        spec = first.attn.spec
        loop = module.DecodeLoop(
            {name: f for m in lent for name, f in m.c_api().items()},
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_size,
            eps,
            spec.scale,
            rotary.cos_cache,
            rotary.sin_cache,
        )
        max_rows = _UNBOUNDED
        for layer, (args, rows, _) in zip(layers, linears, strict=True):
            attn = layer.self_attn.attn
            loop.add_layer(
                layer.input_layernorm.weight.detach(),
                layer.post_attention_layernorm.weight.detach(),
                *args,
                attn.spec.k_scale,
                attn.spec.v_scale,
                attn.spec.sliding_window or 0,
            )
            max_rows = min(max_rows, rows)
        return cls(loop, [layer.self_attn.attn for layer in layers], max_rows)

    def __call__(
        self, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        ctx = get_forward_context()
        if ctx.attn_metadata is None or type(ctx.backend) is not CPUAttentionBackend:
            return None
        group = self._attention[0].kv_cache_group
        md = ctx.attn_metadata[group]
        num_tokens = hidden.shape[0]
        decodes = md.decodes
        if (
            num_tokens > self.max_rows
            or md.long_prefill_reqs_cpu
            or decodes.num != num_tokens
            or md.num_actual_tokens != num_tokens
        ):
            return None
        caches = []
        for attn in self._attention:
            if attn.kv_cache is None or attn.kv_cache_group != group:
                return None
            caches.append(attn.kv_cache)
        return self._loop.forward(
            hidden,
            positions.long().contiguous(),
            caches,
            md.slot_mapping,
            decodes.block_table,
            decodes.seq_lens,
            decodes.reqs,
            decodes.rows,
        )


def _takes_layer(layer: nn.Module, layer_type: type, first: nn.Module, eps: float) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)

    def shape(spec: Any) -> tuple:
        return spec.num_heads, spec.num_kv_heads, spec.head_size, spec.scale

    return (
        type(layer) is layer_type
        and not attn.qk_norm
        and type(getattr(mlp, "act_fn", None)) is SiluAndMul
        and all(type(n) is RMSNorm and n.ops is not None for n in norms)
        and all(n.variance_epsilon == eps for n in norms)
        and shape(attn.attn.spec) == shape(first.attn.spec)
        and attn.o_proj.tp_size == 1
    )


def _linears(layer: nn.Module, dtype: torch.dtype) -> tuple[tuple, int, list] | None:
    """The C++ arguments of the layer's qkv, o, gate_up and down projections, the most rows
    their kernels take and the C++ modules that lend them; None where one is not computed
    as the loop computes it."""
    args, max_rows, modules = [], _UNBOUNDED, []
    attn, mlp = layer.self_attn, layer.mlp
    for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        found = _linear_args(linear, dtype)
        if found is None:
            return None
        args.append(found[0])
        max_rows = min(max_rows, found[1])
        if found[2] is not None:
            modules.append(found[2])
    return tuple(args), max_rows, modules


def _linear_args(layer: LinearBase, dtype: torch.dtype) -> tuple[tuple, int, Any] | None:
    """As the layer computes x of `dtype`, and the C++ module that lends the kernel:
    F.linear on a dense weight of that dtype, the dense kernel where the layer has it
    (F.linear for the rows it declines); the int8 kernels, strips at any rows (bfloat16 x:
    up to STRIP_INT8_ROWS_BF16 where torch's bf16 matmul is native), rows up to INT8_ROWS
    (bfloat16 x from TILE_ROWS on may take the bf16 tiles instead)."""
    bias = None if layer.bias is None else layer.bias.detach()
    weight = layer.quant_method.decode_weight(layer)
    if isinstance(weight, torch.Tensor):
        if weight.dtype != dtype:
            return None
        return ("", weight.detach(), None, None, 0, 0, bias), _UNBOUNDED, None
    if isinstance(weight, PackedWeight):
        (name,) = weight.kernel.c_api()  # dense_linear, bf16_linear or amx_linear
        rows = weight.row_limit or _UNBOUNDED  # F.linear past it
        return (name, weight.data, None, None, 0, 0, bias), rows, weight.kernel
    if not isinstance(weight, PreparedQuantWeight) or weight.kernel is None:
        return None
    if weight.exact_float32 and dtype == torch.float32:
        return None
    w = weight.weight
    if isinstance(w, StripQuantWeight):
        rows = weight.strip_int8_rows(dtype) or _UNBOUNDED
        strip_args = ("strip_linear_int8", w.q, w.scales, w.mins, w.bits, w.block_size, bias)
        return strip_args, rows, weight.kernel
    rows = min(INT8_ROWS, TILE_ROWS.start - 1) if dtype == torch.bfloat16 else INT8_ROWS
    row_args = ("linear_int8", w.qweight, w.scales, w.mins, w.bits, w.block_size, bias)
    return row_args, rows, weight.kernel
