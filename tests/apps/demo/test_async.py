"""Off-policy-correct GRPO from per-token data (docs/async.md): the truncated importance weights and their
staleness caps, the per-token facts read from an engine's answer, the busy/idle accounting and the rollout
mode's figures, all on synthetic data (no processes)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flipsync.engines.torch.tokenizer import ByteTokenizer
from flipsync_apps.demo.grpo import Rollout, WeightConfig, policy_loss, token_weights
from flipsync_apps.demo.records import DemoConfig, IslandStep, StepRecord
from flipsync_apps.demo.rollouts import busy_seconds, parse_sample
from flipsync_apps.demo.summary import comparison, quantile, rollout_summary, summary_lines
from flipsync_apps.demo.task import Problem


def test_caps_fall_beyond_the_staleness_bound() -> None:
    caps = WeightConfig(is_cap=2.0, staleness_bound=2).caps(torch.tensor([0, 1, 2, 3, 4, 8]))
    assert caps.tolist() == pytest.approx([2.0, 2.0, 2.0, 2.0 * 2 / 3, 1.0, 0.5])
    # bound 0: every stale token's cap falls as is_cap / s
    assert WeightConfig(2.0, 0).caps(torch.tensor([0, 1, 4])).tolist() == pytest.approx([2.0, 0.0, 0.0])


def test_token_weights_are_truncated_ratios() -> None:
    logp = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5]))
    behaviour = torch.log(torch.tensor([0.5, 0.1, 0.9, 0.1, 0.3]))
    known = torch.tensor([True, True, True, True, False])
    stale = torch.tensor([0, 0, 0, 6, 0])
    w, clipped = token_weights(logp, behaviour, known, stale, WeightConfig(2.0, 2))
    # on-policy 1; 0.5/0.1 = 5 clipped at 2; 0.5/0.9; stale 6 steps: cap 2 * 2/6; unknown behaviour: 1
    assert w.tolist() == pytest.approx([1.0, 2.0, 0.5 / 0.9, 2 / 3, 1.0])
    assert clipped.tolist() == [False, True, False, True, False]


def _model() -> torch.nn.Module:
    from flipsync.engines.torch.model_dir import demo_config
    from flipsync.engines.torch.models import build_model

    return build_model(demo_config("llama-1m"), seed=0, dtype=torch.float32)


def _rollout(tokens: tuple[int, ...], behaviour: tuple[float | None, ...], stale: tuple[int, ...], *, reward: float,
             group: int = 0, stopped: bool = True) -> Rollout:  # fmt: skip
    return Rollout(Problem("12=", "21"), group, "", tokens, reward, 0, 0, "island-0", behaviour, stale, stopped)


def test_on_policy_tokens_weigh_one_and_the_kl_is_zero() -> None:
    """Behaviour log-probs equal to the trained policy's own: every weight is 1, the KL estimates 0, and the
    loss is the plain GRPO loss."""
    model, tok = _model(), ByteTokenizer()
    tokens = [(ord("2"), ord("1")), (ord("3"),)]
    rollouts = [_rollout(t, (), (0,), reward=r) for t, r in zip(tokens, (1.0, 0.0), strict=True)]
    plain, stats = policy_loss(model, tok, rollouts)
    assert stats.corrected == 0 and stats.weight_mean == 1.0 and stats.tokens == 3 + 2  # the stop tokens too
    # the trained policy's log-probs, fed back as the behaviour's
    with torch.no_grad():
        behaviour = []
        for t in tokens:
            ids = torch.tensor([[*tok.encode("12="), *t, tok.eos_id]])
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            start = len(tok.encode("12=")) - 1
            behaviour.append(tuple(float(lp[start + j, ids[0, start + j + 1]]) for j in range(len(t) + 1)))
    on_policy = [_rollout(t, b, (0,) * len(t), reward=r) for t, b, r in zip(tokens, behaviour, (1.0, 0.0), strict=True)]
    loss, stats = policy_loss(model, tok, on_policy)
    assert stats.corrected == stats.tokens == 5
    assert stats.weight_mean == pytest.approx(1.0, abs=1e-5) and stats.clipped == 0.0
    assert abs(stats.kl_k1) < 1e-5 and abs(stats.kl_k3) < 1e-8
    assert float(loss) == pytest.approx(float(plain), rel=1e-5)
    assert stats.staleness == {0: 5}


def test_a_sequence_cut_at_max_tokens_does_not_score_the_stop_token() -> None:
    model, tok = _model(), ByteTokenizer()
    cut = [_rollout((ord("2"), ord("1")), (-1.0, -1.0), (3, 3), reward=r, stopped=False) for r in (0.0, 1.0)]
    _, stats = policy_loss(model, tok, cut)
    assert stats.tokens == 4 and stats.corrected == 4 and stats.staleness == {3: 4}
    assert stats.kl_k3 >= 0


def test_the_engines_answer_gives_per_token_facts() -> None:
    tok = ByteTokenizer()
    steps = {5: 3, 6: 4}.__getitem__  # board version -> trainer step
    choice = {
        "text": "321",
        "finish_reason": "stop",
        "token_versions": [5, 5, 6],
        "logprobs": {"tokens": ["3", "2", "1"], "token_logprobs": [-0.1, -0.2, -0.3]},
    }
    s, aligned = parse_sample(tok, choice, 3, steps)
    assert aligned and s.tokens == (ord("3"), ord("2"), ord("1")) and s.stopped
    assert s.behaviour == (-0.1, -0.2, -0.3) and s.steps == (3, 3, 4) and s.start_step == 3
    # a sampled id outside the bytes has no text: the log-probs would be shifted, so they are left out; at
    # the end it would pass for the stop token's, so one entry more than the text has is refused too
    for pieces, lps in (
        (["3", "", "2", "1"], [-0.1, -5.0, -0.2, -0.3]),
        (["3", "2", "1", ""], [-0.1, -0.2, -0.3, -5.0]),
    ):
        s, aligned = parse_sample(tok, {**choice, "logprobs": {"tokens": pieces, "token_logprobs": lps}}, 3, steps)
        assert not aligned and s.behaviour == ()
    s, aligned = parse_sample(
        tok, {**choice, "text": "", "logprobs": {"tokens": [""], "token_logprobs": [-4.0]}}, 3, steps
    )
    assert not aligned and s.behaviour == () and s.tokens == ()
    # vLLM: no per-token versions, the response's start bounds every token
    s, _ = parse_sample(tok, {**choice, "token_versions": None}, 3, steps)
    assert s.steps == (3, 3, 3)
    # facts that do not line up with the text are left out (those tokens weigh 1), and said so
    s, aligned = parse_sample(tok, {**choice, "logprobs": {"token_logprobs": [-0.1]}}, 3, steps)
    assert not aligned and s.behaviour == ()
    cut, _ = parse_sample(tok, {**choice, "finish_reason": "length"}, 3, steps)
    assert not cut.stopped and cut.behaviour == (-0.1, -0.2, -0.3)


def test_busy_seconds_is_the_union_of_requests() -> None:
    assert busy_seconds([], 0.0, 10.0) == 0.0
    assert busy_seconds([(1.0, 3.0), (2.0, 4.0), (6.0, 7.0)], 0.0, 10.0) == pytest.approx(4.0)
    assert busy_seconds([(-5.0, 1.0), (9.0, 12.0)], 0.0, 10.0) == pytest.approx(2.0)  # clipped to the window
    assert busy_seconds([(1.0, 5.0), (2.0, 3.0)], 0.0, 10.0) == pytest.approx(4.0)  # nested


def test_quantiles_of_a_histogram() -> None:
    hist = {0: 50, 1: 40, 3: 9, 7: 1}
    assert [quantile(hist, q) for q in (0.5, 0.9, 0.99, 1.0)] == [0, 1, 3, 7]
    assert quantile({}, 0.5) is None


def test_the_rollout_figures_and_the_comparison() -> None:
    from io import StringIO

    from rich.console import Console

    docs = []
    for mode, stale in (("sync", {0: 30}), ("inflight", {0: 20, 1: 10})):
        cfg = DemoConfig(rollout=mode)
        records = [
            StepRecord(i, 0.1 * i, 9, {"island-0": IslandStep(0, 9, 0, None, 0)}, t=10.0 * i, tokens=30,
                       kl_k2=0.01, kl_k3=0.01, weight_mean=0.99, clipped=0.02, staleness=stale,
                       staleness_response={0: 15, 1: 15} if mode == "inflight" else stale)
            for i in range(1, 11)
        ]  # fmt: skip
        r = rollout_summary(
            cfg,
            records,
            120.0,
            tokens={"island-0": 600, "island-1": 600},
            generated={"island-0": 100, "island-1": 100},
            dropped={"island-0": 2},
            unaligned={},
            idle_s={"island-0": 10.0, "island-1": 30.0},
        )
        assert r["mode"] == mode and r["tokens_per_s"] == pytest.approx(10.0) and r["idle_s_mean"] == 20.0
        assert r["dropped_pct"] == pytest.approx(1.0) and r["steps_per_min"] == pytest.approx(5.0)
        assert r["reward_gain_per_min"] == pytest.approx((0.8 - 0.3) / 2.0)
        assert r["kl_k3"] == pytest.approx(0.01) and r["trained_tokens"] == 300
        docs.append((mode, {"config": {"lr": 3e-5, "model": "m", "served_format": "bf16"}, "summary": {"rollout": r}}))
        assert any(ln.startswith(f"rollout mode {mode}:") for ln in summary_lines({"rollout": r}))
    inflight = docs[1][1]["summary"]["rollout"]
    assert inflight["staleness_p90"] == 1 and inflight["staleness_max"] == 1
    # a per-response version calls 5 token-steps a step older than they were (15 tokens at 1 step, not 10),
    # in each of the 10 steps
    assert inflight["staleness_overstated_steps"] == 50
    assert math.isclose(inflight["staleness_mean"], 10 / 30)
    console = Console(file=StringIO(), width=160, record=True)
    console.print(comparison(docs))
    out = console.export_text()
    for expected in ("rollout mode", "sync", "inflight", "tokens/s across islands", "island idle s", "KL"):
        assert expected in out


def test_the_warm_start_is_cached_and_the_prompts_stay_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flipsync.engines.torch.model_dir import demo_config
    from flipsync_apps.demo.run import cached_warm_start, warm_start_cache_dir
    from flipsync_apps.demo.task import ReverseDigits

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = DemoConfig(model="llama-1m", warm_start_steps=2)
    arch = demo_config("llama-1m").to_json_string()
    got = []
    for _ in range(2):
        model, task = _model().requires_grad_(True), ReverseDigits(min_len=2, max_len=3, seed=cfg.seed)
        loss = cached_warm_start(model, ByteTokenizer(), task, cfg, arch)
        got.append((loss, {k: v.clone() for k, v in model.state_dict().items()}, task.sample()))
    assert len(list(warm_start_cache_dir().glob("*.safetensors"))) == 1
    (loss0, weights0, next0), (loss1, weights1, next1) = got
    assert loss0 == loss1 and next0 == next1  # the RL run's first prompt is the same, cached or not
    assert all(torch.equal(weights0[k], weights1[k]) for k in weights0)
    assert not torch.equal(weights0["lm_head.weight"], _model().state_dict()["lm_head.weight"])  # it trained
