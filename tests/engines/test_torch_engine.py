"""The torch engine: zero-copy bf16, quantized refresh, all-or-nothing writes, versioned tokens."""

from __future__ import annotations

import threading

import pytest
import torch

from flipsync.codec.bits import int_view
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.engines.torch.engine import SamplingParams, TorchEngine
from flipsync.engines.torch.models import build_model
from flipsync.engines.torch.openai_server import ChoiceText
from flipsync.errors import BaseMismatchError, ConfigError, EngineError
from flipsync.formats import dequantize_view, served_view
from tests.sidecar.sidecar_helpers import TINY, Trainer, same_bits, tiny_engine, tiny_masters


def test_bf16_parameters_are_the_served_tensors(store: object) -> None:
    tr = Trainer(store)  # type: ignore[arg-type]
    eng = tiny_engine("bf16")
    params = dict(eng.model.named_parameters())
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    assert eng.zero_copy
    assert all(eng.served[n].data_ptr() == ptrs[n] for n in params)

    eng.load_view(tr.views[0])
    assert same_bits(eng.served, tr.views[0])
    new = tr.next_view()
    patch, table = tr.make_patch(new)
    staged = eng.stage(patch)
    assert same_bits(eng.served, tr.views[0])  # staging writes nothing
    undo = eng.commit(staged)
    assert same_bits(eng.served, new)
    assert eng.table.view_fp() == table.view_fp() == FingerprintTable.of(new).view_fp()
    # Scattered in place: the model's own parameters changed, their storage did not move.
    assert all(p.data_ptr() == ptrs[n] for n, p in eng.model.named_parameters())
    assert all(torch.equal(int_view(p.data), int_view(new[n])) for n, p in eng.model.named_parameters())
    eng.rollback(undo)
    assert same_bits(eng.served, tr.views[0])
    assert eng.table.view_fp() == tr.fps[0]


@pytest.mark.parametrize(
    ("fmt", "prepared"),
    [("fp8-block", True), ("nvfp4", True), ("mxfp4", True), ("mxfp4", False), ("int8-channel", True)],
)
def test_quantized_commit_refreshes_the_touched_parameters(store: object, fmt: str, prepared: bool) -> None:
    tr = Trainer(store, fmt=fmt)  # type: ignore[arg-type]
    eng = tiny_engine(fmt)
    eng.stage_refresh = prepared  # False: the touched parameters are dequantized inside the commit
    assert not eng.zero_copy
    eng.load_view(tr.views[0])

    def params_match(view: dict[str, torch.Tensor]) -> bool:
        deq = dequantize_view(view, fmt)
        return all(torch.equal(p, deq[n].to(p.dtype)) for n, p in eng.model.state_dict().items())

    assert params_match(tr.views[0])
    new = tr.next_view()
    patch, table = tr.make_patch(new)
    staged = eng.stage(patch)
    assert bool(staged.params) == prepared
    if prepared:  # only the elements that change are written inside the pause
        assert (
            0
            < sum(int(w.positions.numel()) for w in staged.params.values())
            < sum(p.numel() for p in eng.model.parameters())
        )
    assert params_match(tr.views[0])  # prepared aside, nothing written yet
    undo = eng.commit(staged)
    assert same_bits(eng.served, new)
    assert eng.table.view_fp() == table.view_fp()
    assert params_match(new)
    eng.rollback(undo)
    assert same_bits(eng.served, tr.views[0])
    assert params_match(tr.views[0])


def test_stage_refuses_a_patch_for_other_weights(store: object) -> None:
    tr = Trainer(store)  # type: ignore[arg-type]
    eng = tiny_engine()
    eng.load_view(tr.views[0])
    tr.step()
    patch, _ = tr.make_patch(tr.next_view())  # v1 -> v2, but the engine holds v0
    with pytest.raises(BaseMismatchError):
        eng.stage(patch)
    assert same_bits(eng.served, tr.views[0])


def test_load_view_refuses_a_foreign_layout_before_writing() -> None:
    eng = tiny_engine()
    before = {k: v.clone() for k, v in eng.served.items()}
    other = served_view(tiny_masters(), "fp16")  # same names, other dtype
    with pytest.raises(EngineError, match="served format"):
        eng.load_view(other)
    partial = dict(served_view(tiny_masters(), "bf16"))
    partial.pop(next(iter(partial)))
    with pytest.raises(EngineError, match="missing"):
        eng.load_view(partial)
    assert same_bits(eng.served, before)


def test_greedy_generation_is_deterministic_and_stops() -> None:
    eng = tiny_engine()
    prompt = eng.tokenizer.encode("hello")
    a = eng.generate(prompt, SamplingParams(max_tokens=12, temperature=0))
    b = eng.generate(prompt, SamplingParams(max_tokens=12, temperature=0))
    assert a.tokens == b.tokens and len(a.tokens) == 12 and a.finish_reason == "length"
    s1 = eng.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=7))
    s2 = eng.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=7))
    assert s1.tokens == s2.tokens
    first = a.tokens[3]
    stopped = eng.generate(prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=frozenset({first})))
    assert stopped.finish_reason == "stop" and first not in stopped.tokens


