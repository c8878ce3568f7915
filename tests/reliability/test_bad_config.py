"""The bad-configuration matrix: each row is a mistake a user can make, what they ran, the flipsync error (or
exit code) they get, and the words the message must hold so that they can act on it.

CLI rows run the real ``flipsync`` app through typer's CliRunner (exit code 1 for flipsync errors, 2 for the
sidecar's and for usage errors) and must print one line, never a traceback. API rows call what a Python user
or the sidecar calls and expect the exception class. Everything runs against local files, one module-scoped
board and a closed loopback port, so the whole matrix takes seconds.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from obstore.store import MemoryStore
from typer.testing import CliRunner

from flipsync.board.ahead import FetchAhead
from flipsync.board.part_stream import PartStream
from flipsync.board.throttle import parse_bandwidth
from flipsync.checkpoint import save_checkpoint
from flipsync.cli.main import app
from flipsync.codec import Patch, apply_patch
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.codec.section import decode_symbols
from flipsync.errors import (
    BaseMismatchError,
    ConfigError,
    CorruptPatchError,
    EngineError,
    FlipsyncError,
    NotFoundError,
    TransientStoreError,
)
from flipsync.formats import served_view
from flipsync.stores import ObstoreStore, StoreOptions, open_store

runner = CliRunner(env={"COLUMNS": "400"})


def _masters(seed: int, rows: int = 64, drift: float = 0.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {"l0.weight": torch.randn(rows, 32, generator=g) * 0.02, "l1.weight": torch.randn(32, 32, generator=g) * 0.02}
    if drift:
        g2 = torch.Generator().manual_seed(seed)
        out = {k: v + drift * torch.randn(v.shape, generator=g2) for k, v in out.items()}
    return out


@dataclass(frozen=True)
class Env:
    root: Path

    def __call__(self, name: str) -> str:
        return str(self.root / name)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    """Checkpoints of one model at three versions, two patches, a board with run r1, and some keys."""
    e = Env(tmp_path_factory.mktemp("badconfig"))
    save_checkpoint(_masters(0), e("m0.safetensors"))
    save_checkpoint(_masters(1, drift=1e-3), e("m1.safetensors"))
    save_checkpoint(_masters(2, drift=2e-3), e("m2.safetensors"))
    save_checkpoint({"other.weight": torch.randn(8, 8)}, e("other.safetensors"))
    save_checkpoint(_masters(0, rows=48), e("shape.safetensors"))
    save_checkpoint({"z.weight": torch.zeros(4, dtype=torch.uint16)}, e("u16.safetensors"))
    save_checkpoint({"z.weight": torch.zeros(4, dtype=torch.complex64)}, e("cplx.safetensors"))
    for a, b in (("m0", "m1"), ("m1", "m2")):
        r = runner.invoke(
            app, ["diff", e(f"{a}.safetensors"), e(f"{b}.safetensors"), "-f", "bf16", "-o", e(f"p{a}{b}")]
        )
        assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["publish", e("board"), e("m0.safetensors"), e("m1.safetensors"), "--run", "r1"])
    assert r.exit_code == 0, r.output
    assert runner.invoke(app, ["keygen", e("key")]).exit_code == 0
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    Path(e("rsa.pem")).write_bytes(
        rsa_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return e


def _crafted_huge_patch(e: Env) -> str:
    """A real patch whose header claims 2**40 changes in a 2**20 x 2**20 tensor: its streams hold a few."""
    patch = Patch.load(e("pm0m1"))
    first, *rest = patch.header.sections
    huge = replace(first, shape=(1 << 20, 1 << 20), n=1 << 40)
    Path(e("phuge")).write_bytes(Patch(replace(patch.header, sections=(huge, *rest)), patch._blobs).to_bytes())
    return e("phuge")


@dataclass(frozen=True)
class CliRow:
    mistake: str
    args: Callable[[Env], list[str]]
    exit_code: int
    words: tuple[str, ...]


CLI_ROWS = [
    CliRow(
        "wrong model: a checkpoint of another model as the base",
        lambda e: ["apply", e("other.safetensors"), e("pm0m1"), "-o", e("out")],
        1,
        ("'l0.weight'", "do not have", "is not the base", "pass the checkpoint the patch was diffed from"),
    ),
    CliRow(
        "shapes that do not match the patch's",
        lambda e: ["apply", e("shape.safetensors"), e("pm0m1"), "-o", e("out")],
        1,
        ("(48, 32)", "(64, 32)", "is not the base"),
    ),
    CliRow(
        "base version mismatch: a patch applied to a later version",
        lambda e: ["apply", e("m1.safetensors"), e("pm0m1"), "-o", e("out")],
        1,
        ("is not the base", "holds served view", "the patch applies to view", "flipsync diff OLD NEW"),
    ),
    CliRow(
        "base version mismatch: a patch applied to an older version",
        lambda e: ["apply", e("m0.safetensors"), e("pm1m2"), "-o", e("out")],
        1,
        ("the patch applies to view", "is not the base"),
    ),
    CliRow(
        "wrong served format: --format fp8-block for a bf16 patch",
        lambda e: ["apply", e("m0.safetensors"), e("pm0m1"), "-f", "fp8-block", "-o", e("out")],
        1,
        ("holds bf16", "--format fp8-block", "leave --format out"),
    ),
    CliRow(
        "unknown served format",
        lambda e: ["view", e("m0.safetensors"), "-f", "fp7", "-o", e("v")],
        1,
        ("unknown served format 'fp7'", "bf16", "fp8-block"),
    ),
    CliRow(
        "masters without a served format",
        lambda e: ["diff", e("m0.safetensors"), e("m1.safetensors"), "-o", e("x")],
        1,
        ("holds master weights", "--format"),
    ),
    CliRow(
        "nonexistent checkpoint path",
        lambda e: ["diff", e("missing.safetensors"), e("m1.safetensors"), "-f", "bf16", "-o", e("x")],
        1,
        ("missing.safetensors does not exist", "a .safetensors file or a directory"),
    ),
    CliRow(
        "checkpoints of two different models diffed",
        lambda e: ["diff", e("m0.safetensors"), e("other.safetensors"), "-f", "bf16", "-o", e("x")],
        1,
        ("different tensors", "'other.weight'", "keyframe"),
    ),
    CliRow(
        "unsupported dtype in a served view",
        lambda e: ["diff", e("u16.safetensors"), e("u16.safetensors"), "-o", e("x")],
        1,
        ("'z.weight'", "torch.uint16", "cannot patch", "convert it"),
    ),
    CliRow(
        "complex master weights",
        lambda e: ["view", e("cplx.safetensors"), "-f", "bf16", "-o", e("x")],
        1,
        ("'z.weight'", "complex"),
    ),
    CliRow(
        "a checkpoint given where a patch belongs",
        lambda e: ["inspect", e("m0.safetensors")],
        1,
        ("not a flipsync patch",),
    ),
    CliRow("a patch path that does not exist", lambda e: ["inspect", e("nope")], 1, ("cannot read patch", "nope")),
    CliRow(
        "patches squashed out of order",
        lambda e: ["squash", e("pm1m2"), e("pm0m1"), "-o", e("x")],
        1,
        ("do not form a chain",),
    ),
    CliRow(
        "a crafted patch declaring 2**40 changes (terabytes once decoded) squashed",
        lambda e: ["squash", _crafted_huge_patch(e), "-o", e("x")],
        1,
        ("the patch declares 1,099,511,6", "GiB once decoded", "more than the limit of 8 GiB", "--max-decoded-gib"),
    ),
    CliRow(
        "a chain squashed under a lower memory cap",
        lambda e: ["squash", e("pm0m1"), e("pm1m2"), "-o", e("x"), "--max-decoded-gib", "0.000001"],
        1,
        ("the patches declare", "more than the limit", "--max-decoded-gib N"),
    ),
    CliRow(
        "a board path that does not exist",
        lambda e: ["board", "ls", e("no-such-board")],
        1,
        ("does not exist", "check the path"),
    ),
    CliRow(
        "a board URL with an unknown scheme",
        lambda e: ["board", "ls", "ftp://host/board"],
        1,
        ("unsupported board URL", "s3://", "file://"),
    ),
    CliRow(
        "unknown run name",
        lambda e: ["board", "show", e("board"), "--run", "r7"],
        1,
        ("run 'r7' does not exist", "r1", "--run"),
    ),
    CliRow(
        "a store option without a value",
        lambda e: ["board", "ls", e("board"), "-o", "endpoint"],
        1,
        ("key=value", "'endpoint'"),
    ),
    CliRow(
        "a span written wrongly",
        lambda e: ["board", "show", e("board"), "--run", "r1", "--span", "3"],
        1,
        ("--span takes A-B",),
    ),
    CliRow(
        "bad key file: not a PEM key at all",
        lambda e: ["board", "show", e("board"), "--run", "r1", "--public-key", e("m0.safetensors")],
        1,
        ("cannot load the Ed25519 public key", "flipsync keygen"),
    ),
    CliRow(
        "bad key file: the private key given to a reader",
        lambda e: ["board", "show", e("board"), "--run", "r1", "--public-key", e("key")],
        1,
        ("public key", "KEY.pub"),
    ),
    CliRow(
        "bad key file: an RSA key to sign with",
        lambda e: ["publish", e("board"), e("m0.safetensors"), "--run", "r8", "--key", e("rsa.pem")],
        1,
        ("RSAPrivateKey", "not Ed25519", "flipsync keygen"),
    ),
    CliRow(
        "bad key file: a signing key that does not exist",
        lambda e: ["publish", e("board"), e("m0.safetensors"), "--run", "r9", "--key", e("nokey.pem")],
        1,
        ("cannot read the private key file", "nokey.pem"),
    ),
    CliRow(
        "resuming a run with another model's checkpoint",
        lambda e: ["publish", e("board"), e("other.safetensors"), "--run", "r1", "--resume"],
        1,
        ("cannot resume run 'r1'", "differ from HEAD's", "another --run name", "--resume --new-weights"),
    ),
    CliRow(
        "--new-weights without --resume",
        lambda e: ["publish", e("board"), e("other.safetensors"), "--run", "r1", "--new-weights"],
        1,
        ("--new-weights", "needs --resume"),
    ),
    CliRow(
        "bad bandwidth string",
        lambda e: ["demo", "--bandwidth", "fast", "--steps", "1", "-o", e("demo")],
        1,
        ("cannot read bandwidth 'fast'", "100mbit"),
    ),
    CliRow(
        "unknown served format for the demo",
        lambda e: ["demo", "--format", "fp7", "--steps", "1", "-o", e("demo")],
        1,
        ("unknown served format 'fp7'",),
    ),
    CliRow(
        "a learning-rate scale of zero for the demo's LM head",
        lambda e: ["demo", "--head-lr-scale", "0", "--steps", "1", "-o", e("demo")],
        1,
        ("--head-lr-scale must be positive",),
    ),
    CliRow(
        "unknown inference engine",
        lambda e: ["sidecar", "--board", e("board"), "--engine", "tensorrt"],
        2,
        ("unknown engine 'tensorrt'", "torch", "vllm"),
    ),
    CliRow(
        "a listen address without a port",
        lambda e: ["sidecar", "--board", e("board"), "--listen", "localhost"],
        2,
        ("'localhost' is not HOST:PORT",),
    ),
    CliRow(
        "a listen port written with a non-ASCII digit",
        lambda e: ["sidecar", "--board", e("board"), "--listen", "127.0.0.1:\u00b2"],
        2,
        ("'127.0.0.1:\u00b2' is not HOST:PORT",),
    ),
    CliRow(
        "wrong served format at the sidecar: --format fp8-block for a bf16 run",
        # --wait-timeout bounds the test should the check regress (the sidecar would otherwise serve on).
        lambda e: ["sidecar", "--board", e("board"), "--run", "r1", "--format", "fp8-block", "--wait-timeout", "5"],
        2,
        ("--format fp8-block does not match run 'r1'", "serves bf16", "--format bf16", "leave --format out"),
    ),
    CliRow(
        "a sidecar's --run naming a run that is not on the board",
        lambda e: ["sidecar", "--board", e("board"), "--run", "r7", "--wait-timeout", "0"],
        2,
        ("run 'r7' does not exist", "the runs there are: r1", "typo", "gave up waiting"),
    ),
    CliRow(
        "a vLLM sidecar without the engine's URL",
        lambda e: ["sidecar", "--board", e("board"), "--run", "r1", "--engine", "vllm", "--listen", "127.0.0.1:0"],
        2,
        ("--upstream", "vllm"),
    ),
    CliRow(
        "a relay told to check the board for waited-for objects without pause",
        lambda e: ["relay", "--board", e("board"), "--listen", "127.0.0.1:0", "--watch-interval", "0"],
        2,
        ("watch interval", "above 0"),
    ),
    CliRow(
        "a sidecar told to list the next version's folder every -1 s",
        lambda e: ["sidecar", "--board", e("board"), "--run", "r1", "--fetch-ahead", "-1"],
        2,
        ("--fetch-ahead", ">= 0", "0: off"),
    ),
]


@pytest.mark.parametrize("row", CLI_ROWS, ids=[r.mistake for r in CLI_ROWS])
def test_cli_misconfiguration(env: Env, row: CliRow) -> None:
    r = runner.invoke(app, row.args(env))
    out = " ".join(r.output.split())  # rich wraps long lines
    assert r.exit_code == row.exit_code, out
    # A clean exit: the error was turned into a message, not raised through typer as a traceback.
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in out
    assert "error:" in out
    for word in row.words:
        assert word in out, f"{word!r} missing from: {out}"


def test_a_board_that_does_not_exist_is_not_created(env: Env) -> None:
    runner.invoke(app, ["board", "ls", env("typo-board")])
    assert not os.path.exists(env("typo-board"))


def test_a_patch_whose_header_names_another_target_writes_nothing(env: Env) -> None:
    """Fuzz finding F3: the header's target view is checked (by stage, before anything is written)."""
    patch = Patch.load(env("pm0m1"))
    bad = patch.with_refs(target=type(patch.header.target)("0" * 32, None))
    Path(env("pbad")).write_bytes(bad.to_bytes())
    r = runner.invoke(app, ["apply", env("m0.safetensors"), env("pbad"), "-o", env("out-bad")])
    out = " ".join(r.output.split())
    assert r.exit_code == 1 and "not the target view 00000000" in out and "nothing was changed" in out, out
    assert not os.path.exists(env("out-bad"))


