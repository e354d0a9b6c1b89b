"""Quantized weights: the formats, their kernels and the per-layer quantization methods."""
