"""SIGTERM drain and engine-process death, each on its own server."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from benchmarks.server_process import ServerProcess

pytestmark = pytest.mark.model

ARGS = ("--threads", "1", "--dtype", "float32", "--kv-cache-gib", "0.1")


class StreamReader(threading.Thread):
    """Reads one streamed completion in the background, keeping its events and their times."""

    def __init__(self, server, body: dict):
        super().__init__(daemon=True)
        self.server, self.body = server, {**body, "stream": True}
        self.events: list[tuple[float, str]] = []
        self.status: int | None = None
        self.first = threading.Event()
        self.error: Exception | None = None

    def run(self):
        try:
            with httpx.stream("POST", self.server.url + "/v1/completions", json=self.body, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append((time.monotonic(), line[6:]))
                        self.first.set()
        except httpx.HTTPError as exc:
            self.error = exc
        finally:
            self.first.set()

    def finish_reasons(self) -> list[str]:
        reasons = []
        for _, data in self.events:
            if data != "[DONE]":
                for choice in json.loads(data).get("choices", []):
                    if choice.get("finish_reason"):
                        reasons.append(choice["finish_reason"])
        return reasons


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_drains_then_exits_cleanly():
    server = ServerProcess(*ARGS, "--drain-timeout", "5").start()
    try:
        engine_pid = server.engine_pid()
        short = StreamReader(server, {"prompt": "Hello", "max_tokens": 12, "ignore_eos": True})
        long = StreamReader(server, {"prompt": "Count to a thousand:", "max_tokens": 2000, "ignore_eos": True})
        short.start()
        long.start()
        assert short.first.wait(60) and long.first.wait(60)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        assert httpx.get(server.url + "/ready", timeout=10).status_code == 503
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "server_shutting_down"
        short.join(30)
        long.join(30)
        assert short.finish_reasons() == ["length"] and short.events[-1][1] == "[DONE]"
        assert long.finish_reasons() == ["abort"] and long.events[-1][1] == "[DONE]"
        assert server.process.wait(30) == 0
        deadline = time.monotonic() + 10
        while _pid_alive(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _pid_alive(engine_pid)
    finally:
        server.stop()


def test_engine_death_fails_requests_and_exits_nonzero():
    server = ServerProcess(*ARGS).start()
    try:
        engine_pid = server.engine_pid()
        streams = [StreamReader(server, {"prompt": f"Story {i}:", "max_tokens": 2000, "ignore_eos": True})
                   for i in range(3)]
        for s in streams:
            s.start()
        assert all(s.first.wait(60) for s in streams)
        result = {}

        def whole():
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"prompt": "Another story:", "max_tokens": 2000, "ignore_eos": True})
            result["status"], result["body"] = r.status_code, r.json()
        blocking = threading.Thread(target=whole, daemon=True)
        blocking.start()
        time.sleep(0.5)
        os.kill(engine_pid, signal.SIGKILL)
        for s in streams:
            s.join(60)                                    # generous: no wall-clock bound on the end
            assert not s.is_alive(), "a stream did not end after the engine died"
            assert s.error is None and s.status == 200
            assert s.events[-1][1] == "[DONE]"
            assert json.loads(s.events[-2][1])["error"]["code"] == "engine_unavailable"
            assert "length" not in s.finish_reasons()     # ended by the engine's death, not by max_tokens
        blocking.join(60)
        assert result["status"] == 503 and result["body"]["error"]["code"] == "engine_unavailable"
        try:
            assert httpx.get(server.url + "/ready", timeout=5).status_code == 503
        except httpx.ConnectError:
            pass                                          # already exited
        assert server.process.wait(30) != 0
    finally:
        server.stop()
