"""``python -m areal_stream.controller`` as a managed child process."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any


def child_env() -> dict[str, str]:
    """This environment, with this checkout importable (it may not be installed)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


class ControllerProcess:
    """``python -m areal_stream.controller`` as a child process, for examples and tests.

    ``start()`` waits (at most ``timeout`` s) for the ready file and sets ``data`` and
    ``control``; ``stop()`` sends SIGTERM (the controller commits what it holds), waits,
    and kills it if it does not exit in time. Use as a context manager.
    """

    def __init__(
        self,
        config: str,
        *,
        seal_timeout: float | None = None,
        commit_every: float | None = None,
        extra_args: tuple[str, ...] = (),
        timeout: float = 60.0,
    ) -> None:
        self.config = config
        self.timeout = timeout
        self.args = ["--seal-timeout", str(seal_timeout)] if seal_timeout else []
        if commit_every:
            self.args += ["--commit-every", str(commit_every)]
        self.args += list(extra_args)
        self.proc: Any = None
        self.data = ""
        self.control = ""

    def start(self) -> ControllerProcess:
        self._tmp = tempfile.TemporaryDirectory(prefix="areal_stream_ctrl_")
        ready = os.path.join(self._tmp.name, "ready.json")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "areal_stream.controller", "--config", self.config,
             "--bind", "tcp://127.0.0.1:0", "--control", "tcp://127.0.0.1:0",
             "--ready-file", ready, *self.args],
            env=child_env(),
            # Its own session: a terminal's Ctrl-C reaches the owner, which stops the
            # controller last (after the producers said goodbye) with stop().
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + self.timeout
        try:
            while not os.path.exists(ready):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the controller exited with code {self.proc.returncode}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the controller was not ready within {self.timeout}s")
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(0.02)
            with open(ready, encoding="utf-8") as f:
                addr = json.load(f)
        except BaseException:
            self.stop()
            raise
        self.data, self.control = addr["data"], addr["control"]
        return self

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM and wait; returns the exit code (0 on a clean stop)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._tmp.cleanup()
        rc: int = self.proc.returncode
        return rc

    def __enter__(self) -> ControllerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
