"""The data plane's shared secret in a file: read it, or create it with a random token when it is missing.

The standalone servers (``dspark draft-server``, ``verify-server``, ``scheduler``) are separate processes with no
parent to hand them a token, so by default they share one through a file that only its owner can read (the
way ssh keeps keys): the first server to start creates it, the others read it. A file that others can read is
refused, as is an empty one: either would mean serving with a secret that is not one.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

#: Where the standalone servers keep their token unless told otherwise.
DEFAULT_TOKEN_FILE = Path("~/.config/dspark/grpc-token")


def load_or_create_token(path: Path) -> tuple[str, bool]:
    """The token in ``path`` and whether this call created it (random, 256 bits, file mode 0600).

    Concurrent callers agree: the token is written to a private temporary file that is then hard-linked into
    place, which fails if another process got there first (its token is read instead). Raises ``ValueError``
    for a file readable or writable by group or others, and for an empty one.
    """
    path = path.expanduser()
    created = False
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
            try:
                os.link(tmp, path)
                created = True
            except FileExistsError:  # another server created it meanwhile: use theirs
                pass
        finally:
            tmp.unlink()
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"gRPC token file {path} is accessible by other users (mode {stat.S_IMODE(mode):o}): "
                         f"chmod 600 {path}")
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"gRPC token file {path} is empty")
    return token, created
