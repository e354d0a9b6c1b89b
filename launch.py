"""Start and supervise a splitserve cluster.

    python launch.py [--model PATH] [--tp N] [engine args] [--no-api | api args]

starts one EngineCore process, N worker processes and the OpenAI-compatible HTTP
server, prints "splitserve ready: ..." once the engine has every worker's READY, and
shuts everything down on SIGINT/SIGTERM or when any child dies (exiting non-zero with
the name of the child). Multi-node: start the engine side with `--role engine` and each
worker on its own with

    python launch.py --role worker --engine-address tcp://H:P --rank R \
        --dist-init-address tcp://H0:P0 [engine args]

or under torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are honoured).

A tcp engine address admits only peers holding the cluster's CURVE keys (ipc/auth.py):
`--role all` makes them in a private folder (or uses `--credentials FILE`, made if
missing) and writes the clients' part beside `--address-file F` as F.credentials;
on several hosts give every process a copy of the same `--credentials FILE`.

The children are this file again (`--role engine|worker|api`) with plain command line
arguments (the engine config as JSON), each in its own session so that a terminal's
Ctrl-C reaches only the launcher, and each dying with the launcher (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import dataclasses
import importlib.util
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from engine_core.config import EngineConfig
from ipc.auth import CLIENT, WORKER, Credentials, credentials_beside, ensure_credentials
from ipc.sockets import (
    free_tcp_port,
    new_ipc_address,
    private_folder,
    remove_ipc_files,
    write_address_file,
)
from server.args import add_server_args, server_child_args, server_options

_THIS_FILE = str(Path(__file__).resolve())
_ENGINE_ARGS = (
    "model",
    "tensor_parallel_size",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "dtype",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "gpu_memory_utilization",
    "kv_cache_memory",
    "num_gpu_blocks_override",
    "attention_backend",
    "scheduling_policy",
    "seed",
    "device",
    "enforce_eager",
    "cuda_graph_sizes",
    "worker_step_timeout",
    "max_worker_restarts",
    "worker_restart_window",
    "shutdown_timeout",
)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS.update({f"{u}i": 1024 ** "kmgt".index(u) * 1024 for u in "kmgt"})
_CREDENTIALS_ENV = "SPLITSERVE_CREDENTIALS"
ENGINE_REPORT_S = 5.0  # time the engine gets to report a dead worker to its clients
SHUTDOWN_GRACE_S = 5.0
API_RESTARTS = 3  # API server starts within a minute before its death is fatal


class Stop(BaseException):
    """SIGINT or SIGTERM reached the launcher."""


class ChildDied(Exception):
    pass


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '64M' (decimal), '1000000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4GiB, 512MiB)")
    return int(float(match[1]) * _UNITS[(match[2] or "").lower()])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--role",
        choices=("all", "engine", "worker", "api"),
        default="all",
        help="all: the whole cluster, supervised (default); otherwise that one process",
    )
    p.add_argument("--model", help="a local Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int, metavar="N"
    )
    p.add_argument("--host", help="serve the engine on tcp://HOST:PORT (default: a fresh ipc://)")
    p.add_argument("--port", type=int, help="first of 3 ports (input, output, workers)")
    p.add_argument("--address-file", help="write the engine address here once it is ready")
    p.add_argument(
        "--credentials",
        metavar="FILE",
        default=os.environ.get(_CREDENTIALS_ENV),
        help="CURVE keys of a tcp engine address; the engine side makes FILE if missing "
        f"(default: ${_CREDENTIALS_ENV}, else fresh keys for --role all)",
    )
    engine = p.add_argument_group("engine")
    engine.add_argument("--max-model-len", type=int)
    engine.add_argument("--max-num-seqs", type=int)
    engine.add_argument("--max-num-batched-tokens", type=int)
    engine.add_argument("--block-size", type=int)
    engine.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"))
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    engine.add_argument("--gpu-memory-utilization", type=float)
    engine.add_argument(
        "--kv-cache-memory", type=parse_bytes, help="KV cache bytes per rank: 4GiB, 512MiB, 64M"
    )
    engine.add_argument("--num-gpu-blocks-override", type=int)
    engine.add_argument("--attention-backend", choices=("auto", "flash_attn", "triton", "torch"))
    engine.add_argument("--scheduling-policy", choices=("fcfs", "priority"))
    engine.add_argument("--seed", type=int)
    engine.add_argument("--device", choices=("auto", "cpu", "cuda"))
    engine.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    engine.add_argument(
        "--cuda-graph-sizes", type=int, nargs="+", help="decode batch sizes to capture"
    )
    resilience = p.add_argument_group("resilience")
    resilience.add_argument(
        "--worker-step-timeout",
        type=float,
        help="seconds a step may take before its workers are deemed hung (default 300)",
    )
    resilience.add_argument(
        "--max-worker-restarts",
        type=int,
        help="replace failed workers at most this often within --worker-restart-window, "
        "replaying their requests; 0 makes a worker failure fatal (default 3)",
    )
    resilience.add_argument("--worker-restart-window", type=float, help="seconds (default 300)")
    resilience.add_argument(
        "--shutdown-timeout",
        type=float,
        help="on SIGTERM, seconds to let running requests finish (default 30)",
    )
    p.add_argument("--no-api", action="store_true", help="start no HTTP server")
    add_server_args(p)
    single = p.add_argument_group("one process (--role engine|worker|api)")
    single.add_argument("--engine-address")
    single.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
    single.add_argument("--dist-init-address", help="tcp://HOST:PORT of rank 0's group store")
    p.add_argument("--config-json", help=argparse.SUPPRESS)
    p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    if args.config_json:
        return EngineConfig(**json.loads(args.config_json))
    kwargs = {name: getattr(args, name) for name in _ENGINE_ARGS if getattr(args, name) is not None}
    if "WORLD_SIZE" in os.environ:  # torchrun
        kwargs.setdefault("tensor_parallel_size", int(os.environ["WORLD_SIZE"]))
    if "model" not in kwargs:
        from models.default import default_model_path

        kwargs["model"] = default_model_path()
    return EngineConfig(**kwargs)


def start_workers(
    config: EngineConfig,
    engine_address: str,
    dist_init_address: str | None = None,
    credentials: str | None = None,
) -> list[subprocess.Popen]:
    """Start config.tensor_parallel_size worker processes on this machine. Unless told
    otherwise they meet through a file in a private folder (no listening store) and gloo
    binds loopback only."""
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


def spawn(role: str, config: EngineConfig, *args: str, **popen_kwargs) -> subprocess.Popen:
    """This file as a child process in `role`, in its own session, dying with us."""
    command = [sys.executable, _THIS_FILE, "--role", role, "--parent-pid", str(os.getpid())]
    command += ["--config-json", json.dumps(dataclasses.asdict(config)), *args]
    return subprocess.Popen(command, start_new_session=True, **popen_kwargs)


class Supervisor:
    """The launcher's children by name; `run` returns the launcher's exit code.

    The engine writes lines on a pipe: "ready" once every worker registered, then
    "restart" whenever it wants fresh workers (it decides when a worker failed and
    bounds the restarts); a worker that dies is left for the engine to notice. An API
    server that dies is started again (at most API_RESTARTS times a minute): it holds
    nothing but connections.
    """

    def __init__(self, args: argparse.Namespace, config: EngineConfig, address: str) -> None:
        self.args = args
        self.config = config
        self.address = address
        self.children: dict[str, subprocess.Popen] = {}
        self._api_starts: list[float] = []

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _raise_stop)
        dead = None
        try:
            with self._start() as engine_lines:
                while True:
                    self._check_children()
                    if select.select([engine_lines], [], [], 0.1)[0]:
                        self._on_engine_line(engine_lines.readline())
        except Stop:
            pass
        except ChildDied as e:
            dead = str(e)
        finally:
            self._stop(dead)
        if dead is not None:
            print(f"splitserve: {dead}", file=sys.stderr, flush=True)
            return 1
        return 0

    def _start(self):
        """Start the engine and the workers, wait for "ready", start the API server;
        returns the engine's pipe (a file to read lines from)."""
        ready_read, ready_write = os.pipe()
        args = ["--engine-address", self.address, "--ready-fd", str(ready_write)]
        self._add("engine core", spawn("engine", self.config, *args, pass_fds=(ready_write,)))
        os.close(ready_write)
        self._start_workers()
        engine_lines = os.fdopen(ready_read, "rb", buffering=0)
        while not select.select([engine_lines], [], [], 0.1)[0]:
            self._check_children()
        if engine_lines.readline() != b"ready\n":
            self.children["engine core"].wait()
            self._check_children()
        api = ""
        if not self.args.no_api and _server_importable():
            self._start_api()
            self._wait_api_port()
            api = f" (api http://{self.args.api_host}:{self.args.api_port})"
        elif not self.args.no_api:
            print("splitserve: server/ is not importable; no HTTP API", file=sys.stderr)
        print(f"splitserve ready: engine address {self.address}{api}", flush=True)
        if self.args.address_file:
            write_address_file(self.args.address_file, self.address)
        return engine_lines

    def _on_engine_line(self, line: bytes) -> None:
        if line == b"restart\n":
            print("splitserve: the engine asked for new workers; restarting them", flush=True)
            self._stop_workers()
            self._start_workers()
        elif not line:  # the engine closed its end: it is exiting
            self.children["engine core"].wait()
            self._check_children()

    def _start_workers(self) -> None:
        for rank, process in enumerate(start_workers(self.config, self.address)):
            self._add(f"worker rank {rank}", process)

    def _stop_workers(self) -> None:
        for name in [n for n in self.children if n.startswith("worker")]:
            process = self.children.pop(name)
            process.kill()
            process.wait()

    def _start_api(self) -> None:
        argv, env = server_child_args(self.args)
        args = ["--engine-address", self.address, *argv]
        env = dict(os.environ, **env)
        self._api_starts = [t for t in self._api_starts if time.monotonic() - t < 60.0]
        self._api_starts.append(time.monotonic())
        self._add("api server", spawn("api", self.config, *args, env=env))

    def _wait_api_port(self) -> None:
        """Block until the API server accepts connections, so "ready" means ready."""
        host = self.args.api_host if self.args.api_host not in ("0.0.0.0", "::") else "127.0.0.1"
        while True:
            self._check_children()
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
                probe.settimeout(0.5)
                if probe.connect_ex((host, self.args.api_port)) == 0:
                    return
            time.sleep(0.1)

    def _add(self, name: str, process: subprocess.Popen) -> None:
        self.children[name] = process
        print(f"splitserve: {name} pid {process.pid}", flush=True)

    def _check_children(self) -> None:
        """Raise ChildDied for the likeliest cause among the children that exited: one
        killed by a signal before one that exited with an error (say, a worker whose peer
        vanished mid-collective), a failure before a clean exit, a worker before the
        engine it takes down. A dead worker is the engine's to replace while restarts
        are allowed; a dead API server is started again."""
        dead = [(n, p.returncode) for n, p in self.children.items() if p.poll() is not None]
        engine_alive = self.children["engine core"].poll() is None
        if engine_alive and self.config.max_worker_restarts > 0:
            dead = [d for d in dead if not d[0].startswith("worker")]
        api_only = [name for name, _ in dead] == ["api server"]
        if api_only and engine_alive and len(self._api_starts) < API_RESTARTS:
            print(f"splitserve: api server died with exit code {dead[0][1]}; restarting it")
            self._start_api()
            return
        if dead:
            name, code = min(
                dead, key=lambda d: (d[1] >= 0, d[1] == 0, not d[0].startswith("worker"))
            )
            raise ChildDied(f"{name} died with exit code {code}")

    def _stop(self, dead: str | None) -> None:
        """The engine first: it drains (finishes what runs, for up to shutdown_timeout)
        while the API server still streams, then tells the workers to stop; then the API
        server. After a grace period terminate, then kill, whatever is left."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        engine = self.children.get("engine core")
        if engine is not None and dead is not None and dead.startswith("worker"):
            _wait([engine], ENGINE_REPORT_S)
        if engine is not None and engine.poll() is None:
            engine.terminate()
            _wait([engine], self.config.shutdown_timeout + SHUTDOWN_GRACE_S)
        if "api server" in self.children:
            self.children["api server"].terminate()
        _wait(self.children.values(), SHUTDOWN_GRACE_S)
        for process in self.children.values():
            if process.poll() is None:
                process.terminate()
        _wait(self.children.values(), 2.0)
        for process in self.children.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        remove_ipc_files(self.address)
        if self.args.address_file:
            Path(self.args.address_file).unlink(missing_ok=True)


def _wait(processes, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


def _raise_stop(signum: int, frame: object) -> None:
    raise Stop(signal.Signals(signum).name)


def _server_importable() -> bool:
    return all(importlib.util.find_spec(name) for name in ("server", "fastapi", "uvicorn"))


def _engine_address(args: argparse.Namespace) -> str:
    if args.engine_address:
        return args.engine_address
    if args.host is None and args.port is None:
        return new_ipc_address()
    host = args.host or "127.0.0.1"
    return f"tcp://{host}:{args.port or free_tcp_port(host)}"


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


def _run_role(args: argparse.Namespace) -> int:
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
        from server import run_server

        run_server(
            args.engine_address,
            config.tokenizer,
            max_model_len=config.max_model_len,
            vocab_size=config.vocab_size,
            credentials=_role_credentials(args, CLIENT),
            **server_options(args),
        )
        return 0
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


def _run_engine(args: argparse.Namespace, config: EngineConfig) -> int:
    from engine_core.engine_proc import run_engine_core

    address = _engine_address(args)
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


def _role_credentials(args: argparse.Namespace, role: str) -> Credentials | None:
    """A worker's or the API server's part of the credentials of a tcp engine address."""
    if not args.engine_address.startswith("tcp://"):
        return None
    if args.credentials is None:
        raise SystemExit(f"the tcp engine address needs --credentials FILE for the {role}")
    return Credentials.load(args.credentials).for_role(role)


@contextlib.contextmanager
def _cluster_credentials(args: argparse.Namespace, address: str) -> Iterator[None]:
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
    os.environ[_CREDENTIALS_ENV] = str(Path(args.credentials).resolve())
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.salt_cache_by_api_key and not server_options(args)["api_keys"]:
        parser.error("--salt-cache-by-api-key needs --api-key")
    if args.role != "all":
        return _run_role(args)
    config = engine_config(args)
    address = _engine_address(args)
    with _cluster_credentials(args, address):
        return Supervisor(args, config, address).run()


if __name__ == "__main__":
    sys.exit(main())
