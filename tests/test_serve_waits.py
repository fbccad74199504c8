"""serve/offload.py's waits (within, next_or_gone): a handler cancelled just as its next chunk arrives stays
cancelled, and the chunk stays in its queue (asyncio.wait_for, used before, returned the chunk and lost the
cancellation on Python 3.10-3.11); a client that hung up ends the wait; a time limit that passes cancels the
inner wait without taking anything."""
import asyncio

import pytest

from bitnet_cpu.serve import offload
from bitnet_cpu.serve.offload import next_or_gone, within


class Client:
    """What next_or_gone asks of Starlette's Request."""

    def __init__(self, gone=False):
        self.gone = gone
        self.scope = {}   # the request's ASGI scope, where next_or_gone notes when it last looked

    async def is_disconnected(self):
        return self.gone


@pytest.fixture(params=["asyncio.timeout", "asyncio.wait"])
def path(request, monkeypatch):
    """Both ways within() waits run here: asyncio.timeout (Python 3.11+) and Python 3.10's asyncio.wait."""
    if request.param == "asyncio.wait":
        monkeypatch.setattr(offload, "_timeout", None)
    elif offload._timeout is None:
        pytest.skip("asyncio.timeout needs Python 3.11")
    return request.param


def test_cancelled_as_the_chunk_arrives_stays_cancelled(path):
    async def main():
        q = asyncio.Queue()
        waiter = asyncio.ensure_future(next_or_gone(q, Client()))
        await asyncio.sleep(0.01)       # waiting on the empty queue
        q.put_nowait("chunk")           # the chunk and the cancellation in the same turn of the loop
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        if path == "asyncio.timeout":   # the get was cancelled before it took the chunk
            assert q.get_nowait() == "chunk"
    asyncio.run(main())


def test_next_or_gone_returns_items_and_notices_a_hang_up(path):
    async def main():
        q = asyncio.Queue()
        client = Client()
        asyncio.get_running_loop().call_later(0.05, q.put_nowait, 1)
        assert await next_or_gone(q, client, poll=0.01) == 1
        client.gone = True
        assert await next_or_gone(q, client, poll=0.01) is None
        assert q.empty()
    asyncio.run(main())


def test_a_hang_up_is_noticed_while_items_keep_coming(path):
    """A decoding answer gives an item every few ms: the hang-up is still looked for every `poll` s (it used to
    be looked for only after `poll` s without an item, so a non-streaming answer ran to its end for nobody)."""
    async def main():
        q = asyncio.Queue()
        client = Client()
        for i in range(3):
            q.put_nowait(i)
        assert [await next_or_gone(q, client, poll=0.05) for _ in range(3)] == [0, 1, 2]
        client.gone = True
        got = []
        for i in range(1000):   # an item always waiting: at most 5 s of them at 5 ms each
            q.put_nowait(i)
            item = await next_or_gone(q, client, poll=0.05)
            if item is None:
                break
            got.append(item)
            await asyncio.sleep(0.005)
        assert item is None and len(got) < 1000
    asyncio.run(main())


def test_within_times_out_without_taking_anything(path):
    async def main():
        q = asyncio.Queue()
        assert await within(q.get(), 0.01) == (False, None)
        q.put_nowait(2)
        assert await within(q.get(), 0.01) == (True, 2)

        async def fails():
            raise ValueError("boom")
        with pytest.raises(ValueError):
            await within(fails(), 1)
        assert q.empty()
    asyncio.run(main())


def test_a_hang_up_leaves_no_unread_error_behind():
    """unless_gone over a gather() (the echo scoring passes of a prompt list): a hang-up cancels it, and the
    gather ends with its CancelledError set as an exception no one read; asyncio logged 'exception was never
    retrieved' with a traceback in the server's log for every such hang-up."""
    import gc
    from bitnet_cpu.serve.offload import ClientGone, unless_gone
    unread = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unread.append(ctx["message"]))
        with pytest.raises(ClientGone):
            await unless_gone(asyncio.gather(asyncio.sleep(10), asyncio.sleep(10)), Client(gone=True), poll=0.01)
        await asyncio.sleep(0.05)   # the children's cancellations reach the gather
        gc.collect()
        await asyncio.sleep(0.05)
    asyncio.run(main())
    gc.collect()
    assert unread == []
