"""Shared test settings: a bounded hypothesis profile so the suite fits CI's 2 cores."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    # CI (CI=true) replays the same examples every run so that a landing never depends on luck;
    # developers' runs explore new ones (and HYPOTHESIS_PROFILE=thorough explores many more).
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
