"""The kernels' Python face (kernels/python_module.h): arguments by position or name, with
defaults; a wrong call is a TypeError naming the function and the argument; the kernels'
own checks arrive as RuntimeError or ValueError with their message; the bound classes are
made only by their factories; a kernel run without the GIL lets another thread run."""

import threading
import time

import pytest
import torch

from kernels.kernel_set import KernelSet
from kernels.libraries import ATTENTION, DECODE_LOOP, DENSE_LINEAR, MOE, OPS, QUANT_MOE, SAMPLER

CPP = KernelSet(cpu=True)


@pytest.fixture(scope="module")
def ops():
    module = CPP.cpp(OPS)
    if module is None:
        pytest.skip("the C++ kernels could not be built")
    return module


def test_arguments_by_position_by_name_and_by_default(ops):
    x, w = torch.randn(3, 64), torch.rand(64) + 0.5
    reference = ops.rms_norm(x, w, 1e-6)
    assert torch.equal(ops.rms_norm(x=x, weight=w, eps=1e-6), reference)
    assert torch.equal(ops.rms_norm(x, eps=1e-6, weight=w), reference)
    expected = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(reference, expected)
    dense = CPP.cpp(DENSE_LINEAR)
    weight = torch.randn(16, 64)
    by_default = dense.dense_linear(x, weight)
    assert torch.equal(dense.dense_linear(x, weight, None), by_default)
    assert torch.equal(dense.dense_linear(x, weight, bias=None), by_default)
    torch.testing.assert_close(by_default, x @ weight.T)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ops, x, w: ops.rms_norm(x, w), r"rms_norm\(\): missing argument 'eps'"),
        (lambda ops, x, w: ops.rms_norm(x, w, 1e-6, 1), r"rms_norm\(\): 3 arguments at most"),
        (lambda ops, x, w: ops.rms_norm(x, w, epsilon=1e-6), r"no argument named 'epsilon'"),
        (lambda ops, x, w: ops.rms_norm(x, w, 1e-6, x=x), r"argument 'x' given twice"),
        (
            lambda ops, x, w: ops.rms_norm(x, "w", 1e-6),
            r"rms_norm\(\): argument 'weight': expected a Tensor, got str",
        ),
        (
            lambda ops, x, w: ops.rms_norm(x, w, None),
            r"rms_norm\(\): argument 'eps': expected a float, got NoneType",
        ),
        (
            lambda ops, x, w: ops.rotary_embedding(x, x, x, x, x, 2.5),
            r"argument 'head_dim': expected an int, got float",
        ),
    ],
)
def test_a_wrong_call_names_the_function_and_the_argument(ops, call, message):
    x, w = torch.randn(2, 64), torch.ones(64)
    with pytest.raises(TypeError, match=message):
        call(ops, x, w)


def test_an_int_beyond_64_bits_is_refused(ops):
    x = torch.randn(2, 64)
    with pytest.raises(OverflowError):
        ops.rotary_embedding(x, x, x, x, x, 1 << 70)


def test_the_kernels_checks_arrive_with_their_type_and_message():
    attention, moe = CPP.cpp(ATTENTION), CPP.cpp(MOE)
    if attention is None or moe is None:
        pytest.skip("the C++ kernels could not be built")
    cache = torch.zeros(2, 4, 16, 2, 64)
    k = torch.randn(3, 2, 64)
    with pytest.raises(RuntimeError, match="share a dtype"):
        attention.store_kv(k.half(), k.half(), cache, torch.arange(3))
    x = torch.randn(2, 8)
    w13, w2 = torch.randn(2, 16, 8), torch.randn(2, 8, 8)
    ids = torch.tensor([[0], [5]])
    with pytest.raises(ValueError, match="names expert 5 of 2"):
        moe.fused_experts(x, w13, w2, torch.ones(2, 1), ids)


def test_bound_classes_come_only_from_their_factories():
    loop, quant_moe = CPP.cpp(DECODE_LOOP), CPP.cpp(QUANT_MOE)
    if loop is None or quant_moe is None:
        pytest.skip("the C++ kernels could not be built")
    cos = torch.zeros(8, 32)
    made = loop.DecodeLoop({}, 2, 1, 64, 1e-6, 0.125, cos, cos)
    assert type(made).__name__ == "DecodeLoop"
    with pytest.raises(TypeError):
        type(made)()
    x = torch.randn(1, 8)
    with pytest.raises(TypeError, match="argument 'down': expected a kernel object, got"):
        quant_moe.fused_quant_experts(x, [], made, torch.ones(1, 1), torch.zeros(1, 1), 1)
    with pytest.raises(RuntimeError, match="lends no linear_int8"):
        quant_moe.BlockQuantExperts(x, x, None, 4, 32, {}, "linear_int8")


def test_a_kernel_without_the_gil_lets_another_thread_run():
    """The sampler releases the GIL: a Python thread keeps counting while one long call
    runs (holding it, no other thread could run until the call returned)."""
    sampler = CPP.cpp(SAMPLER)
    if sampler is None:
        pytest.skip("the C++ kernels could not be built")
    logits = torch.randn(64, 300_000)
    temperature, u, top_p = torch.ones(64), torch.rand(64), torch.full((64,), 0.9)
    ticks, done = [], threading.Event()

    def count():
        while not done.is_set():
            ticks.append(time.perf_counter())

    counter = threading.Thread(target=count)
    counter.start()
    try:
        time.sleep(0.05)
        start = time.perf_counter()
        sampler.sample(logits, temperature, None, top_p, None, u, 0.0)
        end = time.perf_counter()
    finally:
        done.set()
        counter.join()
    margin = (end - start) / 4
    assert any(start + margin < t < end - margin for t in ticks), end - start