def test_every_token_carries_the_version_of_the_weights_that_made_it(store: object) -> None:
    tr = Trainer(store)  # type: ignore[arg-type]
    eng = tiny_engine()
    eng.label_version(tr.fps[0], 0)
    eng.load_view(tr.views[0])
    assert eng.version == 0
    new = tr.next_view()
    patch, table = tr.make_patch(new)
    eng.label_version(table.view_fp(), 1)
    staged = eng.stage(patch)
    reached, resume = threading.Event(), threading.Event()

    def on_token(i: list[int]) -> object:
        def cb(tok: int, version: int | None) -> bool:
            i[0] += 1
            if i[0] == 4:
                reached.set()
                assert resume.wait(10)
            return True

        return cb

    out: dict[str, object] = {}
    t = threading.Thread(
        target=lambda: out.update(
            g=eng.generate(eng.tokenizer.encode("x"), SamplingParams(max_tokens=10, temperature=0), on_token([0]))
        )
    )
    t.start()
    assert reached.wait(10)
    eng.commit(staged)  # between two decode steps of the running sequence
    resume.set()
    t.join(10)
    gen = out["g"]
    assert gen.versions == [0] * 4 + [1] * 6  # type: ignore[attr-defined]


def test_a_write_waits_for_the_decode_step_in_flight() -> None:
    eng = tiny_engine()
    with eng._lock.step():
        done = threading.Event()
        t = threading.Thread(target=lambda: (eng.load_view({k: v.clone() for k, v in eng.served.items()}), done.set()))
        t.start()
        assert not done.wait(0.2)  # held off while a forward pass reads the weights
    assert done.wait(10)
    t.join(10)


def test_stop_strings_never_leak_into_streamed_text() -> None:
    ct = ChoiceText(["END"])
    out = "".join(ct.push(b) for b in b"abcEN") + "".join(ct.push(b) for b in b"Dxyz") + ct.finish()
    assert out == "abc" and ct.stopped
    ct = ChoiceText(["END"])
    out = "".join(ct.push(b) for b in b"abEN!") + ct.finish()
    assert out == "abEN!" and not ct.stopped
    ct = ChoiceText([])
    out = "".join(ct.push(b) for b in "héllo".encode()) + ct.finish()
    assert out == "héllo"


def test_engine_on_fp32_model_for_quantized_formats() -> None:
    model = build_model(TINY, seed=5, dtype=torch.float32)
    eng = TorchEngine(model, served_format="fp8-channel")
    view = served_view(tiny_masters(1), "fp8-channel")
    eng.load_view(view)
    assert same_bits(eng.served, view)
    # bf16 tensors of the view (norms, embeddings) are cast into the fp32 parameters.
    emb = eng.model.state_dict()["model.embed_tokens.weight"]
    assert emb.dtype == torch.float32 and torch.equal(emb, view["model.embed_tokens.weight"].float())


def test_ignore_eos_generates_max_tokens() -> None:
    import httpx

    from flipsync.engines.torch.openai_server import create_engine_app
    from flipsync.serving import ServerThread

    engine = tiny_engine()
    with ServerThread(create_engine_app(engine, max_concurrency=2)) as server, httpx.Client(timeout=60) as client:
        url = server.url + "/v1/completions"
        # Sampling from random weights emits an end-of-sequence token sooner or later: find a seed where it does.
        for seed in range(40):
            body = {"prompt": "x", "max_tokens": 120, "seed": seed, "temperature": 1.0}
            choice = client.post(url, json=body).json()["choices"][0]
            if choice["finish_reason"] == "stop":
                break
        else:
            pytest.fail("no seed stopped early")
        assert len(choice["token_versions"]) < 120
        forced = client.post(url, json={**body, "ignore_eos": True}).json()["choices"][0]
        assert forced["finish_reason"] == "length" and len(forced["token_versions"]) == 120
        assert client.post(url, json={**body, "ignore_eos": "yes"}).status_code == 400


def test_top_logprobs_are_the_top_of_the_raw_distribution_only_when_asked() -> None:
    eng = tiny_engine()
    prompt = eng.tokenizer.encode("ab")
    params = SamplingParams(max_tokens=5, temperature=0.8, seed=4, stop_token_ids=frozenset())
    plain = eng.generate(prompt, params)
    assert plain.top_logprobs == []  # no top-k unless asked
    topped = eng.generate(prompt, SamplingParams(**{**params.__dict__, "top_logprobs": 4}))
    assert topped.tokens == plain.tokens and topped.logprobs == plain.logprobs  # asking changes nothing else
    assert len(topped.top_logprobs) == 5
    for tok, lp, top in zip(topped.tokens, topped.logprobs, topped.top_logprobs, strict=True):
        assert len(top) == 4 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        if tok in dict(top):
            assert dict(top)[tok] == lp  # the same number, not a recomputation


def test_check_prompt_refuses_what_generate_cannot_take() -> None:
    eng = tiny_engine()
    for bad, match in (([], "empty"), ([1] * eng.max_positions, "at most"), ([10**6], "token ids")):
        with pytest.raises(ConfigError, match=match):
            eng.check_prompt(bad)
        with pytest.raises(ConfigError, match=match):
            eng.generate(bad, SamplingParams(max_tokens=1))
    eng.check_prompt([1] * (eng.max_positions - 1))
