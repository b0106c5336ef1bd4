"""The executor channel's keys: CURVE key pairs derived from one shared secret, where the
secret comes from, and which addresses may go without one. (`channel.py` uses the keys on the
sockets; `folio keygen` writes a secret.)"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

SECRET_ENV = "FOLIO_CHANNEL_SECRET"


@dataclass(frozen=True, kw_only=True)
class ChannelKeys:
    """CURVE key pairs (Z85 text, as libzmq takes them) derived from one shared secret: the
    scheduler's (server) pair and the executor's (client) pair. Whoever holds the secret can
    play either role; nobody without it can connect or read the traffic."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: str | bytes) -> ChannelKeys:
        if isinstance(secret, str):
            secret = secret.encode()
        secret = secret.strip()
        if len(secret) < 16:
            raise ValueError("the channel secret is too short: use at least 16 characters "
                             "(`folio serve` generates 64 hex digits)")

        def pair(role: bytes) -> tuple[bytes, bytes]:
            seed = hashlib.blake2b(secret, digest_size=32, person=b"folio-curve-" + role).digest()
            private = z85.encode(seed)  # any 32 bytes are a Curve25519 private key
            return zmq.curve_public(private), private

        server_public, server_secret = pair(b"srv")
        client_public, client_secret = pair(b"cli")
        return cls(server_public=server_public, server_secret=server_secret,
                   client_public=client_public, client_secret=client_secret)


def generate_secret() -> str:
    return secrets.token_hex(32)


def read_secret(path: str | None, env: dict[str, str] | None = None) -> str | None:
    """The channel secret from a file (compose secrets, a key file) or $FOLIO_CHANNEL_SECRET;
    None when neither is set. A file wins over the environment."""
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the channel secret file {path}: {e}") from e
        if not text:
            raise ValueError(f"the channel secret file {path} is empty")
        return text
    value = (os.environ if env is None else env).get(SECRET_ENV, "").strip()
    return value or None


def is_loopback(address: str) -> bool:
    """True for ipc:// and inproc:// endpoints and tcp:// on a loopback host."""
    transport, _, rest = address.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_insecure_address(address: str, allow_insecure: bool) -> None:
    """Without a secret, anyone who can reach the address could act as the executor."""
    if not allow_insecure and not is_loopback(address):
        raise ValueError(
            f"the executor channel {address} is not a loopback address and no channel secret "
            f"is set: set ${SECRET_ENV} or --channel-secret-file on both the scheduler and "
            "the executor (any string of 16+ characters), or pass --insecure-channel to accept "
            "unauthenticated executors")
