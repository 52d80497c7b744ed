"""Prefect flows: compose the tasks of tasks/ into the closed loop (profile -> extract -> search -> accept)."""
