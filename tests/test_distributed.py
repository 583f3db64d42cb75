"""Ring attention without several GPUs: every rank in one process (LocalRing), blocks on the float64 reference.

The ring's forward and backward must equal attention over the gathered sequence within rounding, for 1 to 4
ranks, causal or not, both layouts, MHA / GQA / MQA. Then the schedule (exact cover of the causal mask), the
sharding helpers, the overlap structure (each transfer starts before the block it overlaps), validation before
anything runs, the launcher and the NCCL id exchange (no NCCL needed), the real Numba kernels on the simulator
(slow), the CuPy backend on one GPU (gpu) and the NCCL path with 2, 4, 8 ranks (multigpu).
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from rawflash import reference
from rawflash.distributed import (LAYOUTS, ComputeOnly, LocalRing, NcclComm, gather, ring_attention,
                                  ring_attention_backward, schedule, shard, shard_positions)
from rawflash.distributed import bench as bench_mod, blocks, comm as comm_mod, run as run_mod
from rawflash.distributed.bench import Config, summarize
from conftest import random_qkv

ROOT = Path(__file__).resolve().parents[1]
TOL = dict(rtol=1e-5, atol=1e-5)   # float32 results of float64 block math, merged in float32


def problem(world, heads=4, kv_heads=2, chunk=3, batch=2, head_dim=8, dtype=np.float32, seed=0):
    """Full-sequence q, k, v, dout of 2 * world * chunk tokens (divisible for both layouts)."""
    n = 2 * world * chunk
    q, k, v = random_qkv(batch, n, n, heads, kv_heads, head_dim, dtype, seed=seed)
    dout = np.random.default_rng(seed + 100).standard_normal(q.shape).astype(q.dtype)
    return q, k, v, dout


def run_ring(world, q, k, v, dout, causal, layout, backend="reference", **kw):
    """Shard, run ring forward and backward on every rank of a LocalRing, gather: (out, lse, dq, dk, dv)."""

    def rank(comm):
        def mine(x, axis=1):
            return shard(x, comm.rank, comm.world_size, layout=layout, axis=axis)

        qs, ks, vs, dos = mine(q), mine(k), mine(v), mine(dout)
        out, lse = ring_attention(qs, ks, vs, comm, causal=causal, layout=layout, backend=backend, **kw)
        grads = ring_attention_backward(dos, qs, ks, vs, out, lse, comm, causal=causal, layout=layout,
                                        backend=backend, **kw)
        return out, lse, *grads

    results = LocalRing(world).run(rank)
    return tuple(gather([r[i] for r in results], layout=layout, axis=2 if i == 1 else 1) for i in range(5))


# ---------------------------------------------------------------- equal to single-device attention
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_equals_attention_over_the_gathered_sequence(world, causal, layout):
    q, k, v, dout = problem(world, seed=world)                                  # GQA 4 on 2
    out, lse, dq, dk, dv = run_ring(world, q, k, v, dout, causal, layout)
    ref_out, ref_lse = reference.forward(q, k, v, causal=causal)
    ref_grads = reference.backward(dout, q, k, v, causal=causal)
    assert out.dtype == q.dtype and lse.dtype == np.float32 and dk.dtype == k.dtype
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        np.testing.assert_allclose(got, want, **TOL, err_msg=name)


@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (4, 1)], ids=["MHA", "MQA"])
def test_ring_mha_and_mqa_with_a_custom_scale(heads, kv_heads):
    q, k, v, dout = problem(3, heads=heads, kv_heads=kv_heads, chunk=2, batch=1)
    got = run_ring(3, q, k, v, dout, True, "zigzag", scale=0.3)
    want = reference.forward(q, k, v, causal=True, scale=0.3) + reference.backward(dout, q, k, v, causal=True,
                                                                                  scale=0.3)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **TOL)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_ring_in_half_precision_passes_the_error_rule(dtype):
    """Blocks rounded to the input dtype, merged in float32: no worse than naive attention in that dtype."""
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    q, k, v, dout = problem(4, chunk=4, batch=1, head_dim=32, dtype=dt, seed=9)
    got = run_ring(4, q, k, v, dout, True, "zigzag")
    refs = reference.forward(q, k, v, causal=True) + reference.backward(dout, q, k, v, causal=True)
    bases = (reference.forward(q, k, v, causal=True, upcast=False)
             + reference.backward(dout, q, k, v, causal=True, upcast=False))
    for name, g, ref, base, factor in zip(("out", "lse", "dq", "dk", "dv"), got, refs, bases, (2, 2, 3, 3, 3)):
        ok, err, base_err, bound = reference.error_ratio_ok(g, ref, base, q.dtype, factor)
        assert ok, f"{name}: error {err:.3g} > bound {bound:.3g} (naive {base_err:.3g})"


def test_reference_block_backward_uses_the_given_lse():
    """On the whole sequence it is the reference backward; on a key block with the global lse, its share."""
    q, k, v, dout = problem(1, chunk=4, batch=1)
    out, lse = reference.forward(q, k, v, causal=True)
    whole = blocks.reference_backward(dout, q, k, v, out.astype(np.float32), lse.astype(np.float32),
                                      causal=True, scale=1 / np.sqrt(8))
    for got, want in zip(whole, reference.backward(dout, q, k, v, causal=True)):
        np.testing.assert_allclose(got, want, **TOL)
    # keys [0, 5) and [5, 8) of a non-causal problem: the block dq's add up, dk / dv are the block's rows
    out, lse = reference.forward(q, k, v)
    parts = [blocks.reference_backward(dout, q, k[:, a:b], v[:, a:b], out.astype(np.float32),
                                       lse.astype(np.float32), causal=False, scale=1 / np.sqrt(8))
             for a, b in ((0, 5), (5, 8))]
    dq, dk, dv = reference.backward(dout, q, k, v)
    np.testing.assert_allclose(parts[0][0] + parts[1][0], dq, **TOL)
    np.testing.assert_allclose(np.concatenate([parts[0][1], parts[1][1]], axis=1), dk, **TOL)
    np.testing.assert_allclose(np.concatenate([parts[0][2], parts[1][2]], axis=1), dv, **TOL)


# ---------------------------------------------------------------- the schedule
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_schedule_covers_the_causal_mask_exactly_once(world, layout):
    """Over every rank and step, each (query, key) pair the global causal mask allows is computed exactly once,
    and no other pair is."""
    n = 2 * world * 2
    local = n // world
    covered = np.zeros((n, n), int)
    for rank in range(world):
        rows_global = shard_positions(n, rank, world, layout)
        for step, block in enumerate(schedule(layout, True, rank, world, local)):
            if block is None:
                continue
            src = (rank - step) % world
            cols_global = shard_positions(n, src, world, layout)
            qi, kj = rows_global[block.rows], cols_global[block.cols]
            mask = np.ones((len(qi), len(kj)), bool)
            if block.causal:
                mask = np.tril(mask, len(kj) - len(qi))                 # bottom-right aligned, as the kernels
            np.add.at(covered, (np.repeat(qi, len(kj)).reshape(mask.shape)[mask],
                                np.tile(kj, len(qi)).reshape(mask.shape)[mask]), 1)
    np.testing.assert_array_equal(covered, np.tril(np.ones((n, n), int)))


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    def work(layout, rank):
        return sum((b.rows.stop - b.rows.start) * (b.cols.stop - b.cols.start) for b in
                   schedule(layout, True, rank, 4, 8) if b is not None)

    assert len({work("zigzag", r) for r in range(4)}) == 1
    assert [work("contiguous", r) for r in range(4)] == [64, 128, 192, 256]


# ---------------------------------------------------------------- sharding
def test_zigzag_and_contiguous_assignments():
    assert [list(shard_positions(8, r, 2)) for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [list(shard_positions(8, r, 4, "contiguous")) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_shard_then_gather_is_the_identity(world, layout):
    x = np.arange(2 * 12 * 3).reshape(2, 12, 3)
    for axis in (1, -2):
        shards = [shard(x, r, world, layout=layout, axis=axis) for r in range(world)]
        for r, s in enumerate(shards):
            np.testing.assert_array_equal(s, x[:, shard_positions(12, r, world, layout)])
            assert not np.shares_memory(s, x)
        np.testing.assert_array_equal(gather(shards, layout=layout, axis=axis), x)


def test_sharding_refuses_uneven_lengths_and_bad_ranks():
    x = np.zeros((1, 10, 2))
    with pytest.raises(ValueError, match=r"layout='zigzag' cuts the sequence into 2 \* world_size = 4 equal chunks: "
                                         r"x's sequence length must be divisible by 4, got 10"):
        shard(x, 0, 2)
    with pytest.raises(ValueError, match="divisible by 3, got 10"):
        shard(x, 0, 3, layout="contiguous")
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size\) = \[0, 2\), got 2"):
        shard(np.zeros((1, 8)), 2, 2)
    with pytest.raises(ValueError, match="layout must be one of 'zigzag', 'contiguous', got 'ring'"):
        shard(np.zeros((1, 8)), 0, 2, layout="ring")
    with pytest.raises(ValueError, match="shards must share one shape"):
        gather([np.zeros((1, 4)), np.zeros((1, 2))], axis=1)
    with pytest.raises(ValueError, match="seqlen must be >= 0, got -4"):
        shard_positions(-4, 0, 2)


# ---------------------------------------------------------------- overlap structure
class Spy:
    """A communicator for one rank that logs the order of transfers and block computations."""

    def __init__(self, log, rank, world_size):
        self.log, self.rank, self.world_size = log, rank, world_size

    def check(self, named):
        pass

    def ring_pass(self, arrays):
        self.log.append(f"pass{len(arrays)}")
        log = self.log

        class Pending:
            def wait(self):
                log.append("wait")
                return list(arrays)
        return Pending()


def test_each_transfer_starts_before_the_block_it_overlaps(monkeypatch):
    log = []
    for name in ("forward", "backward"):
        real = getattr(blocks, name)
        monkeypatch.setattr(blocks, name, lambda *a, _real=real, _n=name, **kw: (log.append(_n), _real(*a, **kw))[1])
    q, k, v, dout = problem(3)
    qs, ks, vs, dos = (shard(x, 1, 3) for x in (q, k, v, dout))
    out, lse = ring_attention(qs, ks, vs, Spy(log, 1, 3), causal=True, backend="reference")
    assert log == ["pass2", "forward", "wait", "pass2", "forward", "wait", "forward"]
    log.clear()
    ring_attention_backward(dos, qs, ks, vs, out, lse, Spy(log, 1, 3), causal=True, backend="reference")
    # step s: K/V for s+1 leaves, the block's gradients are queued, then the dK/dV buffer of step s-1 is
    # awaited, updated and sent on; the last pass brings each owner its dK, dV
    assert log == ["pass2", "backward", "pass2", "wait",
                   "pass2", "backward", "wait", "pass2", "wait",
                   "backward", "wait", "pass2", "wait"]


def test_compute_only_skips_every_transfer():
    q, k, v, dout = problem(2)

    def rank(comm):
        comm.ring_pass = lambda arrays: pytest.fail("ComputeOnly started a transfer")
        quiet = ComputeOnly(comm)
        qs, ks, vs = (shard(x, comm.rank, 2) for x in (q, k, v))
        out, lse = ring_attention(qs, ks, vs, quiet, causal=True, backend="reference")
        return out.shape, lse.shape, quiet.all_max(comm.rank)

    assert LocalRing(2).run(rank) == [((2, 6, 4, 8), (2, 4, 6), 1.0)] * 2


# ---------------------------------------------------------------- validation before anything runs
class Refuse:
    """A communicator whose transfers fail the test: validation must refuse first."""

    rank, world_size = 0, 2

    def check(self, named):
        pass

    def ring_pass(self, arrays):
        raise AssertionError("a transfer was started")


@pytest.fixture
def no_compute(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("a block was computed")

    monkeypatch.setattr(blocks, "forward", refuse)
    monkeypatch.setattr(blocks, "backward", refuse)


def shards(n=8, **kw):
    q, k, v, dout = problem(2, **kw)
    return q[:, :n], k[:, :n], v[:, :n], dout[:, :n]


@pytest.mark.usefixtures("no_compute")
def test_refusals_name_the_argument():
    q, k, v, dout = shards()
    with pytest.raises(ValueError, match="layout must be one of 'zigzag', 'contiguous', got 'striped'"):
        ring_attention(q, k, v, Refuse(), layout="striped", backend="reference")
    with pytest.raises(ValueError, match=r"the shard length \(axis 1 of q\) must be even, got 7"):
        ring_attention(q[:, :7], k[:, :7], v[:, :7], Refuse(), backend="reference")
    with pytest.raises(ValueError, match="q and k must hold the same number of tokens per rank, got q 8, k 6"):
        ring_attention(q, k[:, :6], v[:, :6], Refuse(), backend="reference")
    with pytest.raises(TypeError, match="comm must be a communicator .* with int rank, got object"):
        ring_attention(q, k, v, object(), backend="reference")
    bad_rank = Refuse()
    bad_rank.rank = 2
    with pytest.raises(ValueError, match="comm must have world_size >= 1 and 0 <= rank < world_size, got rank 2"):
        ring_attention(q, k, v, bad_rank, backend="reference")
    with pytest.raises(TypeError, match="q must have dtype float16, bfloat16 or float32, got float64"):
        ring_attention(q.astype(np.float64), k, v, Refuse(), backend="reference")
    with pytest.raises(ValueError, match="heads of q must be a multiple of kv_heads"):
        ring_attention(q[:, :, :3], k, v, Refuse(), backend="reference")
    with pytest.raises(TypeError, match="causal must be a bool"):
        ring_attention(q, k, v, Refuse(), causal=1, backend="reference")
    lse = np.zeros((2, 4, 8), np.float32)
    with pytest.raises(ValueError, match=r"lse must have shape \(batch, heads, seqlen_q\) = \(2, 4, 8\)"):
        ring_attention_backward(dout, q, k, v, q, lse[:, :, :6], Refuse(), backend="reference")
    with pytest.raises(ValueError, match="dout must have q's shape"):
        ring_attention_backward(dout[:, :6], q, k, v, q, lse, Refuse(), backend="reference")
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        ring_attention_backward(dout, q, k, v, q, lse, Refuse(), deterministic=None, backend="reference")


@pytest.mark.usefixtures("no_compute")
def test_empty_shards_give_empty_results_without_transfers():
    q, k, v, dout = shards(n=0)
    out, lse = ring_attention(q, k, v, Refuse(), causal=True, backend="reference")
    assert out.shape == q.shape and lse.shape == (2, 4, 0)
    dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, Refuse(), backend="reference")
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_nccl_comm_refuses_host_arrays_before_sending():
    comm = NcclComm.__new__(NcclComm)         # check() needs no NCCL: a bare instance on "device 0"
    comm.device = 0
    with pytest.raises(TypeError, match="q must be a CuPy array on device 0 to travel over NCCL, got ndarray"):
        comm.check({"q": np.zeros(2)})


# ---------------------------------------------------------------- NcclComm against a recording stand-in for CuPy
class FakeCupy:
    """Just enough of cupy / cupy.cuda / cupy.cuda.nccl to log what NcclComm asks of them, in order."""

    def __init__(self):
        import types

        self.log = []
        log = self.log
        self.compute = self.Stream("compute", log)

        class Arr:
            def __init__(self, name, shape, dtype):
                self.name, self.shape, self.dtype = name, shape, np.dtype(dtype)
                self.nbytes = int(np.prod(shape)) * self.dtype.itemsize
                self.data = types.SimpleNamespace(ptr=name)

        class Communicator:
            def __init__(self, ndev, unique_id, rank):
                log.append(("init", ndev, unique_id, rank))

            def send(self, ptr, count, datatype, peer, stream):
                log.append(("send", ptr, count, datatype, peer, stream))

            def recv(self, ptr, count, datatype, peer, stream):
                log.append(("recv", ptr, count, datatype, peer, stream))

        fake_stream = self.Stream
        self.Arr = Arr
        self.nccl = types.SimpleNamespace(
            available=True, NCCL_UINT8=1, NcclCommunicator=Communicator, get_unique_id=lambda: b"\x07" * 128,
            groupStart=lambda: log.append(("groupStart",)), groupEnd=lambda: log.append(("groupEnd",)))
        self.cuda = types.ModuleType("cupy.cuda")
        self.cuda.nccl = self.nccl
        self.cuda.get_current_stream = lambda: self.compute
        self.cuda.Stream = lambda non_blocking: fake_stream("comm" if non_blocking else "blocking", log)
        self.current_device = 0

        def device(index=None):
            def use():
                log.append(("use", index))
                self.current_device = index
            return types.SimpleNamespace(id=self.current_device if index is None else index, use=use)

        buffers = itertools.count()
        self.cuda.Device = device
        self.module = types.ModuleType("cupy")
        self.module.cuda = self.cuda
        self.module.ascontiguousarray = lambda a: a
        self.module.empty = lambda shape, dtype: Arr(f"recv{next(buffers)}", shape, dtype)

    class Stream:
        def __init__(self, name, log):
            self.name, self.log, self.ptr = name, log, f"{name}-stream"

        def record(self):
            self.log.append(("record", self.name))
            return f"event-{self.name}-{sum(e[0] == 'record' for e in self.log)}"

        def wait_event(self, event):
            self.log.append(("wait_event", self.name, event))

    def install(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "cupy", self.module)
        monkeypatch.setitem(sys.modules, "cupy.cuda", self.cuda)
        monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", self.nccl)


def test_nccl_ring_pass_orders_streams_and_peers(monkeypatch):
    fake = FakeCupy()
    fake.install(monkeypatch)
    comm = NcclComm(fake.nccl.NcclCommunicator(3, b"", 1), rank=1, world_size=3)
    k, v = fake.Arr("k", (2, 8, 2, 4), ml_dtypes.bfloat16), fake.Arr("v", (2, 8, 2, 4), ml_dtypes.bfloat16)
    fake.log.clear()
    pending = comm.ring_pass([k, v])
    assert fake.log == [
        ("record", "compute"), ("wait_event", "comm", "event-compute-1"),    # NCCL starts after queued work
        ("groupStart",),
        ("send", "k", 256, 1, 2, "comm-stream"), ("recv", "recv0", 256, 1, 0, "comm-stream"),   # bf16 as bytes
        ("send", "v", 256, 1, 2, "comm-stream"), ("recv", "recv1", 256, 1, 0, "comm-stream"),
        ("groupEnd",), ("record", "comm")]
    fake.log.clear()
    received = pending.wait()
    assert fake.log == [("wait_event", "compute", "event-comm-2")]           # work after wait() sees the data
    assert [r.shape for r in received] == [k.shape, v.shape] and received[0].dtype == k.dtype


def test_nccl_from_env_selects_the_device_and_joins_with_the_shared_id(monkeypatch, tmp_path):
    fake = FakeCupy()
    fake.install(monkeypatch)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    env = {"RAWFLASH_RANK": "0", "RAWFLASH_WORLD_SIZE": "4", "RAWFLASH_DEVICE": "2",
           "RAWFLASH_NCCL_ID_FILE": str(tmp_path / "id.json")}
    comm = NcclComm.from_env(env)
    assert (comm.rank, comm.world_size, comm.device) == (0, 4, 2)
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert fake.log[0] == ("use", 2) and ("init", 4, b"\x07" * 128, 0) in fake.log
    assert comm_mod.exchange_unique_id(1, tmp_path / "id.json", lambda: None, timeout=1) == b"\x07" * 128


# ---------------------------------------------------------------- LocalRing
def test_a_failing_rank_stops_the_others_and_its_error_is_raised():
    def rank(comm):
        if comm.rank == 1:
            raise KeyError("boom")
        return comm.ring_pass([np.zeros(2)]).wait()    # rank 0 waits for rank 1's pass, which never comes

    start = time.monotonic()
    with pytest.raises(KeyError, match="boom"):
        LocalRing(2, timeout=30).run(rank)
    assert time.monotonic() - start < 5


def test_a_missing_peer_times_out():
    def rank(comm):
        return comm.ring_pass([np.zeros(1)]).wait() if comm.rank == 0 else None

    with pytest.raises(TimeoutError, match="rank 0, ring pass 0: no peer answered within 0.2 s"):
        LocalRing(2, timeout=0.2).run(rank)


def test_ring_pass_sends_to_the_next_rank_as_copies_and_all_max():
    def rank(comm):
        mine = np.full(3, comm.rank)
        got = comm.ring_pass([mine, mine * 10]).wait()
        mine[:] = -1                                    # the receiver's copy is its own
        return [g.tolist() for g in got], comm.all_max(comm.rank * 1.5), comm.all_max(-comm.rank)

    res = LocalRing(3).run(rank)
    assert [r[0] for r in res] == [[[2] * 3, [20] * 3], [[0] * 3, [0] * 3], [[1] * 3, [10] * 3]]
    assert [r[1:] for r in res] == [(3.0, 0.0)] * 3


# ---------------------------------------------------------------- launcher and NCCL id (no NCCL needed)
def test_launcher_sets_each_ranks_environment(tmp_path):
    script = tmp_path / "dump.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        keys = ["RAWFLASH_RANK", "RAWFLASH_WORLD_SIZE", "RAWFLASH_DEVICE", "RAWFLASH_NCCL_ID_FILE",
                "NCCL_NVLS_ENABLE", "CUDA_VISIBLE_DEVICES"]
        out = os.path.join(sys.argv[1], os.environ["RAWFLASH_RANK"] + ".json")
        json.dump({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[2:]}, open(out, "w"))
    """))
    env = dict(os.environ, NCCL_NVLS_ENABLE="1", CUDA_VISIBLE_DEVICES="4,5,6")
    rc = subprocess.run([sys.executable, "-m", "rawflash.distributed.run", "--gpus", "3", str(script), str(tmp_path),
                         "--gpus", "9"], env=env, cwd=ROOT, timeout=60).returncode
    assert rc == 0
    seen = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    for r, s in enumerate(seen):
        assert s["argv"] == ["--gpus", "9"]
        e = s["env"]
        assert (e["RAWFLASH_RANK"], e["RAWFLASH_WORLD_SIZE"], e["RAWFLASH_DEVICE"]) == (str(r), "3", str(r))
        assert e["NCCL_NVLS_ENABLE"] == "0" and e["CUDA_VISIBLE_DEVICES"] == "4,5,6"
    assert len({s["env"]["RAWFLASH_NCCL_ID_FILE"] for s in seen}) == 1
    assert not Path(seen[0]["env"]["RAWFLASH_NCCL_ID_FILE"]).parent.exists()    # the launch's own, removed


