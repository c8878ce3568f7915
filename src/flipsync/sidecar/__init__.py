"""The sidecar: follows the board, keeps one inference engine bitwise at the newest version, and puts a
version-aware proxy in front of it."""

# Here, not in service.py: the command line checks --engine before it imports torch and the engines.
ENGINE_KINDS = ("torch", "vllm", "sglang")
