"""The ``sglang`` engine: keeps an SGLang server's weights at a board version through its HTTP update routes.
See docs/engines.md#how-a-patch-reaches-sglang."""

from __future__ import annotations

import logging
import os
import random
import secrets
import shutil
import tempfile
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx
import torch

from flipsync.codec import ClassIndex, Patch, StagedWrite, UndoRecord, scatter
from flipsync.codec import commit as codec_commit
from flipsync.codec import stage as codec_stage
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.engines.base import Engine, Staged, Undo
from flipsync.engines.host_copy import flush, open_host_copy, write_safetensors
from flipsync.engines.registry import EngineOptions
from flipsync.errors import ConfigError, EngineError, EngineUnavailableError

log = logging.getLogger(__name__)

# What every /update_weights_from_disk asks besides the directory: requests in flight go on, the KV cache is dropped.
_UPDATE_OPTIONS = {"load_format": None, "abort_all_requests": False, "flush_cache": True}

__all__ = ["SglangEngine", "SglangStaged", "SglangUndo"]


@dataclass
class SglangStaged(Staged):
    writes: list[StagedWrite]
    update_dir: Path
    undo_dir: Path
    target_view: str
    weight_version: str
    n_changed: int


@dataclass
class SglangUndo(Undo):
    record: UndoRecord
    undo_dir: Path
    weight_version_before: str | None
    done: bool = False


