"""Two hosts on one machine: network namespaces joined by a veth pair, each with its own
host name and process ids (`ip netns`, `unshare`, `nsenter`; root only). `launch.py
--role engine` on host a and a worker on each host: tensor parallel 2 over tcp, with the
cluster's CURVE keys and gloo on the veth addresses. Each worker runs under a restart
loop, as a host's service manager keeps it. The group answers as one host does; a cut
link is seen within --worker-step-timeout; once the link is back, the old workers finish
their step, take the engine's Shutdown and exit, fresh ones register, the interrupted
request is replayed, and the group answers as before."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ipc.auth import Credentials
from tests.cluster.helpers import LAUNCH, ROOT, cluster_env
from tests.integration.greedy import greedy_reference

pytestmark = [
    pytest.mark.slow,  # 30 s on 2 Zen 4 cores
    pytest.mark.skipif(
        os.geteuid() != 0 or not all(map(shutil.which, ("ip", "unshare", "nsenter"))),
        reason="two network namespaces need root, ip, unshare and nsenter",
    ),
]

STEP_TIMEOUT_S = 5
ENGINE_ARGS = ("--dtype", "float32", "--kv-cache-memory", "64MiB", "--tp", "2")
ENGINE_ARGS += ("--worker-step-timeout", str(STEP_TIMEOUT_S))
PROMPTS = [[5, 77, 3, 200], [42] * 30, [9, 8, 7, 6, 5, 4, 3]]
MAX_TOKENS = 8
LONG = 500  # tokens: running when the link is cut

# Prints "streaming" once the first prompt's first token is in, then every answer.
_CLIENT = """
import json, sys
from ipc.client import EngineClient
from ipc.sampling_params import SamplingParams
address, credentials, prompts, max_tokens = sys.argv[1:5]
params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True)
answers = []
with EngineClient(address, credentials=credentials, connect_timeout=120) as client:
    for prompt in json.loads(prompts):
        tokens = []
        for delta in client.stream(prompt, params):
            if not answers and not tokens:
                print("streaming", flush=True)
            tokens += delta.outputs[0].token_ids
        answers.append([tokens, delta.outputs[0].finish_reason])
print(json.dumps(answers))
"""


@dataclass
class Host:
    """A network namespace with a process holding a UTS and a PID namespace of its own."""

    name: str
    namespace: str
    interface: str
    address: str
    holder: subprocess.Popen

    def init_pid(self) -> int:
        """The host's pid 1, as this machine numbers it."""
        children = Path(f"/proc/{self.holder.pid}/task/{self.holder.pid}/children")
        deadline = time.monotonic() + 10
        while not (text := children.read_text().split()):
            assert time.monotonic() < deadline, f"host {self.name} did not start"
            time.sleep(0.01)
        return int(text[0])

    def popen(self, argv: list[str], log: Path) -> subprocess.Popen:
        enter = ["nsenter", "-t", str(self.init_pid()), "--net", "--uts", "--pid", "--mount"]
        env = dict(cluster_env(), GLOO_SOCKET_IFNAME=self.interface)
        with log.open("ab") as out:
            return subprocess.Popen(
                [*enter, "--", *argv], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT
            )

    def link(self, state: str) -> None:
        _ip("-n", self.namespace, "link", "set", self.interface, state)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def two_hosts():
    tag = os.urandom(2).hex()
    hosts = []
    try:
        for name in ("a", "b"):
            _ip("netns", "add", f"ss{name}{tag}")
        _ip("link", "add", f"ssva{tag}", "type", "veth", "peer", "name", f"ssvb{tag}")
        for i, name in enumerate(("a", "b")):
            namespace, interface = f"ss{name}{tag}", f"ssv{name}{tag}"
            address = f"10.231.{int(tag[:2], 16)}.{i + 1}"
            _ip("link", "set", interface, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            _ip("-n", namespace, "link", "set", interface, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            holder = subprocess.Popen(
                ["ip", "netns", "exec", namespace, "unshare", "--uts", "--pid", "--fork"]
                + [
                    "--kill-child",
                    "--mount-proc",
                    "sh",
                    "-c",
                    f"hostname host-{name}; exec sleep inf",
                ]
            )
            hosts.append(Host(f"host-{name}", namespace, interface, address, holder))
        yield hosts
    finally:
        for host in hosts:
            host.holder.kill()  # its pid 1 dies with it, and every process of the host
            host.holder.wait()
        for name in ("a", "b"):
            subprocess.run(["ip", "netns", "del", f"ss{name}{tag}"], capture_output=True)


def _client(host: Host, address: str, credentials: Path, prompts, max_tokens: int, log: Path):
    argv = [sys.executable, "-c", _CLIENT, address, str(credentials), json.dumps(prompts)]
    return host.popen([*argv, str(max_tokens)], log)


def _answers(process: subprocess.Popen, log: Path, timeout: float) -> list:
    assert process.wait(timeout) == 0, log.read_text()
    return json.loads(log.read_text().strip().splitlines()[-1])


def _wait_for(log: Path, text: str, timeout: float) -> float:
    """Seconds until `text` is in the log."""
    start = time.monotonic()
    while text not in log.read_text():
        assert time.monotonic() - start < timeout, f"no {text!r} in:\n{log.read_text()}"
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_group_over_two_hosts_survives_a_cut_link(tmp_path, llama_path):
    credentials = tmp_path / "cluster.credentials"
    Credentials.generate().save(credentials)
    greedy = greedy_reference(llama_path, ignore_eos=True)
    expected = [[greedy(p, MAX_TOKENS), "length"] for p in PROMPTS]
    with two_hosts() as (a, b):
        engine_address = f"tcp://{a.address}:29100"
        common = ["--model", llama_path, *ENGINE_ARGS, "--credentials", str(credentials)]
        engine_log = tmp_path / "engine.log"
        a.popen(
            [sys.executable, LAUNCH, "--role", "engine", "--engine-address", engine_address]
            + [*common, "--address-file", str(tmp_path / "address")],
            engine_log,
        )
        worker = [sys.executable, LAUNCH, "--role", "worker", "--engine-address", engine_address]
        worker += ["--dist-init-address", f"tcp://{a.address}:29110", *common]
        for rank, host in enumerate((a, b)):
            loop = 'while :; do "$@"; sleep 0.5; done'
            host.popen(
                ["sh", "-c", loop, "sh", *worker, "--rank", str(rank)], tmp_path / f"w{rank}.log"
            )
        deadline = time.monotonic() + 120
        while not (tmp_path / "address").exists():
            assert time.monotonic() < deadline, engine_log.read_text()
            time.sleep(0.1)

        log = tmp_path / "client1.log"
        assert (
            _answers(_client(a, engine_address, credentials, PROMPTS, MAX_TOKENS, log), log, 60)
            == expected
        )

        long_log = tmp_path / "long.log"
        long = _client(a, engine_address, credentials, [PROMPTS[0]], LONG, long_log)
        _wait_for(long_log, "streaming", 60)
        b.link("down")
        seen = _wait_for(engine_log, "did not answer step", STEP_TIMEOUT_S + 15)
        time.sleep(2)
        b.link("up")
        _wait_for(engine_log, "new worker(s) ready", 120)
        ((tokens, reason),) = _answers(long, long_log, 120)
        assert reason == "length" and tokens == greedy(PROMPTS[0], LONG)
        log = tmp_path / "client2.log"
        assert (
            _answers(_client(a, engine_address, credentials, PROMPTS, MAX_TOKENS, log), log, 60)
            == expected
        )
        assert seen <= STEP_TIMEOUT_S + 15
