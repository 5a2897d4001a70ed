"""Notifications: tell someone when a supervised run finishes, fails, is resized or gives up.

Two channels, both site settings (`notify_webhook`, `notify_command`; `olmo-ctl config show`):

  webhook   an HTTP POST of the message as JSON (`Content-Type: application/json`); its `text` field
            is one line, so a Slack or Google Chat incoming webhook shows it as is. Connection errors
            and 5xx answers are retried twice (1 s, then 2 s); any other answer is final. A
            `user:password@` in the URL is sent as `Authorization: Basic` (percent-decoded), never in
            the request line, and not again to where a redirect points.
  command   run with `sh -c`, the message as JSON on its stdin and `OLMO_CTL_NOTIFY_EVENT`,
            `OLMO_CTL_NOTIFY_RUN`, `OLMO_CTL_NOTIFY_TEXT` in its environment.

A notification is a courtesy: one that fails (unreachable, refused, a command that exits non-zero
or hangs past the timeout) is reported as one line through `log` and never changes what the
supervisor does or its exit code. The URL is a secret (Slack's carries it in the path): that line
shows it as `mask_url` does, and its reason is one built here, with nothing of the URL's secret.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from urllib.parse import unquote

from olmo_ctl.core.config import Settings, mask_url, scrub_url, strip_userinfo

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
        webhook = str(self.webhook)
        what = f"notification `{message.get('event')}` to {mask_url(webhook)}"
        url, userinfo = strip_userinfo(webhook)
        for i in range(len(RETRY_DELAYS_S) + 1):
            last = i == len(RETRY_DELAYS_S)
            try:
                req = urllib.request.Request(
                    url, data=body, method="POST", headers={"Content-Type": "application/json"}
                )
                if userinfo is not None:  # urllib never sends a URL's userinfo itself
                    req.add_unredirected_header("Authorization", basic_auth(userinfo))
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    resp.read()
                return
            except urllib.error.HTTPError as e:
                if e.code < 500 or last:
                    self.log(f"{what} failed: HTTP {e.code} {scrub_url(str(e.reason), webhook)}")
                    return
            except (urllib.error.URLError, OSError) as e:
                if last:
                    self.log(f"{what} failed: {_reason(e, webhook)}")
                    return
            except Exception as e:  # a URL urllib refuses (http.client.InvalidURL), a broken answer: final
                self.log(f"{what} failed: {_reason(e, webhook)}")
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


def basic_auth(userinfo: str) -> str:
    """The Authorization header of a URL's `user:password@` (RFC 7617, UTF-8): each part percent-decoded."""
    user, _, password = userinfo.partition(":")
    return "Basic " + base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()


def _reason(e: BaseException, url: str) -> str:
    """Why a POST to `url` failed, in words built here: an OS error's own (`[Errno 111] Connection
    refused`), else the exception's text scrubbed of the URL's secret (http.client.InvalidURL and
    urllib's ValueError quote the URL)."""
    reason = e.reason if isinstance(e, urllib.error.URLError) else e
    if isinstance(reason, OSError) and reason.strerror:
        text = f"[Errno {reason.errno}] {reason.strerror}" if reason.errno is not None else reason.strerror
    else:
        text = str(reason) or type(reason).__name__
    return scrub_url(text, url)
