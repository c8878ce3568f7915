"""The pure vocabulary everything else shares: patch headers, board manifests and catch-up planning.

No I/O, no torch: ``headers`` (what a patch says about itself), ``manifest`` (what a board artifact says
about itself) and ``catchup`` (the cheapest way from a replica's version to a goal).
"""
