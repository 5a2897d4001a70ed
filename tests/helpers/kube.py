"""A kubeconfig for a test API server (`KubeServer`): one context, `test`, in namespace `default`."""

from __future__ import annotations

import json
from pathlib import Path


def write_kubeconfig(path: Path, url: str) -> str:
    """Write a kubeconfig pointing at `url` to `path`; returns the path."""
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "test",
                "clusters": [{"name": "test", "cluster": {"server": url}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [
                    {"name": "test", "context": {"cluster": "test", "user": "u", "namespace": "default"}}
                ],
            }
        )
    )
    return str(path)
