"""Who may talk to an EngineCore on tcp: ZeroMQ CURVE keys, handed over in files.

A cluster's credentials are three CURVE key pairs: the engine's (server), the clients'
and the workers'. The engine binds its tcp sockets as a CURVE server and a ZAP handler
(`AuthContext`) accepts the client key only on the input and output sockets (ZAP domain
"client") and the worker key only on the workers socket (domain "worker"), so a client
can never speak on the workers port. ipc:// addresses need no keys: their socket files
live in a 0700 folder.

A credentials file is JSON holding Z85 keys, readable by its owner alone (0600; one that
group or others may read is refused). The full file (every key) is the engine's;
`for_role("client")` or `for_role("worker")` keeps only the engine's public key and that
role's key pair, which is what a client or a worker needs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger(__name__)

CLIENT = "client"
WORKER = "worker"
ROLES = (CLIENT, WORKER)
CREDENTIALS_SUFFIX = ".credentials"
_MAX_LOGGED_KEYS = 64


class CredentialsError(PermissionError):
    """Credentials missing, unsafe to read, or refused by the EngineCore."""


@dataclasses.dataclass(frozen=True)
class Credentials:
    """Z85-encoded CURVE keys (bytes, as zmq.curve_keypair gives them); repr hides the
    secret ones."""

    server_public: bytes
    server_secret: bytes | None = dataclasses.field(default=None, repr=False)
    client_public: bytes | None = None
    client_secret: bytes | None = dataclasses.field(default=None, repr=False)
    worker_public: bytes | None = None
    worker_secret: bytes | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def generate(cls) -> Credentials:
        server, client, worker = (zmq.curve_keypair() for _ in range(3))
        return cls(*server, *client, *worker)

    def for_role(self, role: str) -> Credentials:
        """Only what `role` needs: the engine's public key and the role's own pair."""
        public, secret = self.keypair(role)
        return Credentials(
            self.server_public, **{f"{role}_public": public, f"{role}_secret": secret}
        )

    def keypair(self, role: str) -> tuple[bytes, bytes]:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        public, secret = getattr(self, f"{role}_public"), getattr(self, f"{role}_secret")
        if public is None or secret is None:
            raise CredentialsError(f"these credentials hold no {role} key pair")
        return public, secret

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically, mode 0600 from the start."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        fields = {k: v.decode("ascii") for k, v in dataclasses.asdict(self).items() if v}
        with os.fdopen(fd, "w") as f:
            json.dump(fields, f, indent=1)
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Credentials:
        """Read a credentials file; refuse one that anybody but its owner could read."""
        path = Path(path)
        try:
            info = path.stat()
        except FileNotFoundError:
            raise CredentialsError(f"no credentials file {path}") from None
        if info.st_uid != os.getuid():
            raise CredentialsError(f"credentials file {path} belongs to another user")
        if info.st_mode & 0o077:
            mode = stat.S_IMODE(info.st_mode)
            raise CredentialsError(
                f"credentials file {path} is readable by others (mode {mode:o}); chmod 600 it"
            )
        try:
            fields = json.loads(path.read_text())
            return cls(**{k: v.encode("ascii") for k, v in fields.items()})
        except (ValueError, TypeError, AttributeError) as e:
            raise CredentialsError(f"{path} is not a credentials file: {e}") from None


def load_credentials(credentials: Credentials | str | os.PathLike | None) -> Credentials | None:
    if credentials is None or isinstance(credentials, Credentials):
        return credentials
    return Credentials.load(credentials)


def ensure_credentials(path: str | os.PathLike) -> Credentials:
    """The credentials in `path`, made there first if the file does not exist."""
    if not Path(path).exists():
        Credentials.generate().save(path)
        logger.info("made new CURVE credentials in %s", path)
    return Credentials.load(path)


def credentials_beside(address_file: str | os.PathLike) -> Path:
    """Where launch.py writes the client credentials of the engine in `address_file`."""
    return Path(f"{address_file}{CREDENTIALS_SUFFIX}")


def client_credentials(
    address_or_file: str, address: str, credentials: Credentials | str | os.PathLike | None
) -> Credentials | None:
    """A client's credentials: those given, else the file beside the address file it was
    given, else none (fine for ipc://; a tcp `address` without them raises CredentialsError)."""
    if credentials is None and address_or_file != address:
        beside = credentials_beside(address_or_file)
        if beside.exists():
            credentials = beside
    loaded = load_credentials(credentials)
    if loaded is None and address.startswith("tcp://"):
        raise CredentialsError(
            f"the EngineCore at {address} accepts authenticated clients only: pass "
            f"credentials (launch.py writes them beside --address-file F as F{CREDENTIALS_SUFFIX})"
        )
    return loaded


def secure_socket(sock: zmq.Socket, credentials: Credentials, role: str, server: bool) -> None:
    """Make `sock` a CURVE server for `role`'s peers, or a CURVE client as `role`."""
    if server:
        if credentials.server_secret is None:
            raise CredentialsError("these credentials hold no engine secret key")
        sock.curve_server = True
        sock.curve_publickey = credentials.server_public
        sock.curve_secretkey = credentials.server_secret
        sock.zap_domain = role.encode()
    else:
        sock.curve_publickey, sock.curve_secretkey = credentials.keypair(role)
        sock.curve_serverkey = credentials.server_public


class _AllowedKey:
    """ZAP callback of one domain: only the role's public key gets in."""

    def __init__(self, role: str, key: bytes | None) -> None:
        self.role = role
        self.key = key
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.key:
            return True
        if key not in self.refused and len(self.refused) < _MAX_LOGGED_KEYS:
            self.refused.add(key)
            logger.warning("refused a peer on the %s sockets: unknown CURVE key", self.role)
        return False


class AuthContext(zmq.Context):
    """A zmq.Context whose CURVE sockets admit only the keys of `credentials`, each on its
    own role's sockets. term() stops the ZAP thread first."""

    authenticator: ThreadAuthenticator | None = None

    def __init__(self, credentials: Credentials) -> None:
        super().__init__()
        self.authenticator = ThreadAuthenticator(self)
        self.authenticator.start()
        for role in ROLES:
            key = getattr(credentials, f"{role}_public")
            self.authenticator.configure_curve_callback(role, _AllowedKey(role, key))

    def term(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None
        super().term()


def engine_context(credentials: Credentials | None) -> zmq.Context:
    """The context for sockets an engine binds: with a ZAP handler when there are keys."""
    return zmq.Context() if credentials is None else AuthContext(credentials)
