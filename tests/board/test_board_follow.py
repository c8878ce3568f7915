"""The one follow-and-replan loop (``board.follow.Follower``): what the replica relies on beyond the plain
catch-up that the publish and fault tests cover. An artifact whose content ``apply`` finds unusable stays
excluded across passes until the position is past it; ``Replan`` from ``apply`` plans again from the new
position; hooks see every move and every download."""

from __future__ import annotations

import pytest
from board_helpers import Recorder, build_run, fp, small_view

from flipsync.board.follow import Follower, Replan
from flipsync.board.reader import BoardReader, Step
from flipsync.domain.manifest import Manifest
from flipsync.errors import UnusableArtifactError
from flipsync.stores import ObstoreStore


def test_an_unusable_patch_stays_excluded_across_passes_until_a_way_past_it(store: ObstoreStore) -> None:
    pub = build_run(store, 3)
    tried: list[tuple[str, int | None, int]] = []

    def refuse_v2_patch(step: Step) -> None:
        tried.append(step.manifest.edge)
        if step.manifest.edge == ("patch", 1, 2):
            raise UnusableArtifactError("v1->v2 does not decode", edge=step.manifest.edge, kind="corrupt_patch")

    f = Follower(BoardReader(store, "run"), version=0, view_fp=fp(0), max_replans=1)
    with pytest.raises(UnusableArtifactError, match="no other way to v3"):
        f.sync(refuse_v2_patch)
    assert f.version == 1 and set(f.excluded) == {("patch", 1, 2)}
    tried.clear()
    with pytest.raises(UnusableArtifactError, match="no other way to v3"):
        f.sync(refuse_v2_patch)  # the next pass does not download it again
    assert tried == []
    pub.publish_keyframe(small_view(3), version=3, view_fp=fp(3), served_format="bf16")
    rec = Recorder()
    assert f.sync(rec) == 3  # a keyframe past it: followed, and the exclusion is dropped with the move
    assert rec.edges == [("keyframe", None, 3)] and f.excluded == {}


def test_replan_from_apply_plans_again_from_the_new_position(store: ObstoreStore) -> None:
    build_run(store, 3, keyframes=(3,))
    seen: list[tuple[str, int | None, int]] = []
    f = Follower(BoardReader(store, "run"), version=1, view_fp=fp(1))

    def lose_the_version_once(step: Step) -> None:
        seen.append(step.manifest.edge)
        if len(seen) == 1:
            f.move_to(None, None)  # e.g. the engine's weights changed under the replica
            raise Replan()

    assert f.sync(lose_the_version_once) == 3
    assert seen[0] == ("patch", 1, 2) and seen[1:] == [("keyframe", None, 3)]


def test_hooks_see_every_download_and_every_move(store: ObstoreStore) -> None:
    build_run(store, 2)
    moves: list[int | None] = []
    fetched: list[tuple[int, float]] = []

    def on_fetch(m: Manifest, wait_s: float) -> None:
        fetched.append((m.version, wait_s))

    f = Follower(
        BoardReader(store, "run"), version=0, view_fp=fp(0), on_move=lambda v, _fp: moves.append(v), on_fetch=on_fetch
    )
    assert f.sync(Recorder()) == 2
    assert moves == [1, 2] and [v for v, _ in fetched] == [1, 2] and all(w >= 0 for _, w in fetched)
    f.move_to(None, None)
    assert moves[-1] is None and f.version is None and f.view_fp is None
