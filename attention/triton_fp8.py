"""fp8 KV pages in Triton, with integer ops only, so every GPU (with fp8 or without) and
the interpreter compute the same bits: the store's round to nearest even (as torch's cast
of float32) and the read through fp16 bits (as the C++ kernels read them). The caches are
passed as uint8 views (`page_format`)."""

import torch
import triton
import triton.language as tl

# dtype -> (mantissa bits, exponent bias, largest finite value)
_FORMATS = {torch.float8_e4m3fn: (3, 7, 448.0), torch.float8_e5m2: (2, 15, 57344.0)}


def page_format(kv_cache: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The cache as a kernel takes it (fp8: a uint8 view), and the FP8 / MANT / BIAS / LIMIT
    constexprs of its format (FP8 False for 16/32-bit pages)."""
    if kv_cache.dtype not in _FORMATS:
        return kv_cache, dict(FP8=False, MANT=0, BIAS=0, LIMIT=0.0)
    mant, bias, limit = _FORMATS[kv_cache.dtype]
    return kv_cache.view(torch.uint8), dict(FP8=True, MANT=mant, BIAS=bias, LIMIT=limit)


@triton.jit
def quantize_fp8(x, scale, MANT: tl.constexpr, BIAS: tl.constexpr, LIMIT: tl.constexpr):
    """The fp8 byte (uint8) of x / scale, clamped to +-LIMIT, rounded to nearest even."""
    y = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -LIMIT, LIMIT)
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    shift: tl.constexpr = 23 - MANT
    # Below the smallest normal: adding 2^(shift + 1 - BIAS), whose ulp is the smallest
    # subnormal, rounds to nearest even in the float adder and leaves the code in the bits.
    magic_bits: tl.constexpr = (127 + shift + 1 - BIAS) << 23
    magic = tl.full(mag.shape, magic_bits, tl.int32).to(tl.float32, bitcast=True)
    subnormal = (mag.to(tl.float32, bitcast=True) + magic).to(tl.int32, bitcast=True) - magic_bits
    # Normal: rebias the exponent, add half an ulp less one plus the kept lowest bit, shift.
    odd = (mag >> shift) & 1
    normal = (mag + (((BIAS - 127) << 23) + (1 << (shift - 1)) - 1) + odd) >> shift
    code = tl.where(mag < ((127 - BIAS + 1) << 23), subnormal, normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def dequantize_fp8(byte, scale, MANT: tl.constexpr):
    """fp8 bytes (uint8; MANT 3: e4m3, 2: e5m2) read as float32 times scale, through the
    fp16 bits they equal: e5m2 is fp16's high byte, e4m3 shifted into place is 2^-8 of
    its value."""
    wide = byte.to(tl.uint16)
    if MANT == 3:
        half = (((wide & 0x80) << 8) | ((wide & 0x7F) << 7)).to(tl.float16, bitcast=True)
        return half.to(tl.float32) * (scale * 256.0)
    else:
        half = (wide << 8).to(tl.float16, bitcast=True)
        return half.to(tl.float32) * scale
