"""Prefill/decode disaggregation settings: vLLM's `--kv-transfer-config` JSON and the
`kv_transfer_params` a request and its answer carry.

A producer (`kv_role` kv_producer or kv_both) keeps the KV blocks of a request that asks
`{"do_remote_decode": true}` after it finishes, and answers with the params a consumer
needs to pull them: where (`remote_host`, `remote_port`: its rank 0's port, rank r at
port + r), what (`remote_block_ids`, `transfer_id`), until when (`expires`, Unix time),
for which prompt (`prompt_hash`), and `transfer_key`: an HMAC of all of that (and the
producer's engine id and port) under a secret only the deployment's hosts hold, so the
producer's workers serve a pull at once without having heard of it, and nobody can name
other blocks. A consumer (kv_consumer or kv_both) given those params with
`do_remote_prefill` pulls the blocks rank to rank before it schedules the request, and
computes the prompt itself when the pull fails.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from ipc.auth import Credentials
from ipc.json_config import from_json_value, json_option_parser

KV_CONNECTORS = ("ZmqConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_KV_PORT = 14579  # vLLM's
# kv_connector_extra_config keys and their defaults.
EXTRA_DEFAULTS: dict[str, Any] = {
    # The CURVE keys every producer and consumer of a deployment share (made on first use;
    # copy the file to the other hosts).
    "credentials": "~/.config/splitserve/kv_transfer.credentials",
    # A producer frees blocks nobody pulled after this many seconds (vLLM's default is 480).
    "send_timeout_s": 120.0,
    # A consumer gives up a pull (and computes the prompt) after this many seconds.
    "pull_timeout_s": 30.0,
}


@dataclass
class KVTransferConfig:
    kv_connector: str = "ZmqConnector"
    kv_role: str = "kv_both"
    engine_id: str | None = None  # a new uuid when not given
    # A producer's workers listen here (rank r of data-parallel engine d at kv_port +
    # d * tensor_parallel_size + r), and its answers tell consumers this host and port.
    kv_ip: str = "127.0.0.1"
    kv_port: int = DEFAULT_KV_PORT
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(
                f"kv_transfer_config: unknown kv_connector {self.kv_connector!r}; "
                f"supported: {', '.join(KV_CONNECTORS)}"
            )
        if self.kv_role not in KV_ROLES:
            raise ValueError(
                f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}, "
                f"got {self.kv_role!r}"
            )
        if self.engine_id is None:
            self.engine_id = uuid.uuid4().hex
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_transfer_config: kv_ip must be a host, got {self.kv_ip!r}")
        port = self.kv_port
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"kv_transfer_config: kv_port must be in [1, 65535], got {port!r}")
        extra = self.kv_connector_extra_config
        unknown = sorted(set(extra) - set(EXTRA_DEFAULTS))
        if unknown:
            raise ValueError(
                f"kv_transfer_config: unknown kv_connector_extra_config key(s) "
                f"{', '.join(unknown)}; known: {', '.join(EXTRA_DEFAULTS)}"
            )
        for name in ("send_timeout_s", "pull_timeout_s"):
            value = extra.get(name, EXTRA_DEFAULTS[name])
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(
                    f"kv_transfer_config: {name} must be a number of seconds > 0, got {value!r}"
                )
        if not isinstance(extra.get("credentials", ""), str):
            raise ValueError("kv_transfer_config: credentials must be a file path")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, name: str) -> Any:
        return self.kv_connector_extra_config.get(name, EXTRA_DEFAULTS[name])

    @property
    def credentials_path(self) -> Path:
        return Path(os.path.expanduser(self.extra("credentials")))

    @classmethod
    def from_value(cls, value: KVTransferConfig | dict[str, Any] | str) -> KVTransferConfig:
        """From a config, a dict or its JSON text; unknown keys are refused by name."""
        return from_json_value(cls, value, "kv_transfer_config")


parse_kv_transfer_config = json_option_parser(KVTransferConfig.from_value)


class KVTransferParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """vLLM's `kv_transfer_params`, in a request (`do_remote_decode`, or `do_remote_prefill`
    with the rest) and in a producer's answer (everything but `do_remote_decode`).
    `remote_block_ids`: the producer's blocks per KV cache group."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[list[int]] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_tp_size: int | None = None
    transfer_id: str | None = None
    transfer_key: str | None = None
    prompt_hash: str | None = None
    expires: float | None = None

    def __post_init__(self) -> None:
        if self.do_remote_decode and self.do_remote_prefill:
            raise ValueError("do_remote_decode and do_remote_prefill exclude each other")
        if self.do_remote_prefill:
            missing = [name for name in _PULL_FIELDS if getattr(self, name) is None]
            if missing:
                raise ValueError(f"do_remote_prefill needs {', '.join(missing)}")
            if not 1 <= self.remote_port <= 65535:
                raise ValueError(f"remote_port must be in [1, 65535], got {self.remote_port}")

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, value: Any) -> KVTransferParams:
        """Raises ValueError naming what is wrong."""
        try:
            return msgspec.convert(value, cls)
        except msgspec.ValidationError as e:
            raise ValueError(str(e)) from None


_PULL_FIELDS = (
    "remote_block_ids",
    "remote_host",
    "remote_port",
    "remote_tp_size",
    "transfer_id",
    "transfer_key",
    "prompt_hash",
    "expires",
)


def prompt_hash(token_ids: list[int]) -> str:
    """What a consumer checks its prompt against the producer's by."""
    data = b"".join(t.to_bytes(8, "little", signed=True) for t in token_ids)
    return hashlib.sha256(data).hexdigest()[:32]


def shared_credentials(path: Path) -> Credentials:
    """The credentials in `path`; made first if missing, by exactly one process when
    several start at once (the file is linked into place, which fails if it exists)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        Credentials.generate().save(tmp)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return Credentials.load(path)


def transfer_secret(credentials: Credentials) -> bytes:
    """The key transfer keys are made with: from the deployment's credentials, which only
    its producers and consumers hold."""
    return hashlib.sha256(b"splitserve kv transfer\0" + credentials.server_secret).digest()


def transfer_key(
    secret: bytes,
    engine_id: str,
    port: int,
    transfer_id: str,
    block_ids: list[list[int]],
    expires: float,
) -> str:
    """What a producer's workers check a pull by: an HMAC binding the transfer to its
    engine, its blocks and its end."""
    message = json.dumps([engine_id, port, transfer_id, block_ids, repr(expires)])
    return hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()
