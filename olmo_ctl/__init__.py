"""olmo-ctl: run OLMo 3 7B stages 1-3 on TPU slices (GKE, JobSet, Kueue) and on one machine."""

__version__ = "0.1.0"
