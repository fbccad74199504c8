"""Soak: 32 concurrent clients for a bounded time (BITNET_SOAK_S, default 60 s; loopback only) mixing full
streams, mid-stream hang-ups, non-streaming requests and bad requests against one `bitnet serve`:
no 5xx, no stuck slot afterwards, and RSS flat after the warm-up third of the run."""
from __future__ import annotations

import asyncio
import json
import os
import random
import time

import httpx
import pytest

pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
from serve_proc import Server  # noqa: E402

pytestmark = pytest.mark.slow
SOAK_S = float(os.environ.get("BITNET_SOAK_S", "60"))
BAD = [({"messages": []}, 400), ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400),
       ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 9}, 400),
       ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400)]


async def client_loop(url, seed, until, stats):
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        while time.monotonic() < until:
            kind = rng.random()
            q = {"role": "user", "content": f"What is {rng.randint(0, 99)}+{rng.randint(0, 99)}?"}
            body = {"messages": [q], "max_tokens": rng.randint(1, 64), "temperature": rng.choice([0, 0.8])}
            if kind < 0.4 or kind >= 0.6 and kind < 0.75:
                hang = kind >= 0.6
                async with c.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as r:
                    stats["status"].append(r.status_code)
                    n, done = 0, False
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            json.loads(line[6:])
                            n += 1
                            if hang and n >= 2:
                                break
                    if r.status_code == 200 and not hang:
                        assert done, "stream ended without [DONE]"
                stats["hangups" if hang else "streams"] += 1
            elif kind < 0.6:
                r = await c.post("/v1/chat/completions", json=body)
                stats["status"].append(r.status_code)
                if r.status_code == 200:
                    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
                stats["plain"] += 1
            else:
                bad, want = rng.choice(BAD)
                r = await c.post("/v1/chat/completions", json=bad)
                stats["status"].append(r.status_code)
                assert r.status_code == want and "error" in r.json()
                stats["bad"] += 1


def test_soak_32_clients():
    s = Server("--parallel", "16", "--max-queue", "64")
    try:
        t0 = time.monotonic()
        until = t0 + SOAK_S
        stats = {"status": [], "streams": 0, "hangups": 0, "plain": 0, "bad": 0}
        rss = []

        async def sample_rss():
            while time.monotonic() < until:
                rss.append((time.monotonic() - t0, s.rss_kb()))
                await asyncio.sleep(1)

        async def main():
            await asyncio.gather(sample_rss(), *(client_loop(s.url, i, until, stats) for i in range(32)))
        asyncio.run(main())
        codes = stats["status"]
        counts = {k: v for k, v in stats.items() if k != "status"}
        print(f"\nsoak {SOAK_S:.0f}s, 32 clients: {len(codes)} requests {counts}, statuses {sorted(set(codes))}")
        assert not [c for c in codes if c >= 500], sorted(set(codes))
        assert stats["streams"] and stats["hangups"] and stats["plain"] and stats["bad"]
        st = s.slots_when_idle()
        assert st["slots"] == [] and st["metrics"]["running"] == 0 and st["metrics"]["waiting"] == 0
        warm = [kb for t, kb in rss if t >= SOAK_S / 3]
        growth_mb = (max(warm[len(warm) // 2:]) - warm[0]) / 1024
        print(f"RSS after warm-up {warm[0] / 1024:.0f} MiB, growth to the end {growth_mb:+.1f} MiB")
        assert growth_mb < 40, f"RSS grew {growth_mb:.1f} MiB after warm-up"
    finally:
        assert s.stop()[0] == 0
