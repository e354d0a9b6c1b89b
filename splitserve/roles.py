"""One process of the cluster (`launch.py --role engine|worker|api`): the EngineCore, a
worker rank or the HTTP server. Started by a parent (`--parent-pid`), a child dies with
it; started by hand (multi-node, torchrun), it runs on its own."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ipc.auth import CLIENT, WORKER, Credentials, credentials_beside, ensure_credentials
from ipc.config import EngineConfig
from ipc.sockets import free_tcp_port, new_ipc_address, write_address_file
from server.args import server_options
from splitserve.engine_args import engine_config


def engine_address(args: argparse.Namespace) -> str:
    """--engine-address, else tcp://--engine-host:--engine-port (a free port if none), else
    a fresh ipc address."""
    if args.engine_address:
        return args.engine_address
    return engine_addresses(args, 1)[0]


def engine_addresses(args: argparse.Namespace, count: int) -> list[str]:
    """The addresses of `count` data-parallel engines: on tcp, engine i takes the 3 ports
    from --engine-port + 3i (from a free port if none); else fresh ipc addresses."""
    if args.engine_host is None and args.engine_port is None:
        return [new_ipc_address() for _ in range(count)]
    host = args.engine_host or "127.0.0.1"
    first = args.engine_port or free_tcp_port(host, 3 * count)
    return [f"tcp://{host}:{first + 3 * i}" for i in range(count)]


def run_role(args: argparse.Namespace) -> int:
    """Run the process `args.role` names; returns its exit code (a worker exits here)."""
    role = args.role if args.role != "worker" else f"worker {args.rank}"
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s"
    )
    if args.parent_pid is not None:
        # Workers hold nothing to clean up; the engine removes its socket files on SIGTERM.
        sig = signal.SIGKILL if args.role == "worker" else signal.SIGTERM
        _die_with_parent(args.parent_pid, sig)
    config = engine_config(args)
    if args.role == "engine":
        return _run_engine(args, config)
    if args.engine_address is None:
        raise SystemExit(f"--role {args.role} needs --engine-address")
    if args.role == "api":
        return _run_api(args, config)
    return _run_worker(args, config)


def _run_engine(args: argparse.Namespace, config: EngineConfig) -> int:
    from engine_core.engine_proc import run_engine_core

    address = engine_address(args)
    credentials = None
    if address.startswith("tcp://"):
        if args.credentials is None:
            raise SystemExit(
                "a tcp engine address needs --credentials FILE (made if missing); give the "
                "workers and clients a copy"
            )
        credentials = ensure_credentials(args.credentials)
    if credentials is not None and args.address_file:
        credentials.for_role(CLIENT).save(credentials_beside(args.address_file))

    def on_ready() -> None:
        if args.ready_fd is not None:
            os.write(args.ready_fd, b"ready\n")
        if args.address_file:
            write_address_file(args.address_file, address)

    def request_new_workers() -> None:
        os.write(args.ready_fd, b"restart\n")

    try:
        supervised = args.ready_fd is not None
        return run_engine_core(
            config, address, on_ready, request_new_workers if supervised else None, credentials
        )
    finally:
        if args.address_file:
            Path(args.address_file).unlink(missing_ok=True)
            credentials_beside(args.address_file).unlink(missing_ok=True)


def _run_api(args: argparse.Namespace, config: EngineConfig) -> int:
    from server import run_server

    run_server(
        args.engine_address,
        config.tokenizer,
        max_model_len=config.max_model_len,
        vocab_size=config.vocab_size,
        sampling_defaults=config.sampling_defaults,
        scheduling_policy=config.scheduling_policy.value,
        credentials=_role_credentials(args, CLIENT),
        reuse_port=args.api_reuse_port,
        **server_options(args),
    )
    return 0


def _run_worker(args: argparse.Namespace, config: EngineConfig) -> int:
    from worker.worker_main import run_worker

    dist_init = args.dist_init_address
    if dist_init is None and "MASTER_ADDR" in os.environ:
        dist_init = "env://"
    if dist_init is None:
        raise SystemExit("--role worker needs --dist-init-address (or torchrun's MASTER_ADDR)")
    credentials = _role_credentials(args, WORKER)
    code = run_worker(config, args.engine_address, args.rank, dist_init, credentials=credentials)
    # The process group is destroyed by now. Skip the interpreter's teardown: there,
    # torch.distributed's C++ threads now and then abort (SIGABRT) a clean exit.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _role_credentials(args: argparse.Namespace, role: str) -> Credentials | None:
    """A worker's or the API server's part of the credentials of a tcp engine address."""
    if not args.engine_address.startswith("tcp://"):
        return None
    if args.credentials is None:
        raise SystemExit(f"the tcp engine address needs --credentials FILE for the {role}")
    return Credentials.load(args.credentials).for_role(role)


def _die_with_parent(parent_pid: int, sig: int) -> None:
    """Get `sig` when the parent dies: PR_SET_PDEATHSIG on Linux, a polling thread elsewhere."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, sig)
    else:
        threading.Thread(target=_poll_parent, args=(parent_pid, sig), daemon=True).start()
    if os.getppid() != parent_pid:  # it died before we asked
        os.kill(os.getpid(), sig)


def _poll_parent(parent_pid: int, sig: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os.kill(os.getpid(), sig)
