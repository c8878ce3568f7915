"""The sidecar: follows the board, keeps one inference engine bitwise at the newest version, and puts a
version-aware proxy in front of it."""
