"""The demo's fleet: rollouts through a gateway, an island that joins mid-run, and one that is killed.

Each flipsync island's sidecar joins the fleet under the island's name (`island_link.join_fleet`: a member record
on the board). The trainer's process starts ``flipsync gateway`` over the run's records (`GatewayProcess`), and the
rollout threads send the flipsync islands' requests there: the gateway picks a replica that holds the
version asked for. `FleetDirector` samples the gateway's ``/flipsync/fleet`` (members, ready, readiness)
and, at the steps of its `FleetPlan`, starts a new island (it boots, catches up from the board, and enters
rotation once it is within ``max_lag`` of HEAD: the time to ready is printed) and SIGKILLs another (the
gateway fails its requests over, and its record expires). `FleetDirector.report` is the report's ``fleet``
entry, `plot` draws it, `fleet_lines` sums it up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from rich.console import Console

from flipsync.errors import ConfigError
from flipsync.serving import free_port

if TYPE_CHECKING:
    from flipsync_apps.demo.island import Island

log = logging.getLogger(__name__)

HOLD_S = 5.0  # how long the gateway holds a request no island can serve yet


@dataclass(frozen=True)
class FleetPlan:
    """When an island joins (a new name) and when one is killed (trainer steps; None: never)."""

    join_step: int | None
    join: str
    kill_step: int | None
    kill: str | None

    @classmethod
    def for_run(
        cls, steps: int, islands: int, *, join_step: int | None = None, kill_step: int | None = None
    ) -> FleetPlan:
        """A join a third of the way in and a kill two thirds of the way in (of island-1, or of island-0
        when there is one flipsync island: the kill then waits for the joined island to be ready)."""
        join = join_step if join_step is not None else max(1, steps // 3)
        kill = kill_step if kill_step is not None else max(join + 1, (2 * steps) // 3)
        victim = "island-1" if islands > 1 else "island-0"
        return cls(join, f"island-{islands}", kill if kill <= steps else None, victim)


class GatewayProcess:
    """``flipsync gateway`` over one run's member records, on a loopback port."""

    def __init__(self, board: str, run: str, log_path: Path, *, max_lag: int = 1) -> None:
        self.max_lag = max_lag  # versions behind HEAD an island may be and still be ready
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        # one client for the polls (5 a second): a client per poll built a TLS context each time, in the trainer's
        # process
        self._client = httpx.Client(timeout=5, limits=httpx.Limits(keepalive_expiry=2.0))
        cmd = [
            *(sys.executable, "-m", "flipsync.cli.gateway", "gateway", "--board", board, "--run", run),
            *("--listen", f"127.0.0.1:{self.port}", "--max-lag", str(max_lag), "--hold", str(HOLD_S)),
            *("--refresh", "0.25"),
        ]
        self.log_path = log_path
        with log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
            )

    def fleet(self) -> dict[str, Any] | None:
        try:
            r = self._client.get(f"{self.url}/flipsync/fleet")
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        except RuntimeError:  # stopped while a sampler still asked
            if self._client.is_closed:
                return None
            raise

    def wait_ready(self, names: list[str], timeout_s: float) -> None:
        """Until every island in ``names`` is in rotation."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ConfigError(f"the gateway exited ({self.proc.returncode}); its log: {self.log_path}")
            doc = self.fleet()
            if doc is not None and set(names) <= {m["replica"] for m in doc["members"] if m["ready"]}:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the islands {names} did not enter the gateway's rotation within {timeout_s} s")
            time.sleep(0.2)

    def stop(self) -> None:
        self._client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class FleetDirector:
    """Runs the demo's fleet events and records them; see the module doc.

    ``start_island(name)`` starts a flipsync island process (the caller's); ``on_join(island)`` is called once
    its proxy is up, so the run can watch it; ``islands()`` the islands now in the run (to find the one to
    kill and to know who else is ready).
    """

    def __init__(
        self,
        gateway: GatewayProcess,
        plan: FleetPlan,
        console: Console,
        *,
        start_island: Callable[[str], Island],
        on_join: Callable[[Island], None],
        islands: Callable[[], list[Island]],
        on_kill: Callable[[str], None] | None = None,
    ) -> None:
        self.gateway = gateway
        self.plan = plan
        self.console = console
        self.start_island = start_island
        self.on_join = on_join
        self.islands = islands
        self.on_kill = on_kill  # the monitor stops waiting for the killed island's commits
        self.t0 = time.monotonic()
        self.events: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.killed: set[str] = set()
        self.joined: Island | None = None
        self._join_at: float | None = None
        self._up_at: float | None = None
        self._ready_at: float | None = None
        self._kill_pending: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample_loop, daemon=True, name="demo-fleet")
        self.trainer_step = 0

    def start(self) -> FleetDirector:
        self.t0 = time.monotonic()
        self._sampler.start()
        return self

    def _event(self, kind: str, island: str, **detail: Any) -> None:
        with self._lock:
            self.events.append(
                {
                    "t": round(time.monotonic() - self.t0, 3),
                    "step": self.trainer_step,
                    "kind": kind,
                    "island": island,
                    **detail,
                }
            )

    # -- sampling -------------------------------------------------------------------------------------------

    def _sample_loop(self) -> None:
        present: set[str] = set()
        while not self._stop.is_set():
            doc = self.gateway.fleet()
            if doc is not None:
                now = time.monotonic()
                members = {m["replica"]: m for m in doc["members"]}
                ready = sorted(n for n, m in members.items() if m["ready"])
                run = next(iter(doc["runs"].values()), {})
                with self._lock:
                    self.samples.append(
                        {
                            "t": round(now - self.t0, 3),
                            "step": self.trainer_step,
                            "members": sorted(members),
                            "ready": ready,
                            "readiness": run.get("readiness"),
                            "head": run.get("head"),
                            "versions": {n: m["version"] for n, m in members.items()},
                        }
                    )
                for gone in present - set(members):
                    self._event("left", gone, why="record expired" if gone in self.killed else "record removed")
                present = set(members)
                joined = self.plan.join
                if self._join_at is not None and self._ready_at is None and joined in ready:
                    self._ready_at = now
                    head = run.get("head")
                    self._event("ready", joined, time_to_ready_s=round(now - self._join_at, 3), head=head)
                    boot = f", {self._up_at - self._join_at:.1f} s to boot" if self._up_at else ""
                    self.console.print(
                        f"[bold]{joined} (joined at step {self.plan.join_step}) entered rotation "
                        f"{now - self._join_at:.1f} s after it started{boot}, at HEAD v{head}[/]"
                    )
            self._stop.wait(0.2)

    # -- the plan -------------------------------------------------------------------------------------------

    def after_step(self, step: int) -> None:
        """Called by the trainer after each step: join or kill when the plan says."""
        self.trainer_step = step
        if step == self.plan.join_step:
            self._join(step)
        if step == self.plan.kill_step or (self._kill_pending is not None and step > self._kill_pending):
            self._kill(step)

    def _join(self, step: int) -> None:
        name = self.plan.join
        self._join_at = time.monotonic()
        island = self.start_island(name)
        self.joined = island
        self._event("join", name)
        self.console.print(f"[bold]step {step}: {name} joins the fleet (a new island process)[/]")

        def wait_up() -> None:
            try:
                island.wait_ready(timeout_s=300)
            except (TimeoutError, EOFError, OSError) as e:
                self._event("failed", name, why=str(e))
                return
            self._up_at = time.monotonic()
            self._event("up", name, boot_s=round(self._up_at - (self._join_at or self._up_at), 3))
            self.on_join(island)

        threading.Thread(target=wait_up, daemon=True, name="demo-fleet-join").start()

    def _kill(self, step: int) -> None:
        name = self.plan.kill
        victim = next((i for i in self.islands() if i.spec.name == name), None)
        if victim is None or name in self.killed:
            return
        others = [i.spec.name for i in self.islands() if not i.spec.control and i.spec.name != name]
        last = self.samples[-1]["members"] if self.samples else []
        if not set(others) & set(last):  # nobody else would be left to serve: wait for the joined island
            self._kill_pending = step
            return
        self._kill_pending = None
        self.killed.add(name)
        with contextlib.suppress(OSError):
            victim.process.kill()  # SIGKILL: no drain, no deregistration
        if self.on_kill is not None:
            self.on_kill(name)
        self._event("kill", name)
        self.console.print(f"[bold]step {step}: {name} killed (SIGKILL); the gateway fails its requests over[/]")

    def finish(self, timeout_s: float = 180.0) -> None:
        """Wait (bounded) for the joined island to enter rotation and for a killed island's record to expire
        (a short run can end within its TTL), then stop sampling."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (
            (self._join_at is not None and self._ready_at is None) or self.killed - self._left()
        ):
            time.sleep(0.2)
        time.sleep(0.5)
        self._stop.set()
        self._sampler.join(10)

    def _left(self) -> set[str]:
        with self._lock:
            return {e["island"] for e in self.events if e["kind"] == "left"}

    def report(self) -> dict[str, Any]:
        with self._lock:
            ready = next((e for e in self.events if e["kind"] == "ready"), None)
            return {
                "gateway": self.gateway.url,
                "max_lag": self.gateway.max_lag,
                "plan": {
                    "join_step": self.plan.join_step,
                    "join": self.plan.join,
                    "kill_step": self.plan.kill_step,
                    "kill": self.plan.kill,
                },
                "events": list(self.events),
                "time_to_ready_s": ready["time_to_ready_s"] if ready else None,
                "killed": sorted(self.killed),
                "samples": list(self.samples),
            }


