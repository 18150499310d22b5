"""Topology profiles: which all-to-all algorithm is fastest, per message size, on one cluster.

A profile is a JSON file written by ``python -m topology tune`` and read by
``moecomm.init(profile=...)`` (or from the default cache directory). ``algorithm="auto"``
then picks, for each call, the choice of the profile entry nearest (in log scale) to the
call's bytes per rank.

File format (``version`` 1)::

    {
      "schema": "moecomm.topology-profile",
      "version": 1,
      "fingerprint": {"num_nodes": 2, "local_size": 4, "device": "NVIDIA H200",
                      "link": "nccl-2hosts", "backend": "nccl"},
      "created": "2026-01-01T00:00:00+00:00",          # optional
      "moecomm_version": "0.1.0",                     # optional
      "links": {...},                                 # optional: the probe's figures
      "entries": [                                    # at least one, sizes distinct
        {"bytes_per_rank": 1048576, "choice": "2dh", "degree": null,
         "timings": {"flat": {"median_s": 0.0012, "p99_s": 0.0015, "iters": 20},
                     "2dh":  {"median_s": 0.0009, "p99_s": 0.0011, "iters": 20}}}
      ]
    }

``bytes_per_rank`` is the size of the input of one rank (all destinations together);
``choice`` is ``"flat"`` or ``"2dh"``; ``degree`` is the overlap chunk count chosen for
that size (null: none measured). ``links`` holds, per link kind (``"intra"``, ``"inter"``,
``"copy"``), the fitted ``alpha_s`` (seconds per call), ``msg_s`` (seconds per message) and
``beta_Bps`` (bytes per second) and the measured ``points`` ``[[group size, bytes per peer,
seconds], ...]`` (see ``topology.model``).

The default location of a cluster's profile is ``<dir>/<fingerprint key>.json`` with
``<dir>`` = ``$MOECOMM_PROFILE_DIR`` or ``~/.cache/moecomm/profiles``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from . import env

__all__ = [
    "SCHEMA",
    "VERSION",
    "CHOICES",
    "ProfileError",
    "Fingerprint",
    "ProfileEntry",
    "Profile",
    "load_profile",
    "default_profile_dir",
    "default_profile_path",
]

SCHEMA = "moecomm.topology-profile"
VERSION = 1
CHOICES = ("flat", "2dh")


class ProfileError(ValueError):
    """A profile file that cannot be used: unreadable, not JSON, wrong schema or version, or bad fields."""


@dataclass(frozen=True)
class Fingerprint:
    """What identifies a cluster for tuning purposes."""

    num_nodes: int
    local_size: int
    device: str  # "cpu" or the GPU model name
    link: str  # e.g. "mpi-1host-simulated", "nccl-4hosts"
    backend: str

    def key(self) -> str:
        """A file-name-safe identifier, e.g. ``cpu_mpi-1host-simulated_2x4``."""
        raw = f"{self.device}_{self.link}_{self.num_nodes}x{self.local_size}"
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", raw).strip("-")

    def to_json(self) -> dict:
        return {"num_nodes": self.num_nodes, "local_size": self.local_size, "device": self.device,
                "link": self.link, "backend": self.backend}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "Fingerprint":
        if not isinstance(data, dict):
            raise ProfileError(f"{where}: 'fingerprint' must be an object, got {type(data).__name__}")
        for name in ("num_nodes", "local_size"):
            v = data.get(name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ProfileError(f"{where}: fingerprint.{name} must be a positive integer, got {v!r}")
        for name in ("device", "link", "backend"):
            v = data.get(name)
            if not isinstance(v, str) or not v:
                raise ProfileError(f"{where}: fingerprint.{name} must be a non-empty string, got {v!r}")
        return cls(data["num_nodes"], data["local_size"], data["device"], data["link"], data["backend"])

    def describe(self) -> str:
        return (f"{self.num_nodes} node(s) x {self.local_size} rank(s), device {self.device!r}, "
                f"link {self.link!r}, backend {self.backend!r}")


@dataclass(frozen=True)
class ProfileEntry:
    """The choice for one message size and the timings it was made on."""

    bytes_per_rank: int
    choice: str
    timings: dict = field(default_factory=dict)  # algorithm -> {"median_s", "p99_s", "iters"}
    degree: Optional[int] = None

    def to_json(self) -> dict:
        return {"bytes_per_rank": self.bytes_per_rank, "choice": self.choice, "degree": self.degree,
                "timings": self.timings}


@dataclass(frozen=True)
class Profile:
    """A validated topology profile (see the module docstring for the file format)."""

    fingerprint: Fingerprint
    entries: tuple[ProfileEntry, ...]
    links: dict = field(default_factory=dict)
    created: Optional[str] = None
    moecomm_version: Optional[str] = None
    source: Optional[str] = None  # the path it was loaded from

    def choose(self, bytes_per_rank: int) -> str:
        """The algorithm for a message of ``bytes_per_rank``: the nearest entry's (log scale)."""
        return self.entry_for(bytes_per_rank).choice

    def entry_for(self, bytes_per_rank: int) -> ProfileEntry:
        target = math.log2(max(int(bytes_per_rank), 1))
        return min(self.entries, key=lambda e: (abs(math.log2(max(e.bytes_per_rank, 1)) - target), e.bytes_per_rank))

    def uniform_choice(self) -> Optional[str]:
        """The choice when every entry makes the same one (then no size needs to be agreed on)."""
        choices = {e.choice for e in self.entries}
        return choices.pop() if len(choices) == 1 else None

    def to_json(self) -> dict:
        data: dict = {"schema": SCHEMA, "version": VERSION, "fingerprint": self.fingerprint.to_json()}
        if self.created is not None:
            data["created"] = self.created
        if self.moecomm_version is not None:
            data["moecomm_version"] = self.moecomm_version
        data["links"] = self.links
        data["entries"] = [e.to_json() for e in self.entries]
        return data

    def save(self, path: Union[str, os.PathLike]) -> Path:
        """Write the profile as JSON (atomically: a temporary file renamed into place)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n")
        os.replace(tmp, p)
        return p

    @classmethod
    def from_json(cls, data: Any, where: str = "profile") -> "Profile":
        """Validate parsed JSON; raises :class:`ProfileError` naming the first problem."""
        if not isinstance(data, dict):
            raise ProfileError(f"{where}: a profile must be a JSON object, got {type(data).__name__}")
        if data.get("schema") != SCHEMA:
            raise ProfileError(f"{where}: not a moecomm topology profile (schema is {data.get('schema')!r}, "
                               f"expected {SCHEMA!r})")
        version = data.get("version")
        if version != VERSION:
            raise ProfileError(f"{where}: profile version {version!r} is not supported (this moecomm reads "
                               f"version {VERSION}); re-run `python -m topology tune`")
        fp = Fingerprint.from_json(data.get("fingerprint"), where)
        raw_entries = data.get("entries")
        if not isinstance(raw_entries, list) or not raw_entries:
            raise ProfileError(f"{where}: 'entries' must be a non-empty list")
        entries = []
        seen = set()
        for i, e in enumerate(raw_entries):
            at = f"{where}: entries[{i}]"
            if not isinstance(e, dict):
                raise ProfileError(f"{at} must be an object")
            size = e.get("bytes_per_rank")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ProfileError(f"{at}.bytes_per_rank must be an integer >= 0, got {size!r}")
            if size in seen:
                raise ProfileError(f"{at}.bytes_per_rank {size} appears twice")
            seen.add(size)
            choice = e.get("choice")
            if choice not in CHOICES:
                raise ProfileError(f"{at}.choice must be one of {CHOICES}, got {choice!r}")
            degree = e.get("degree")
            if degree is not None and (isinstance(degree, bool) or not isinstance(degree, int) or degree < 1):
                raise ProfileError(f"{at}.degree must be null or a positive integer, got {degree!r}")
            timings = e.get("timings", {})
            if not isinstance(timings, dict):
                raise ProfileError(f"{at}.timings must be an object")
            for alg, t in timings.items():
                if not isinstance(t, dict):
                    raise ProfileError(f"{at}.timings[{alg!r}] must be an object")
                for k in ("median_s", "p99_s"):
                    v = t.get(k)
                    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
                        raise ProfileError(f"{at}.timings[{alg!r}].{k} must be a number >= 0, got {v!r}")
            entries.append(ProfileEntry(size, choice, timings, degree))
        links = data.get("links", {})
        if not isinstance(links, dict):
            raise ProfileError(f"{where}: 'links' must be an object")
        for name, fig in links.items():
            if not isinstance(fig, dict):
                raise ProfileError(f"{where}: links[{name!r}] must be an object")
            for k in ("alpha_s", "msg_s", "beta_Bps"):
                v = fig.get(k)
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
                    raise ProfileError(f"{where}: links[{name!r}].{k} must be a number >= 0, got {v!r}")
        entries.sort(key=lambda e: e.bytes_per_rank)
        return cls(fp, tuple(entries), links, data.get("created"), data.get("moecomm_version"), None)


def load_profile(path: Union[str, os.PathLike]) -> Profile:
    """Read and validate a profile file; raises :class:`ProfileError` with the path and the problem."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read topology profile {str(p)!r}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"topology profile {str(p)!r} is not valid JSON: {exc}") from None
    prof = Profile.from_json(data, f"topology profile {str(p)!r}")
    return Profile(prof.fingerprint, prof.entries, prof.links, prof.created, prof.moecomm_version, str(p))


def default_profile_dir() -> Path:
    """``$MOECOMM_PROFILE_DIR`` or ``~/.cache/moecomm/profiles``."""
    return env.default_profile_dir()


def default_profile_path(fingerprint: Fingerprint) -> Path:
    return default_profile_dir() / f"{fingerprint.key()}.json"
