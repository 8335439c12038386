"""The encoder cache's bookkeeping: what the runner is told to encode and drop."""

from __future__ import annotations

import pytest
import torch

from pagedbatch.engine.core.encoder_cache import EncoderCache
from pagedbatch.engine.multimodal.inputs import MediaItem


def item(name: str, length: int = 4) -> MediaItem:
    return MediaItem("image", torch.zeros(3, 2, 2), name.encode().ljust(16, b"."), 0, length)


def hashes(items: list[MediaItem]) -> list[bytes]:
    return [i.content_hash for i in items]


def test_an_image_is_encoded_once_while_cached():
    cache = EncoderCache(capacity=8)
    a = item("a")
    cache.hold("r1", a)
    cache.hold("r2", a)
    assert hashes(cache.take_work().encode) == [a.content_hash]
    cache.release("r1")
    cache.release("r2")
    cache.hold("r3", a)  # nobody held it, yet it stayed
    assert cache.take_work().encode == []
    assert (cache.media_encoded, cache.cache_hits) == (1, 2)


def test_held_entries_are_never_evicted():
    cache = EncoderCache(capacity=8)
    a, b, c = item("a"), item("b"), item("c")
    cache.hold("r1", a)
    cache.hold("r2", b)
    assert hashes(cache.take_work().encode) == [a.content_hash, b.content_hash]
    assert not cache.room_for(4)
    cache.release("r1")
    assert cache.room_for(4)
    cache.hold("r3", c)
    work = cache.take_work()
    assert work.free == [a.content_hash]
    assert hashes(work.encode) == [c.content_hash]
    assert cache.used == 8 and not cache.cached(a.content_hash)


def test_least_recently_used_goes_first():
    cache = EncoderCache(capacity=8)
    a, b, c = item("a"), item("b"), item("c")
    for request_id, image in (("r1", a), ("r2", b), ("r3", a)):
        cache.hold(request_id, image)
        cache.take_work()
        cache.release(request_id)
    cache.hold("r4", c)
    assert cache.take_work().free == [b.content_hash]


def test_an_entry_evicted_before_its_step_ran_is_not_encoded():
    cache = EncoderCache(capacity=4)
    a, b = item("a"), item("b")
    cache.hold("r1", a)
    cache.release("r1")  # its request was not scheduled after all
    cache.hold("r2", b)
    work = cache.take_work()
    assert hashes(work.encode) == [b.content_hash] and work.free == []


def test_release_of_one_image_keeps_the_others():
    cache = EncoderCache(capacity=8)
    a, b = item("a"), item("b")
    cache.hold("r1", a)
    cache.hold("r1", b)
    cache.release("r1", a.content_hash)
    assert not cache.holds("r1", a.content_hash) and cache.holds("r1", b.content_hash)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        EncoderCache(0)
