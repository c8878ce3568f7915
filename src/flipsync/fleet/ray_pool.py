"""`RayPool`: a fleet whose replicas Ray places, scales and replaces (docs/integrations/ray.md).

A replica is one engine and its sidecar: a ``flipsync sidecar`` process (the torch engine in process, or a
sidecar in front of an engine the command names) started and supervised by a detached Ray actor
(``ray_supervisor.ProcessSupervisor``) with the resources the replica needs: CPUs, GPUs, and custom resources
that name regions or providers (``{"region:us-east": 1}``). The actors are named ``FLEET/replica-N`` in a
Ray namespace, so any process attached to the cluster (``flipsync fleet scale``) finds the fleet; nothing
else is kept. Ray restarts an actor whose node died on a node with room (``max_restarts=-1``), and the actor
starts a new sidecar there; `RayPool.reconcile` recreates an actor Ray gave up on.

Replicas are still *found* through their member records on the board: discovery is the `BoardPool`'s, so a
gateway routes the same whether Ray, a person or another scheduler started a replica. Ray is imported only
when a `RayPool` is used (``pip install 'flipsync[ray]'`` or ``pip install 'ray>=2.41'``).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from flipsync.board.signing import Verifier
from flipsync.errors import ConfigError, FlipsyncError
from flipsync.fleet.pool import BoardPool, FleetSnapshot, Pool
from flipsync.fleet.ray_supervisor import ProcessSupervisor
from flipsync.stores import StoreOptions, open_store

log = logging.getLogger(__name__)

NAMESPACE = "flipsync"
INSTALL_HINT = "pip install 'ray>=2.41' (or the flipsync[ray] extra)"
SCHEDULING = ("SPREAD", "DEFAULT")


def import_ray() -> Any:
    """The ``ray`` module, or a ConfigError that says how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"a Ray fleet needs Ray, which is not installed here ({e}): {INSTALL_HINT}") from None
    return ray


@dataclass(frozen=True)
class ReplicaSpec:
    """What one replica of a Ray fleet is: the ``flipsync sidecar`` it runs and the resources it takes.

    ``resources``: Ray custom resources, e.g. ``{"region:us-east": 1}`` (nodes started with ``ray start
    --resources '{"region:us-east": 8}'``). ``scheduling``: ``SPREAD`` (replicas on different nodes first, so a
    lost node takes few) or ``DEFAULT``; a placement group goes through `RayPool`'s ``scheduling_strategy``.
    ``sidecar_args``: more ``flipsync sidecar`` options (``--upstream URL --engine vllm``, ``--member-key K``).
    ``island``: the record's island (default: the first custom resource's value, ``us-east``, else ``ray``).
    """

    board: str
    run: str | None = None
    engine: str = "torch"
    model: str = "tiny"
    island: str | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict)
    scheduling: str = "SPREAD"
    heartbeat_s: float = 5.0
    member_ttl_s: float = 15.0
    exit_timeout_s: float = 30.0
    poll_s: float = 1.0
    threads: int | None = None
    sidecar_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    max_process_restarts: int = 10
    python: str | None = None  # the interpreter on the nodes (default: the actor's own)

    def __post_init__(self) -> None:
        if self.scheduling not in SCHEDULING:
            raise ConfigError(f"scheduling must be one of {', '.join(SCHEDULING)}, not {self.scheduling!r}")
        if self.num_cpus < 0 or self.num_gpus < 0 or any(v < 0 for v in self.resources.values()):
            raise ConfigError("num_cpus, num_gpus and every resource amount must be >= 0")
        if not 0 < self.heartbeat_s < self.member_ttl_s:
            raise ConfigError(
                f"heartbeat ({self.heartbeat_s:g} s) must be positive and below the member TTL "
                f"({self.member_ttl_s:g} s)"
            )

    def island_name(self) -> str:
        if self.island:
            return self.island
        for key in self.resources:
            if ":" in key:  # region:us-east -> us-east
                return key.split(":", 1)[1].replace(":", "-") or "ray"
        return "ray"

    def sidecar_argv(self) -> list[str]:
        """The command each replica's actor runs; ``{port}``, ``{url}``, ``{replica_id}`` filled in there."""
        argv = [
            *("sidecar", "--board", self.board, "--engine", self.engine, "--model", self.model),
            *("--listen", "0.0.0.0:{port}", "--public-url", "{url}", "--replica-id", "{replica_id}"),
            *("--island", self.island_name(), "--heartbeat", f"{self.heartbeat_s:g}"),
            *("--member-ttl", f"{self.member_ttl_s:g}", "--exit-timeout", f"{self.exit_timeout_s:g}"),
            *("--poll", f"{self.poll_s:g}"),
        ]
        if self.run:
            argv += ["--run", self.run]
        threads = self.threads if self.threads is not None else max(1, int(self.num_cpus))
        if self.engine == "torch":
            argv += ["--threads", str(threads)]
        return [*argv, *self.sidecar_args]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ReplicaSpec:
        d = json.loads(text)
        d["sidecar_args"] = tuple(d.get("sidecar_args") or ())
        return cls(**d)