class SglangEngine(Engine[SglangStaged, SglangUndo]):
    """An SGLang server updated through ``/update_weights_from_disk`` from a host copy of the served view."""

    name: ClassVar[str] = "sglang"

    def __init__(
        self,
        base_url: str,
        host_copy: MutableMapping[str, torch.Tensor],
        *,
        staging_dir: str | os.PathLike[str] | None = None,
        timeout_s: float = 600.0,
        keep_updates: int = 2,
        client: httpx.Client | None = None,
        audit: str = "every",
        audit_rows: int | None = None,
        unreadable: str = "refuse",
    ) -> None:
        """``host_copy`` must hold exactly what the server serves now (e.g. the checkpoint it started from).
        ``audit``: read back the touched tensors after each update (``every``, ``sample``: one, ``off``), whole
        (``audit_rows``: only their first rows). ``unreadable``: what to do with tensors SGLang does not read back
        as the host copy holds them at start (another runtime layout): ``refuse`` to start, naming them, or
        ``skip`` them (listed in ``unaudited``, and logged at every update that touches them)."""
        if audit not in ("every", "sample", "off"):
            raise ConfigError(f"audit must be every, sample or off, not {audit!r}")
        if unreadable not in ("refuse", "skip"):
            raise ConfigError(f"unreadable must be refuse or skip, not {unreadable!r}")
        self.base_url = base_url.rstrip("/")
        self._host_copy = host_copy
        self._timeout = timeout_s
        self._keep = max(1, keep_updates)
        self._own_client = client is None
        self._client = client or httpx.Client(timeout=httpx.Timeout(30.0, connect=5.0))
        self._staging = Path(staging_dir or tempfile.mkdtemp(prefix="flipsync-sglang-"))
        self._staging.mkdir(parents=True, exist_ok=True)
        self._live_dirs: list[Path] = []  # update/undo dirs SGLang may still point at
        self._table = FingerprintTable.of(host_copy)
        self._index = ClassIndex()  # of the host copy, kept current with it: sparse ctx sections read only their blocks
        data = self._request("GET", "/get_weight_version")
        if not isinstance(data, dict) or "weight_version" not in data:
            raise EngineError(f"SGLang answered /get_weight_version without a weight_version: {data!r}")
        self.weight_version: str | None = None if data["weight_version"] is None else str(data["weight_version"])
        # Blind spot 7: the first 2 rows of a touched tensor were read back and tensors that did not read back
        # at start were dropped with a warning; now whole tensors, and none dropped unless asked.
        self.audit, self.audit_rows = audit, (None if audit_rows is None else max(1, audit_rows))
        self._rng = random.Random(0)
        self.auditable: set[str] = set()
        self.unaudited: list[str] = []  # tensors SGLang does not read back (``unreadable="skip"``)
        self.last_audit: list[str] = []  # the tensors the last update's audit read back
        if audit != "off":
            found = self.sample_check(sorted(host_copy), rows=self.audit_rows)
            self.auditable = {n for n, ok in found.items() if ok}
            self.unaudited = sorted(set(found) - self.auditable)
            if self.unaudited and unreadable == "refuse":
                raise ConfigError(
                    f"SGLang does not read back {len(self.unaudited)} of {len(found)} tensors as the host copy holds "
                    f"them ({', '.join(self.unaudited[:3])}...): a runtime layout other than the checkpoint's, or a "
                    "server that does not serve the host copy; updates to them could not be audited. Check the host "
                    "copy, or pass unreadable='skip' to serve them unaudited"
                )
            if self.unaudited:
                log.warning(
                    "sglang engine: %d of %d tensors do not read back as the host copy holds them (%s...); they are "
                    "served unaudited (unreadable='skip')",
                    len(self.unaudited),
                    len(found),
                    ", ".join(self.unaudited[:3]),
                )

    # ------------------------------------------------------------------------------------- HTTP
    def _request(self, method: str, route: str, body: Mapping[str, Any] | None = None, timeout: float = 30.0) -> Any:
        try:
            resp = self._client.request(method, f"{self.base_url}{route}", json=body, timeout=timeout)
        except httpx.TimeoutException:
            raise EngineUnavailableError(
                f"SGLang at {self.base_url} did not answer {route} within {timeout:.0f}s"
            ) from None
        except httpx.HTTPError as e:
            raise EngineUnavailableError(f"SGLang at {self.base_url} is unreachable ({route}): {e}") from None
        try:
            data = resp.json()
        except ValueError:
            data = None
        if resp.status_code == 404:
            raise ConfigError(f"SGLang at {self.base_url} has no route {route}; this SGLang version is too old")
        if resp.status_code != 200 or (isinstance(data, dict) and data.get("success") is False):
            msg = data.get("message") if isinstance(data, dict) else resp.text[:300]
            raise EngineError(f"SGLang refused {route} (HTTP {resp.status_code}): {msg}")
        return data

    def _update_from_disk(self, directory: Path, weight_version: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": str(directory), **_UPDATE_OPTIONS}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._request("POST", "/update_weights_from_disk", body, timeout=self._timeout)

    # ------------------------------------------------------------------------------------- port
    @property
    def table(self) -> FingerprintTable:
        return self._table

    @property
    def host_view(self) -> Mapping[str, torch.Tensor]:
        """The host_copy: what the server was last given, where the sidecar reads it."""
        return self._host_copy

    def load_view(self, view: Mapping[str, torch.Tensor]) -> None:
        if set(view) != set(self._host_copy):
            raise ConfigError("the view does not have the tensors of the host copy")
        directory = self._new_dir("full")
        write_safetensors(view, directory / "model.safetensors")
        self._update_from_disk(directory, self.weight_version)
        for name, t in view.items():
            self._host_copy[name] = t.detach().to("cpu")
        flush(self._host_copy)
        self._table = FingerprintTable.of(self._host_copy)
        self._index = ClassIndex()
        self._retire(directory)

    def stage(self, patch: Patch) -> SglangStaged:
        # base check, decode, target fingerprints
        writes = codec_stage(self._host_copy, patch, self._table, index=self._index)
        token = secrets.token_hex(6)
        update_dir = self._new_dir(f"update-{token}")
        undo_dir = self._new_dir(f"undo-{token}")
        try:
            old = {w.name: self._host_copy[w.name].detach().clone() for w in writes}
            new = {name: t.clone() for name, t in old.items()}
            for w in writes:
                scatter(new[w.name], w.positions, w.new_bits)
            write_safetensors(new, update_dir / "model.safetensors")
            write_safetensors(old, undo_dir / "model.safetensors")
        except BaseException:
            shutil.rmtree(update_dir, ignore_errors=True)
            shutil.rmtree(undo_dir, ignore_errors=True)
            raise
        after = self._table.copy()
        after.update({w.name: w.target for w in writes})
        target = patch.header.target
        version = str(target.version) if target.version is not None else target.view
        return SglangStaged(
            writes=writes,
            update_dir=update_dir,
            undo_dir=undo_dir,
            target_view=after.view_fp(),
            weight_version=version,
            n_changed=sum(int(w.positions.numel()) for w in writes),
        )

    @property
    def adoptable(self) -> bool:
        # The fingerprints come from the host copy, not the server: a sidecar killed between the server's update
        # and the host copy's write leaves them apart, so a restarted sidecar resyncs from a keyframe instead.
        return False

    def commit(self, staged: SglangStaged) -> SglangUndo:
        before = self.weight_version
        try:
            self._update_from_disk(staged.update_dir, staged.weight_version)
        except EngineUnavailableError:
            self._recover(staged.undo_dir, before, "the update's outcome is unknown")
            raise
        except EngineError:
            # SGLang reports a failed load after trying to restore; push the old values to be sure
            self._recover(staged.undo_dir, before, "SGLang refused the update")
            raise
        bad = self._audit_update(staged)
        if bad:
            self._recover(staged.undo_dir, before, "SGLang acknowledged an update it does not hold")
            raise EngineError(
                f"SGLang acknowledged the update but reads back other values for {', '.join(bad[:3])} "
                f"({'whole tensors' if self.audit_rows is None else f'the first {self.audit_rows} rows'}, "
                "/get_weights_by_name); the update was undone"
            )
        record = codec_commit(self._host_copy, staged.writes, self._table, index=self._index)
        flush(self._host_copy)
        self.weight_version = staged.weight_version
        self._retire(staged.update_dir, staged.undo_dir)
        return SglangUndo(record, staged.undo_dir, before)

    def rollback(self, undo: SglangUndo) -> None:
        if undo.done:
            return
        if not (undo.undo_dir / "model.safetensors").exists():
            raise EngineError(f"the undo checkpoint {undo.undo_dir} is gone (only the last {self._keep} are kept)")
        self._update_from_disk(undo.undo_dir, undo.weight_version_before)
        undo.record.rollback(self._host_copy, self._table)
        flush(self._host_copy)
        self.weight_version = undo.weight_version_before
        undo.done = True

    def recompute_table(self) -> FingerprintTable:
        """Fingerprints of the host copy (what SGLang acknowledged); see :meth:`sample_check` for the server."""
        return FingerprintTable.of(self._host_copy)

    def health(self) -> bool:
        try:
            return self._client.get(f"{self.base_url}/health", timeout=10.0).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        if self._own_client:
            self._client.close()
        flush(self._host_copy)

    # ------------------------------------------------------------------------------------ extras
    def _audit_update(self, staged: SglangStaged) -> list[str]:
        """The touched auditable tensors that do not read back with the update's values (O(touched size))."""
        unaudited = sorted({w.name for w in staged.writes} - self.auditable)
        if unaudited and self.audit != "off":
            log.warning("sglang engine: this update touches %d unaudited tensors (%s...)", len(unaudited), unaudited[0])
        touched = sorted({w.name for w in staged.writes} & self.auditable)
        if self.audit == "off" or not touched:
            self.last_audit = []
            return []
        names = touched if self.audit == "every" else [self._rng.choice(touched)]
        self.last_audit = names
        expected = {w.name: w for w in staged.writes}
        bad = []
        for name in names:
            t = _rows(self._host_copy[name], self.audit_rows).detach().clone()
            w = expected[name]
            keep = w.positions < t.numel()
            scatter(t, w.positions[keep], w.new_bits[keep])
            if not self._reads_back(name, t):
                bad.append(name)
        return bad

    def _reads_back(self, name: str, want: torch.Tensor) -> bool:
        rows = want.shape[0] if want.dim() else 1
        try:
            data = self._request("POST", "/get_weights_by_name", {"name": name, "truncate_size": rows}, timeout=120.0)
        except EngineError:
            return False
        got = torch.tensor(data, dtype=torch.float32)
        want32 = want.to(torch.float32)
        return got.shape == want32.shape and bool(torch.equal(got.view(torch.int32), want32.view(torch.int32)))

    def sample_check(self, names: list[str], rows: int | None = None) -> dict[str, bool]:
        """Compare what SGLang reports (``/get_weights_by_name``; whole tensors, or their first ``rows`` rows) with
        the host copy, exactly (float32 bit patterns); a tensor SGLang cannot report reads as False."""
        return {name: self._reads_back(name, _rows(self._host_copy[name], rows)) for name in names}

    # -------------------------------------------------------------------------------- plumbing
    def _new_dir(self, stem: str) -> Path:
        d = self._staging / stem
        d.mkdir(parents=True, exist_ok=False)
        return d

    def _retire(self, *dirs: Path) -> None:
        """Keep the last few update/undo dirs (SGLang's model_path points at the newest); drop older ones."""
        self._live_dirs.extend(dirs)
        per_commit = max(1, len(dirs))
        while len(self._live_dirs) > self._keep * per_commit:
            shutil.rmtree(self._live_dirs.pop(0), ignore_errors=True)

    def _recover(self, undo_dir: Path, version: str | None, why: str) -> None:
        try:
            self._update_from_disk(undo_dir, version)
        except Exception as e:
            raise EngineUnavailableError(
                f"{why}, and reloading the previous values failed too ({e}); audit the server or resync it "
                "from a keyframe"
            ) from None


def _rows(t: torch.Tensor, rows: int | None) -> torch.Tensor:
    """The tensor's first ``rows`` rows (None: all of it; a 0-d tensor as one element)."""
    t = t.reshape(1) if t.dim() == 0 else t
    return t if rows is None else t[:rows]


def create_engine(options: EngineOptions) -> SglangEngine:
    """The ``--engine-option`` keys: ``host_copy`` (required: a safetensors file holding what the server holds;
    created from ``model_dir`` when missing), ``model_dir``, ``staging_dir``, ``admin_url`` (default
    ``--upstream``)."""
    opts = options.options
    url = options.admin_url("sglang")
    if "host_copy" not in opts:
        raise ConfigError("the sglang engine needs --engine-option host_copy=FILE (and model_dir=PATH to create it)")
    return SglangEngine(
        url, open_host_copy(opts["host_copy"], opts.get("model_dir")), staging_dir=opts.get("staging_dir")
    )
