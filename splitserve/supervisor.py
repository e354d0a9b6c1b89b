"""The launcher's supervision of the cluster it started (`launch.py --role all`)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import BinaryIO

from ipc.config import EngineConfig
from ipc.processes import pid_alive
from ipc.sockets import ipc_paths, remove_ipc_files, write_address_file
from server.args import METRICS_FOLDER_ENV, server_child_args
from splitserve.cluster import spawn, start_workers

ENGINE_REPORT_S = 5.0  # time the engine gets to report a dead worker to its clients
SHUTDOWN_GRACE_S = 5.0
API_RESTARTS = 3  # API server starts within a minute before its death is fatal
ENGINE_RESTARTS = 3  # the same for each data-parallel engine (one engine: never restarted)
EXITING_S = 5.0  # the most the launcher waits for an exiting child's exit code


class Stop(BaseException):
    """SIGINT or SIGTERM reached the launcher."""


class ChildDied(Exception):
    pass


@dataclasses.dataclass
class Engine:
    """One EngineCore of the cluster (data-parallel rank `config.data_parallel_rank`),
    the pipe it reports on and the times it was started."""

    config: EngineConfig
    address: str
    name: str
    lines: BinaryIO | None = None
    starts: list[float] = dataclasses.field(default_factory=list)

    @property
    def worker_prefix(self) -> str:
        """Its workers' names, less the rank."""
        return "worker rank " if self.name == "engine core" else f"{self.name} worker rank "

    def owns(self, child: str) -> bool:
        """Whether `child` names one of its workers."""
        return child.startswith(self.worker_prefix)


