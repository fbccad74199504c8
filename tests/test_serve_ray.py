"""`bitnet serve --ray-replicas 2` on a local Ray instance (loopback only) with the bundled model: requests from
the openai client spread over both replicas, and a killed replica is replaced while the other keeps answering.
Bounded: ~3 minutes at most. Skipped (with the reason) when ray[serve] is not installed or Ray cannot start."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai", reason="needs the openai client (pip install .[test])")
pytest.importorskip("ray.serve", reason="Ray Serve not installed (pip install .[cluster])")
from serve_proc import ROOT, free_port  # noqa: E402

pytestmark = pytest.mark.slow


def _instances(client, n):
    seen = []
    for i in range(n):
        raw = client.chat.completions.with_raw_response.create(
            model="bitnet-b1.58-tiny", messages=[{"role": "user", "content": f"What is {i}+1?"}], temperature=0,
            max_tokens=8)
        assert raw.parse().choices[0].message.content
        seen.append(raw.headers["x-bitnet-instance"])
    return seen


def test_ray_two_replicas_spread_and_replace():
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.Popen([sys.executable, "-m", "bitnet_cpu", "serve", "--ray-replicas", "2", "--host", "127.0.0.1",
                             "--port", str(port), "-t", "1", "--parallel", "4"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        up = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                up = httpx.get(url + "/health", timeout=3).status_code == 200
            except httpx.HTTPError:
                pass
            if up:
                break
            time.sleep(1)
        if proc.poll() is not None:
            err = proc.stderr.read()
            pytest.skip(f"Ray could not start here (exit {proc.returncode}): {err.strip().splitlines()[-1:]}")
        assert up, "Ray Serve app not healthy within 150 s"
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=2, timeout=60)
        # both replicas load their own engine; wait until two distinct ones answer (bounded)
        seen = set()
        while len(seen) < 2 and time.monotonic() < deadline:
            seen |= set(_instances(client, 6))
        assert len(seen) == 2, seen

        import ray
        ray.init(address="auto", namespace="serve", logging_level="ERROR", log_to_driver=False)
        try:
            names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                     if "REPLICA" in a["name"] and "bitnet" in a["name"]]
            assert len(names) == 2, names
            ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
            # the other replica keeps answering while the controller starts a replacement
            t0 = time.monotonic()
            after = set()
            while time.monotonic() - t0 < 90:
                after |= set(_instances(client, 3))
                new = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if "REPLICA" in a["name"] and "bitnet" in a["name"]}
                if len(new) == 2 and names[0] not in new and len(after - seen) >= 1:
                    break
                time.sleep(0.5)
            assert names[0] not in new and len(new) == 2, new
            assert after - seen, "no answer from the replacement replica"
        finally:
            ray.shutdown()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
