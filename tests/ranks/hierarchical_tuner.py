"""The tuner's profile on real MPI ranks (run by tests/test_topology_mpi.py).

Arguments: ``PROFILE WORKDIR`` -- a profile that ``python -m topology tune --local-size 2``
wrote for this launch's layout, and a scratch directory shared by the ranks.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import moecomm
from moecomm import hierarchical
from moecomm.profile import Profile, ProfileEntry, ProfileError, default_profile_path, load_profile
from tests.mpi_util import collective_assert, rank_main
from topology import cli

PROFILE, WORK = sys.argv[1], sys.argv[2]
WORLD = moecomm.init(backend="mpi", set_default=False, hierarchy=False)
R = WORLD.rank


def _ran(comm, nbytes: int) -> str:
    rows = max(1, nbytes // 64)
    x = torch.zeros(rows, 64, dtype=torch.uint8)
    send = [rows // comm.size] * comm.size
    send[0] += rows - sum(send)
    _, _, _, req = hierarchical.start_all_to_all_v(comm.engine, comm.topology, x, send, None, "auto")
    comm.engine.complete(req, "all_to_all_v", None)
    return "2dh" if getattr(req, "plan", None) is not None else "flat"


def check_probe_command() -> None:
    out = os.path.join(WORK, "links.json")
    rc = cli.main(["probe", "--local-size", "2", "--sizes", "256,4K", "--iters", "2", "--warmup", "1", "--out", out])
    WORLD.barrier()
    data = json.load(open(out))
    ok = rc == 0 and set(data["links"]) == {"intra", "inter", "copy"} and all(
        data["links"][k]["alpha_s"] >= 0 and data["links"][k]["beta_Bps"] > 0 for k in data["links"])
    collective_assert(ok, f"probe wrote {data}")


def check_auto_follows_tuned_profile() -> None:
    prof = load_profile(PROFILE)
    comm = moecomm.init(backend="mpi", local_size=2, set_default=False, profile=PROFILE)
    collective_assert(comm.topology.profile is not None and comm.topology.profile.fingerprint == comm.topology.fingerprint,
                      f"profile not attached: {comm.topology}")
    for e in prof.entries:
        got = _ran(comm, e.bytes_per_rank)
        collective_assert(got == e.choice, f"auto ran {got} at {e.bytes_per_rank} B, profile says {e.choice}")
    comm.close()


def check_auto_follows_edited_profiles() -> None:
    fp = load_profile(PROFILE).fingerprint
    cases = {"all2dh": {1 << 10: "2dh", 1 << 20: "2dh"}, "allflat": {1 << 10: "flat", 1 << 20: "flat"},
             "mixed": {1 << 10: "2dh", 1 << 20: "flat"}}
    for name, choices in cases.items():
        path = os.path.join(WORK, f"{name}.json")
        if R == 0:
            Profile(fp, tuple(ProfileEntry(s, c) for s, c in sorted(choices.items()))).save(path)
        WORLD.barrier()
        comm = moecomm.init(backend="mpi", local_size=2, set_default=False, profile=path)
        got = (_ran(comm, 1 << 10), _ran(comm, 1 << 20))
        collective_assert(got == (choices[1 << 10], choices[1 << 20]), f"{name}: auto ran {got}")
        comm.close()
    # The default location, through MOECOMM_PROFILE_DIR.
    os.environ["MOECOMM_PROFILE_DIR"] = os.path.join(WORK, "cache")
    if R == 0:
        Profile(fp, (ProfileEntry(1 << 10, "2dh"), ProfileEntry(1 << 20, "flat"))).save(default_profile_path(fp))
    WORLD.barrier()
    comm = moecomm.init(backend="mpi", local_size=2, set_default=False)
    got = (_ran(comm, 1 << 10), _ran(comm, 1 << 20))
    collective_assert(got == ("2dh", "flat"), f"default-dir profile: auto ran {got}")
    comm.close()


def check_ranks_disagree() -> None:
    """Ranks given different profiles all raise (instead of choosing differently and hanging)."""
    path = os.path.join(WORK, "allflat.json" if R % 2 else "all2dh.json")
    try:
        moecomm.init(backend="mpi", local_size=2, set_default=False, profile=path)
        msg = "no error"
    except ProfileError as exc:
        msg = str(exc)
    collective_assert("different topology profiles" in msg, f"different profiles per rank: {msg!r}")
    path = os.path.join(WORK, "missing.json") if R == 1 else PROFILE
    try:
        moecomm.init(backend="mpi", local_size=2, set_default=False, profile=path)
        msg = "no error"
    except ProfileError as exc:
        msg = str(exc)
    collective_assert("could not be loaded on rank(s) [1]" in msg, f"one rank missing the profile: {msg!r}")


if __name__ == "__main__":
    rank_main([check_probe_command, check_auto_follows_tuned_profile, check_auto_follows_edited_profiles,
               check_ranks_disagree])