class Supervisor:
    """The launcher's children by name; `run` returns the launcher's exit code.

    Each engine writes lines on a pipe: "ready" once every worker registered, then
    "restart" whenever it wants fresh workers (it decides when a worker failed and
    bounds the restarts); a worker that dies is left for its engine to notice. An API
    server that dies is started again (at most API_RESTARTS times a minute): it holds
    nothing but connections; with --api-server-count K, each of the K. With data
    parallelism, an engine that dies is started again with fresh workers (at most
    ENGINE_RESTARTS times a minute) while the others serve; the API servers reconnect to
    it. A lone engine's death ends the cluster.
    """

    def __init__(
        self, args: argparse.Namespace, config: EngineConfig, addresses: list[str]
    ) -> None:
        self.args = args
        self.config = config
        dp = len(addresses)
        self.engines = [
            Engine(
                dataclasses.replace(config, data_parallel_size=dp, data_parallel_rank=i),
                address,
                "engine core" if dp == 1 else f"engine core {i}",
            )
            for i, address in enumerate(addresses)
        ]
        self.children: dict[str, subprocess.Popen] = {}
        count = args.api_server_count
        self.api_servers = (
            ["api server"] if count == 1 else [f"api server {i}" for i in range(count)]
        )
        self._api_starts: dict[str, list[float]] = {name: [] for name in self.api_servers}
        # Several API servers share a port and sum their metrics (prometheus_client's
        # multiprocess mode) in a private folder.
        self._metrics_folder = None
        if count > 1:
            self._metrics_folder = tempfile.mkdtemp(prefix="splitserve-metrics-")

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _raise_stop)
        dead = None
        try:
            self._start()
            while True:
                self._check_children()
                pipes = {e.lines: e for e in self.engines if e.lines is not None}
                for lines in select.select(list(pipes), [], [], 0.1)[0]:
                    self._on_engine_line(pipes[lines], lines.readline())
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

    def _start(self) -> None:
        """Start the engines and their workers, wait for every engine's "ready", start the
        API server."""
        for engine in self.engines:
            self._start_engine(engine)
        for engine in self.engines:
            while not select.select([engine.lines], [], [], 0.1)[0]:
                self._check_children()
            if engine.lines.readline() != b"ready\n":
                self.children[engine.name].wait()
                self._check_children()
        api = ""
        if not self.args.no_api and _server_importable():
            for name in self.api_servers:
                self._start_api(name)
            self._wait_api_port()
            api = f" (api http://{self.args.api_host}:{self.args.api_port})"
        elif not self.args.no_api:
            print("splitserve: server/ is not importable; no HTTP API", file=sys.stderr)
        addresses = ",".join(e.address for e in self.engines)
        label = "engine address" if len(self.engines) == 1 else "engine addresses"
        print(f"splitserve ready: {label} {addresses}{api}", flush=True)
        if self.args.address_file:
            write_address_file(self.args.address_file, addresses)

    def _start_engine(self, engine: Engine) -> None:
        """The engine and its workers; its pipe in engine.lines."""
        ready_read, ready_write = os.pipe()
        args = ["--engine-address", engine.address, "--ready-fd", str(ready_write)]
        self._add(engine.name, spawn("engine", engine.config, *args, pass_fds=(ready_write,)))
        os.close(ready_write)
        engine.lines = os.fdopen(ready_read, "rb", buffering=0)
        _note_start(engine.starts)
        self._start_workers(engine)

    def _on_engine_line(self, engine: Engine, line: bytes) -> None:
        if line == b"restart\n":
            print(f"splitserve: {engine.name} asked for new workers; restarting them", flush=True)
            self._stop_workers(engine)
            self._start_workers(engine)
        elif line == b"ready\n":
            print(f"splitserve: {engine.name} ready again", flush=True)
        elif not line:  # the engine closed its end: it is exiting
            engine.lines.close()
            engine.lines = None
            self.children[engine.name].wait()
            self._check_children()

    def _start_workers(self, engine: Engine) -> None:
        for rank, process in enumerate(start_workers(engine.config, engine.address)):
            self._add(f"{engine.worker_prefix}{rank}", process)

    def _stop_workers(self, engine: Engine) -> None:
        for name in [n for n in self.children if engine.owns(n)]:
            process = self.children.pop(name)
            process.kill()
            process.wait()

    def _restart_engine(self, engine: Engine, code: int | None) -> None:
        print(
            f"splitserve: {engine.name} died with exit code {code}; restarting it and its workers",
            flush=True,
        )
        self._stop_workers(engine)
        if engine.lines is not None:
            engine.lines.close()
        for path in ipc_paths(engine.address):  # not its folder: the workers meet there
            path.unlink(missing_ok=True)
        self._start_engine(engine)

    def _start_api(self, name: str) -> None:
        argv, env = server_child_args(self.args)
        addresses = ",".join(e.address for e in self.engines)
        args = ["--engine-address", addresses, *argv]
        env = dict(os.environ, **env)
        if self._metrics_folder is not None:
            args.append("--api-reuse-port")
            env[METRICS_FOLDER_ENV] = self._metrics_folder
        _note_start(self._api_starts[name])
        self._add(name, spawn("api", self.config, *args, env=env))

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
        engine it takes down. A dead worker is its engine's to replace while restarts
        are allowed; a dead API server is started again, and so is one of several
        engines (with its workers)."""
        if len(self.engines) > 1:
            for engine in self.engines:
                code = self.children[engine.name].poll()
                if code is not None and len(engine.starts) < ENGINE_RESTARTS:
                    self._restart_engine(engine, code)
        if any(p.poll() is not None for p in self.children.values()):
            self._wait_exiting()
        dead = [(n, p.returncode) for n, p in self.children.items() if p.poll() is not None]
        alive = {e.name: self.children[e.name].poll() is None for e in self.engines}
        if self.config.max_worker_restarts > 0:
            dead = [d for d in dead if not self._engine_alive(d[0], alive)]
        api = [(name, code) for name, code in dead if name in self._api_starts]
        restart = all(len(self._api_starts[name]) < API_RESTARTS for name, _ in api)
        if api and len(api) == len(dead) and any(alive.values()) and restart:
            for name, code in api:
                print(f"splitserve: {name} died with exit code {code}; restarting it")
                self._start_api(name)
            return
        if dead:
            name, code = min(dead, key=lambda d: (d[1] >= 0, d[1] == 0, "worker" not in d[0]))
            raise ChildDied(f"{name} died with exit code {code}")

    def _wait_exiting(self) -> None:
        """Wait, a few seconds at most, for the children already exiting to be waitable.
        A killed process's main thread is a zombie at once, but its exit code comes only
        once every thread has gone, which can take a second on a busy machine: meanwhile
        the engine sees the worker gone (worker_liveness) and exits, and would be blamed."""
        deadline = time.monotonic() + EXITING_S
        while time.monotonic() < deadline and any(
            p.poll() is None and not pid_alive(p.pid) for p in self.children.values()
        ):
            time.sleep(0.02)

    def _engine_alive(self, child: str, alive: dict[str, bool]) -> bool:
        """Whether `child` is a worker whose engine is alive."""
        for engine in self.engines:
            if engine.owns(child):
                return alive[engine.name]
        return False

    def _stop(self, dead: str | None) -> None:
        """The engines first: they drain (finish what runs, for up to shutdown_timeout)
        while the API server still streams, then tell the workers to stop; then the API
        server. After a grace period terminate, then kill, whatever is left."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        engines = [self.children[e.name] for e in self.engines if e.name in self.children]
        if engines and dead is not None and "worker" in dead:
            _wait(engines, ENGINE_REPORT_S)
        running = [p for p in engines if p.poll() is None]
        for process in running:
            process.terminate()
        _wait(running, self.config.shutdown_timeout + SHUTDOWN_GRACE_S)
        for name in self.api_servers:
            if name in self.children:
                self.children[name].terminate()
        _wait(self.children.values(), SHUTDOWN_GRACE_S)
        for process in self.children.values():
            if process.poll() is None:
                process.terminate()
        _wait(self.children.values(), 2.0)
        for process in self.children.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        for engine in self.engines:
            remove_ipc_files(engine.address)
        if self._metrics_folder is not None:
            shutil.rmtree(self._metrics_folder, ignore_errors=True)
        if self.args.address_file:
            Path(self.args.address_file).unlink(missing_ok=True)


def _note_start(starts: list[float]) -> None:
    """Add a start now to `starts`, the start times of one child within the last minute."""
    now = time.monotonic()
    starts[:] = [t for t in starts if now - t < 60.0] + [now]


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
