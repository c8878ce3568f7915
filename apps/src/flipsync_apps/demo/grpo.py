"""Group-relative policy gradient (GRPO-style) on rollouts generated elsewhere, plus a short SFT warm start.

The trainer recomputes the log-probabilities of each completion under its own FP32 masters; a rollout's
advantage is its reward minus the mean reward of its group (same prompt), divided by the group's std.

Rollouts come from islands that may trail the trainer (and that serve BF16, not the FP32 masters), so every
token is weighted by a truncated importance weight (TIS; AReaL's decoupled PPO with one gradient step per
batch, where the proximal policy is the policy being trained): ``w = min(pi_theta / pi_behaviour, cap)``,
detached, with ``pi_behaviour`` the probability the engine sampled the token with (its ``logprobs``). The cap
is ``is_cap`` for tokens at most ``staleness_bound`` trainer steps old and falls as ``is_cap * bound / s``
beyond: the staleness bound is a cap on the weight, not a filter. See docs/async.md.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flipsync.engines.torch.tokenizer import ByteTokenizer
from flipsync.errors import ConfigError
from flipsync_apps.demo.task import Problem, ReverseDigits
from flipsync_apps.synthetic import OptimizerSpec, ParamGroup, build_optimizer


@dataclass(frozen=True)
class Rollout:
    problem: Problem
    group: int
    completion: str
    tokens: tuple[int, ...]  # completion token ids as generated (without the stop token)
    reward: float
    version_start: int
    version_end: int
    island: str
    # per generated token (len(tokens), plus one for the stop token when the engine reported it): the log-prob
    # the engine sampled it with (None: not reported), and its staleness in trainer steps at this batch
    behaviour: tuple[float | None, ...] = ()
    staleness: tuple[int, ...] = ()
    stopped: bool = True  # the sequence ended with the stop token (not at max_tokens): the stop token is scored


@dataclass(frozen=True)
class WeightConfig:
    """The truncated importance weight's cap (``is_cap``) and the staleness beyond which it falls."""

    is_cap: float = 2.0
    staleness_bound: int = 2

    def caps(self, staleness: torch.Tensor) -> torch.Tensor:
        s = staleness.float()
        bound = float(max(self.staleness_bound, 0))
        # is_cap up to the bound, then is_cap * bound / s: older tokens may be weighted down, never up much
        scale = torch.where(s > bound, bound / s.clamp_min(1.0), torch.ones_like(s))
        return self.is_cap * scale


@dataclass
class LossStats:
    """What one step's objective saw: tokens, their weights, the behaviour->trained gap, and staleness."""

    tokens: int = 0  # scored tokens
    corrected: int = 0  # of them, with a behaviour log-prob (the others get weight 1)
    weight_mean: float = 1.0
    clipped: float = 0.0  # share of corrected tokens whose ratio exceeded its cap
    kl_k1: float = 0.0  # mean(log pi_b - log pi_theta) over the corrected tokens: KL(b || theta), unbiased
    kl_k2: float = 0.0  # mean((log r)^2 / 2), r = pi_theta / pi_b: low variance, close to the KL when small
    kl_k3: float = 0.0  # mean(r - 1 - log r): unbiased and >= 0, but heavy-tailed where r is large
    staleness: dict[int, int] | None = None  # trainer steps -> tokens
    # the tokens whose trained log-prob is furthest from the behaviour's: (log ratio, token index, staleness,
    # completion, island), the largest three
    outliers: list[tuple[float, int, int, str, str]] | None = None


