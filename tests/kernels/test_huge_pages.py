import gc
from pathlib import Path

import pytest
import torch

from kernels import KernelSet
from kernels.huge_pages import copy_to_huge_pages, zeros_on_huge_pages
from models.layers.cpu_linear import dense_linear_kernel, pack_weight

MiB = 1 << 20


def test_zeros_on_huge_pages_is_a_plain_zeroed_tensor():
    cache = zeros_on_huge_pages((2, 3, 4, 5), torch.bfloat16)
    gc.collect()  # the tensor alone keeps its memory alive
    assert cache.shape == (2, 3, 4, 5) and cache.dtype == torch.bfloat16
    assert cache.is_contiguous() and cache.eq(0).all()
    cache[1, 2] = 7
    assert cache.sum().item() == 7 * 4 * 5


def test_copy_to_huge_pages_is_an_equal_contiguous_copy():
    source = torch.randn(6, 10, dtype=torch.float32).t()  # not contiguous
    copy = copy_to_huge_pages(source)
    gc.collect()
    assert copy.is_contiguous() and copy.shape == (10, 6) and torch.equal(copy, source)
    copy[0, 0] = 99.0
    assert source[0, 0] != 99.0


def _anon_huge_page_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return 1024 * int(line.split()[1])
    return 0


def _huge_pages_given() -> bool:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return thp.exists() and "[never]" not in thp.read_text()


@pytest.mark.skipif(not _huge_pages_given(), reason="this kernel gives no transparent huge pages")
def test_a_copy_is_on_huge_pages_where_the_kernel_allows_them():
    copy = copy_to_huge_pages(torch.ones(16 * MiB, dtype=torch.uint8))
    assert _anon_huge_page_bytes_at(copy.data_ptr()) >= 12 * MiB


@pytest.mark.skipif(not _huge_pages_given(), reason="this kernel gives no transparent huge pages")
def test_a_packed_float32_weight_is_on_huge_pages():
    """The panels' copy the dense kernel streams every decode step."""
    kernels = KernelSet.for_device("cpu")
    if dense_linear_kernel(kernels) is None:
        pytest.skip("no dense kernel here")
    weight = torch.randn(4096, 1024)
    packed = pack_weight(weight, kernels)
    assert packed is not None and packed.data.data_ptr() != weight.data_ptr()
    assert _anon_huge_page_bytes_at(packed.data.data_ptr()) >= 12 * MiB
