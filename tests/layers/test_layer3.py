"""Layer 3 parallel stitching: independent small kernels group, dependent or big ones do not."""
from dataclasses import dataclass

from apollo_py.machine import Machine
from apollo_py.layers.layer3 import ParallelPolicy, stitch_parallel

M = Machine(bandwidth=10e9, peak=50e9, launch=10e-6)


@dataclass
class K:
    name: str
    inputs: tuple
    outputs: tuple
    bytes: float = 400e3  # 40 µs at 10 GB/s
    flops: float = 0.0
    compute_bound: bool = False


def test_four_independent_branches_stitch_into_one_group():
    ks = [K(f"b{i}", ("x",), (f"y{i}",)) for i in range(4)] + [K("cat", ("y0", "y1", "y2", "y3"), ("z",))]
    groups = stitch_parallel(ks, M)
    assert sorted(k.name for k in groups[0]) == ["b0", "b1", "b2", "b3"]
    assert [k.name for k in groups[1]] == ["cat"]


def test_dependent_chain_never_stitches():
    ks = [K("a", ("x",), ("a",)), K("b", ("a",), ("b",)), K("c", ("b",), ("c",))]
    assert [len(g) for g in stitch_parallel(ks, M)] == [1, 1, 1]


def test_compute_bound_and_large_kernels_stay_alone_and_rejections_are_reported():
    ks = [K("mm", ("x",), ("m",), compute_bound=True), K("big", ("x",), ("b",), bytes=1e9),
          K("s1", ("x",), ("s1",), bytes=10), K("s2", ("x",), ("s2",), bytes=10)]
    rejected = []
    groups = stitch_parallel(ks, M, ParallelPolicy(min_gain=1e-3), on_reject=lambda c, g: rejected.append(c))
    assert all(len(g) == 1 for g in groups)
    assert rejected and {k.name for k in rejected[0]} == {"s1", "s2"}