@dataclass(frozen=True)
class RayReplica:
    """One slot of the fleet as Ray sees it, and its member record as the board sees it (None: not live)."""

    slot: int
    info: Mapping[str, Any] | None  # the actor's answer (None: dead, restarting or unreachable)
    record: Mapping[str, Any] | None = None

    @property
    def replica_id(self) -> str | None:
        return None if self.info is None else str(self.info["replica"])


@dataclass(frozen=True)
class ScaleResult:
    """What a `RayPool.scale_to` did: the slots added and removed, and for each added replica the seconds from
    the call to its first ready record (in rotation for unconstrained requests)."""

    added: tuple[int, ...]
    removed: tuple[int, ...]
    to_rotation_s: Mapping[int, float]
    took_s: float


class RayPool(Pool):
    """A fleet of replicas on a Ray cluster; see the module doc.

    ``spec``: what a replica is (None: attach to a running fleet and take the spec its replicas were started
    with). ``name``: the fleet (several may share a cluster and a board: one per region, model or format).
    ``address``: the cluster (``auto``, ``ray://HOST:10001``, ``HOST:6379``; None: the one this process is
    connected to, or ``auto``). ``max_lag``: what "in rotation" means, as the gateway's ``--max-lag``.
    """

    def __init__(
        self,
        spec: ReplicaSpec | None = None,
        *,
        name: str = "flipsync",
        address: str | None = None,
        namespace: str = NAMESPACE,
        scheduling_strategy: Any = None,
        store_options: StoreOptions | None = None,
        member_verifier: Verifier | None = None,
        verifier: Verifier | None = None,
        max_lag: int = 2,
        actor_max_restarts: int = -1,
    ) -> None:
        self.ray = import_ray()
        if not name or "/" in name:
            raise ConfigError(f"a fleet name must be non-empty without '/', not {name!r}")
        self.name = name
        self.namespace = namespace
        self.max_lag = max_lag
        self.actor_max_restarts = actor_max_restarts
        self.scheduling_strategy = scheduling_strategy
        if not self.ray.is_initialized():
            self.ray.init(address=address or "auto", namespace=namespace, log_to_driver=False)
        if spec is None:
            spec = self._spec_of_running_fleet()
        self.spec = spec
        self._board = BoardPool(
            open_store(spec.board, store_options),
            runs=(spec.run,) if spec.run else None,
            member_verifier=member_verifier,
            verifier=verifier,
        )

    # -- the Pool port -----------------------------------------------------------------------------------------

    def discover_replicas(self) -> FleetSnapshot:
        """The board's member records (one source of truth: whatever started a replica, it is found so)."""
        return self._board.discover_replicas()

    def gateway_url(self) -> str | None:
        handle = self._actor(self._gateway_name())
        if handle is None:
            return None
        try:
            return str(self.ray.get(handle.info.remote(), timeout=10)["url"])
        except Exception:  # a gateway actor restarting on another node: no URL right now
            return None

    def scale(self, min_replicas: int, max_replicas: int) -> None:
        """Keep the replica count within ``[min_replicas, max_replicas]`` (the Pool port): add or drain replicas
        to the nearest bound; waits until added replicas are in rotation."""
        if not 0 <= min_replicas <= max_replicas:
            raise ConfigError(f"need 0 <= min_replicas <= max_replicas, got {min_replicas}, {max_replicas}")
        n = len(self.slots())
        self.scale_to(min(max(n, min_replicas), max_replicas))

    def close(self) -> None:
        self._board.close()

    # -- the fleet on Ray ---------------------------------------------------------------------------------------

    def _replica_name(self, slot: int) -> str:
        return f"{self.name}/replica-{slot}"

    def _gateway_name(self) -> str:
        return f"{self.name}/gateway"

    def _actor(self, actor_name: str) -> Any:
        try:
            return self.ray.get_actor(actor_name, namespace=self.namespace)
        except ValueError:
            return None

    def slots(self) -> list[int]:
        """The fleet's replica slots that have an actor (alive, restarting or dead but not yet removed)."""
        prefix = f"{self.name}/replica-"
        out = []
        for entry in self.ray.util.list_named_actors(all_namespaces=True):
            actor_name = str(entry["name"])
            index = actor_name.removeprefix(prefix)
            if entry.get("namespace") == self.namespace and actor_name.startswith(prefix) and index.isdigit():
                out.append(int(index))
        return sorted(out)

    def _spec_of_running_fleet(self) -> ReplicaSpec:
        for slot in self.slots():
            handle = self._actor(self._replica_name(slot))
            if handle is not None:
                try:
                    return ReplicaSpec.from_json(self.ray.get(handle.spec.remote(), timeout=30))
                except Exception as e:  # a dead one: try the next
                    log.debug("slot %d did not give its spec: %s", slot, e)
        raise ConfigError(
            f"fleet {self.name!r} has no running replica on this Ray cluster to read its settings from: start it "
            "with `flipsync fleet up` (or RayPool(ReplicaSpec(...)))"
        )

    def _options(self, actor_name: str, *, cpus: float, gpus: float, resources: Mapping[str, float]) -> dict:
        strategy = self.scheduling_strategy or self.spec.scheduling
        return {
            "name": actor_name,
            "namespace": self.namespace,
            "lifetime": "detached",  # outlives the `flipsync fleet up` that placed it
            "max_restarts": self.actor_max_restarts,  # a lost node: Ray places it again where there is room
            "max_concurrency": 4,  # stop() may wait on a drain while info() is asked
            "num_cpus": cpus,
            "num_gpus": gpus,
            "resources": dict(resources),
            "scheduling_strategy": strategy,
        }

    def _python(self) -> str:
        return self.spec.python or sys.executable

    def _start_replica(self, slot: int) -> Any:
        spec = self.spec
        actor = self.ray.remote(_ReplicaActor).options(
            **self._options(self._replica_name(slot), cpus=spec.num_cpus, gpus=spec.num_gpus, resources=spec.resources)
        )
        # the command's own module, not the whole `flipsync` CLI (whose codec and trainer commands import torch)
        argv = [self._python(), "-m", "flipsync.cli.sidecar", *spec.sidecar_argv()]
        return actor.remote(
            spec.to_json(),
            argv,
            name=f"{self.name}-{slot}",
            env=dict(spec.env),
            max_restarts=spec.max_process_restarts,
        )

    def replicas(self, *, timeout_s: float = 10.0) -> list[RayReplica]:
        """Every slot: its actor's info (None: dead, restarting, unreachable) and its live member record."""
        slots = self.slots()
        snapshot = self.discover_replicas()
        records = {r.replica: r for r in snapshot.members}
        snapshot_ready = {r.replica for r in snapshot.ready(self.max_lag)}
        infos = self._infos(slots, timeout_s)
        out = []
        for slot in slots:
            info = infos.get(slot)
            record = records.get(str(info["replica"])) if info else None
            rec = None
            if record is not None:
                rec = {**record.to_dict(with_signature=False), "ready": record.replica in snapshot_ready}
            out.append(RayReplica(slot, info, rec))
        return out

    def _infos(self, slots: Sequence[int], timeout_s: float) -> dict[int, dict[str, Any]]:
        refs = {}
        for slot in slots:
            handle = self._actor(self._replica_name(slot))
            if handle is not None:
                refs[slot] = handle.info.remote()
        out: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        for slot, ref in refs.items():
            try:
                out[slot] = self.ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except Exception as e:  # dead or restarting: reported as no info
                log.debug("slot %d: no info (%s)", slot, type(e).__name__)
        return out

    def ready_ids(self) -> set[str]:
        """The replica ids in rotation now (ready records: live, serving, within max_lag of HEAD)."""
        return {r.replica for r in self.discover_replicas().ready(self.max_lag)}

    def scale_to(
        self,
        n: int,
        *,
        wait: bool = True,
        timeout_s: float = 300.0,
        progress: Callable[[str], None] | None = None,
    ) -> ScaleResult:
        """Make the fleet ``n`` replicas. New ones take the lowest free slots and count once in rotation (with
        ``wait``: this returns when all are, with the seconds each took); the highest slots leave, drained first
        (SIGTERM: new requests refused so gateways go elsewhere, requests in flight finish, record deleted)."""
        if n < 0:
            raise ConfigError(f"a fleet cannot have {n} replicas")
        t0 = time.monotonic()
        say = progress or (lambda _msg: None)
        slots = self.slots()
        added: list[int] = []
        removed: list[int] = []
        if len(slots) < n:
            free = (s for s in range(n + len(slots)) if s not in slots)
            added = [next(free) for _ in range(n - len(slots))]
            for slot in added:
                self._start_replica(slot)
            say(f"placing {len(added)} replica(s): slots {', '.join(map(str, added))}")
        elif len(slots) > n:
            removed = slots[n:]
            say(f"draining {len(removed)} replica(s): slots {', '.join(map(str, removed))}")
            self._remove(removed)
        to_rotation: dict[int, float] = {}
        if added and wait:
            to_rotation = self.wait_in_rotation(added, timeout_s=timeout_s, t0=t0, progress=say)
        return ScaleResult(tuple(added), tuple(removed), to_rotation, time.monotonic() - t0)

    def wait_in_rotation(
        self,
        slots: Sequence[int],
        *,
        timeout_s: float = 300.0,
        t0: float | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> dict[int, float]:
        """Wait until each slot's current replica is in rotation; the seconds from ``t0`` (default now) to each."""
        start = time.monotonic() if t0 is None else t0
        deadline = time.monotonic() + timeout_s
        done: dict[int, float] = {}
        while len(done) < len(slots):
            pending = [s for s in slots if s not in done]
            infos = self._infos(pending, timeout_s=5.0)
            ready = self.ready_ids()
            for slot, info in infos.items():
                if info["replica"] in ready:
                    done[slot] = time.monotonic() - start
                    if progress is not None:
                        progress(f"slot {slot} ({info['replica']}) in rotation after {done[slot]:.1f} s")
                elif info.get("gave_up"):
                    raise FlipsyncError(
                        f"replica slot {slot} ({info['replica']}) stopped restarting its sidecar; its log ends:\n"
                        + self.logs(slot)
                    )
            if len(done) == len(slots):
                break
            if time.monotonic() > deadline:
                tails = "\n".join(f"-- slot {s}:\n{self.logs(s, 15)}" for s in pending)
                raise FlipsyncError(
                    f"replica slot(s) {pending} not in rotation after {timeout_s:g} s (are there nodes with the "
                    f"resources {dict(self.spec.resources)} and {self.spec.num_cpus:g} CPU free? `ray status` "
                    f"says); their logs end:\n{tails}"
                )
            time.sleep(0.2)
        return done

    def logs(self, slot: int, lines: int = 40) -> str:
        """The last lines a slot's sidecar wrote ('' when its actor cannot answer)."""
        handle = self._actor(self._replica_name(slot))
        if handle is None:
            return ""
        try:
            return str(self.ray.get(handle.logs.remote(lines), timeout=10))
        except Exception:  # dead or restarting
            return ""

    def _remove(self, slots: Sequence[int]) -> None:
        """Drain ``slots`` together (each sidecar SIGTERMed, waited for), then end their actors."""
        handles = [(s, self._actor(self._replica_name(s))) for s in slots]
        refs = [(s, h, h.stop.remote(self.spec.exit_timeout_s)) for s, h in handles if h is not None]
        for slot, handle, ref in refs:
            try:
                code = self.ray.get(ref, timeout=self.spec.exit_timeout_s + 30)
                log.info("slot %d drained (exit %s)", slot, code)
            except Exception as e:  # a dead actor has nothing left to drain
                log.warning("slot %d could not drain (%s): ending it", slot, type(e).__name__)
            self.ray.kill(handle, no_restart=True)

    def reconcile(self, n: int | None = None) -> list[int]:
        """Recreate the slots whose actor Ray gave up on (dead for good) or whose sidecar stopped restarting, and
        with ``n`` also scale to it; the slots recreated. Ray itself replaces actors of lost nodes."""
        recreated = []
        for slot in self.slots():
            handle = self._actor(self._replica_name(slot))
            state = self._actor_state(handle)
            if state == "DEAD" or (state == "ALIVE" and self._gave_up(handle)):
                self.ray.kill(handle, no_restart=True)
                self._wait_name_free(self._replica_name(slot))
                self._start_replica(slot)
                recreated.append(slot)
        if n is not None:
            self.scale_to(n, wait=False)
        return recreated

    def _actor_state(self, handle: Any) -> str:
        # Asked of the actor itself (Ray's state API needs the dashboard, which ray[default] adds).
        try:
            self.ray.get(handle.info.remote(), timeout=10)
            return "ALIVE"
        except self.ray.exceptions.ActorDiedError:
            return "DEAD"
        except Exception:  # restarting (a lost node) or slow: Ray is on it
            return "UNKNOWN"

    def _gave_up(self, handle: Any) -> bool:
        try:
            return bool(self.ray.get(handle.info.remote(), timeout=10)["gave_up"])
        except Exception:
            return False

    def _wait_name_free(self, actor_name: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self._actor(actor_name) is not None and time.monotonic() < deadline:
            time.sleep(0.1)

    def supervise(self, n: int, stop: threading.Event, *, interval_s: float = 5.0) -> None:
        """Keep the fleet at ``n`` replicas until ``stop`` is set: every ``interval_s`` recreate dead slots and
        scale back to ``n`` (``flipsync fleet up --supervise``; Ray alone already replaces lost nodes' actors)."""
        while not stop.is_set():
            try:
                if recreated := self.reconcile(n):
                    log.warning("recreated replica slot(s) %s", recreated)
            except FlipsyncError as e:
                log.warning("reconcile failed (retried in %g s): %s", interval_s, e)
            stop.wait(interval_s)

    # -- the gateway on the cluster ---------------------------------------------------------------------------

    def start_gateway(
        self,
        *,
        port: int = 8300,
        args: Sequence[str] = (),
        num_cpus: float = 1.0,
        resources: Mapping[str, float] | None = None,
        timeout_s: float = 120.0,
    ) -> str:
        """Run ``flipsync gateway --board BOARD`` on the cluster (an actor, restarted elsewhere if its node
        dies); its URL once it answers. ``args``: more gateway options (``--max-lag 1``, ``--hold 30``)."""
        if self._actor(self._gateway_name()) is None:
            argv = [self._python(), "-m", "flipsync.cli.gateway", "gateway", "--board", self.spec.board]
            argv += ["--listen", "0.0.0.0:{port}", *(("--run", self.spec.run) if self.spec.run else ()), *args]
            actor = self.ray.remote(_ReplicaActor).options(
                **self._options(self._gateway_name(), cpus=num_cpus, gpus=0, resources=resources or {})
            )
            actor.remote(self.spec.to_json(), argv, name=f"{self.name}-gateway", port=port, max_restarts=100)
        deadline = time.monotonic() + timeout_s
        import httpx

        while True:
            url = self.gateway_url()
            if url is not None:
                try:
                    httpx.get(f"{url}/flipsync/fleet", timeout=2.0)
                    return url
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise FlipsyncError(f"the gateway of fleet {self.name!r} did not answer within {timeout_s:g} s")
            time.sleep(0.2)

    def stop_gateway(self) -> None:
        handle = self._actor(self._gateway_name())
        if handle is not None:
            try:
                self.ray.get(handle.stop.remote(30.0), timeout=60)
            except Exception as e:  # already gone
                log.debug("gateway stop: %s", e)
            self.ray.kill(handle, no_restart=True)

    def down(self) -> ScaleResult:
        """Drain every replica and stop the fleet's gateway."""
        result = self.scale_to(0)
        self.stop_gateway()
        return result


class _ReplicaActor(ProcessSupervisor):
    """The actor Ray places: a `ProcessSupervisor` that also keeps the spec it was started with."""

    def __init__(self, spec_json: str, argv: Sequence[str], **kw: Any) -> None:
        self._spec_json = spec_json
        super().__init__(argv, **kw)

    def spec(self) -> str:
        return self._spec_json
