"""The pure vocabulary everything else shares (no I/O, no torch): patch ``headers``, board ``manifest``s, fleet
member records (``fleet``) and ``catchup`` planning."""