# -- the Python API and the sidecar's engine ------------------------------------------------------------------


def _tiny_engine_and_view(engine_format: str, view_seed: int, view_layers: int = 1) -> tuple[object, dict]:
    from flipsync.engines.torch.engine import TorchEngine
    from flipsync.engines.torch.models import build_model, preset_config

    engine = TorchEngine(build_model(preset_config("tiny", max_positions=64), seed=1), served_format=engine_format)
    config = preset_config("tiny", max_positions=64)
    config.num_hidden_layers = view_layers
    masters = build_model(config, seed=view_seed, dtype=torch.float32).state_dict()
    return engine, served_view({k: v.detach() for k, v in masters.items()}, "bf16")


def _sidecar_wrong_format() -> None:
    engine, bf16_view = _tiny_engine_and_view("fp8-block", 0)
    engine.load_view(bf16_view)  # type: ignore[attr-defined]


def _sidecar_stages_wrong_format(env: Env) -> None:
    engine, _ = _tiny_engine_and_view("fp8-block", 0)
    engine.stage(Patch.load(env("pm0m1")))  # type: ignore[attr-defined]


def _sidecar_wrong_model() -> None:
    engine, other_view = _tiny_engine_and_view("bf16", 0, view_layers=3)
    engine.load_view(other_view)  # type: ignore[attr-defined]


