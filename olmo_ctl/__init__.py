"""olmo-ctl: run OLMo 3 7B stage 1/2 on TPU slices (GKE, JobSet, Kueue) and on one machine."""

__version__ = "0.1.0"
