"""The sandbox's kubeconfig: the one context (cluster and user of the same name) it names.

A running sandbox writes it (`Sandbox.write_kubeconfig`, which never replaces a kubeconfig that names
any other context); whoever reaches that sandbox through it reads the server and token back
(`faults.send`, `olmo-ctl sandbox fault`).
"""

CONTEXT = "olmo-ctl-sandbox"
