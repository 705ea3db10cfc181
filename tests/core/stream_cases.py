"""Stream and Event semantics, shared by the CPU tests (tests/core) and the CUDA tests (tests/gpu).

Each case takes a `make_stream` factory and buffers from a PinnedBufferPool; on a GPU the same cases
run against CUDA streams.
"""

from hetpipe_core import Event, PinnedBufferPool, copy_async


def _buffers(n: int = 4096):
    pool = PinnedBufferPool(4, n)
    slots = [pool.acquire() for _ in range(4)]
    return pool, slots, [s.numpy("uint8") for s in slots]


def in_order(make_stream):
    s = make_stream()
    _pool, slots, views = _buffers()
    views[0][:] = 1
    views[1][:] = 2
    views[3][:] = 0
    s.enqueue_sleep(0.1)
    copy_async(slots[2], slots[0], slots[0].nbytes, s)
    copy_async(slots[2], slots[1], slots[1].nbytes, s)  # later work sees and overwrites the earlier copy
    copy_async(slots[3].ptr, slots[2].ptr, 16, s)
    assert not s.query()
    s.synchronize()
    assert s.query()
    assert (views[2] == 2).all() and (views[3][:16] == 2).all() and (views[3][16:] == 0).all()
    s.close()


def event_after_preceding_work(make_stream):
    s = make_stream()
    _pool, slots, views = _buffers()
    views[0][:] = 7
    e = Event()
    assert e.query()  # never recorded: complete
    s.enqueue_sleep(0.2)
    copy_async(slots[1], slots[0], slots[0].nbytes, s)
    e.record(s)
    s.enqueue_sleep(1.0)  # work after the record does not delay the event
    assert not e.query()
    e.synchronize()
    # Complete, with the copy before it done, while the work after it still runs (an event that waited
    # for that work too would find the stream idle).
    assert e.query() and (views[1] == 7).all()
    assert not s.query()
    s.close()


def wait_for_orders_two_streams(make_stream):
    producer, consumer = make_stream(), make_stream()
    _pool, slots, views = _buffers()
    views[0][:] = 5
    e = Event()
    producer.enqueue_sleep(0.2)
    copy_async(slots[1], slots[0], slots[0].nbytes, producer)
    e.record(producer)
    consumer.wait_for(e)  # does not block the caller
    copy_async(slots[2], slots[1], slots[1].nbytes, consumer)
    consumer.synchronize()
    assert (views[2] == 5).all()
    producer.close()
    consumer.close()


def close_drains_and_refuses(make_stream):
    s = make_stream()
    _pool, slots, views = _buffers()
    views[0][:] = 3
    s.enqueue_sleep(0.05)
    copy_async(slots[1], slots[0], slots[0].nbytes, s)
    s.close()
    assert (views[1] == 3).all()
    assert s.closed and s.query()
    s.close()  # idempotent
    try:
        s.enqueue_sleep(0)
    except RuntimeError as e:
        assert "closed" in str(e)
    else:
        raise AssertionError("enqueue on a closed stream did not raise")


CASES = [in_order, event_after_preceding_work, wait_for_orders_two_streams, close_drains_and_refuses]
