"""Fleet member records: canonical JSON round trip, strict validation of what a board holds, and the routing
rules (liveness, readiness, admission, ranking) a gateway applies to them."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flipsync.domain.fleet import (
    MAX_RECORD_BYTES,
    MEMBER_STATES,
    MemberRecord,
    Want,
    admits,
    floor_version,
    is_ready,
    lag_behind,
    liveness,
    rank,
    readiness,
    replica_id_for,
    satisfies,
    serves,
)
from flipsync.domain.manifest import Signature, canonical_json
from flipsync.errors import IntegrityError

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


def iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def record(**over: Any) -> MemberRecord:
    fields: dict[str, Any] = {
        "replica": "r1",
        "run": "run",
        "island": "eu-1",
        "url": "http://10.0.0.5:8100",
        "engine": "torch",
        "served_format": "bf16",
        "model": "flipsync-torch",
        "version": 7,
        "view_fp": "ab" * 16,
        "head": 9,
        "state": "idle",
        "serving": True,
        "in_flight": 2,
        "heartbeat": iso(NOW),
        "ttl_s": 15.0,
        "started": iso(NOW - timedelta(minutes=5)),
        "seq": 3,
    }
    fields.update(over)
    return MemberRecord(**fields)


def as_dict(**over: Any) -> dict[str, Any]:
    d = record().to_dict()
    d.update(over)
    return d


def test_round_trip_is_canonical_and_lag_is_derived() -> None:
    r = record()
    text = r.to_json()
    assert MemberRecord.from_json(text) == r
    assert text == canonical_json(json.loads(text))
    assert json.loads(text)["lag"] == 2 == r.lag
    assert record(head=None).lag is None and record(version=None, view_fp=None, serving=False).lag is None
    sig = Signature(alg="ed25519", key_id="0123456789abcdef", value="c2lnbmF0dXJl")
    signed = r.with_signature(sig)
    assert MemberRecord.from_json(signed.to_json()) == signed
    assert b"signature" not in signed.signing_payload() and signed.signing_payload() == r.signing_payload()


names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)


@settings(max_examples=200, deadline=None)
@given(
    replica=names,
    run=names,
    island=names,
    host=st.from_regex(r"[a-z][a-z0-9-]{0,15}", fullmatch=True),
    port=st.integers(1, 65535),
    model=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:/+-]{0,30}", fullmatch=True),
    version=st.none() | st.integers(0, 10**12),
    head=st.none() | st.integers(0, 10**12),
    state=st.sampled_from(MEMBER_STATES),
    in_flight=st.integers(0, 10**6),
    ttl=st.floats(0.001, 3600, allow_nan=False) | st.integers(1, 3600),
    seq=st.integers(0, 2**63),
    serving=st.booleans(),
)
def test_round_trip_property(
    replica: str,
    run: str,
    island: str,
    host: str,
    port: int,
    model: str,
    version: int | None,
    head: int | None,
    state: str,
    in_flight: int,
    ttl: float,
    seq: int,
    serving: bool,
) -> None:
    r = record(
        replica=replica,
        run=run,
        island=island,
        url=f"https://{host}:{port}/v1",
        model=model,
        version=version,
        view_fp=None if version is None else "0f" * 8,
        head=head,
        state=state,
        in_flight=in_flight,
        ttl_s=ttl,
        seq=seq,
        serving=serving and version is not None,
    )
    back = MemberRecord.from_json(r.to_json())
    assert back == r and back.to_json() == r.to_json()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("replica", "../x", "replica must be"),
        ("replica", 5, "replica must be"),
        ("run", "", "run must be"),
        ("island", "eu 1", "island must be"),
        ("url", "ftp://10.0.0.5:8100", "http:// or https://"),
        ("url", "http://user:pw@10.0.0.5:8100", "credentials"),
        ("url", "http://10.0.0.5:8100/?x=1", "query"),
        ("url", "http://10.0.0.5:99999", "not a valid URL"),
        ("url", "http://", "with a host"),
        ("url", "http://exa mple.com", "not a valid URL"),
        ("url", "http://" + "a" * 600, "at most 512"),
        ("engine", "", "engine must be"),
        ("served_format", "bf16 fp8", "served_format"),
        ("model", "name@fp8", "no '@'"),
        ("model", "", "model must be"),
        ("version", -1, "non-negative integer"),
        ("version", True, "non-negative integer"),
        ("version", 1.5, "non-negative integer"),
        ("view_fp", "XYZ", "lowercase hex"),
        ("head", "9", "non-negative integer"),
        ("state", "running", "state must be one of"),
        ("serving", "yes", "true or false"),
        ("in_flight", -2, "non-negative integer"),
        ("heartbeat", "yesterday", "ISO 8601"),
        ("heartbeat", "2026-12-01T12:00:00", "time zone"),
        ("started", 12, "ISO 8601 time string"),
        ("ttl_s", 0, "ttl_s"),
        ("ttl_s", 4000, "ttl_s"),
        ("ttl_s", True, "ttl_s"),
        ("ttl_s", "15", "ttl_s"),
        ("seq", None, "non-negative integer"),
        ("schema", 2, "not supported"),
        ("lag", 0, "lag 0 is not head - version"),
        ("signature", {"alg": "rsa", "key_id": "00", "value": "AA=="}, "signature algorithm"),
        ("signature", "sig", "signature must be an object"),
    ],
)
def test_invalid_fields_are_refused_naming_the_field(field: str, value: Any, message: str) -> None:
    with pytest.raises(IntegrityError, match=message) as e:
        MemberRecord.from_json(json.dumps(as_dict(**{field: value})))
    assert str(e.value).startswith("invalid member record:")


def test_inconsistent_records_are_refused() -> None:
    with pytest.raises(IntegrityError, match="both set"):
        record(view_fp=None)
    with pytest.raises(IntegrityError, match="without a version cannot be serving"):
        record(version=None, view_fp=None, serving=True)
    with pytest.raises(IntegrityError, match="unknown fields"):
        MemberRecord.from_json(json.dumps({**as_dict(), "extra": 1}))
    d = as_dict()
    del d["heartbeat"]
    with pytest.raises(IntegrityError, match="missing fields"):
        MemberRecord.from_json(json.dumps(d))


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"{",
        b"[]",
        b"null",
        b'{"replica": NaN}',
        b"\xff\xfe",
        b"[" * 5000 + b"]" * 5000,
        b'{"a": "' + b"x" * MAX_RECORD_BYTES + b'"}',
    ],
)
def test_garbage_is_an_integrity_error(text: bytes) -> None:
    with pytest.raises(IntegrityError, match="invalid member record"):
        MemberRecord.from_json(text)


def test_an_unhashable_value_where_a_name_belongs_is_refused() -> None:
    with pytest.raises(IntegrityError):
        MemberRecord.from_json(json.dumps(as_dict(state=["idle"])))


def test_liveness_ttl_skew_and_cap() -> None:
    r = record()
    assert liveness(r, NOW) is None
    assert liveness(r, NOW + timedelta(seconds=15)) is None  # the boundary is still live
    assert "expired" in (liveness(r, NOW + timedelta(seconds=15.01)) or "")
    assert "future" in (liveness(r, NOW - timedelta(seconds=6)) or "")
    assert liveness(r, NOW - timedelta(seconds=4)) is None  # within the clock skew allowed
    assert "TTL 5" in (liveness(r, NOW + timedelta(seconds=6), max_ttl_s=5) or "")  # a reader caps a long TTL


def test_readiness_rules() -> None:
    assert lag_behind(record(version=7), 9) == 2 and lag_behind(record(version=9), 7) == 0
    assert lag_behind(record(), None) is None
    assert is_ready(record(version=7), 9, max_lag=2) and not is_ready(record(version=6, head=9), 9, max_lag=2)
    assert not is_ready(record(state="draining"), 9, max_lag=5)
    assert not is_ready(record(version=None, view_fp=None, serving=False), 9, max_lag=5)
    assert not is_ready(record(serving=False), 7, max_lag=5)
    assert not is_ready(record(), None, max_lag=5)  # no HEAD read yet: nothing is ready
    members = [record(replica="a", version=9), record(replica="b", version=8), record(replica="c", version=9)]
    assert readiness(members, 9) == pytest.approx(2 / 3)
    assert readiness([], 9) is None and readiness(members, None) is None


def test_admission_by_constraint_model_format_and_run() -> None:
    r = record(version=7)
    head = 9
    assert admits(r, Want(min_version=7), head, max_lag=0)  # a satisfied constraint needs no readiness
    assert not admits(r, Want(min_version=8), head, max_lag=5)
    assert admits(r, Want(exact_version=7), head, max_lag=0)
    assert not admits(r, Want(exact_version=8), head, max_lag=5)
    assert not admits(r, Want(min_version=5, exact_version=6), head, max_lag=5)  # the stricter wins
    assert admits(r, Want(), head, max_lag=2) and not admits(r, Want(), head, max_lag=1)
    assert not admits(record(state="draining"), Want(min_version=0), head, max_lag=5)
    assert serves(r, Want(model="flipsync-torch", served_format="BF16", run="run"))
    assert not serves(r, Want(model="other")) and not serves(r, Want(served_format="fp8-block"))
    assert not serves(r, Want(run="run-fp8"))
    assert not admits(r, Want(model="other", min_version=0), head, max_lag=5)
    assert satisfies(3, Want()) and not satisfies(None, Want())
    assert floor_version(Want(), 9, 2) == 7 and floor_version(Want(), 1, 2) == 0
    assert floor_version(Want(min_version=3), 9, 2) is None and floor_version(Want(), None, 2) is None
    assert Want().describe() == "any ready replica"
    assert "exactly v3" in Want(exact_version=3, model="m").describe()


def test_rank_least_in_flight_first() -> None:
    a = record(replica="a", in_flight=5, version=8)
    b = record(replica="b", in_flight=1, version=7)
    c = record(replica="c", in_flight=1, version=9)
    assert [r.replica for r in rank([a, b, c])] == ["c", "b", "a"]  # the record's count, then newer version
    assert [r.replica for r in rank([a, b, c], {"c": 2, "b": 2})] == ["a", "c", "b"]  # the caller's own first


def test_replica_ids_from_urls() -> None:
    assert replica_id_for("http://10.0.0.5:8100") == "10.0.0.5-8100"
    assert replica_id_for("https://island-a.example.com/v1") == "island-a.example.com-443"
    assert replica_id_for("http://[::1]:8100") == "1-8100"


def test_rank_breaks_ties_at_random_with_a_generator() -> None:
    import random

    same = [record(replica=n, in_flight=0, version=5) for n in "abcd"]
    assert [r.replica for r in rank(same)] == ["a", "b", "c", "d"]
    rng = random.Random(0)
    firsts = {rank(same, None, rng)[0].replica for _ in range(50)}
    assert firsts == set("abcd")
    assert rank([record(replica="x", in_flight=3), *same], None, rng)[-1].replica == "x"  # load still first
