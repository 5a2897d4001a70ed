"""Backends: where an attempt runs. `local` (processes on this machine) and `gke` (JobSet + Kueue)."""
