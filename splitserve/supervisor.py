"""The launcher's supervision of the cluster it started (`launch.py --role all`)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ipc.config import EngineConfig
from ipc.sockets import remove_ipc_files, write_address_file
from server.args import server_child_args
from splitserve.cluster import spawn, start_workers

ENGINE_REPORT_S = 5.0  # time the engine gets to report a dead worker to its clients
SHUTDOWN_GRACE_S = 5.0
API_RESTARTS = 3  # API server starts within a minute before its death is fatal


class Stop(BaseException):
    """SIGINT or SIGTERM reached the launcher."""


class ChildDied(Exception):
    pass


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
