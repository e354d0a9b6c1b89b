import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny tensors gain nothing from threads, and on a shared 2-core box a parallel
    region can wait milliseconds for a descheduled thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
