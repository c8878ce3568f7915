"""Glue between flipsync and the stacks RL teams already run (Hugging Face / TRL, verl, slime, async rollout
loops); nothing here is needed by the core. See the pages in docs/integrations/.
"""
