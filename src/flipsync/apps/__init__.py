"""The applications built on the library: the CLIs, the demo, the benchmarks and the analysis (docs/architecture.md)."""
