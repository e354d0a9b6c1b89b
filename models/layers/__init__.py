"""Tensor-parallel building blocks for the models."""

from models.layers.activation import SiluAndMul
from models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from models.layers.norm import RMSNorm
from models.layers.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "apply_rotary",
    "compute_inv_freq",
]
