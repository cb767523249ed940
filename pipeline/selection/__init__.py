"""Checkpoint selection on a held-out volume, and released models taken as the selection."""
