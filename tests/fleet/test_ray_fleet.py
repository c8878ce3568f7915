"""A flipsync fleet on a Ray cluster (``flipsync.fleet.ray_pool``): a local cluster of three nodes on this
machine (``ray.cluster_utils.Cluster``), two in region us-east and one in eu-west (custom resources), torch-engine
replicas (``flipsync sidecar --engine torch --model tiny`` processes, each supervised by a Ray actor) of two
fleets on one board, behind one ``flipsync gateway`` that runs on the cluster too.

- scale 1 -> 2 -> 1 (and, marked slow, 2 -> 4 -> 1 beside an eu-west fleet) under light load through the
  gateway: every request answered 200 (added replicas enter rotation once caught up, removed ones drain
  first), each replica on a node of its region;
- a sidecar that crashes is restarted by its actor (same id and address, a new life of its record);
- a node removed under load: its replicas leave the gateway's view within the record TTL and Ray places them
  again on the node left with room, and no request fails (the gateway retries the broken ones).

Sizes are kept for two shared cores: nodes of a few logical CPUs and 80 MB object stores, no dashboard, one
torch thread per replica, a heartbeat of 0.5 s and a TTL of 3 s. Every wait is a poll with a generous deadline.
The seconds from ``scale`` to in rotation and from the node's loss to its replacements are printed (``-s``).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'ray>=2.41' (the flipsync[ray] extra)")
from ray.cluster_utils import Cluster  # noqa: E402 - after the skip

from flipsync.cli.main import app  # noqa: E402
from flipsync.fleet.ray_pool import RayPool, ReplicaSpec  # noqa: E402
from flipsync.stores import open_store  # noqa: E402
from tests.sidecar.sidecar_helpers import FAST, Trainer, wait_until  # noqa: E402

# One xdist worker runs them all, in order, on one cluster (`pytest -n 2 --dist loadgroup`); each test still sets
# up what it needs itself (`start`), so any one of them runs alone too.
pytestmark = pytest.mark.xdist_group("ray")

OBJECT_STORE = 80 * 2**20
BEAT_S, TTL_S, REFRESH_S = 0.5, 3.0, 0.2
EAST, WEST = "region:us-east", "region:eu-west"
HEAD = "node:__internal_head__"  # the resource Ray gives the head node only


@dataclass
class RayFleet:
    cluster: Cluster
    nodes: dict[str, Any]  # "a" (head, us-east), "b" (us-east), "c" (eu-west)
    board: str
    trainer: Trainer
    us: RayPool
    eu: RayPool
    gateway: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    def members(self) -> list[dict[str, Any]]:
        return httpx.get(f"{self.gateway}/flipsync/fleet", timeout=10).json()["members"]


def spec(board: str, region: str) -> ReplicaSpec:
    return ReplicaSpec(
        board=board,
        resources={region: 1},
        num_cpus=0.5,
        threads=1,
        heartbeat_s=BEAT_S,
        member_ttl_s=TTL_S,
        poll_s=0.5,
        exit_timeout_s=20.0,
    )


@pytest.fixture(scope="session")  # not per module: a worker interleaves other modules between these tests
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayFleet]:
    board = str(tmp_path_factory.mktemp("ray") / "board")
    store = open_store(board, FAST)
    trainer = Trainer(store)
    trainer.step()
    node = {"num_cpus": 4, "object_store_memory": OBJECT_STORE}
    cluster = Cluster(
        initialize_head=True,
        connect=True,
        head_node_args={**node, "include_dashboard": False, "resources": {EAST: 4}},
    )
    pools: list[RayPool] = []
    try:
        nodes = {
            "a": cluster.head_node,
            "b": cluster.add_node(**node, resources={EAST: 4}),
            "c": cluster.add_node(**node, resources={WEST: 4}),
        }
        cluster.wait_for_nodes()
        us = RayPool(spec(board, EAST), name="us")
        eu = RayPool(spec(board, WEST), name="eu")
        pools += [us, eu]
        yield RayFleet(cluster, nodes, board, trainer, us, eu)
    finally:
        for pool in pools:
            try:
                pool.down()
            finally:
                pool.close()
        ray.shutdown()
        cluster.shutdown()
        store.close()


class Load:
    """Light load through the gateway: two clients, one short completion after another, every answer kept."""

    def __init__(self, url: str, clients: int = 2) -> None:
        self.url = url
        self.stop = threading.Event()
        self.answers: list[tuple[int, str, str]] = []  # status, replica, body head
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def _client(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                try:
                    # prompts open differently: one opening is one GRPO group, which the gateway keeps on one replica
                    body = {"prompt": f"{len(self.answers)} {threading.get_ident()} hi", "max_tokens": 2}
                    r = client.post(f"{self.url}/v1/completions", json=body)
                    self.answers.append((r.status_code, r.headers.get("x-flipsync-replica", ""), r.text[:200]))
                except httpx.HTTPError as e:
                    self.answers.append((0, "", repr(e)))
                self.stop.wait(0.05)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(150)

    def failed(self) -> list[tuple[int, str, str]]:
        # a 409 is justified only for a version constraint no replica holds; this load sends none
        return [a for a in self.answers if a[0] != 200]

    def served_by(self) -> Counter[str]:
        return Counter(a[1] for a in self.answers if a[0] == 200)


def node_of(pool: RayPool) -> dict[str, str]:
    """Replica id -> the Ray node id its actor runs on."""
    return {str(r.info["replica"]): str(r.info["node_id"]) for r in pool.replicas() if r.info is not None}


def start(fleet: RayFleet, us: int, *, eu: bool = False) -> dict[str, Any]:
    """``us`` us-east replicas (and with ``eu`` one eu-west replica), and the gateway on the cluster."""
    figures: dict[str, Any] = {}
    if eu and not fleet.eu.slots():
        figures["eu_first_s"] = rounded(fleet.eu.scale_to(1).to_rotation_s)
    figures["us_first_s"] = rounded(fleet.us.scale_to(us).to_rotation_s)
    if not fleet.gateway:
        # on the head node: the node-loss test removes another, and a gateway that moves drops the clients' requests
        fleet.gateway = fleet.us.start_gateway(
            port=0, args=["--refresh", str(REFRESH_S), "--hold", "30"], num_cpus=0, resources={HEAD: 0.01}
        )
    health = f"{fleet.gateway}/flipsync/health"  # 200 once it routes to a ready replica
    assert wait_until(lambda: httpx.get(health, timeout=10).status_code == 200, timeout=120, interval=0.2)
    return figures


def rounded(d: Any) -> dict[int, float]:
    return {k: round(v, 2) for k, v in d.items()}


def scale_under_load(fleet: RayFleet, sizes: tuple[int, int, int], *, eu: bool) -> dict[str, Any]:
    """us-east from sizes[0] to sizes[1] to sizes[2] replicas under load through the gateway: nothing fails."""
    first, peak, last = sizes
    figures = start(fleet, first, eu=eu)
    others = len(fleet.eu.slots())
    east = {fleet.nodes["a"].node_id, fleet.nodes["b"].node_id}
    with Load(fleet.gateway) as load:
        assert wait_until(lambda: len(load.answers) >= 5, timeout=60, interval=0.1)
        fleet.trainer.step()  # a new version while serving: everyone catches up, newcomers from the board
        up = fleet.us.scale_to(peak)
        assert len(up.added) == peak - first and set(up.to_rotation_s) == set(up.added)
        placed = node_of(fleet.us)
        assert len(placed) == peak and set(placed.values()) <= east, placed  # us-east replicas on us-east nodes
        assert set(node_of(fleet.eu).values()) <= {fleet.nodes["c"].node_id}  # eu-west: node c only
        for r in fleet.us.replicas():  # each one serves (the gateway's ranking decides which one gets what)
            assert r.info is not None
            answer = httpx.post(f"{r.info['url']}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
            assert answer.status_code == 200, answer.text
        assert wait_until(lambda: len(fleet.members()) == peak + others, timeout=30, interval=0.2)
        n_before_down = len(load.answers)
        down = fleet.us.scale_to(last)
        assert len(down.removed) == peak - last
        # the drained replicas' records are deleted as they leave: the gateway sees the rest at once
        assert wait_until(lambda: len(fleet.members()) == last + others, timeout=30, interval=0.2)
        assert wait_until(lambda: len(load.answers) >= n_before_down + 10, timeout=60, interval=0.1)
    figures |= {
        "us_added_under_load_s": rounded(up.to_rotation_s),
        "drain_s": round(down.took_s, 2),
        "requests": len(load.answers),
        "served_by": dict(load.served_by()),
    }
    print(f"\nray fleet scale {first} -> {peak} -> {last}: {figures}")
    assert load.answers and not load.failed(), load.failed()[:5]
    assert len(load.served_by()) >= 2, load.served_by()
    assert len(fleet.us.slots()) == last
    return figures


@pytest.mark.slow  # the smaller walk of the same path, for a quick look
def test_scale_1_2_1_under_load_through_the_gateway(fleet: RayFleet) -> None:
    fleet.figures["scale_1_2_1"] = scale_under_load(fleet, (1, 2, 1), eu=False)


def test_scale_2_4_1_under_load_through_the_gateway(fleet: RayFleet) -> None:
    fleet.figures["scale_2_4_1"] = scale_under_load(fleet, (2, 4, 1), eu=True)  # and one eu-west replica


def test_a_crashed_sidecar_is_restarted_by_its_actor(fleet: RayFleet) -> None:
    start(fleet, 1)
    [replica] = [r for r in fleet.us.replicas() if r.record is not None]
    assert replica.record is not None and replica.info is not None
    # its kernels were compiled or loaded before its first pass (sidecar.warmup), and the CLI sees the fleet
    st = httpx.get(f"{replica.info['url']}/flipsync/status", timeout=30).json()
    assert isinstance(st["warmup_s"], float), st
    shown = CliRunner().invoke(app, ["fleet", "status", "--name", "us", "--json"])
    assert shown.exit_code == 0, shown.output
    [row] = json.loads(shown.output)["replicas"]
    assert row["actor"]["replica"] == replica.info["replica"] and row["record"]["ready"], row
    rid, life = str(replica.info["replica"]), replica.record["started"]
    handle = ray.get_actor(f"us/replica-{replica.slot}", namespace=fleet.us.namespace)
    ray.get(handle.kill_process.remote())  # SIGKILL: the record stays until a new life rewrites it

    def back() -> bool:
        info = ray.get(handle.info.remote())
        records = {r.replica: r for r in fleet.us.discover_replicas().ready(2)}
        return info["restarts"] >= 1 and info["alive"] and rid in records and records[rid].started != life

    assert wait_until(back, timeout=90, interval=0.2)  # same actor, id and address: a new life of its record


def test_a_lost_node_is_replaced_and_no_request_fails(fleet: RayFleet) -> None:
    start(fleet, 2)  # SPREAD: most likely one on each us-east node; one more if not
    b = fleet.nodes["b"].node_id
    n = 2
    while not (on_b := {rid for rid, node in node_of(fleet.us).items() if node == b}) and n < 4:
        n += 1
        fleet.us.scale_to(n)
    assert on_b, "SPREAD placed no replica on node b"
    with Load(fleet.gateway) as load:
        assert wait_until(lambda: len(load.answers) >= 5, timeout=60, interval=0.1)
        t0 = time.monotonic()
        fleet.cluster.remove_node(fleet.nodes["b"])
        # their records stop being rewritten and expire: gone from the gateway's view within the TTL (+ refresh)
        assert wait_until(lambda: not on_b & {m["replica"] for m in fleet.members()}, timeout=60, interval=0.1)
        gone_s = time.monotonic() - t0

        seen: dict[str, Any] = {}

        def replaced() -> bool:
            seen["placed"] = placed = node_of(fleet.us)
            seen["ready"] = ready = fleet.us.ready_ids()
            return len(placed) == n and b not in placed.values() and set(placed) <= ready

        assert wait_until(replaced, timeout=150, interval=0.2), (seen, b, [fleet.us.logs(s, 5) for s in range(n)])
        replaced_s = time.monotonic() - t0
        n = len(load.answers)
        assert wait_until(lambda: len(load.answers) >= n + 5, timeout=60, interval=0.1)
    assert gone_s <= TTL_S + 5.0, gone_s  # TTL, one refresh, and a loaded machine's slack
    assert set(node_of(fleet.us).values()) == {fleet.nodes["a"].node_id}  # the node left with us-east room
    assert load.answers and not load.failed(), load.failed()[:5]
    fleet.figures["node_loss"] = {"left_view_s": round(gone_s, 2), "replaced_s": round(replaced_s, 2)}
    print(f"\nray fleet node-loss figures: {fleet.figures['node_loss']} (replicas lost: {len(on_b)})")
