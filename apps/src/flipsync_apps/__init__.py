"""Applications built on the flipsync library, apart from its wheel: the end-to-end RL demo, the benchmarks and
the absorption analysis (docs/architecture.md). They add `flipsync demo`, `flipsync bench` and `flipsync analyze`."""
