"""Group-relative policy gradient (GRPO-style) on rollouts generated elsewhere, plus a short SFT warm start.

The trainer recomputes the log-probabilities of each completion under its own FP32 masters; a rollout's
advantage is its reward minus the mean reward of its group (same prompt), divided by the group's std.
Rollouts come from islands a few versions behind (bounded staleness); for a demo-sized policy step the
plain on-policy estimator is used without importance weights, as many async RL stacks do.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flipsync.apps.demo.task import Problem, ReverseDigits
from flipsync.apps.synthetic import OptimizerSpec, ParamGroup, build_optimizer
from flipsync.engines.torch.tokenizer import ByteTokenizer
from flipsync.errors import ConfigError


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
    patches are made for. Under Muon (`flipsync.apps.synthetic.build_optimizer`) the body's 2-D hidden weights take
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


def policy_loss(model: torch.nn.Module, tok: ByteTokenizer, rollouts: Sequence[Rollout]) -> torch.Tensor:
    adv = advantages(rollouts)
    pairs = [(tok.encode(r.problem.prompt), [*r.tokens, tok.eos_id]) for r in rollouts]
    ids, mask = _batch(tok, pairs)
    logp = _token_logprobs(model, ids)
    scored = mask[:, 1:]
    per_token = -(adv[:, None] * logp) * scored
    return per_token.sum() / scored.sum().clamp_min(1)


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
