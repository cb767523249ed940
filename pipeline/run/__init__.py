"""The run itself: its settings, the run-dir layout, the lock, the watchdog, the code copy, the report."""
