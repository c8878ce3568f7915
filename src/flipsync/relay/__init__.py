"""The island relay: one read-through cache of the board per rollout island (``server``), and the Store
client sidecars read it with (``client``)."""
