"""Which images' and audio clips' encoder outputs the model runner holds, keyed by content hash.

The scheduler decides here, and the runner follows: each step's `EncoderWork` names the items
to encode (their outputs then kept) and the entries to drop first. The cache is bounded in
embeddings, `capacity`, so that a burst of large images cannot take the host's memory.

Invariants: `used` is the sum of the entries' lengths and never exceeds `capacity`; an entry a
request holds a reference on (from the step that scheduled its item until the request's prefill
has passed the item, or it ends or is preempted) is never evicted, so the embeddings a step
reads are there; entries nobody holds stay, least recently used first out, until their room is
needed. The same item in two requests is encoded once while it stays cached.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pagedbatch.engine.multimodal.inputs import MediaItem


@dataclass
class EncoderWork:
    """One step's encoder work, in the order the runner does it: drop, then encode."""

    free: list[bytes] = field(default_factory=list)  # content hashes
    encode: list[MediaItem] = field(default_factory=list)


class EncoderCache:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"encoder_cache_size must be at least 1, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self._entries: OrderedDict[bytes, int] = OrderedDict()  # hash -> embeddings, LRU first
        self._holders: dict[bytes, set[str]] = {}  # hash -> request ids holding it
        self._held: dict[str, set[bytes]] = {}  # request id -> hashes it holds
        self._work = EncoderWork()
        self.media_encoded = 0
        self.cache_hits = 0  # items found cached when a request first needed them

    def cached(self, content_hash: bytes) -> bool:
        return content_hash in self._entries

    def room_for(self, embeddings: int) -> bool:
        """Whether `embeddings` more fit, evicting entries that nobody holds."""
        idle = sum(n for h, n in self._entries.items() if not self._holders.get(h))
        return self.used - idle + embeddings <= self.capacity

    def hold(self, request_id: str, item: MediaItem) -> None:
        """The request will read `item`'s embeddings: from the cache if there, else encoded in
        this step (the caller checked `room_for`)."""
        h = item.content_hash
        if h in self._entries:
            self._entries.move_to_end(h)
            if request_id not in self._holders.get(h, ()):
                self.cache_hits += 1
        else:
            self._evict_for(item.length)
            self._entries[h] = item.length
            self.used += item.length
            self._work.encode.append(item)
            self.media_encoded += 1
        self._holders.setdefault(h, set()).add(request_id)
        self._held.setdefault(request_id, set()).add(h)

    def holds(self, request_id: str, content_hash: bytes) -> bool:
        return content_hash in self._held.get(request_id, ())

    def release(self, request_id: str, content_hash: bytes | None = None) -> None:
        """Drop the request's reference on one item, or on all of them; the entries stay."""
        held = self._held.get(request_id)
        if not held:
            return
        for h in [content_hash] if content_hash is not None else list(held):
            if h in held:
                held.discard(h)
                self._holders[h].discard(request_id)
        if not held:
            del self._held[request_id]

    def take_work(self) -> EncoderWork:
        work, self._work = self._work, EncoderWork()
        return work

    def _evict_for(self, embeddings: int) -> None:
        for h in list(self._entries):
            if self.used + embeddings <= self.capacity:
                return
            if not self._holders.get(h):
                self.used -= self._entries.pop(h)
                self._holders.pop(h, None)
                # Not yet encoded (work not yet taken, the step having run nothing): never mind.
                encode = self._work.encode
                if any(item.content_hash == h for item in encode):
                    self._work.encode = [item for item in encode if item.content_hash != h]
                else:
                    self._work.free.append(h)
