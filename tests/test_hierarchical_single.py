"""Single-process checks of the 2DH machinery: layout kernels, setup errors, profiles, auto."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moecomm
import moecomm.functional as F
from moecomm import env, hierarchical
from moecomm.collectives import blocks as _blocks
from moecomm.collectives import topology as _topology
from moecomm.engine.engine import Engine
from moecomm.communicator import Communicator
from moecomm.layout import Layout
from moecomm.profile import Fingerprint, Profile, ProfileEntry, ProfileError, default_profile_path, load_profile

pytestmark = pytest.mark.timeout(120)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int64, torch.bool,
          torch.uint8, torch.complex64]


def _rows(n: int, row_shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * math.prod(row_shape) * torch.empty((), dtype=dtype).element_size(),),
                        generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape((n,) + row_shape)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _blocks_of(x: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    out, at = [], 0
    for c in counts:
        out.append(x[at:at + c])
        at += c
    return out


# -- layout kernels against their references -------------------------------------------------


@settings(deadline=None, max_examples=60)
@given(a=st.integers(1, 5), b=st.integers(1, 5), max_rows=st.integers(0, 4), seed=st.integers(0, 2**31),
       dtype=st.sampled_from(DTYPES), row_shape=st.sampled_from([(), (3,), (2, 2), (0,)]))
def test_permute_blocks_matches_references(a, b, max_rows, seed, dtype, row_shape):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, max_rows + 1, size=(a, b)).tolist()
    x = _rows(sum(map(sum, counts)), row_shape, dtype, seed)
    got = _blocks.permute_blocks(x, counts)
    blocks = _blocks_of(x, [c for row in counts for c in row])
    want = torch.cat([blocks[i * b + j] for j in range(b) for i in range(a)]) if blocks else x
    assert got.dtype == dtype and got.shape == x.shape
    assert np.array_equal(_bytes(got), _bytes(want))
    back = _blocks.permute_blocks(got, counts, inverse=True)
    assert np.array_equal(_bytes(back), _bytes(x))


@settings(deadline=None, max_examples=60)
@given(n=st.integers(1, 9), max_rows=st.integers(0, 4), seed=st.integers(0, 2**31),
       dtype=st.sampled_from(DTYPES), row_shape=st.sampled_from([(), (3,), (2, 2)]))
def test_reorder_blocks_matches_numpy(n, max_rows, seed, dtype, row_shape):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, max_rows + 1, size=n).tolist()
    order = rng.permutation(n).tolist()
    x = _rows(sum(counts), row_shape, dtype, seed)
    got = _blocks.reorder_blocks(x, counts, order)
    blocks = _blocks_of(x, counts)
    want = torch.cat([blocks[o] for o in order])
    assert got.shape == want.shape and got.dtype == dtype
    assert np.array_equal(_bytes(got), _bytes(want))
    # the row index is exactly what a numpy gather of the blocks gives
    idx = _blocks.block_order_index(counts, order)
    starts = np.cumsum([0] + counts)
    assert idx.tolist() == [r for o in order for r in range(starts[o], starts[o] + counts[o])]


def test_layout_kernels_leave_graphs_alone():
    x = torch.randn(6, 2, requires_grad=True)
    y = _blocks.permute_blocks(x, [[1, 2], [3, 0]])
    z = _blocks.reorder_blocks(x, [2, 4], [1, 0])
    assert not y.requires_grad and not z.requires_grad


# -- setup and errors ------------------------------------------------------------------------


@pytest.fixture()
def profile_dir(tmp_path, monkeypatch):
    d = tmp_path / "profiles"
    monkeypatch.setenv("MOECOMM_PROFILE_DIR", str(d))
    return d


def _fake(node_of_rank: tuple, base: Communicator) -> tuple:
    layout = Layout._from_node_of_rank(0, node_of_rank)
    engine = Engine(base.engine.backend, base.engine.pool, timeout=10, validate=False)
    return engine, layout


def _attach(fake: tuple, **kw) -> Communicator:
    engine, layout = fake
    topology = _topology.build(engine, layout, sub_communicator=Communicator, profile=None, hosts=["h"],
                               local_size_given=True, **kw)
    return Communicator(engine, layout, topology=topology)


def test_unequal_nodes_are_named(profile_dir):
    base = moecomm.init(backend="mpi", set_default=False, hierarchy=False)
    with pytest.raises(ValueError, match=r"nodes of equal size.*\[2, 1\]"):
        _attach(_fake((0, 0, 1), base), hierarchy=True)
    comm = _attach(_fake((0, 0, 1, 1, 1), base), hierarchy=None)
    assert comm.topology.hierarchy is None
    with pytest.raises(ValueError, match=r"\[2, 3\] ranks"):
        comm.all_to_all_v(torch.zeros(0, 2), [0], algorithm="2dh")
    base.close()


def test_hierarchy_argument(profile_dir):
    c = moecomm.init(backend="mpi", set_default=False)
    assert c.topology.hierarchy is None  # one node of one rank, no local_size: no groups by default
    with pytest.raises(RuntimeError, match="pass hierarchy=True to moecomm.init"):
        c.all_to_all_v(torch.ones(2, 3), [2], algorithm="2dh")
    with pytest.raises(ValueError, match="algorithm must be one of"):
        c.all_to_all_v(torch.ones(2, 3), [2], algorithm="tree")
    with pytest.raises(TypeError, match="hierarchy must be"):
        moecomm.init(backend="mpi", set_default=False, hierarchy="yes")
    c.close()
    for kw in ({"hierarchy": True}, {"local_size": 1}):
        c = moecomm.init(backend="mpi", set_default=False, **kw)
        h = c.topology.hierarchy
        assert h is not None and (h.intra.size, h.rail.size) == (1, 1)
        x = torch.arange(12.0).reshape(4, 3).requires_grad_()
        y, recv = F.all_to_all_v(x, [4], comm=c, algorithm="2dh")
        assert recv == [4] and torch.equal(y, x.detach())
        y.sum().backward()
        assert torch.equal(x.grad, torch.ones(4, 3))
        w = c.all_to_all_v(x.detach(), torch.tensor([4]), algorithm="2dh", async_op=True)
        assert torch.equal(w.wait()[0], x.detach())
        c.close()
        assert h.intra.closed and h.rail.closed


# -- profiles --------------------------------------------------------------------------------


def _fp(comm, **over) -> Fingerprint:
    fp = comm.topology.fingerprint
    data = fp.to_json()
    data.update(over)
    return Fingerprint.from_json(data, "test")


def _profile(fp: Fingerprint, choices: dict) -> Profile:
    entries = tuple(ProfileEntry(size, ch, {"flat": {"median_s": 1e-3, "p99_s": 2e-3},
                                            "2dh": {"median_s": 2e-3 if ch == "flat" else 5e-4, "p99_s": 3e-3}})
                    for size, ch in sorted(choices.items()))
    return Profile(fp, entries, {"intra": {"alpha_s": 1e-5, "msg_s": 0.0, "beta_Bps": 1e10}})


def _ran(comm, x) -> str:
    """Which algorithm ``auto`` ran: 2DH is the path that asks for the hierarchy groups."""
    from unittest import mock

    with mock.patch.object(hierarchical, "require_hierarchy", wraps=hierarchical.require_hierarchy) as spy:
        _, _, _, req = hierarchical.start_all_to_all_v(comm.engine, comm.topology, x, [x.shape[0]], None, "auto")
        comm.engine.complete(req, "all_to_all_v", None)
    return "2dh" if spy.called else "flat"


def test_auto_follows_profile(profile_dir, tmp_path):
    probe = moecomm.init(backend="mpi", set_default=False, local_size=1)
    fp = probe.topology.fingerprint
    assert fp.device == "cpu" and fp.backend == "mpi" and (fp.num_nodes, fp.local_size) == (1, 1)
    small, large = torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(1 << 14, 64, dtype=torch.uint8)
    assert _ran(probe, small) == "flat"  # no profile; one node: the rule says flat
    probe.close()
    mixed = _profile(fp, {1024: "2dh", 1 << 20: "flat"})
    path = mixed.save(tmp_path / "mixed.json")
    c = moecomm.init(backend="mpi", set_default=False, local_size=1, profile=str(path))
    assert c.topology.profile.source == str(path)
    assert (_ran(c, small), _ran(c, large)) == ("2dh", "flat")
    c.close()
    c = moecomm.init(backend="mpi", set_default=False, local_size=1, profile=_profile(fp, {4096: "2dh"}))
    assert (_ran(c, small), _ran(c, large)) == ("2dh", "2dh")
    c.close()
    # the default location: <MOECOMM_PROFILE_DIR>/<fingerprint key>.json
    _profile(fp, {4096: "2dh"}).save(default_profile_path(fp))
    assert default_profile_path(fp).parent == profile_dir and env.default_profile_dir() == profile_dir
    c = moecomm.init(backend="mpi", set_default=False, local_size=1)
    assert c.topology.profile is not None and _ran(c, large) == "2dh"
    c.close()
    # a broken cached file is reported and ignored
    default_profile_path(fp).write_text("{not json")
    with pytest.warns(RuntimeWarning, match="ignoring the cached topology profile.*not valid JSON"):
        c = moecomm.init(backend="mpi", set_default=False, local_size=1)
    assert c.topology.profile is None
    c.close()


def test_profile_for_other_cluster(profile_dir, tmp_path):
    c = moecomm.init(backend="mpi", set_default=False, local_size=1)
    fp = c.topology.fingerprint
    c.close()
    other = _profile(_fp(c, num_nodes=4, local_size=8), {1024: "2dh"}).save(tmp_path / "other.json")
    with pytest.raises(ProfileError, match=r"tuned for 4 node\(s\) x 8.*1 node\(s\) x 1"):
        moecomm.init(backend="mpi", set_default=False, local_size=1, profile=other)
    gpu = _profile(_fp(c, device="NVIDIA H200"), {1024: "2dh"}).save(tmp_path / "gpu.json")
    with pytest.warns(RuntimeWarning, match="NVIDIA H200"):
        c = moecomm.init(backend="mpi", set_default=False, local_size=1, profile=gpu)
    c.close()
    assert fp.key() == "cpu_" + fp.link + "_1x1"


GOOD = {
    "schema": "moecomm.topology-profile", "version": 1,
    "fingerprint": {"num_nodes": 1, "local_size": 1, "device": "cpu", "link": "mpi-1host", "backend": "mpi"},
    "entries": [{"bytes_per_rank": 1024, "choice": "2dh", "degree": None,
                 "timings": {"flat": {"median_s": 0.001, "p99_s": 0.002}}}],
}


def _with(path, value):
    data = json.loads(json.dumps(GOOD))
    *head, last = path
    node = data
    for k in head:
        node = node[k]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return data


@pytest.mark.parametrize("data, message", [
    ([1, 2], "must be a JSON object"),
    (_with(["schema"], "something-else"), "not a moecomm topology profile"),
    (_with(["version"], 99), "profile version 99 is not supported"),
    (_with(["fingerprint"], KeyError), "'fingerprint' must be an object"),
    (_with(["fingerprint", "num_nodes"], 0), "fingerprint.num_nodes must be a positive integer"),
    (_with(["fingerprint", "device"], ""), "fingerprint.device must be a non-empty string"),
    (_with(["entries"], []), "'entries' must be a non-empty list"),
    (_with(["entries", 0, "choice"], "tree"), r"entries\[0\].choice must be one of"),
    (_with(["entries", 0, "bytes_per_rank"], -1), r"entries\[0\].bytes_per_rank must be an integer"),
    (_with(["entries", 0, "degree"], 0), r"entries\[0\].degree must be null or a positive integer"),
    (_with(["entries", 0, "timings", "flat", "median_s"], "fast"), r"median_s must be a number"),
    (_with(["links"], {"intra": {"alpha_s": -1}}), r"links\['intra'\].alpha_s must be a number >= 0"),
])
def test_bad_profiles_are_rejected_clearly(tmp_path, data, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=message) as info:
        load_profile(path)
    assert str(path) in str(info.value)


def test_profile_files(tmp_path):
    with pytest.raises(ProfileError, match="cannot read topology profile"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "text.json").write_text("profile: yes")
    with pytest.raises(ProfileError, match="is not valid JSON"):
        load_profile(tmp_path / "text.json")
    dup = json.loads(json.dumps(GOOD))
    dup["entries"].append(dict(dup["entries"][0]))
    (tmp_path / "dup.json").write_text(json.dumps(dup))
    with pytest.raises(ProfileError, match="appears twice"):
        load_profile(tmp_path / "dup.json")
    (tmp_path / "good.json").write_text(json.dumps(GOOD))
    prof = load_profile(tmp_path / "good.json")
    assert Profile.from_json(prof.to_json()).to_json() == prof.to_json()
    entries = tuple(ProfileEntry(s, c) for s, c in ((1 << 10, "2dh"), (1 << 16, "flat"), (1 << 24, "2dh")))
    p = Profile(prof.fingerprint, entries)
    assert [p.choose(b) for b in (1, 1 << 10, 1 << 12, 1 << 14, 1 << 20, 1 << 30)] == \
        ["2dh", "2dh", "2dh", "flat", "flat", "2dh"]
    assert p.uniform_choice() is None and prof.uniform_choice() == "2dh"


def test_init_with_bad_profile_raises(tmp_path, profile_dir):
    (tmp_path / "bad.json").write_text(json.dumps(_with(["version"], 2)))
    with pytest.raises(ProfileError, match="profile version 2 is not supported"):
        moecomm.init(backend="mpi", set_default=False, local_size=1, profile=tmp_path / "bad.json")
    with pytest.raises(TypeError, match="profile must be a path"):
        moecomm.init(backend="mpi", set_default=False, local_size=1, profile=42)


def test_profile_dir_env(monkeypatch, tmp_path):
    monkeypatch.delenv("MOECOMM_PROFILE_DIR", raising=False)
    assert str(env.default_profile_dir()).endswith(".cache/moecomm/profiles")
    monkeypatch.setenv("MOECOMM_PROFILE_DIR", str(tmp_path))
    assert env.default_profile_dir() == tmp_path
    assert "MOECOMM_PROFILE_DIR" in env.__doc__


# Up to _blocks._CAT_MAX_BLOCKS blocks one torch.cat of views; above, the gather_rows path.
@pytest.mark.parametrize("sides", [(1, 5), (9, 10)])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_permute_blocks_matches_numpy_block_moves(sides, data):
    A, B = data.draw(st.integers(*sides)), data.draw(st.integers(*sides))
    assert (A * B > _blocks._CAT_MAX_BLOCKS) == (sides[0] > 5)  # both paths are taken
    counts = [[data.draw(st.integers(0, 4)) for _ in range(B)] for _ in range(A)]
    rows = sum(map(sum, counts))
    x = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    blocks, start = {}, 0
    for a in range(A):
        for b in range(B):
            blocks[a, b] = x[start:start + counts[a][b]].numpy()
            start += counts[a][b]
    expect = np.concatenate([blocks[a, b] for b in range(B) for a in range(A)]) if rows else np.zeros((0, 3))
    order = data.draw(st.permutations(range(A * B)))
    flat = [c for row in counts for c in row]
    out = _blocks.permute_blocks(x, counts)
    np.testing.assert_array_equal(out.numpy(), expect)
    np.testing.assert_array_equal(_blocks.permute_blocks(out, counts, inverse=True).numpy(), x.numpy())
    np.testing.assert_array_equal(_blocks.reorder_blocks(x, flat, order).numpy(),
                                  x.numpy()[_blocks.block_order_index(flat, order)])
    np.testing.assert_array_equal(_blocks._device_index(flat, order, x.device).numpy(),
                                  _blocks.block_order_index(flat, order))
