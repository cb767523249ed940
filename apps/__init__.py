"""Thin Parsl apps, one module per stage; each calls `pipeline/` and returns.

Every app takes the task's `settings` (a plain dict, also the task's identity with its inputs)
and its contract `io` (apps/contracts.py: its inputs and outputs by name; `inputs`/`outputs`
hold the same files for Parsl, which waits on them), and wraps its work in
`pipeline.core.stamps.run_once`: it does nothing when its outputs carry a stamp of these
settings and of its inputs' current tokens, and stamps them after writing them. The
workflow plans with the same stamps before submitting (`pipeline.core.stamps.plan`) and submits only
the tasks that must run, so Parsl's own app cache is not used: its key could not see a missing or
rewritten output.

Each app returns "ran" or "up to date".
"""
