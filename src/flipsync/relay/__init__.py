"""The island relay: one read-through cache of the board per rollout island (``server``); sidecars read it with
`flipsync.stores.HttpStore`, and the ``flipsync relay`` command (``flipsync.cli.relay``) runs it."""
