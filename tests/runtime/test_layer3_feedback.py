"""Layer 3 in the runtime: the cost model uses the figures the user pins (``Options.machine``)
or the cache dir's stored ones, and every parallel combination it rejects is written to the
feedback log."""

import numpy as np

import apollo_py as ap
from apollo_py.feedback.log import read_events


SHAPE = (1024, 1024)  # 4 MiB per branch: four together are worth one pool job (Machine.inline_bytes)


def _branches(n=4, shape=SHAPE):
    b = ap.GraphBuilder("branches")
    outs = []
    for i in range(n):
        x = b.input(f"x{i}", shape)
        outs.append(b.reduce_sum(b.exp(x), axes=(1,), keepdims=True))
    return b.build(outs)


def _run(tmp_path, machine, shape=SHAPE):
    """Group sizes and rejected-combination events for four branches; ``machine``: the figures
    as a dict (pinned through Options.machine), or None for what the cache dir holds."""
    pinned = ap.Machine(**machine) if machine is not None else None
    f = ap.jit(_branches(shape=shape), options=ap.Options(target="cpu", cache_dir=str(tmp_path), machine=pinned))
    xs = {f"x{i}": np.full(shape, 0.1 * i, np.float32) for i in range(4)}
    for i, y in enumerate(f.run(**xs)):
        np.testing.assert_allclose(y, np.exp(xs[f"x{i}"]).sum(axis=1, keepdims=True), rtol=1e-6)
    exe = f.specialization({k: shape for k in xs})
    groups = [len(item) for kind, item in exe._schedule if kind == "kernels"]
    return groups, read_events(str(tmp_path / "feedback.jsonl"), "parallel_rejected") \
        if (tmp_path / "feedback.jsonl").exists() else []


def test_cheap_launches_group_the_branches(tmp_path):
    groups, rejected = _run(tmp_path, {"bandwidth": 100e9, "peak": 500e9, "launch": 1e-9})
    assert groups == [4] and rejected == []


def test_tiny_groups_run_inline(tmp_path):
    # layer 3 groups them, but 4 x 128 bytes are not worth a pool wake-up: four inline entries
    groups, rejected = _run(tmp_path, {"bandwidth": 10e9, "peak": 50e9, "launch": 1e-9}, shape=(4, 8))
    assert groups == [1, 1, 1, 1] and rejected == []


def test_slow_memory_leaves_kernels_alone(tmp_path):
    # at 100 kB/s every kernel is predicted to fill the machine on its own: no grouping
    groups, _ = _run(tmp_path, {"bandwidth": 1e5, "peak": 50e9, "launch": 1e-6})
    assert groups == [1, 1, 1, 1]


def test_rejected_combinations_are_logged(tmp_path, monkeypatch):
    from apollo_py.layers import layer3
    real = layer3.stitch_parallel
    # a policy demanding a one-second gain: every combination is tried and refused
    monkeypatch.setattr(layer3, "stitch_parallel", lambda ks, m, on_reject=None: real(
        ks, m, layer3.ParallelPolicy(min_gain=1.0), on_reject=on_reject))
    groups, rejected = _run(tmp_path, {"bandwidth": 100e9, "peak": 500e9, "launch": 1e-9})
    assert groups == [1, 1, 1, 1]
    assert rejected and all(e["detail"]["reason"] == "estimated gain below the policy threshold" for e in rejected)
    assert {len(e["sizes"]) for e in rejected} == {2, 3, 4}


def test_stored_figures_reach_layer3(tmp_path):
    # figures stored in the cache dir (as `apollo-py machine --measure` leaves them) decide too
    from apollo_py.machine import Machine, measure_machine, save_machine
    notes = measure_machine(rounds=1, attempts=1).notes
    save_machine(str(tmp_path), Machine(bandwidth=1e5, peak=50e9, launch=1e-6, notes=notes))
    groups, _ = _run(tmp_path, None)
    assert groups == [1, 1, 1, 1]
    save_machine(str(tmp_path), Machine(bandwidth=100e9, peak=500e9, launch=1e-9, notes=notes))
    from apollo_py import machine as M
    M._MEASURED.clear()         # a new process would read the file anew
    groups, _ = _run(tmp_path, None)
    assert groups == [4]
