"""The OpenAI-compatible API server over a live mesh, for tests (tests/test_api.py, tests/test_tools.py)."""

from __future__ import annotations

import contextlib
import json

import aiohttp
import openai

from meshinfer.app.api import ApiServer
from meshinfer.client.mesh import MeshClient

#: Advert lifetime, seconds: long enough that a loaded test machine never sees a peer expire mid-test.
STEADY_TTL_S = 30.0


@contextlib.asynccontextmanager
async def served(peers, **options):
    """An API server on 127.0.0.1:0 over ``peers`` and an AsyncOpenAI client for it."""
    async with MeshClient(list(peers[0].addrs)) as client:
        server = ApiServer(client, host="127.0.0.1", port=0, **options)
        await server.start()
        api = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        try:
            yield server, api
        finally:
            await api.close()
            await server.close()


async def raw_post(server, body, *, raw: bytes | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/chat/completions", data=raw if raw is not None else json.dumps(body),
                             headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.json()