def _missing_credentials() -> None:
    open_store("s3://flipsync-bucket/board", StoreOptions(allow_metadata_credentials=False))


def _unreachable_bucket() -> None:
    opts = StoreOptions(
        config={"endpoint": "http://127.0.0.1:1", "access_key_id": "k", "secret_access_key": "s", "region": "x"},
        connect_timeout_s=1.0,
        max_retries=0,
        retry_timeout_s=1.0,
    )
    with open_store("s3://flipsync-bucket/board", opts) as store:
        store.get("runs/r1/latest.json")


def _unknown_run_for_the_sidecar() -> None:
    from flipsync.sidecar.service import find_run

    find_run(ObstoreStore(MemoryStore(), "memory://"))


def _apply_to_wrong_base(env: Env) -> None:
    patch = Patch.load(env("pm1m2"))
    view = served_view(_masters(0), "bf16")
    apply_patch(view, patch, FingerprintTable.of(view))


@dataclass(frozen=True)
class ApiRow:
    mistake: str
    call: Callable[[Env], None]
    error: type[FlipsyncError]
    words: tuple[str, ...]


API_ROWS = [
    ApiRow(
        "wrong served format: a sidecar's engine in fp8-block loads a bf16 board's keyframe",
        lambda e: _sidecar_wrong_format(),
        EngineError,
        ("does not fit this model", "weight_scale_inv", "served format (fp8-block)", "match the trainer's"),
    ),
    ApiRow(
        "wrong served format: a sidecar's fp8-block engine stages a bf16 patch",
        _sidecar_stages_wrong_format,
        BaseMismatchError,
        ("served format 'bf16'", "serves 'fp8-block'", "--format bf16"),
    ),
    ApiRow(
        "wrong model: a sidecar's engine loads another model's view",
        lambda e: _sidecar_wrong_model(),
        EngineError,
        ("does not fit this model", "model config"),
    ),
    ApiRow(
        "cloud credentials missing",
        lambda e: _missing_credentials(),
        ConfigError,
        ("no explicit credentials", "s3://flipsync-bucket/board", "AWS_ACCESS_KEY_ID"),
    ),
    ApiRow(
        "an unreachable bucket",
        lambda e: _unreachable_bucket(),
        TransientStoreError,
        ("runs/r1/latest.json", "failed after 1 try over", "check that the store is reachable"),
    ),
    ApiRow(
        "no run on the board the sidecar follows",
        lambda e: _unknown_run_for_the_sidecar(),
        ConfigError,
        ("has no run yet", "--run NAME"),
    ),
    ApiRow(
        "negative bandwidth",
        lambda e: parse_bandwidth("-5mbit"),  # type: ignore[func-returns-value]
        ConfigError,
        ("cannot read bandwidth '-5mbit'", "100mbit"),
    ),
    ApiRow(
        "a crafted fixed-width value stream declaring 2**40 values in one byte",
        lambda e: decode_symbols({"codec": "bits", "bits": 1}, b"\x00", 1 << 40),  # type: ignore[func-returns-value]
        CorruptPatchError,
        ("fixed-width stream of 1 bytes cannot hold 1099511627776 values",),
    ),
    ApiRow(
        "base version mismatch through the Python API",
        _apply_to_wrong_base,
        BaseMismatchError,
        ("this patch applies to view", "resync from a keyframe"),
    ),
    ApiRow(
        "a reader told to list the next version's folder without pause",
        lambda e: FetchAhead(open_store(e("board")), interval_s=0),  # type: ignore[func-returns-value]
        ConfigError,
        ("fetch-ahead interval", "above 0"),
    ),
    ApiRow(
        "a part streamed in chunks of 100 bytes",
        lambda e: PartStream(open_store(e("board")), "v", "a", 0, chunk_bytes=100),  # type: ignore[func-returns-value]
        ConfigError,
        ("stream chunks must be at least 4096 bytes", "100"),
    ),
    ApiRow(
        "reading a run that is not on the board",
        lambda e: open_store(e("board")).get("runs/r7/latest.json"),  # type: ignore[func-returns-value]
        NotFoundError,
        ("runs/r7/latest.json does not exist",),
    ),
]


@pytest.mark.usefixtures("no_cloud_env")
@pytest.mark.parametrize("row", API_ROWS, ids=[r.mistake for r in API_ROWS])
def test_api_misconfiguration(env: Env, row: ApiRow) -> None:
    with pytest.raises(row.error) as info:
        row.call(env)
    message = str(info.value)
    for word in row.words:
        assert word in message, f"{word!r} missing from: {message}"
