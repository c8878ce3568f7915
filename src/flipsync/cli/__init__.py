"""The operational command line (``flipsync``): one module a command or group, assembled by `flipsync.cli.main`."""
