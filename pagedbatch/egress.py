"""Where webhooks may be sent: public addresses only, unless the operator allows more.

A webhook URL is chosen by a tenant and fetched from inside the deployment, so without a check it
could reach the metadata service, the database or anything else on the private network. Each URL
is checked when it is registered and again before every attempt (what a name resolves to can
change), and the attempt connects to the very address that was checked, so a name cannot resolve
to a public address for the check and a private one for the connection.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Cloud metadata services (AWS, GCP and Azure; AWS over IPv6; Alibaba): the first is link-local
# and the second private anyway, but they are the prize an attacker wants, so they are named.
METADATA_ADDRESSES = {
    ipaddress.ip_address("169.254.169.254"),
    ipaddress.ip_address("fd00:ec2::254"),
    ipaddress.ip_address("100.100.100.200"),
}

# IPv6 addresses that stand for one IPv4 address: a packet to them goes to exactly that address
# (an IPv4-mapped one over a dual-stack socket, a NAT64 one through the translator).
NAT64_WELL_KNOWN = ipaddress.ip_network("64:ff9b::/96")
# Prefixes whose last 32 bits are an IPv4 address that a tunnel or translator may reach:
# IPv4-compatible (::/96, deprecated) and NAT64's local-use /48 (RFC 8215; local /96 prefixes
# embed there). Never global themselves, but the embedded address names the kind of refusal.
LOW_32_BITS_IPV4 = [ipaddress.ip_network("::/96"), ipaddress.ip_network("64:ff9b:1::/48")]
# IPv6 global unicast; Python's `is_global` also passes reserved blocks outside it (NAT64's
# 64:ff9b::/96, site-local fec0::/10, ...), so an address must be in here to be public.
GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")
# Special-purpose blocks inside 2000::/3 that are not globally reachable (IANA's IPv6
# special-purpose registry): IETF protocol assignments (Teredo, benchmarking, ...), 6to4
# (judged by its embedded address first, then refused as deprecated relaying), documentation.
NOT_GLOBAL_IPV6 = [
    ipaddress.ip_network("2001::/23"),
    ipaddress.ip_network("2001:db8::/32"),
    ipaddress.ip_network("2002::/16"),
    ipaddress.ip_network("3fff::/20"),
]


class ForbiddenDestination(ValueError):
    """The URL may not be a webhook; the message says why, for the endpoint's owner."""


@dataclass(frozen=True)
class Destination:
    url: httpx.URL  # parsed once, by the client that sends the request
    host: str  # lower case, without brackets, IDNA-encoded
    port: int
    address: IPAddress  # the checked address to connect to


def check_url(url: str, allowed_hosts: Sequence[str], trust_names: bool = True) -> Destination:
    """Resolve `url`'s host and return where to connect, or raise `ForbiddenDestination`.

    Every address the host resolves to must be public, or allowed by `allowed_hosts` (host names,
    addresses or networks): one bad address among good ones is refused too. Without
    `trust_names`, a listed name does not vouch for what it resolves to: only listed addresses
    and networks may be other than public.
    """
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise ForbiddenDestination(f"the URL is malformed ({e})") from None
    if parsed.scheme not in ("http", "https"):
        raise ForbiddenDestination("the URL must start with https:// or http://")
    host = parsed.raw_host.decode("ascii").lower()
    if not host:
        raise ForbiddenDestination("the URL has no host")
    # Not `parsed.port or ...`: port 0, which no server listens on, would pass as the default.
    port = parsed.port if parsed.port is not None else (443 if parsed.scheme == "https" else 80)
    if not 0 < port < 65536:
        raise ForbiddenDestination("the URL's port is not a valid port number")
    addresses = _resolve(host, port)
    host_allowed = trust_names and any(entry.strip().lower() == host for entry in allowed_hosts)
    networks = _networks(allowed_hosts)
    for address in addresses:
        if host_allowed or any(address in network for network in networks):
            continue
        kind = forbidden_kind(address)
        if kind is None:
            continue
        if _is_literal(host, address):
            raise ForbiddenDestination(
                f"{host} is a {kind} address; webhooks go to public addresses only"
            )
        # What an internal name resolves to is the deployment's business, not the tenant's.
        raise ForbiddenDestination(
            f"{host} resolves to a non-public address; webhooks go to public addresses only"
        )
    return Destination(parsed, host, port, addresses[0])


def forbidden_kind(address: IPAddress) -> str | None:
    """What makes `address` unfit for a webhook, or None for a public address.

    An IPv6 address that carries an IPv4 address (mapped, NAT64, compatible, 6to4, Teredo) is
    judged by that IPv4 address: a translator or tunnel relay would deliver to it. Mapped and
    well-known NAT64 addresses are only that IPv4 address; the tunnelling forms are refused even
    when it is public. Beyond the named kinds, anything not clearly global unicast is refused.
    """
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return _kind(address.ipv4_mapped)
        if address in NAT64_WELL_KNOWN:
            return _kind(_low_32_bits(address))
        for embedded in _tunnelled_ipv4(address):
            if (kind := _kind(embedded)) is not None:
                return kind
    return _kind(address)


def _kind(address: IPAddress) -> str | None:
    if address in METADATA_ADDRESSES:
        return "cloud metadata"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_private:
        return "private"
    if address.is_multicast:
        return "multicast"
    if isinstance(address, ipaddress.IPv6Address):
        if address.is_site_local:
            return "site-local"
        if address not in GLOBAL_UNICAST or any(address in net for net in NOT_GLOBAL_IPV6):
            return "reserved"
    if not address.is_global:  # unspecified, reserved, shared (100.64.0.0/10), ...
        return "reserved"
    return None


def _tunnelled_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    if address.sixtofour is not None:
        return [address.sixtofour]
    if address.teredo is not None:
        return list(address.teredo)  # the relay server, and the client packets end at
    # :: and ::1 are in ::/96 but are the unspecified and loopback addresses, not IPv4 ones.
    if int(address) > 1 and any(address in prefix for prefix in LOW_32_BITS_IPV4):
        return [_low_32_bits(address)]
    return []


def _low_32_bits(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)


def _is_literal(host: str, address: IPAddress) -> bool:
    try:
        return ipaddress.ip_address(host) == address
    except ValueError:
        return False


def _resolve(host: str, port: int) -> list[IPAddress]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise ForbiddenDestination(f"the host {host} could not be resolved") from None
    addresses: list[IPAddress] = []
    for _, _, _, _, sockaddr in infos:
        # An IPv6 link-local sockaddr names its interface ("fe80::1%eth0"); the address is enough.
        address = ipaddress.ip_address(str(sockaddr[0]).partition("%")[0])
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise ForbiddenDestination(f"the host {host} could not be resolved")
    return addresses


def _networks(allowed_hosts: Sequence[str]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    networks = []
    for entry in allowed_hosts:
        try:
            networks.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            continue  # a host name, matched by name
    return networks
