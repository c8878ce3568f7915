"""Catch-up planning (shortest path by bytes over the version DAG) and the keyframe / span cadence."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flipsync.board.cadence import KeyframePolicy, SpanPolicy, should_write_keyframe, spans_to_publish
from flipsync.domain.catchup import plan_catchup
from flipsync.domain.manifest import Kind, Manifest, Part
from flipsync.errors import BoardError, ConfigError, NotFoundError


def art(kind: str, base: int | None, target: int, size: int) -> Manifest:
    return Manifest(
        run="r",
        version=target,
        kind=Kind(kind),
        base_version=base,
        target_version=target,
        base_view_fp=None if base is None else f"{base + 1:x}",
        target_view_fp=f"{target + 1:x}",
        served_format="bf16",
        parts=(Part("p", size, "0" * 64),),
        created="2026-01-01T00:00:00Z",
        publisher="t",
    )


def chain(n: int, size: int = 10) -> list[Manifest]:
    return [art("patch", v - 1, v, size) for v in range(1, n + 1)]


def edges(plan_steps: tuple[Manifest, ...]) -> list[tuple[str, int | None, int]]:
    return [m.edge for m in plan_steps]


def test_chain_when_patches_are_cheap() -> None:
    arts = [*chain(5), art("keyframe", None, 0, 1000), art("keyframe", None, 3, 1000)]
    plan = plan_catchup(2, 5, arts)
    assert edges(plan.steps) == [("patch", 2, 3), ("patch", 3, 4), ("patch", 4, 5)]
    assert plan.total_bytes == 30 and plan.downloads == 3


def test_new_replica_takes_newest_keyframe_then_patches() -> None:
    arts = [*chain(5), art("keyframe", None, 0, 1000), art("keyframe", None, 3, 1000)]
    plan = plan_catchup(None, 5, arts)
    assert edges(plan.steps) == [("keyframe", None, 3), ("patch", 3, 4), ("patch", 4, 5)]
    assert "new replica" in plan.describe()


def test_keyframe_beats_a_long_expensive_chain() -> None:
    arts = [*chain(10, size=100), art("keyframe", None, 9, 250)]
    plan = plan_catchup(1, 10, arts)
    assert edges(plan.steps) == [("keyframe", None, 9), ("patch", 9, 10)]


def test_span_beats_chain_and_ties_prefer_fewer_downloads() -> None:
    arts = [*chain(8), art("span", 0, 8, 50), art("span", 4, 8, 40)]
    assert edges(plan_catchup(0, 8, arts).steps) == [("span", 0, 8)]
    # 4->8 by chain costs 40, the span costs 40 too: one download wins.
    assert edges(plan_catchup(4, 8, arts).steps) == [("span", 4, 8)]


def test_excluded_edges_are_routed_around() -> None:
    arts = [*chain(4), art("span", 0, 4, 5), art("keyframe", None, 4, 1000)]
    assert edges(plan_catchup(0, 4, arts).steps) == [("span", 0, 4)]
    plan = plan_catchup(0, 4, arts, exclude={("span", 0, 4)})
    assert [e[0] for e in edges(plan.steps)] == ["patch"] * 4
    plan = plan_catchup(0, 4, arts, exclude={("span", 0, 4), ("patch", 1, 2)})
    assert edges(plan.steps) == [("keyframe", None, 4)]


def test_no_path_and_backwards() -> None:
    with pytest.raises(NotFoundError, match="no way from a new replica to v3"):
        plan_catchup(None, 3, chain(3))
    with pytest.raises(NotFoundError, match="gap"):
        plan_catchup(0, 3, [a for a in chain(3) if a.target_version != 2])
    with pytest.raises(BoardError, match="moved backwards"):
        plan_catchup(5, 3, chain(5))
    assert plan_catchup(3, 3, []).steps == ()


def test_artifacts_past_goal_are_ignored() -> None:
    arts = [*chain(6), art("span", 2, 6, 1)]
    assert edges(plan_catchup(2, 4, arts).steps) == [("patch", 2, 3), ("patch", 3, 4)]


def brute_force(start: int | None, goal: int, arts: list[Manifest]) -> int | None:
    """Cheapest cost by trying every sequence of at most 6 artifacts."""
    best: int | None = None
    for n in range(1, 7):
        for seq in itertools.product(arts, repeat=n):
            pos, cost = start, 0
            ok = True
            for m in seq:
                if m.kind is not Kind.KEYFRAME and m.base_version != pos:
                    ok = False
                    break
                pos, cost = m.target_version, cost + m.total_size
            if ok and pos == goal and (best is None or cost < best):
                best = cost
    return best


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 50), min_size=4, max_size=4),
    spans=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4), st.integers(1, 120)), max_size=3),
    keyframes=st.lists(st.tuples(st.integers(0, 4), st.integers(20, 200)), max_size=2),
    start=st.one_of(st.none(), st.integers(0, 3)),
)
def test_plan_is_optimal(
    sizes: list[int],
    spans: list[tuple[int, int, int]],
    keyframes: list[tuple[int, int]],
    start: int | None,
) -> None:
    arts = [art("patch", v - 1, v, sizes[v - 1]) for v in range(1, 5)]
    arts += [art("span", a, b, s) for a, b, s in spans if a < b]
    arts += [art("keyframe", None, k, s) for k, s in keyframes]
    expected = brute_force(start, 4, arts) if start != 4 else 0
    try:
        plan = plan_catchup(start, 4, arts)
    except NotFoundError:
        assert expected is None
        return
    assert plan.total_bytes == expected
    pos = start
    for m in plan.steps:  # the plan is applicable in order
        assert m.kind is Kind.KEYFRAME or m.base_version == pos
        pos = m.target_version
    assert pos == 4


# -- cadence ---------------------------------------------------------------------------------------------


def test_keyframe_cadence() -> None:
    p = KeyframePolicy(chain_fraction=0.5, max_interval=10, min_interval=2)
    assert should_write_keyframe(chain_bytes=0, keyframe_bytes=None, versions_since=0, policy=p)
    assert not should_write_keyframe(chain_bytes=40, keyframe_bytes=100, versions_since=3, policy=p)
    assert should_write_keyframe(chain_bytes=50, keyframe_bytes=100, versions_since=3, policy=p)
    assert not should_write_keyframe(chain_bytes=500, keyframe_bytes=100, versions_since=1, policy=p)
    assert should_write_keyframe(chain_bytes=1, keyframe_bytes=100, versions_since=10, policy=p)
    with pytest.raises(ConfigError):
        KeyframePolicy(chain_fraction=0)
    with pytest.raises(ConfigError):
        KeyframePolicy(min_interval=5, max_interval=2)


def test_keyframe_cadence_bounds_catch_up_cost() -> None:
    """Simulate a run: with the policy, any catch-up costs at most (1 + fraction) keyframes + one patch."""
    kf, fraction = 1000, 0.5
    policy = KeyframePolicy(chain_fraction=fraction, max_interval=1000)
    sizes = [37, 120, 5, 300, 64, 64, 64, 250, 9, 180] * 5
    arts = [art("keyframe", None, 0, kf)]
    chain_bytes, since = 0, 0
    for v, s in enumerate(sizes, start=1):
        arts.append(art("patch", v - 1, v, s))
        chain_bytes, since = chain_bytes + s, since + 1
        due = should_write_keyframe(chain_bytes=chain_bytes, keyframe_bytes=kf, versions_since=since, policy=policy)
        if due:
            arts.append(art("keyframe", None, v, kf))
            chain_bytes, since = 0, 0
    head = len(sizes)
    worst = max(plan_catchup(s, head, arts).total_bytes for s in [None, *range(head)])
    assert worst <= (1 + fraction) * kf + max(sizes)


def test_spans_to_publish_is_aligned_power_of_two() -> None:
    assert spans_to_publish(1) == []
    assert spans_to_publish(2) == [(0, 2)]
    assert spans_to_publish(8) == [(6, 8), (4, 8), (0, 8)]
    assert spans_to_publish(12) == [(10, 12), (8, 12)]
    assert spans_to_publish(13, origin=5) == [(11, 13), (9, 13), (5, 13)]
    assert spans_to_publish(64, policy=SpanPolicy(min_level=2, max_level=3)) == [(60, 64), (56, 64)]
    with pytest.raises(ConfigError):
        SpanPolicy(min_level=0)


@pytest.mark.parametrize("n", [16, 100])
def test_spans_give_logarithmic_catch_up(n: int) -> None:
    """With every span the policy asks for (unit patch sizes, spans a bit cheaper), any catch-up from a to
    HEAD takes O(log n) downloads."""
    arts = chain(n, size=10)
    for v in range(1, n + 1):
        arts += [art("span", a, b, 9) for a, b in spans_to_publish(v, policy=SpanPolicy(max_level=10))]
    for start in range(n):
        plan = plan_catchup(start, n, arts)
        assert plan.downloads <= 2 * (n - start).bit_length() + 1, (start, plan.describe())
