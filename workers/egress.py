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


class ForbiddenDestination(ValueError):
    """The URL may not be a webhook; the message says why, for the endpoint's owner."""


@dataclass(frozen=True)
class Destination:
    url: httpx.URL  # parsed once, by the client that sends the request
    host: str  # lower case, without brackets, IDNA-encoded
    port: int
    address: IPAddress  # the checked address to connect to


def check_url(url: str, allowed_hosts: Sequence[str]) -> Destination:
    """Resolve `url`'s host and return where to connect, or raise `ForbiddenDestination`.

    Every address the host resolves to must be public, or allowed by `allowed_hosts` (host names,
    addresses or networks): one bad address among good ones is refused too.
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
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    if not 0 < port < 65536:
        raise ForbiddenDestination("the URL's port is not a valid port number")
    addresses = _resolve(host, port)
    host_allowed = any(entry.strip().lower() == host for entry in allowed_hosts)
    networks = _networks(allowed_hosts)
    for address in addresses:
        if host_allowed or any(address in network for network in networks):
            continue
        kind = forbidden_kind(address)
        if kind is not None:
            shown = host if _is_literal(host, address) else f"{host} resolves to {address}, which"
            raise ForbiddenDestination(
                f"{shown} is a {kind} address; webhooks go to public addresses only"
            )
    return Destination(parsed, host, port, addresses[0])


def forbidden_kind(address: IPAddress) -> str | None:
    """What makes `address` unfit for a webhook, or None for a public address."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
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
    if not address.is_global:  # unspecified, reserved, shared (100.64.0.0/10), ...
        return "reserved"
    return None


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
