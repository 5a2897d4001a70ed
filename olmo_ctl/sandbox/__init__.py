"""The sandbox behind `olmo-ctl sandbox`: a Kubernetes API (`kube_server`) with a cluster behind it
(`cluster`), its pods as local processes or image containers, its nodes' faults, the GCS emulator."""
