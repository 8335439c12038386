"""S3 blob storage rides out an outage of the S3 server (here: of the proxy in front of it)."""

from __future__ import annotations

import threading
from urllib.parse import urlsplit

from services import S3Server
from tcp_proxy import TcpProxy

from pagedbatch.store.blobs import MIN_PART_SIZE, S3BlobStore

# Longer than boto3's own retries ever wait (legacy mode: four waits of at most 1, 2, 4 and 8 s),
# so that what rides it out is the store's retrying.
OUTAGE_SECONDS = 16.0


def test_writes_and_reads_ride_out_an_outage(s3_server: S3Server, s3_settings_env: str):
    address = urlsplit(s3_server.endpoint_url)
    proxy = TcpProxy(address.hostname, address.port)
    try:
        store = S3BlobStore(
            s3_settings_env, f"http://127.0.0.1:{proxy.port}", part_size=MIN_PART_SIZE
        )
        store.put("kept/small", [b"hello"])
        big = bytes(range(256)) * ((2 * MIN_PART_SIZE + 1000) // 256)  # three parts
        proxy.cut()
        threading.Timer(OUTAGE_SECONDS, proxy.restore).start()
        assert store.put("kept/big", [big]) == len(big)
        proxy.cut()
        threading.Timer(1.0, proxy.restore).start()
        assert b"".join(store.open("kept/small")) == b"hello"
        assert store.size("kept/big") == len(big)
    finally:
        proxy.close()
    assert b"".join(S3BlobStore(s3_settings_env, s3_server.endpoint_url).open("kept/big")) == big
