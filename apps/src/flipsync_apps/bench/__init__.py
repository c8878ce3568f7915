"""``flipsync bench``: side-by-side measurements of flipsync against the methods other systems use.

One module per section (``codec``, ``board``, ``trainer``, ``sidecar``, ``crossregion``, ``scaling``), run
on the workloads of ``workload``; ``all`` runs them and writes docs/benchmarks.md with ``report``.
"""
