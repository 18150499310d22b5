"""Environment variables that provide defaults for explicit arguments.

Each variable only supplies the default of one argument; passing the argument always wins.

=========================  ==========================================  =================
variable                   argument it defaults                        built-in default
=========================  ==========================================  =================
``MOECOMM_BACKEND``        ``moecomm.init(backend=...)``               ``"auto"``
``MOECOMM_TIMEOUT``        ``moecomm.init(timeout=...)``, seconds      ``600``
``MOECOMM_VALIDATE``       ``moecomm.init(validate=...)``, 0 or 1      ``0``
``MOECOMM_POOL_BYTES``     ``moecomm.init(pool_bytes=...)``            ``268435456``
``MOECOMM_PROFILE_DIR``    the directory where ``moecomm.init``        ``~/.cache/moecomm/profiles``
                           looks for ``<fingerprint>.json`` when
                           ``profile=`` is not given
=========================  ==========================================  =================
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_backend", "default_timeout", "default_validate", "default_pool_bytes", "default_profile_dir"]


def _read(name: str) -> str | None:
    value = os.environ.get(name)
    return value.strip() if value is not None and value.strip() else None


def default_backend() -> str:
    return _read("MOECOMM_BACKEND") or "auto"


def default_timeout() -> float:
    raw = _read("MOECOMM_TIMEOUT")
    if raw is None:
        return 600.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"MOECOMM_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"MOECOMM_TIMEOUT must be > 0 seconds, got {raw!r}")
    return value


def default_validate() -> bool:
    raw = _read("MOECOMM_VALIDATE")
    if raw is None:
        return False
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"MOECOMM_VALIDATE must be 0 or 1, got {raw!r}")


def default_pool_bytes() -> int:
    raw = _read("MOECOMM_POOL_BYTES")
    if raw is None:
        return 256 << 20
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"MOECOMM_POOL_BYTES must be an integer number of bytes, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"MOECOMM_POOL_BYTES must be >= 0, got {raw!r}")
    return value


def default_profile_dir() -> Path:
    raw = _read("MOECOMM_PROFILE_DIR")
    if raw is None:
        return Path.home() / ".cache" / "moecomm" / "profiles"
    return Path(raw).expanduser()
