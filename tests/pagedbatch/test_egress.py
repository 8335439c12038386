"""Which webhook URLs may be called: public addresses, and what the allow-list names."""

from __future__ import annotations

import ipaddress

import pytest

from pagedbatch.egress import ForbiddenDestination, check_url, forbidden_kind


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("8.8.8.8", None),
        ("2606:4700:4700::1111", None),
        ("127.0.0.2", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped: judged as the IPv4 address
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fc00::1", "private"),
        ("169.254.10.10", "link-local"),
        ("fe80::1", "link-local"),
        ("169.254.169.254", "cloud metadata"),
        ("fd00:ec2::254", "cloud metadata"),
        ("100.100.100.200", "cloud metadata"),
        ("100.64.0.1", "reserved"),  # carrier-grade NAT
        ("224.0.0.1", "multicast"),
        ("240.0.0.1", "private"),  # reserved, which Python counts as private
        ("0.0.0.0", "private"),
        # IPv6 forms that carry an IPv4 address are judged by it: a translator or a tunnel
        # relay delivers there. NAT64, well-known and local-use prefixes:
        ("64:ff9b::a9fe:a9fe", "cloud metadata"),
        ("64:ff9b::7f00:1", "loopback"),
        ("64:ff9b::a00:1", "private"),
        ("64:ff9b::808:808", None),  # how an IPv6-only network with DNS64 reaches 8.8.8.8
        ("64:ff9b:1::a9fe:a9fe", "cloud metadata"),
        ("64:ff9b:1::808:808", "reserved"),  # a local translator: not clearly global
        # 6to4, refused even to a public address (deprecated relaying):
        ("2002:a9fe:a9fe::1", "cloud metadata"),
        ("2002:c0a8:101::1", "private"),
        ("2002:808:808::1", "reserved"),
        # IPv4-compatible (deprecated):
        ("::a9fe:a9fe", "cloud metadata"),
        ("::7f00:1", "loopback"),
        ("::808:808", "reserved"),
        ("::ffff:a9fe:a9fe", "cloud metadata"),
        ("::ffff:808:808", None),
        # Teredo: 2001:0:<server>:<flags>:<port>:<client, inverted>; the client is 10.0.0.1.
        ("2001:0:4136:e378:8000:63bf:f5ff:fffe", "private"),
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "private"),  # client public: still a tunnel
        # Not global unicast, though Python's is_global passes them:
        ("fec0::1", "site-local"),
        ("3fff::1", "reserved"),  # documentation (RFC 9637)
        ("5f00::1", "reserved"),  # SRv6 SIDs, outside 2000::/3
        ("::", "private"),
        ("100::1", "private"),  # discard-only
        ("2001:db8::1", "private"),  # documentation
        ("ff02::1", "multicast"),
    ],
)
def test_only_public_addresses_are_fit(address, kind):
    assert forbidden_kind(ipaddress.ip_address(address)) == kind


def test_a_public_url_resolves_to_the_address_to_connect_to():
    destination = check_url("https://8.8.8.8:8443/hooks?x=1", [])
    assert (destination.host, destination.port) == ("8.8.8.8", 8443)
    assert destination.url.path == "/hooks" and destination.url.query == b"x=1"
    assert destination.address == ipaddress.ip_address("8.8.8.8")
    assert check_url("http://8.8.8.8/", []).port == 80


def test_the_allow_list_names_hosts_addresses_or_networks():
    assert check_url("http://localhost:8000/", ["LOCALHOST"]).host == "localhost"
    assert check_url("http://127.0.0.1/", ["127.0.0.1"]).port == 80
    assert check_url("http://10.9.8.7/", ["10.0.0.0/8"]).address.is_private
    with pytest.raises(ForbiddenDestination, match="10.9.8.7 is a private address"):
        check_url("http://10.9.8.7/", ["127.0.0.1", "192.168.0.0/16"])
    with pytest.raises(ForbiddenDestination, match="cloud metadata"):
        check_url("http://169.254.169.254/", ["127.0.0.1"])


def test_without_trusted_names_only_listed_addresses_may_be_private():
    """Image hosts: listing a name allows fetching from it, not from what it comes to resolve to."""
    with pytest.raises(ForbiddenDestination, match="non-public address"):
        check_url("http://localhost:8000/", ["localhost"], trust_names=False)
    assert check_url("http://127.0.0.1/", ["127.0.0.1"], trust_names=False).port == 80
    assert check_url("http://8.8.8.8/", ["8.8.8.8"], trust_names=False).port == 80


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("file:///etc/passwd", "must start with https:// or http://"),
        ("http:///path", "has no host"),
        ("http://8.8.8.8:70000/", "not a valid port number"),
        ("https://8.8.8.8:0/", "not a valid port number"),  # not taken for the default
        ("http://no-such-host.invalid/", "could not be resolved"),
        ("http://[64:ff9b::a9fe:a9fe]/", r"64:ff9b::a9fe:a9fe is a cloud metadata address"),
        ("http://[2002:a9fe:a9fe::1]:8080/", "2002:a9fe:a9fe::1 is a cloud metadata address"),
        ("http://[::a9fe:a9fe]/", "::a9fe:a9fe is a cloud metadata address"),
    ],
)
def test_other_urls_are_refused_with_the_reason(url, reason):
    with pytest.raises(ForbiddenDestination, match=reason):
        check_url(url, [])


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("http://0x7f.1/", "127.0.0.1"),  # a name to the URL's reader, an address to the resolver
        ("http://localhost/", "127.0.0.1"),
        ("http://localhost/", "::1"),  # whichever the machine's hosts file has
    ],
)
def test_a_refused_name_does_not_reveal_what_it_resolves_to(url, address):
    with pytest.raises(ForbiddenDestination) as refused:
        check_url(url, [])
    host = url.removeprefix("http://").rstrip("/")
    assert str(refused.value) == (
        f"{host} resolves to a non-public address; webhooks go to public addresses only"
    )
    assert address not in str(refused.value) and "loopback" not in str(refused.value)
