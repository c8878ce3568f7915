"""``flipsync bench ray``: how fast a Ray fleet grows and heals (docs/integrations/ray.md#measured).

A local Ray cluster of three nodes on this machine (``ray.cluster_utils.Cluster``: two with the custom
resource ``region:us-east``, one ``region:eu-west``), a board with v0 of the ``tiny`` preset, and a `RayPool`
of torch-engine replicas (``flipsync sidecar --engine torch --model tiny``, one torch thread each). Measured:

1. **scale to rotation**: from `RayPool.scale_to` to the new replica's first ready member record (what a
   gateway routes by), one replica at a time (the first one apart: it also starts Ray's first worker);
2. **node loss**: a node holding a replica is removed; the seconds until its record leaves the fleet (the TTL)
   and until Ray placed its replacement on the other us-east node and that one is in rotation.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from flipsync.errors import ConfigError
from flipsync.fleet.ray_pool import RayPool, ReplicaSpec, import_ray
from flipsync_apps.bench.gateway import publish_tiny

OBJECT_STORE = 80 * 2**20
EAST, WEST = "region:us-east", "region:eu-west"


def run(console: Console, quick: bool = False) -> dict[str, Any]:
    """Run the Ray fleet benchmark; print a table and return the numbers."""
    # The local cluster on loopback (Ray otherwise advertises this machine's interface address): read by Ray
    # when first imported, inherited by every process the cluster starts.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = import_ray()
    try:
        from ray.cluster_utils import Cluster
    except ImportError as e:  # pragma: no cover - a Ray without its test utilities
        raise ConfigError(f"this Ray has no ray.cluster_utils ({e}): pip install 'ray>=2.41'") from None
    joins = 2 if quick else 4
    results: dict[str, Any] = {"quick": quick}
    with console.status("Ray fleet bench: a 3-node local cluster") as status, tempfile.TemporaryDirectory() as tmp:
        board = str(Path(tmp) / "board")
        publish_tiny(board)
        node = {"num_cpus": 4, "object_store_memory": OBJECT_STORE}
        t0 = time.monotonic()
        head = {**node, "include_dashboard": False, "resources": {EAST: 4}}
        cluster = Cluster(initialize_head=True, connect=True, head_node_args=head)
        pool: RayPool | None = None
        try:
            b = cluster.add_node(**node, resources={EAST: 4})
            cluster.add_node(**node, resources={WEST: 4})
            cluster.wait_for_nodes()
            results["cluster_up_s"] = round(time.monotonic() - t0, 2)
            ttl = 3.0
            spec = ReplicaSpec(
                board=board, run="bench", resources={EAST: 1}, num_cpus=0.5, threads=1, heartbeat_s=0.5,
                member_ttl_s=ttl, poll_s=0.2, exit_timeout_s=10.0,
            )  # fmt: skip
            pool = RayPool(spec, name="bench")
            scale_s = []
            for n in range(1, joins + 1):
                status.update(f"Ray fleet bench: scale to {n}")
                result = pool.scale_to(n)
                scale_s.extend(result.to_rotation_s.values())
            results["first_replica_s"] = round(scale_s[0], 2)
            results["scale_to_rotation_s"] = [round(s, 2) for s in scale_s[1:]]
            results["scale_to_rotation_median_s"] = round(statistics.median(scale_s[1:]), 2)
            on_b = {str(r.info["replica"]) for r in pool.replicas() if r.info and r.info["node_id"] == b.node_id}
            status.update(f"Ray fleet bench: removing a node with {len(on_b)} replica(s)")
            t_loss = time.monotonic()
            cluster.remove_node(b)
            gone = replaced = None
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and replaced is None:
                live = {r.replica for r in pool.discover_replicas().members}
                if gone is None and not on_b & live:
                    gone = time.monotonic() - t_loss
                infos = [r.info for r in pool.replicas(timeout_s=2)]
                if (
                    gone is not None
                    and all(i is not None and i["node_id"] != b.node_id for i in infos)
                    and {str(i["replica"]) for i in infos if i} <= pool.ready_ids()
                ):
                    replaced = time.monotonic() - t_loss
                time.sleep(0.2)
            results["node_loss"] = {
                "replicas_lost": len(on_b),
                "left_view_s": None if gone is None else round(gone, 2),
                "replaced_in_rotation_s": None if replaced is None else round(replaced, 2),
                "member_ttl_s": ttl,
            }
        finally:
            if pool is not None:
                pool.down()
                pool.close()
            ray.shutdown()
            cluster.shutdown()
    t = Table(title="Ray fleet: torch-engine replicas (tiny) on a 3-node local cluster")
    t.add_column("measure")
    t.add_column("seconds", justify="right")
    t.add_row("cluster up (3 nodes)", f"{results['cluster_up_s']:.1f}")
    t.add_row("first replica: scale -> in rotation", f"{results['first_replica_s']:.1f}")
    each = ", ".join(f"{s:.1f}" for s in results["scale_to_rotation_s"])
    t.add_row("next replicas: scale -> in rotation (median)", f"{results['scale_to_rotation_median_s']:.1f} ({each})")
    loss = results["node_loss"]
    t.add_row(f"node lost ({loss['replicas_lost']} replica(s)): out of the fleet's view", str(loss["left_view_s"]))
    t.add_row("node lost: replaced and in rotation", str(loss["replaced_in_rotation_s"]))
    console.print(t)
    return results
