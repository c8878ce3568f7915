"""`SidecarSettings`: every knob of one sidecar process (what ``flipsync sidecar`` takes, one field a flag), checked
where it is made, so a typo is refused in milliseconds before anything heavy starts. `run_sidecar` runs it.
The pieces it configures keep their own small configs (`ReplicaConfig`, `ProxyConfig`, `MembershipConfig`),
derived from it here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from flipsync.auth import ApiKeys
from flipsync.domain.fleet import check_model, check_url
from flipsync.engines.registry import check_kind
from flipsync.errors import ConfigError, FlipsyncError
from flipsync.serving import parse_listen
from flipsync.sidecar.gate import CommitMode

if TYPE_CHECKING:  # the pieces' configs import their pieces (the board, httpx, fastapi): made when run
    from flipsync.sidecar.heartbeat import MembershipConfig
    from flipsync.sidecar.proxy import ProxyConfig
    from flipsync.sidecar.replica import ReplicaConfig


def _seconds(value: float | None, flag: str, what: str = "") -> None:
    if value is not None and not value >= 0:  # also refuses NaN
        raise ConfigError(f"{flag} must be a number of seconds >= 0{what}, not {value}")


@dataclass(frozen=True)
class SidecarSettings:
    """One sidecar: the board it follows, the engine it keeps there, the proxy in front, the fleet it joins."""

    # The board.
    board: str  # board URL or path (s3://..., ./board), or a relay http://HOST:PORT
    run: str | None = None  # run name on the board (None: its only run)
    store_options: Mapping[str, str] = field(default_factory=dict)  # store settings (endpoint, region, ...)
    public_keys: tuple[Path, ...] = ()  # accept only manifests signed by one of these Ed25519 keys
    poll_s: float = 1.0  # seconds between board polls
    fetch_ahead_s: float = 0.0  # list the next version's folder this often, to download parts early (0: off)
    wait_timeout_s: float | None = None  # give up when the run has no version after this long (None: wait)
    origin: str | None = None  # ``board`` is a replicated copy of this board: read what it lacks from here
    origin_options: Mapping[str, str] = field(default_factory=dict)  # the origin store's settings
    mirror_wait_s: float | None = None  # a replicated copy: wait this long for an object it lacks yet
    # The engine.
    engine: str = "torch"  # torch (served in this process) | vllm | sglang
    upstream: str | None = None  # the engine's OpenAI-compatible URL (vllm, sglang)
    engine_options: Mapping[str, str] = field(default_factory=dict)  # vllm / sglang settings (docs/engines.md)
    served_format: str | None = None  # must match the board's (None: the board's)
    model: str = "tiny"  # torch: a model preset (tiny, small, base) or a config.json
    model_name: str | None = None  # the OpenAI model name served (torch answers with it; the member record's)
    device: str = "cpu"  # torch: cpu or cuda[:N]
    engine_listen: str = "127.0.0.1:0"  # torch: where its OpenAI server listens
    threads: int | None = None  # torch: CPU threads for the model
    max_concurrency: int = 8  # torch: sequences generated at once
    # Commits.
    commit_mode: CommitMode = CommitMode.IN_PLACE  # in_place: pause and continue; quiesce: drain first
    max_backoff_s: float = 30.0  # longest wait between retries after failures
    drain_timeout_s: float = 30.0  # longest wait for the requests in flight before a commit
    adopt_search: int = 64  # on boot, versions searched for the engine's current weights (0: always reload)
    # The proxy.
    listen: str = "127.0.0.1:8100"  # where the proxy listens, HOST:PORT
    api_keys: ApiKeys | None = None  # clients of the model API must send one (None: no check)
    exit_timeout_s: float = 30.0  # on SIGTERM, longest wait for the requests in flight before leaving
    # The fleet (joined when ``public_url`` is set).
    public_url: str | None = None  # the URL gateways reach this proxy at; the sidecar keeps a member record
    replica_id: str | None = None  # this replica's id on the board (None: host-port of ``public_url``)
    island: str = "default"  # the island (region, cluster) this replica is in
    heartbeat_s: float = 5.0  # seconds between member record writes
    member_ttl_s: float = 15.0  # seconds a record stays valid after its last write
    member_key: Path | None = None  # sign the member record with this Ed25519 key (a signed board)
    fleet_board: str | None = None  # the board to keep the member record on (None: ``board``; a relay is read-only)

    def __post_init__(self) -> None:
        parse_listen(self.listen)
        check_kind(self.engine)
        if self.engine == "torch":
            parse_listen(self.engine_listen)
        elif not self.upstream:
            raise ConfigError(f"--upstream URL is required for the {self.engine} engine (its OpenAI server)")
        _seconds(self.wait_timeout_s, "--wait-timeout")
        _seconds(self.fetch_ahead_s, "--fetch-ahead", " (0: off)")
        _seconds(self.mirror_wait_s, "--mirror-wait")
        _seconds(self.exit_timeout_s, "--exit-timeout")
        try:  # the member record's rules, whether or not the sidecar joins a fleet
            if self.model_name is not None:
                check_model(self.model_name)
            if self.public_url is not None:
                check_url(self.public_url)
        except FlipsyncError as e:
            raise ConfigError(str(e).replace("invalid member record: ", "")) from None
        if self.public_url is not None:
            if not 0 < self.heartbeat_s < self.member_ttl_s:
                raise ConfigError(
                    f"--heartbeat ({self.heartbeat_s:g} s) must be positive and below --member-ttl "
                    f"({self.member_ttl_s:g} s)"
                )
        elif self.replica_id is not None or self.member_key is not None or self.fleet_board is not None:
            raise ConfigError("--replica-id, --member-key and --fleet-board need --public-url (joining the fleet)")

    def replica_config(self) -> ReplicaConfig:
        from flipsync.sidecar.replica import ReplicaConfig

        return ReplicaConfig(
            commit_mode=self.commit_mode,
            poll_interval_s=self.poll_s,
            max_backoff_s=self.max_backoff_s,
            drain_timeout_s=self.drain_timeout_s,
            adopt_search=self.adopt_search,
        )

    def proxy_config(self, upstream_url: str) -> ProxyConfig:
        from flipsync.sidecar.proxy import ProxyConfig

        return ProxyConfig(upstream_url, retry_after_s=max(1, round(self.poll_s)), api_keys=self.api_keys)

    def membership(self) -> MembershipConfig | None:
        """How the sidecar appears in the fleet; None when it does not join one."""
        if self.public_url is None:
            return None
        from flipsync.sidecar.heartbeat import MembershipConfig

        return MembershipConfig(
            public_url=self.public_url,
            replica_id=self.replica_id,
            island=self.island,
            model=self.model_name,
            interval_s=self.heartbeat_s,
            ttl_s=self.member_ttl_s,
        )
