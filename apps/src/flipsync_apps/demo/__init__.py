"""``flipsync demo``: a real, small RL run whose rollouts come from islands that follow the board."""
