r"""Start and supervise a splitserve cluster.

    python launch.py [MODEL | --model PATH] [--tp N] [engine args] [--no-api | api args]

starts one EngineCore process, N worker processes and the OpenAI-compatible HTTP
server, prints "splitserve ready: ..." once the engine has every worker's READY, and
shuts everything down on SIGINT/SIGTERM or when any child dies (exiting non-zero with
the name of the child). With `--data-parallel-size D` (`-dp D`) it starts D EngineCores,
each with its own N workers, behind the HTTP server; one of them that dies is started
again while the others serve. `--api-server-count K` starts K HTTP server processes on
the one port. Multi-node: start the engine side with `--role engine` and each
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
The code that starts, supervises and runs them is in splitserve.cluster,
splitserve.supervisor and splitserve.roles; this file parses and dispatches.
"""

from __future__ import annotations

import argparse
import os
import sys

from ipc.sockets import socket_address
from server.args import add_server_args, check_server_args
from splitserve.cluster import CREDENTIALS_ENV, cluster_credentials
from splitserve.engine_args import add_engine_args, engine_config
from splitserve.roles import engine_addresses, run_role
from splitserve.supervisor import Supervisor


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--role",
        choices=("all", "engine", "worker", "api"),
        default="all",
        help="all: the whole cluster, supervised; otherwise that one process (default: all)",
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model folder or .gguf file, as in `vllm serve MODEL` (the same as --model; "
        "default: none)",
    )
    p.add_argument(
        "--engine-host",
        help="serve the engine on tcp://HOST:PORT (default: a fresh ipc:// address)",
    )
    p.add_argument(
        "--engine-port",
        type=int,
        help="first of 3 ports: input, output, workers (default: a free one)",
    )
    p.add_argument(
        "--address-file", help="write the engine address here once it is ready (default: none)"
    )
    p.add_argument(
        "--credentials",
        metavar="FILE",
        default=os.environ.get(CREDENTIALS_ENV),
        help="CURVE keys of a tcp engine address; the engine side makes FILE if missing "
        f"(default: ${CREDENTIALS_ENV}, else fresh keys for --role all)",
    )
    add_engine_args(p)
    p.add_argument("--no-api", action="store_true", help="start no HTTP server (default: off)")
    p.add_argument(
        "--api-server-count",
        "-asc",
        type=int,
        default=1,
        metavar="K",
        help="HTTP server processes, all on the one port (SO_REUSEPORT), each a client of "
        "every engine, their metrics summed (default: %(default)s)",
    )
    p.add_argument("--api-reuse-port", action="store_true", help=argparse.SUPPRESS)
    add_server_args(p)
    single = p.add_argument_group("one process (--role engine|worker|api)")
    single.add_argument(
        "--engine-address", help="the EngineCore's address to serve or join (default: none)"
    )
    single.add_argument(
        "--rank",
        type=int,
        default=int(os.environ.get("RANK", 0)),
        help="this worker's tensor-parallel rank (default: $RANK, else 0)",
    )
    single.add_argument(
        "--dist-init-address",
        help="tcp://HOST:PORT of rank 0's group store (default: torchrun's MASTER_ADDR)",
    )
    p.add_argument("--config-json", help=argparse.SUPPRESS)
    p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked; a positional MODEL becomes --model."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    check_server_args(parser, args)
    if args.api_server_count < 1:
        parser.error(f"--api-server-count must be >= 1, got {args.api_server_count}")
    for address in args.engine_address.split(",") if args.engine_address else []:
        try:
            socket_address(address, "workers")
        except ValueError as e:
            parser.error(f"--engine-address: {e}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role != "all":
        return run_role(args)
    config = engine_config(args)
    if args.engine_address:
        addresses = args.engine_address.split(",")
        if config.data_parallel_size not in (1, len(addresses)):
            raise SystemExit(
                f"--engine-address names {len(addresses)} engines but --data-parallel-size "
                f"is {config.data_parallel_size}"
            )
    else:
        if config.distributed_executor_backend == "ray" and args.engine_host is None:
            raise SystemExit(
                "Ray workers join the engine over tcp: give --engine-host, the address the "
                "Ray nodes reach this host at"
            )
        addresses = engine_addresses(args, config.data_parallel_size)
    with cluster_credentials(args, addresses[0]):
        return Supervisor(args, config, addresses).run()


if __name__ == "__main__":
    sys.exit(main())
