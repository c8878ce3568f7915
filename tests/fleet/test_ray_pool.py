"""`RayPool`'s parts that need no Ray cluster: the replica spec and the command it runs, the process
supervisor (restart after a crash, SIGTERM to stop), the install hint when Ray is missing, the CLI's
settings. The fleet on a real local cluster is tests/fleet/test_ray_fleet.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flipsync.cli.fleet import parse_resources
from flipsync.cli.main import app
from flipsync.errors import ConfigError
from flipsync.fleet.ray_pool import ReplicaSpec, import_ray
from flipsync.fleet.ray_supervisor import ProcessSupervisor, expand
from tests.sidecar.sidecar_helpers import wait_until

# Exits 0 on SIGTERM (as a drained sidecar does); writes its port so the test sees the placeholders filled in.
CHILD = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
    "print('port', sys.argv[1], flush=True)\n"
    "while True: time.sleep(0.05)\n"
)


def test_the_spec_names_the_sidecar_its_actor_runs() -> None:
    spec = ReplicaSpec(board="s3://b/board", resources={"region:us-east": 1}, num_cpus=2, run="r1")
    argv = spec.sidecar_argv()
    assert argv[:3] == ["sidecar", "--board", "s3://b/board"]
    opts = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert opts["--island"] == "us-east" and opts["--threads"] == "2" and opts["--run"] == "r1"
    assert opts["--public-url"] == "{url}" and opts["--listen"] == "0.0.0.0:{port}"
    assert ReplicaSpec.from_json(spec.to_json()) == spec
    assert ReplicaSpec(board="b", island="lab").island_name() == "lab"
    assert ReplicaSpec(board="b").island_name() == "ray"
    for bad, words in (
        ({"scheduling": "PACK"}, "scheduling"),
        ({"num_gpus": -1}, ">= 0"),
        ({"heartbeat_s": 20.0}, "below the member TTL"),
    ):
        with pytest.raises(ConfigError, match=words):
            ReplicaSpec(board="b", **bad)  # type: ignore[arg-type]


def test_placeholders_are_filled_in_plainly() -> None:
    assert expand(["--x={port}", "{a}{port}", "{{port}}"], {"port": "7"}) == ["--x=7", "{a}7", "{7}"]


def test_the_supervisor_restarts_a_crashed_process_and_stops_it_with_sigterm(tmp_path: Path) -> None:
    sup = ProcessSupervisor([sys.executable, "-c", CHILD, "{port}"], name="t", log_dir=str(tmp_path), max_restarts=3)
    try:
        assert wait_until(lambda: f"port {sup.port}" in sup.logs(), timeout=60, interval=0.05)
        info = sup.info()
        assert info["alive"] and info["restarts"] == 0 and info["url"] == f"http://{sup.host}:{sup.port}"
        assert info["replica"].startswith("t-")
        first = info["pid"]
        sup.kill_process()
        assert wait_until(lambda: sup.info()["alive"] and sup.info()["pid"] != first, timeout=60, interval=0.05)
        assert sup.info()["restarts"] == 1 and sup.info()["exit_codes"] == [-9]
        assert wait_until(lambda: sup.logs().count(f"port {sup.port}") == 2, timeout=60, interval=0.05)  # same port
    finally:
        code = sup.stop(timeout_s=30)
    assert code == 0  # SIGTERM reached it (not blocked or ignored by the parent's mask): it exited cleanly
    assert not sup.info()["alive"]
    if importlib.util.find_spec("ray") is not None:  # outside Ray, asking where it runs neither starts nor joins Ray
        import ray

        assert not ray.is_initialized() and sup.info()["node_id"] is None


def test_the_supervisor_gives_up_after_its_restarts(tmp_path: Path) -> None:
    sup = ProcessSupervisor(
        [sys.executable, "-c", "raise SystemExit(3)"], name="t", log_dir=str(tmp_path), max_restarts=1
    )
    assert wait_until(lambda: sup.info()["gave_up"], timeout=60, interval=0.05)
    assert sup.info()["exit_codes"] == [3, 3] and sup.stop() == 3


def test_without_ray_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'ray>=2\.41'"):
        import_ray()
    result = CliRunner().invoke(app, ["fleet", "status", "--ray", "127.0.0.1:1"])
    assert result.exit_code == 2 and "pip install" in result.output


def test_fleet_settings_are_refused_before_anything_starts() -> None:
    assert parse_resources(["region:us-east=2", "gpu-a100"]) == {"region:us-east": 2.0, "gpu-a100": 1.0}
    for bad in (["=1"], ["region:x=many"]):
        with pytest.raises(ConfigError, match="--resource"):
            parse_resources(bad)
    runner = CliRunner()
    for args, words in (
        (["fleet", "up", "--board", "b", "--replicas", "-1"], "--replicas"),
        (["fleet", "up", "--board", "b", "--scheduling", "PACK"], "scheduling"),
        (["fleet", "up", "--board", "b", "--resource", "=2"], "--resource"),
        (["fleet", "scale", "--", "-1"], "cannot have"),
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and words in result.output, (args, result.output)


def test_warmup_fills_the_kernel_cache() -> None:
    result = CliRunner().invoke(app, ["fleet", "warmup", "--format", "bf16"])
    assert result.exit_code == 0 and "codec kernels for bf16" in result.output
    assert CliRunner().invoke(app, ["fleet", "warmup", "--format", "nope"]).exit_code == 2