def token_weights(
    logp: torch.Tensor, behaviour: torch.Tensor, known: torch.Tensor, staleness: torch.Tensor, weights: WeightConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance weights (detached) and which tokens were clipped. ``logp``: the trained policy's
    log-probs; ``behaviour``: the engine's (any value where ``known`` is False: those tokens get weight 1)."""
    log_ratio = (logp.detach() - behaviour).clamp(max=20.0)  # exp() of a huge gap: clipped anyway
    ratio = torch.exp(log_ratio)
    caps = weights.caps(staleness)
    w = torch.where(known, torch.minimum(ratio, caps), torch.ones_like(ratio))
    return w, known & (ratio > caps)


def advantages(rollouts: Sequence[Rollout]) -> torch.Tensor:
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    groups = torch.tensor([r.group for r in rollouts])
    adv = torch.zeros_like(rewards)
    for g in groups.unique():
        members = groups == g
        r = rewards[members]
        std = r.std(unbiased=False)
        adv[members] = (r - r.mean()) / (std + 1e-4) if std > 0 else 0.0
    return adv


def _batch(tok: ByteTokenizer, pairs: Sequence[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids of prompt+completion, and a mask of the completion positions to score."""
    length = max(len(p) + len(c) for p, c in pairs)
    ids = torch.full((len(pairs), length), tok.eos_id, dtype=torch.long)
    mask = torch.zeros((len(pairs), length), dtype=torch.bool)
    for i, (p, c) in enumerate(pairs):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        mask[i, len(p) : len(p) + len(c)] = True
    return ids, mask


def _token_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def optimizer_spec(cfg: Any) -> OptimizerSpec:
    """The RL optimizer a demo config names (``optimizer``, ``muon_lr_scaling``)."""
    return OptimizerSpec(
        getattr(cfg, "optimizer", "adam"), muon_lr_scaling=getattr(cfg, "muon_lr_scaling", "match_rms_adamw")
    )


def rl_optimizer(
    model: torch.nn.Module, lr: float, head_lr_scale: float = 1.0, *, optimizer: OptimizerSpec | None = None
) -> torch.optim.Optimizer:
    """The optimizer of the RL steps (Adam unless ``optimizer``), in two parameter groups: the output layer (the
    LM head and the final norm before it) learns at ``head_lr_scale`` times ``lr``, the rest at ``lr``. The head
    turns the body's features into the few logits the reward depends on (stop or not, which digit), so a step
    there moves the reward most for the values it changes; the body keeps the low rate whose sparse change
    patches are made for. Under Muon (`flipsync_apps.synthetic.build_optimizer`) the body's 2-D hidden weights take
    Muon steps; the embedding, the head, norms and biases take AdamW steps, the head with the eps below."""
    spec = optimizer or OptimizerSpec()
    named = list(model.named_parameters())
    if head_lr_scale == 1.0:
        return build_optimizer([ParamGroup(named, lr)], spec)
    head_names = ("lm_head.", "model.norm.")
    head = [(n, p) for n, p in named if n.startswith(head_names)]
    body = [(n, p) for n, p in named if not n.startswith(head_names)]
    if not head:
        raise ConfigError("a head learning-rate scale needs a model with an lm_head; this one has none")
    # eps 1e-5 (the usual PPO value) on the head: the rows of tokens the policy never samples get tiny
    # gradients, which Adam at eps 1e-8 would turn into full-size steps that change their served values
    return build_optimizer([ParamGroup(body, lr), ParamGroup(head, lr * head_lr_scale, eps=1e-5)], spec)


def _per_token(rollouts: Sequence[Rollout], prompts: Sequence[int], width: int) -> tuple[torch.Tensor, ...]:
    """Behaviour log-probs, whether known, and staleness, laid out like the scored positions (``[:, 1:]``)."""
    behaviour = torch.zeros((len(rollouts), width))
    known = torch.zeros((len(rollouts), width), dtype=torch.bool)
    stale = torch.zeros((len(rollouts), width), dtype=torch.long)
    for i, (r, p) in enumerate(zip(rollouts, prompts, strict=True)):
        n = len(r.tokens) + (1 if r.stopped else 0)
        for j in range(n):
            col = p - 1 + j  # position p + j predicts from column p - 1 + j of the shifted log-probs
            b = r.behaviour[j] if j < len(r.behaviour) else None
            if b is not None:
                behaviour[i, col], known[i, col] = b, True
            if r.staleness:
                stale[i, col] = r.staleness[min(j, len(r.staleness) - 1)]  # the stop token: the last token's
    return behaviour, known, stale


def policy_loss(
    model: torch.nn.Module,
    tok: ByteTokenizer,
    rollouts: Sequence[Rollout],
    weights: WeightConfig | None = None,
    *,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, LossStats]:
    """The GRPO loss with a truncated importance weight per token, and what it saw. The trained log-probs use
    the sampling temperature, as the behaviour log-probs must (the demo samples at 1.0, where the engine's
    log-probs of the raw logits are the sampling distribution's)."""
    weights = weights or WeightConfig()
    adv = advantages(rollouts)
    prompts = [tok.encode(r.problem.prompt) for r in rollouts]
    # the stop token is scored only where it was sampled: a sequence cut at max_tokens never chose to stop
    pairs = [(p, [*r.tokens, *([tok.eos_id] if r.stopped else [])]) for p, r in zip(prompts, rollouts, strict=True)]
    ids, mask = _batch(tok, pairs)
    logits = model(input_ids=ids).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    scored = mask[:, 1:]
    behaviour, known, stale = _per_token(rollouts, [len(p) for p in prompts], scored.shape[1])
    known &= scored
    w, clipped = token_weights(logp, behaviour, known, stale, weights)
    per_token = -(w * adv[:, None] * logp) * scored
    loss = per_token.sum() / scored.sum().clamp_min(1)
    with torch.no_grad():
        gap = (behaviour - logp)[known]  # log pi_b - log pi_theta
        n_known = int(known.sum())
        hist: dict[int, int] = {}
        for s in stale[scored].tolist():
            hist[s] = hist.get(s, 0) + 1
        outliers = []
        if n_known:
            log_r = torch.where(known, logp - behaviour, torch.zeros_like(logp))
            for flat in log_r.abs().flatten().topk(min(3, n_known)).indices.tolist():
                i, col = divmod(flat, log_r.shape[1])
                j = col - (len(prompts[i]) - 1)
                row = (float(log_r[i, col]), j, int(stale[i, col]), rollouts[i].completion, rollouts[i].island)
                outliers.append(row)
        stats = LossStats(
            tokens=int(scored.sum()),
            corrected=n_known,
            weight_mean=float(w[scored].mean()) if scored.any() else 1.0,
            clipped=float(clipped.sum()) / n_known if n_known else 0.0,
            kl_k1=float(gap.mean()) if n_known else 0.0,
            kl_k2=float((gap**2 / 2).mean()) if n_known else 0.0,
            kl_k3=float((torch.exp(-gap) - 1 + gap).mean()) if n_known else 0.0,
            staleness=dict(sorted(hist.items())),
            outliers=outliers,
        )
    return loss, stats


def warm_start(
    model: torch.nn.Module,
    tok: ByteTokenizer,
    task: ReverseDigits,
    *,
    steps: int,
    lr: float = 3e-3,
    batch: int = 32,
    stop_fraction: float = 1.0,
    max_tokens: int = 8,
    seed: int = 0,
) -> float:
    """Supervised steps on right answers so the RL run starts from a policy with some skill; returns the
    last loss. Uses its own optimizer: the RL optimizer's state starts fresh afterwards.

    ``stop_fraction``: the share of examples whose target ends with the stop token; the others run on with
    random digits to ``max_tokens`` characters. The policy then learns the answers but stops after them
    only sometimes; the reward counts the extra characters as wrong, so the RL run has a clear thing to
    learn (when to stop) besides the answers themselves."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    rng = random.Random(seed)
    loss = torch.tensor(0.0)
    model.train()
    for _ in range(steps):
        problems = [task.sample() for _ in range(batch)]
        targets = []
        for p in problems:
            if rng.random() < stop_fraction:
                targets.append([*tok.encode(p.answer, bos=False), tok.eos_id])
            else:
                ramble = "".join(rng.choice("0123456789") for _ in range(max(0, max_tokens - len(p.answer))))
                targets.append(tok.encode(p.answer + ramble, bos=False))
        ids, mask = _batch(tok, [(tok.encode(p.prompt), t) for p, t in zip(problems, targets, strict=True)])
        logp = _token_logprobs(model, ids)
        loss = -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())
