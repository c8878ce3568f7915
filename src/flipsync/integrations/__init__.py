"""Glue between flipsync and the stacks RL teams already run; nothing here is needed by the core.

Its one job: connect flipsync's trainer ``Publisher`` and board readers to other people's training loops,
clients and storage setups, without changing them. ``hf``: a ``transformers.TrainerCallback`` that publishes
every optimizer step of any ``Trainer`` (TRL's ``GRPOTrainer`` included; needs the ``hf`` extra).
``rollouts``: an async rollout loop over island proxies with the ``openai`` client, version constraints and
a staleness bound. ``verl``: a verl 0.9 checkpoint engine over a board (needs verl); ``slime``: a slime / miles
post-write hook that publishes every disk weight sync; ``named``: publish whole sets of named tensors at a
stack's own steps, and a host copy that follows a run and says what changed. Mirrored boards (a reader
following a regional copy) are a board concern and live in ``flipsync.board.mirror``.
"""
