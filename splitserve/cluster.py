"""Starting the cluster's processes: each child is the launch.py command line again
(`--role engine|worker|api`, the engine config as JSON), in its own session so that a
terminal's Ctrl-C reaches only the parent, and dying with its parent (see
`splitserve.roles`). `splitserve.LLM` starts its workers with `start_workers` too."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ipc.auth import CLIENT, Credentials, credentials_beside, ensure_credentials
from ipc.config import EngineConfig
from ipc.sockets import private_folder

# launch.py lies beside the project's packages, in a checkout as in site-packages (it is
# installed as a module). Run by its path, the child imports this very tree, whatever
# its working directory holds.
LAUNCH_SCRIPT = str(Path(__file__).resolve().parents[1] / "launch.py")
CREDENTIALS_ENV = "SPLITSERVE_CREDENTIALS"


def spawn(role: str, config: EngineConfig, *args: str, **popen_kwargs) -> subprocess.Popen:
    """launch.py as a child process in `role`, in its own session, dying with us."""
    command = [sys.executable, LAUNCH_SCRIPT, "--role", role, "--parent-pid", str(os.getpid())]
    command += ["--config-json", json.dumps(dataclasses.asdict(config)), *args]
    return subprocess.Popen(command, start_new_session=True, **popen_kwargs)


def start_workers(
    config: EngineConfig,
    engine_address: str,
    dist_init_address: str | None = None,
    credentials: str | None = None,
) -> list[subprocess.Popen]:
    """Start config.tensor_parallel_size worker processes on this machine. Unless told
    otherwise they meet through a file in a private folder (no listening store) and gloo
    binds loopback only. With the ray backend, Ray actors instead
    (splitserve.ray_workers), with the credentials of $SPLITSERVE_CREDENTIALS."""
    if config.distributed_executor_backend == "ray":
        from splitserve.ray_workers import start_ray_workers

        path = credentials or os.environ.get(CREDENTIALS_ENV)
        return start_ray_workers(config, engine_address, path and Credentials.load(path))
    dist_init = dist_init_address or _private_rendezvous(engine_address)
    args = ["--engine-address", engine_address, "--dist-init-address", dist_init]
    if credentials is not None:
        args += ["--credentials", credentials]
    return [
        spawn("worker", config, *args, "--rank", str(rank))
        for rank in range(config.tensor_parallel_size)
    ]


def _private_rendezvous(engine_address: str) -> str:
    """A fresh file in the engine's private ipc folder, else in a new private folder."""
    folder = private_folder(engine_address)
    if folder is None:
        folder = tempfile.mkdtemp(prefix="splitserve-dist-")  # mode 0700
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return f"file://{folder}/rendezvous-{os.urandom(4).hex()}"


@contextlib.contextmanager
def cluster_credentials(args: argparse.Namespace, address: str) -> Iterator[None]:
    """For a tcp cluster: the credentials file (fresh keys in a private folder unless
    --credentials names one), named to the children in $SPLITSERVE_CREDENTIALS, and the
    clients' part beside the address file while the cluster runs."""
    if not address.startswith("tcp://"):
        yield
        return
    folder = None
    if args.credentials is None:
        folder = tempfile.mkdtemp(prefix="splitserve-keys-")  # mode 0700
        args.credentials = os.path.join(folder, "cluster.credentials")
    credentials = ensure_credentials(args.credentials)
    os.environ[CREDENTIALS_ENV] = str(Path(args.credentials).resolve())
    beside = credentials_beside(args.address_file) if args.address_file else None
    if beside is not None:
        credentials.for_role(CLIENT).save(beside)
    try:
        yield
    finally:
        if beside is not None:
            beside.unlink(missing_ok=True)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