def test_launcher_stops_the_other_ranks_when_one_fails(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['RAWFLASH_RANK'] == '1': sys.exit(3)\ntime.sleep(60)\n")
    start = time.monotonic()
    rc = run_mod.launch([sys.executable, str(script)], 3, grace=5)
    assert rc == 3 and time.monotonic() - start < 30


def test_launcher_runs_a_module(tmp_path):
    (tmp_path / "ringmod.py").write_text("import os\nassert os.environ['RAWFLASH_WORLD_SIZE'] == '2'\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "rawflash.distributed.run", "--gpus", "2", "-m", "ringmod"]
    assert subprocess.run(cmd, env=env, cwd=ROOT, timeout=60).returncode == 0
    assert subprocess.run(cmd[:-1] + ["--gpus", "3", "ringmod"], env=env, cwd=ROOT, timeout=60).returncode != 0


@pytest.mark.parametrize("unique_id", [bytes(range(128)), tuple(range(-64, 64))], ids=["bytes", "ints"])
def test_unique_id_reaches_every_rank_in_its_own_form(tmp_path, unique_id):
    path = tmp_path / "id.json"
    got = {}

    def reader(rank):
        got[rank] = comm_mod.exchange_unique_id(rank, path, lambda: pytest.fail("only rank 0 makes the id"),
                                                timeout=10)

    readers = [threading.Thread(target=reader, args=(r,)) for r in (1, 2)]
    for t in readers:
        t.start()
    time.sleep(0.05)
    assert comm_mod.exchange_unique_id(0, path, lambda: unique_id) == unique_id
    for t in readers:
        t.join()
    assert got == {1: unique_id, 2: unique_id}


def test_unique_id_wait_times_out(tmp_path):
    with pytest.raises(TimeoutError, match="rank 1: rank 0 did not write the NCCL unique id"):
        comm_mod.exchange_unique_id(1, tmp_path / "never.json", lambda: b"", timeout=0.1)


def test_from_env_names_the_missing_variable():
    with pytest.raises(RuntimeError, match="RAWFLASH_RANK is not set: start the ranks with 'python -m "
                                           "rawflash.distributed.run"):
        NcclComm.from_env({})
    with pytest.raises(ValueError, match="RAWFLASH_WORLD_SIZE must be an integer, got 'two'"):
        NcclComm.from_env({"RAWFLASH_RANK": "0", "RAWFLASH_WORLD_SIZE": "two"})
    with pytest.raises(RuntimeError, match="RAWFLASH_NCCL_ID_FILE is not set"):
        NcclComm.from_env({"RAWFLASH_RANK": "0", "RAWFLASH_WORLD_SIZE": "2"})


# ---------------------------------------------------------------- the benchmark's arithmetic
def test_summary_efficiency_and_hidden_fraction():
    cfg = Config(seqlen=1024, heads=2, kv_heads=2, head_dim=64)
    ring = {"ring_fwd_ms": 3.0, "compute_fwd_ms": 2.5, "comm_fwd_ms": 2.0,
            "ring_fwdbwd_ms": 10.0, "compute_fwdbwd_ms": 10.0, "comm_fwdbwd_ms": 4.0}
    row = summarize(cfg, 4, {"fwd_ms": 9.0, "fwdbwd_ms": 36.0}, ring)
    assert row["efficiency_fwd"] == pytest.approx(0.75) and row["efficiency_fwdbwd"] == pytest.approx(0.9)
    assert row["hidden_fwd"] == pytest.approx(0.75) and row["hidden_fwdbwd"] == 1.0
    flops = 2 * 2 * 1024 * 1024 * 64 * 3.5                         # causal: half of 4 B H N^2 d, fwd + bwd 3.5x
    assert row["ring_fwdbwd_tflops_per_gpu"] == pytest.approx(flops / 10e-3 / 4 / 1e12)
    missing = summarize(cfg, 8, None, None, "skipped: needs 8 GPUs, 0 visible")
    assert missing["efficiency_fwd"] is None and missing["status"].startswith("skipped")


def test_measurement_subprocesses_report_json_failures_and_timeouts():
    ok = [sys.executable, "-c", "import json, sys; json.dump({'fwd_ms': 1.5}, open(sys.argv[-1], 'w'))"]
    assert bench_mod._measure(ok, timeout=60) == ({"fwd_ms": 1.5}, None)
    result, why = bench_mod._measure([sys.executable, "-c", "import sys; print('no GPU'); sys.exit(2)"], 60)
    assert result is None and why == "exit 2: no GPU"
    result, why = bench_mod._measure([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    assert result is None and why == "timed out after 0.5 s"


def test_bench_ring_rows_say_why_nothing_was_timed(monkeypatch):
    monkeypatch.setattr(bench_mod, "_visible_gpus", lambda: 0)
    rows = bench_mod.bench_ring(gpus=(2, 3), seqlens=(1024,), heads=2)
    assert [r["status"] for r in rows] == ["single: skipped: no GPU visible; ring: skipped: needs 2 GPUs, 0 visible",
                                           "single: skipped: no GPU visible; ring: skipped: needs 3 GPUs, 0 visible"]
    monkeypatch.setattr(bench_mod, "_visible_gpus", lambda: 4)
    monkeypatch.setattr(bench_mod, "_measure", lambda cmd, timeout: ({"fwd_ms": 4.0, "fwdbwd_ms": 8.0}, None)
                        if "--single" in cmd else ({"ring_fwd_ms": 1.0, "ring_fwdbwd_ms": 2.5}, None))
    rows = bench_mod.bench_ring(gpus=(2, 3), seqlens=(1024,), heads=2)
    assert rows[0]["status"] == "ok" and rows[0]["efficiency_fwd"] == 2.0 and rows[0]["efficiency_fwdbwd"] == 1.6
    assert rows[1]["status"] == "ring: skipped: seqlen 1024 does not cut into 6 equal chunks"


# ---------------------------------------------------------------- the real kernels, on Numba's CPU simulator
@pytest.mark.slow
def test_ring_with_the_numba_kernels_on_the_simulator():
    """rawflash.backward's kernels (Numba twins of the CUDA C ones) on K/V blocks with the global out and lse."""
    code = textwrap.dedent("""
        import numpy as np
        from rawflash import reference
        from test_distributed import problem, run_ring
        q, k, v, dout = problem(2, heads=2, kv_heads=1, chunk=4, batch=1, head_dim=16)
        got = run_ring(2, q, k, v, dout, True, "zigzag", backend="numba")
        want = reference.forward(q, k, v, causal=True) + reference.backward(dout, q, k, v, causal=True)
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)
        print("ok")
    """)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests", env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


# ---------------------------------------------------------------- one GPU: CuPy kernels, LocalRing
@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_ring_on_one_gpu_with_the_cupy_kernels(world):
    from ring_cases import CASES, check_rank

    failures = LocalRing(world).run(lambda comm: [f for case in CASES for f in check_rank(comm, *case)])
    assert not [f for per_rank in failures for f in per_rank]


# ---------------------------------------------------------------- several GPUs: NCCL through the launcher
@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4, 8])
def test_ring_over_nccl(world):
    if bench_mod._visible_gpus() < world:
        pytest.skip(f"needs {world} CUDA GPUs, {bench_mod._visible_gpus()} visible")
    from cupy.cuda import nccl

    if not nccl.available:
        pytest.skip("NCCL cannot be loaded by CuPy (pip install 'rawflash[nccl13]')")
    proc = subprocess.run([sys.executable, "-m", "rawflash.distributed.run", "--gpus", str(world),
                           str(ROOT / "tests" / "ring_cases.py")], cwd=ROOT / "tests", capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
