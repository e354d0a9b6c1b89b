"""Fixtures the client tests share."""

import pytest

from ipc.client.core import ClientCore
from ipc.sockets import WELCOME


@pytest.fixture
def core():
    """A connected ClientCore whose sends land in `core.sent`."""
    sent: list = []
    core = ClientCore(None, "ipc://nowhere", lambda message: sent.append(message) or True)
    core.sent = sent
    core.handle_frame(WELCOME)
    return core
