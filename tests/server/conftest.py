"""Fixtures shared by the server tests."""
from __future__ import annotations

import openai
import pytest

from benchmarks.server_process import ServerProcess


@pytest.fixture(scope="session")
def open_server():
    """One server with no API keys (fp32, 16 decode slots, 0.1 GiB of KV) for the modules that
    only need a plain server (structured output, tool calling): started once for them all."""
    with ServerProcess("--threads", "1", "--dtype", "float32", "--kv-cache-gib", "0.1", "--max-num-seqs", "16") as proc:
        yield proc


@pytest.fixture(scope="session")
def open_client(open_server):
    """The OpenAI SDK on ``open_server`` (no retries, so a refusal shows as it is)."""
    return openai.OpenAI(base_url=open_server.base_url, api_key="unused", max_retries=0, timeout=300)
