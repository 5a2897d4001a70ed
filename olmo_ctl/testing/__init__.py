"""Test support shipped with olmo-ctl: `kube_server`, a Kubernetes API test server with a scripted cluster."""
