"""Ray's token authentication as ringmaster's Ray clients use it.

A cluster started with RAY_AUTH_MODE=token refuses every gRPC call and dashboard request without its token. The
embedded head's token is a file in the data directory (created once, mode 0600); an external cluster's comes from
Settings (ray_auth_token or ray_auth_token_file). Clients get it as an Authorization header (the Jobs API, the
dashboard) or through their environment (the Ray agent's ray.init): never on a command line, and never in a Ray job's
runtime_env, which the Jobs API shows to whoever asks.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

TOKEN_FILE = "ray-auth-token"


@dataclass(frozen=True)
class RayAuth:
    """The token a cluster asks for: in a file (token_path), or the value itself (token)."""

    token_path: Path | None = None
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.token_path is None) == (self.token is None):
            raise ValueError("RayAuth needs exactly one of token_path and token")

    def value(self) -> str:
        if self.token is not None:
            return self.token
        assert self.token_path is not None  # __post_init__
        return self.token_path.read_text().strip()

    def headers(self) -> dict[str, str]:
        """What the dashboard and the Jobs API take the token from."""
        return {"Authorization": f"Bearer {self.value()}"}

    def client_env(self) -> dict[str, str]:
        """The variables with which a Ray client process (ray.init, `ray start`) finds the token: the file's path when
        there is a file, so the token itself stays out of every process's environment."""
        if self.token_path is not None:
            return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path.resolve())}
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.value()}


def ensure_token_file(path: Path) -> Path:
    """The token file at path, created with a new random token if there is none: written whole under another name with
    mode 0600 from its creation, then linked into place, so it is never readable by others nor seen empty. An existing
    file is kept (a restarted head, and its worker nodes, go on with the same token) and made private if it is not."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        if path.stat().st_mode & 0o077:
            log.warning("the Ray token file %s was readable by others: now mode 0600", path)
            os.chmod(path, 0o600)
        if path.read_text().strip():
            return path
        path.unlink()  # Ray refuses an empty token file: start over
    partial = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(descriptor, secrets.token_hex(32).encode())  # 256 bits, as `ray get-auth-token --generate` makes
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    try:
        os.link(partial, path)  # fails if another process made one meanwhile: theirs is kept
    except FileExistsError:
        pass
    finally:
        partial.unlink()
    return path
