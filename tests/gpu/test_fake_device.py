"""The GPU code paths on the fake device (tests/gpu/fake_device.py): runs on every machine.

`device.kind = "cuda"` with HPCPIPE_TEST_ARRAY_MODULE=fake_device puts every array on a host
stand-in for CuPy that counts each device-to-host conversion, refuses host arrays in device
operations, runs queued copies only when they are waited for, and tells whether a buffer
handed to MPI is safe. These tests check that:

- the model layers, the MoE layer and the sweep kernel make no host copy in their hot paths
  (MoE: one per forward, the router probabilities, by design);
- a training step makes exactly the copies of `d2h_budget.expected_d2h` (loss and gradient norms
  once per step; staged messages when MPI is not CUDA-aware), every one of them through the
  backend's counter, with pinned buffers reused across steps;
- every MPI call gets a device buffer only after a stream synchronisation and a staged host
  buffer only after its copy landed (p2p, bucketed allreduce, MoE all-to-all, sweep faces);
- training on the "device" matches the single-process reference, staged and direct, and the
  CUDA-aware decision is logged and stored in the trace.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import fake_device
import fake_mpi
import h5py
import numpy as np
import pytest
from conftest import clean_environ, mpiexec_command
from mpi4py import MPI

import hpcpipe.backend as backend_module
from hpcpipe.backend import TEST_ARRAY_MODULE_ENV, Backend, detect_cuda_aware, make_backend

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ENV = {TEST_ARRAY_MODULE_ENV: "fake_device", "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}


@pytest.fixture
def fake(monkeypatch):
    """A fake-device backend made by make_backend (and the active one), restored afterwards."""
    monkeypatch.setenv(TEST_ARRAY_MODULE_ENV, "fake_device")
    monkeypatch.setattr(backend_module, "_ACTIVE", None)
    fake_device.reset()
    fake_device.Event.delay_queries = 0
    fake_mpi.VIOLATIONS.clear()
    yield make_backend("cuda", "float64", 0, "off")
    fake_device.Event.delay_queries = 0


def events(kind: str) -> list[tuple]:
    return [e for e in fake_device.STATS.log if e[0] == kind]


# ------------------------------------------------------------------------- the fake itself


def test_fake_counts_host_conversions_and_refuses_host_operands():
    a = fake_device.asarray(np.arange(6.0).reshape(2, 3))
    fake_device.reset()
    s = (a * 2).sum()
    assert isinstance(s, fake_device.ndarray) and s.ndim == 0  # scalars stay on the device
    assert fake_device.STATS.d2h == 0
    assert float(s) == 30.0 and a[1, 2].item() == 5.0 and bool(a[0, 1] > 0)
    assert a.get().sum() == 15.0 and fake_device.asnumpy(a).shape == (2, 3)
    assert fake_device.STATS.d2h == 5
    with pytest.raises(TypeError, match="host numpy array"):
        _ = a + np.ones(3)


def test_make_backend_selects_the_device_module_and_says_why_it_stages(fake):
    assert fake.on_gpu and fake.xp is fake_device and fake.staged
    assert backend_module.active_backend() is fake
    assert "staged" in fake.describe() and "device.cuda_aware = off" in fake.describe()


def test_cuda_aware_detection_falls_back_to_the_library_variables(monkeypatch):
    monkeypatch.setattr(backend_module, "_libmpi", lambda: None)
    monkeypatch.delenv("MV2_USE_CUDA", raising=False)
    monkeypatch.delenv("MPICH_GPU_SUPPORT_ENABLED", raising=False)
    assert detect_cuda_aware("auto") == (
        False,
        "the MPI library offers no CUDA query; set device.cuda_aware = on to force",
    )
    monkeypatch.setenv("MPICH_GPU_SUPPORT_ENABLED", "1")
    aware, why = detect_cuda_aware("auto")
    assert aware and why.startswith("MPICH_GPU_SUPPORT_ENABLED=1")
    assert detect_cuda_aware("off")[0] is False and detect_cuda_aware("on")[0] is True


def test_mpich_wheel_is_not_cuda_aware_here():
    """The PyPI mpich wheel is built without CUDA: its own query answers 0 (the backend then
    stages), even with MPIR_CVAR_ENABLE_GPU set."""
    if "pypi.org/p/mpich" not in MPI.Get_library_version():
        pytest.skip("the MPI here is not the PyPI mpich wheel")
    aware, why = detect_cuda_aware("auto")
    assert not aware and why.startswith("MPIX_GPU_query_support(CUDA) = 0")


# ------------------------------------------------------------------------- staging


def test_staging_slots_are_pinned_reused_and_grown_by_powers_of_two(fake):
    a = fake.staging(1000, "s")
    b = fake.staging(800, "s")
    assert a.nbytes == 1000 and b.nbytes == 800
    assert np.shares_memory(a, b) and fake.pinned_allocations == 1
    c = fake.staging(1500, "s")
    assert c.base is not None and c.base.nbytes == 2048 and fake.pinned_allocations == 2
    assert fake_device.STATS.pinned == 2


def test_stage_out_waits_for_its_copy_before_mpi_may_read_it(fake):
    fake_device.Event.delay_queries = 2
    x = fake_device.asarray(np.arange(16.0))
    copy = fake.stage_out(x * 3, "out")
    assert fake_device.check_mpi_buffer(copy.host) is not None  # copy still queued
    assert not copy.ready() and not copy.ready()
    assert fake_device.check_mpi_buffer(copy.host) is not None
    host = copy.wait()
    assert fake_device.check_mpi_buffer(host) is None
    assert np.array_equal(host, np.arange(16.0) * 3)
    assert fake.transfers.d2h == 1 and fake_device.STATS.d2h == 1


def test_stage_in_orders_later_kernels_after_the_copy_without_blocking_the_host(fake):
    dst = fake_device.zeros(8)
    host = fake.staging(64, "in").view(np.float64)
    host[...] = np.arange(8.0)
    fake_device.reset()
    fake.stage_in(dst, host, "in")
    assert ("wait_event", "null", fake.copy_stream.name) in fake_device.STATS.log
    assert not events("event_sync")  # the host did not wait
    assert np.array_equal((dst + 1).view(np.ndarray), np.arange(8.0) + 1)
    assert fake.transfers.h2d == 1
    fake.staging(64, "in")  # reusing the slot waits for the copy first
    assert events("event_sync")


# ------------------------------------------------------------------------- p2p ordering


def self_mailbox(
    backend: Backend,
    overlap: bool = False,
    microbatches: int = 1,
    lookahead=1,
    blocking: bool = False,
):
    """A mailbox on one rank that sends stage 1's activations to itself: rank 0 plays both
    ends of a two-stage pipeline, one message in flight per microbatch."""
    from hpcpipe.mpi.p2p import Mailbox
    from hpcpipe.schedules.messages import MessagePlan, Receive, Send

    m = microbatches
    receives = tuple(Receive(1, mb, 0, 0, mb % 2, 3 * mb, 3 * mb + 2) for mb in range(m))
    sends = tuple(Send(1, mb, 0, 0) for mb in range(m))
    plan = MessagePlan(0, receives, {2: min(m, 2)}, {2: 0}, sends, {2: min(m, 2)}, lookahead)
    comm = fake_mpi.RecordingComm(MPI.COMM_SELF.Dup())
    return Mailbox(comm, backend, plan, (32,), np.float64, overlap=overlap, blocking=blocking)


@pytest.mark.parametrize("cuda_aware", [True, False])
def test_mailbox_blocking_sends_complete_before_returning(fake, cuda_aware):
    # train.sends = "blocking": one Ssend per message once its bytes are complete (after the
    # producer's event, or the staging copy), nothing left in flight for drain
    fake.cuda_aware = cuda_aware
    box = self_mailbox(fake, microbatches=4, blocking=True)
    for mb in range(4):
        box.post_recv(mb)
        fake_device.reset()
        box.send(fake_device.arange(32.0) + mb, mb)
        assert not box._sends and not box._deferred  # completed, not queued
        mpi = [e for e in fake_device.STATS.log if e[0] == "mpi"]
        assert mpi == [("mpi", "Ssend", "device" if cuda_aware else "host")], mpi
        got = box.wait_recv(mb)
        assert np.array_equal((got * 1).view(np.ndarray), np.arange(32.0) + mb)
        box.release(((2, mb % 2),))
    box.drain()
    assert fake_mpi.VIOLATIONS == []  # MPI never read bytes a kernel was still writing
    if not cuda_aware:
        assert fake.pinned_allocations <= 3  # one send slot reused, the plan's two receives


def test_mailbox_direct_waits_for_an_event_not_the_stream_before_mpi(fake):
    fake.cuda_aware = True
    box = self_mailbox(fake)
    box.post_recv(0)
    y = fake_device.arange(32.0) * 2  # a kernel producing the message
    fake_device.reset()
    box.send(y, 0)
    got = box.wait_recv(0)
    box.drain()
    log = [e for e in fake_device.STATS.log if e[0] in ("sync", "record", "mpi")]
    # an event after the producing kernel, polled (done: the fake's kernels finish at once),
    # then MPI: never a stream-wide synchronisation
    assert log[:2] == [("record", "null"), ("mpi", "Isend", "device")]
    assert not events("sync")
    assert fake_mpi.VIOLATIONS == []  # the fake checks the kernel had completed
    assert np.array_equal(got.view(np.ndarray), np.arange(32.0) * 2)
    assert fake_device.STATS.d2h == 0


def test_mailbox_direct_reuses_a_buffer_only_after_the_kernels_that_read_it(fake):
    fake.cuda_aware = True
    box = self_mailbox(fake, microbatches=4)
    for mb in range(4):  # two buffers take turns; each is released after a kernel reads it
        box.post_recv(mb)
        box.send(fake_device.arange(32.0) + mb, mb)
        got = box.wait_recv(mb)
        assert np.array_equal((got * 1).view(np.ndarray), np.arange(32.0) + mb)
        box.release(((2, mb % 2),))
    box.drain()
    assert fake_mpi.VIOLATIONS == []
    starts = [e for e in fake_device.STATS.log if e[:2] == ("mpi", "Recv_init")]
    assert len(starts) == 4  # one persistent request per buffer, started per message


def test_mailbox_staged_sends_after_the_copy_and_copies_back_on_the_copy_stream(fake):
    box = self_mailbox(fake)
    for step in range(2):
        box.post_recv(0)
        fake_device.reset()
        box.send(fake_device.arange(32.0) + step, 0)
        got = box.wait_recv(0)
        box.drain()
        out = (got * 1).view(np.ndarray)
        assert np.array_equal(out, np.arange(32.0) + step)
        kinds = [e[0] for e in fake_device.STATS.log]
        first_mpi = kinds.index("mpi")
        assert "event_sync" in kinds[:first_mpi]  # the host buffer was complete before MPI
        assert ("wait_event", "null", fake.copy_stream.name) in fake_device.STATS.log
        assert fake_device.STATS.d2h == 1 and fake.transfers.d2h == step + 1
    assert fake.pinned_allocations == 2  # one send slot, one receive slot, reused
    assert fake_mpi.VIOLATIONS == []


def test_mailbox_staged_pinned_memory_is_bounded_by_the_plan_not_the_microbatches(fake):
    box = self_mailbox(fake, microbatches=16)
    for mb in range(16):
        box.post_recv(mb)
        box.send(fake_device.arange(32.0) * mb, mb)
        got = box.wait_recv(mb)
        assert np.array_equal((got * 1).view(np.ndarray), np.arange(32.0) * mb)
    box.drain()
    # 2 receive buffers (the plan's) + at most 2 send buffers, 256 bytes each: not 16 of each
    assert fake.pinned_allocations <= 4 and fake.pinned_bytes <= 4 * 256
    assert fake_mpi.VIOLATIONS == []


def test_mailbox_overlap_defers_the_send_until_the_copy_lands(fake):
    fake_device.Event.delay_queries = 2
    box = self_mailbox(fake, overlap=True)
    box.post_recv(0)
    box.send(fake_device.arange(32.0), 0)
    assert box.sends_deferred == 1 and "device sends not ready" in box.describe_pending()
    assert not any(e[:2] == ("mpi", "Send_init") for e in fake_device.STATS.log)
    box.progress()  # still copying: nothing posted, nothing blocks
    got = box.wait_recv(0)  # posts the deferred send before it blocks
    box.drain()
    assert np.array_equal((got * 1).view(np.ndarray), np.arange(32.0))
    assert fake_mpi.VIOLATIONS == []


# ------------------------------------------------------------------------- kernels


def gpt_stage(xp):
    from hpcpipe.model import ModelConfig, Stage, build_model

    cfg = ModelConfig(kind="gpt", layers=2, d_model=16, n_heads=2, d_ff=24, vocab=11, seq_len=6)
    units = build_model(cfg)
    stage = Stage(units, range(len(units)))
    return stage, stage.init(3, xp, "float64")


def test_model_layers_make_no_host_copy_and_match_numpy():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 11, size=(3, 6))
    t = rng.integers(0, 11, size=(3, 6))
    out = {}
    for name, xp in (("host", np), ("device", fake_device)):
        stage, params = gpt_stage(xp)
        fake_device.reset()
        loss, ctx = stage.forward(params, xp.asarray(x), xp.asarray(t))
        _, wctx = stage.backward_input(params, ctx, 0.5)
        grads = stage.backward_weight(params, wctx)
        if xp is fake_device:
            assert fake_device.STATS.d2h == 0, fake_device.STATS.d2h_sites
            assert isinstance(loss, fake_device.ndarray)
        out[name] = (np.asarray(loss.view(np.ndarray) if xp is fake_device else loss), grads)
    assert out["host"][0] == out["device"][0]
    for i, g in out["host"][1].items():
        for k, v in g.items():
            assert np.array_equal(v, out["device"][1][i][k].view(np.ndarray)), (i, k)


def test_moe_layer_copies_only_the_router_probabilities(fake):
    from hpcpipe.moe import MoELayer

    layer = MoELayer(6, 5, 4, top_k=2, capacity_factor=1.0, aux_loss_coef=0.3, z_loss_coef=0.2)
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((2, 5, 6)), rng.standard_normal((2, 5, 6))
    results = {}
    for name, xp in (("host", np), ("device", fake_device)):
        params = layer.init(7, 0, xp, "float64")
        fake_device.reset()
        y, ctx = layer.forward(params, xp.asarray(x), 0.5)
        forward_d2h = fake_device.STATS.d2h
        dh, wctx = layer.backward_input(params, ctx, xp.asarray(dy))
        grads = layer.backward_weight(params, wctx)
        if xp is fake_device:
            assert forward_d2h == 1 and fake_device.STATS.d2h == 1  # routing, once
            assert fake.transfers.d2h == 1  # ... through the backend
        host = (lambda a: a.view(np.ndarray)) if xp is fake_device else (lambda a: a)
        results[name] = (host(y), host(dh), {k: host(v) for k, v in grads.items()})
    for a, b in zip(results["host"][:2], results["device"][:2], strict=True):
        assert np.array_equal(a, b)
    for k, v in results["host"][2].items():
        assert np.array_equal(v, results["device"][2][k]), k


def test_moe_stats_are_copied_once_for_all_layers(fake):
    from hpcpipe.moe import MoEStats, summarize_stats

    stats = [
        MoEStats(
            fake_device.asarray(1.0 + i), fake_device.asarray(2.0), np.ones(4), np.ones(4), 4, 2, 4
        )
        for i in range(5)
    ]
    fake_device.reset()
    fig = summarize_stats(stats)
    assert fake_device.STATS.d2h == 1 and fig["aux_loss"] == 3.0 and fig["z_loss"] == 2.0


def thick_problem(fixup: bool = True):
    from hpcpipe.config import load_config
    from hpcpipe.sweep.mesh import build_problem

    sets = ["sweep.sigma_t=[[10.0, 15.0], [20.0, 40.0]]", f"sweep.fixup={str(fixup).lower()}"]
    return build_problem(load_config(ROOT / "inputs" / "sweep_tiny.toml", sets).sweep)


def test_sweep_kernel_masked_fixup_equals_the_host_fixup_without_host_copies():
    from hpcpipe.sweep.kernel import sweep_domain
    from hpcpipe.sweep.solver import LocalCells

    problem = thick_problem()
    results = {}
    for name, xp in (("host", np), ("device", fake_device)):
        cells = LocalCells(problem, xp=xp)
        q = cells.source(xp.zeros((cells.cells, problem.groups)) + 1.0)
        fake_device.reset()
        phi, out, inflow = sweep_domain(xp, problem, q, cells.sigma_t)
        if xp is fake_device:
            assert fake_device.STATS.d2h == 0, fake_device.STATS.d2h_sites
            phi, out, inflow = (a.view(np.ndarray) for a in (phi, out, inflow))
        results[name] = (phi, out, inflow)
    for a, b in zip(results["host"], results["device"], strict=True):
        assert np.array_equal(a, b)  # the same arithmetic, element for element
    plain = thick_problem(fixup=False)
    cells = LocalCells(plain)
    phi0, _, _ = sweep_domain(
        np, plain, cells.source(np.zeros((cells.cells, 2)) + 1.0), cells.sigma_t
    )
    assert not np.array_equal(phi0, results["host"][0])  # the fix-up did change fluxes


# ------------------------------------------------------------------------- under mpiexec


def driver(ranks: int, what: str, timeout: float = 240) -> list[dict]:
    cmd = [*mpiexec_command(), "-n", str(ranks), sys.executable, str(HERE / "fake_driver.py"), what]
    env = {**clean_environ(), **ENV}
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"fake_driver {what}: no end in {timeout}s\n{exc.stderr}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def check_training(records: list[dict]) -> None:
    losses = {r["case"]: r["ranks"][0]["loss"] for r in records}
    for record in records:
        for rank in record["ranks"]:
            where = (record["case"], rank["rank"])
            assert rank["violations"] == [], where
            for step in rank["steps"]:
                # every copy goes through the backend, and there are exactly the budgeted ones
                assert step["fake_d2h"] == step["backend_d2h"] == rank["expected_total"], where
            pinned = [s["pinned"] for s in rank["steps"]]
            assert pinned == [pinned[0]] * len(pinned), where  # reused, never reallocated
            if not rank["staged"]:
                assert pinned[0] == 0 and all(s["mpi_host"] == 0 for s in rank["steps"]), where
    base = next(iter(losses.values()))
    same_layout = [name for name in losses if "zbv" not in name and "pairs" not in name]
    for name in same_layout:
        assert losses[name] == base, name  # staged, direct, overlapped: bit for bit


@pytest.mark.mpi
def test_training_step_copies_only_its_budget_and_hands_mpi_safe_buffers():
    records = driver(4, "train")
    assert [r["case"] for r in records] == ["direct", "staged", "staged-overlap", "staged-zbv"]
    check_training(records)
    overlap = next(r for r in records if r["case"] == "staged-overlap")
    assert sum(s["deferred"] for rk in overlap["ranks"] for s in rk["steps"]) > 0
    for record in records:  # the transport never synchronises a stream; what is left per step
        for rank in record["ranks"]:  # (end-of-step timing, loss and norm copies) stays flat
            steps = rank["steps"]
            assert all(s["stream_syncs"] <= 3 for s in steps), (record["case"], steps)
            assert len({s["stream_syncs"] for s in steps[1:]}) == 1, (record["case"], steps)
            for a, b in itertools.pairwise(steps):
                assert b["host_waits"] - a["host_waits"] <= b["receives"], record["case"]
    direct = records[0]["ranks"]
    assert all(rk["expected_total"] <= 2 for rk in direct)  # loss + norms at most


@pytest.mark.mpi
def test_moe_step_copies_only_its_budget_and_hands_mpi_safe_buffers():
    records = driver(4, "moe")
    check_training(records)
    for rank in records[0]["ranks"]:
        assert rank["expected"]["routing"] > 0 and rank["expected"]["moe_stats"] == 1
    direct, staged = (
        next(r for r in records if r["case"] == f"moe-{k}-pairs") for k in ("direct", "staged")
    )
    assert staged["ranks"][0]["loss"] == direct["ranks"][0]["loss"]  # bit for bit
    for rank in staged["ranks"]:  # a second set of staging buffers: two exchanges were out
        assert rank["a2a_slots"] == ["a2a.recv", "a2a.recv.1", "a2a.send", "a2a.send.1"], rank
        assert rank["exchanges_in_flight"] == [], rank  # every slot given back
    for rank in direct["ranks"]:  # CUDA-aware: MPI reads the device arrays, no slot taken
        assert rank["a2a_slots"] == [] and rank["exchanges_in_flight"] == [], rank


@pytest.mark.mpi
def test_sweep_on_the_device_equals_numpy_with_one_copy_per_sweep():
    for record in driver(2, "sweep"):
        for rank in record["ranks"]:
            where = (record["case"], rank["rank"])
            assert rank["violations"] == [], where
            assert rank["max_rel_phi"] == 0.0 and rank["flows_equal"], where
            assert rank["sweep_d2h"] == rank["sweep_backend_d2h"], where
            staged_faces = rank["face_sends"] if rank["staged"] else 0
            assert rank["sweep_d2h"] == 1 + staged_faces, where


@pytest.mark.mpi
@pytest.mark.parametrize("aware", ["off", "on"])
def test_training_on_the_device_matches_the_reference_and_records_the_decision(
    mpirun, tmp_path, aware
):
    r = mpirun(
        4,
        [
            "run",
            str(ROOT / "inputs" / "train_tiny.toml"),
            "--set",
            f"run.output={tmp_path}",
            "--set",
            'device.kind="cuda"',
            "--set",
            f'device.cuda_aware="{aware}"',
            "--set",
            "trace.enabled=true",
        ],
        env=ENV,
    )
    assert r.returncode == 0, r.output
    assert "verify OK" in r.stdout, r.output
    assert f"device=cuda mpi_cuda_aware={int(aware == 'on')}" in r.stdout
    with h5py.File(tmp_path / "trace.h5") as f:
        assert f.attrs["device"] == "cuda:0"
        assert bool(f.attrs["cuda_aware"]) is (aware == "on")
        assert f.attrs["cuda_aware_reason"] == f"device.cuda_aware = {aware} (deck)"


@pytest.mark.mpi
@pytest.mark.parametrize("aware", ["off", "on"])
def test_local_steps_on_the_device_average_through_the_gradients_paths(mpirun, tmp_path, aware):
    """`[async] mode = local`: the parameter averaging goes through the bucketed reductions'
    staged (and CUDA-aware) paths; the replicas still equal the reference."""
    sets = {
        "run.output": tmp_path,
        "device.kind": '"cuda"',
        "device.cuda_aware": f'"{aware}"',
        "run.steps": 5,
        "async.mode": "local",
        "async.average_every": 2,
        "async.delay": 1,
    }
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    r = mpirun(4, ["run", str(ROOT / "inputs" / "train_tiny.toml"), *args], env=ENV)
    assert r.returncode == 0, r.output
    assert "verify OK" in r.stdout and "local-steps reference" in r.stdout, r.output


@pytest.mark.mpi
def test_p2p_benchmark_device_mode_measures_staged_and_says_why_not_direct(tmp_path):
    script = tmp_path / "p2p.py"
    script.write_text(
        "import argparse, json, sys\n"
        "from mpi4py import MPI\n"
        "from hpcpipe.bench.p2p import run\n"
        "a = argparse.Namespace(device='cuda', cuda_aware=sys.argv[1], min_bytes=1 << 20,\n"
        "    max_bytes=2 << 20, factor=2, repeats=1, budget_mib=4)\n"
        "r = run(MPI.COMM_WORLD, a)\n"
        "if MPI.COMM_WORLD.rank == 0: print(json.dumps(r.to_json()))\n"
    )
    for aware in ("auto", "on"):
        cmd = [*mpiexec_command(), "-n", "2", sys.executable, str(script), aware]
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=120,
            env={**clean_environ(), **ENV},
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        report = json.loads(proc.stdout.splitlines()[-1])
        rows = report["rows"]
        assert [r["bytes"] for r in rows] == [1 << 20, 2 << 20]
        assert all(r["staged_gbps"] > 0 and r["host_gbps"] > 0 for r in rows)
        if aware == "on":
            assert all(r["direct_gbps"] > 0 for r in rows)
        else:
            assert all(r["direct_gbps"] is None for r in rows)
            assert "direct path not measured" in report["notes"][-1]


def test_too_many_stages_for_the_tag_bound_is_a_clear_error(monkeypatch):
    """Channel tags are 2 x stage (+1): an MPI whose MPI_TAG_UB is below them is refused when
    the mailbox is built (the trainer turns it into exit 2 naming topology.pp)."""
    import hpcpipe.mpi.p2p as p2p

    class World:
        @staticmethod
        def Get_attr(key):  # mpi4py's name
            return 1

    class ShimMPI:
        def __getattr__(self, name):
            return World if name == "COMM_WORLD" else getattr(MPI, name)

    monkeypatch.setattr(p2p, "MPI", ShimMPI())
    with pytest.raises(p2p.TagLimitError, match=r"tags up to 2 .* allows 1 \(MPI_TAG_UB\)"):
        self_mailbox(make_backend("cpu", "float64", 0))
