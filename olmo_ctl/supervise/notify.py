"""Notifications: tell someone when a supervised run finishes, fails, is resized or gives up.

Two channels, both site settings (`notify_webhook`, `notify_command`; `olmo-ctl config show`):

  webhook   an HTTP POST of the message as JSON (`Content-Type: application/json`); its `text` field
            is one line, so a Slack or Google Chat incoming webhook shows it as is. Connection errors
            and 5xx answers are retried twice (1 s, then 2 s); any other answer is final.
  command   run with `sh -c`, the message as JSON on its stdin and `OLMO_CTL_NOTIFY_EVENT`,
            `OLMO_CTL_NOTIFY_RUN`, `OLMO_CTL_NOTIFY_TEXT` in its environment.

A notification is a courtesy: one that fails (unreachable, refused, a command that exits non-zero
or hangs past the timeout) is reported as one line through `log` and never changes what the
supervisor does or its exit code.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from olmo_ctl.core.config import Settings

TIMEOUT_S = 10.0
RETRY_DELAYS_S = (1.0, 2.0)
EVENTS = ("finished", "failed", "resized", "gave_up")  # what the supervisor hands over (its `_tell`)


class Notifier:
    def __init__(
        self,
        webhook: str | None = None,
        command: str | None = None,
        *,
        log: Callable[[str], None] = lambda _: None,
        timeout_s: float = TIMEOUT_S,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.webhook = webhook
        self.command = command
        self.log = log
        self.timeout_s = timeout_s
        self.sleep = sleep

    @classmethod
    def from_settings(cls, settings: Settings, log: Callable[[str], None]) -> Notifier | None:
        """The notifier of the site settings; None when neither channel is set."""
        if not settings.notify_webhook and not settings.notify_command:
            return None
        return cls(settings.notify_webhook, settings.notify_command, log=log)

    def __call__(self, message: dict) -> None:
        if self.webhook:
            self._post(message)
        if self.command:
            self._run(message)

    def _post(self, message: dict) -> None:
        body = json.dumps(message, default=str).encode()
        what = f"notification `{message.get('event')}` to {self.webhook}"
        for i in range(len(RETRY_DELAYS_S) + 1):
            req = urllib.request.Request(
                str(self.webhook), data=body, method="POST", headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    resp.read()
                return
            except urllib.error.HTTPError as e:
                if e.code < 500 or i == len(RETRY_DELAYS_S):
                    self.log(f"{what} failed: HTTP {e.code} {e.reason}")
                    return
            except (urllib.error.URLError, OSError) as e:
                if i == len(RETRY_DELAYS_S):
                    self.log(f"{what} failed: {getattr(e, 'reason', e)}")
                    return
            self.sleep(RETRY_DELAYS_S[i])

    def _run(self, message: dict) -> None:
        env = {
            **os.environ,
            "OLMO_CTL_NOTIFY_EVENT": str(message.get("event", "")),
            "OLMO_CTL_NOTIFY_RUN": str(message.get("run", "")),
            "OLMO_CTL_NOTIFY_TEXT": str(message.get("text", "")),
        }
        what = f"notification command for `{message.get('event')}`"
        try:
            p = subprocess.run(
                ["sh", "-c", str(self.command)],
                input=json.dumps(message, default=str),
                text=True,
                env=env,
                capture_output=True,
                timeout=self.timeout_s,
            )
        except subprocess.TimeoutExpired:
            self.log(f"{what} did not finish in {self.timeout_s:g} s; left behind")
            return
        except OSError as e:
            self.log(f"{what} could not start: {e}")
            return
        if p.returncode != 0:
            last = (p.stderr or p.stdout).strip().splitlines()
            self.log(f"{what} exited {p.returncode}" + (f": {last[-1]}" if last else ""))