def fleet_lines(fleet: dict[str, Any], failed_rollouts: int) -> list[str]:
    """What the run's fleet did, in a line or two."""
    if not fleet:
        return []
    kinds = {(e["kind"], e["island"]): e for e in fleet["events"]}
    parts = []
    join = kinds.get(("join", fleet["plan"]["join"]))
    if join is not None:
        ready = kinds.get(("ready", join["island"]))
        parts.append(
            f"{join['island']} joined at step {join['step']}"
            + (f" and entered rotation {ready['time_to_ready_s']:.1f} s later" if ready else " (never ready)")
        )
    for name in fleet["killed"]:
        kill = kinds[("kill", name)]
        left = kinds.get(("left", name))
        parts.append(
            f"{name} was killed at step {kill['step']}"
            + (f" and left the gateway's view {left['t'] - kill['t']:.1f} s later (TTL)" if left else "")
        )
    return ["fleet (rollouts through the gateway): " + "; ".join(parts) + f"; failed rollouts: {failed_rollouts}"]


def plot(fleet: dict[str, Any], ax: Any) -> None:
    """Members, ready islands and readiness over time, with the join, ready, kill and leave events."""
    samples = fleet.get("samples") or []
    if not samples:
        return
    ts = [s["t"] for s in samples]
    members = [len(s["members"]) for s in samples]
    ax.step(ts, members, where="post", lw=2.2, label="members (live records)")
    ax.step(
        ts, [len(s["ready"]) for s in samples], where="post", lw=1.2, label=f"ready (within {fleet['max_lag']} of HEAD)"
    )
    top = max(members) + 1
    ax.set_ylim(0, top)
    twin = ax.twinx()
    readiness = [s["readiness"] if s["readiness"] is not None else 0 for s in samples]
    twin.plot(ts, readiness, color="tab:green", lw=0.6, alpha=0.5, label="readiness (fraction at HEAD)")
    twin.set_ylim(0, 1.05)
    twin.set_ylabel("fraction of members at HEAD")
    colors = {"join": "tab:blue", "ready": "tab:green", "kill": "tab:red", "left": "tab:gray"}
    for k, e in enumerate(x for x in fleet["events"] if x["kind"] in colors):
        ax.axvline(e["t"], color=colors[e["kind"]], ls="--", lw=1)
        ax.annotate(
            f"{e['island']} {e['kind']} (step {e['step']})",
            (e["t"], top - 0.15 - 0.3 * (k % 3)),
            fontsize=7,
            color=colors[e["kind"]],
            ha="left",
        )
    ax.set_xlabel("wall time since the RL steps started (s)")
    ax.set_ylabel("islands")
    ax.set_title("The fleet behind the gateway: joins, kills and readiness")
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = twin.get_legend_handles_labels()
    ax.legend(lines + more, labels + more_labels, loc="lower left", fontsize=8)
