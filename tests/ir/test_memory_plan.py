"""Liveness-based memory plan: reuse without overlap of live buffers."""
from apollo_py.runtime.memory import plan_memory


def test_chain_reuses_buffers():
    # x -> a -> b -> c -> y : a and c can share memory, b must not overlap a or c
    steps = [(["x"], ["a"]), (["a"], ["b"]), (["b"], ["c"]), (["c"], ["y"])]
    sizes = {"x": 400, "a": 400, "b": 400, "c": 400, "y": 400}
    plan = plan_memory(steps, sizes, external={"x", "y"})
    assert set(plan.slots) == {"a", "b", "c"}
    assert plan.arena_bytes < plan.naive_bytes
    for u in plan.slots.values():
        for v in plan.slots.values():
            if u.value < v.value and not (u.last < v.first or v.last < u.first):
                assert u.offset + u.nbytes <= v.offset or v.offset + v.nbytes <= u.offset


def test_value_read_late_stays_live():
    steps = [(["x"], ["a"]), (["x"], ["b"]), (["a", "b"], ["y"])]
    plan = plan_memory(steps, {"x": 64, "a": 64, "b": 64, "y": 64}, external={"x", "y"})
    a, b = plan.slots["a"], plan.slots["b"]
    assert a.offset != b.offset
