"""The island relay: one read-through cache of the board per rollout island (``server``), the Store client
sidecars read it with (``client``), and the ``flipsync relay`` command (``cli``)."""
