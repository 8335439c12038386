"""Which webhook URLs may be called: public addresses, and what the allow-list names."""

from __future__ import annotations

import ipaddress

import pytest

from pagedbatch.workers.egress import ForbiddenDestination, check_url, forbidden_kind


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


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("file:///etc/passwd", "must start with https:// or http://"),
        ("http:///path", "has no host"),
        ("http://8.8.8.8:70000/", "not a valid port number"),
        ("http://no-such-host.invalid/", "could not be resolved"),
        ("http://0x7f.1/", "0x7f.1 resolves to 127.0.0.1, which is a loopback address"),
        # 127.0.0.1 or ::1, as the machine's hosts file has it.
        ("http://localhost/", r"localhost resolves to \S+, which is a loopback address"),
    ],
)
def test_other_urls_are_refused_with_the_reason(url, reason):
    with pytest.raises(ForbiddenDestination, match=reason):
        check_url(url, [])
