"""DNS discovery: URL syntax, and real resolution of a name with several loopback addresses.

How a name gets several addresses without touching the machine's resolver: the resolution runs in a
child process inside a private mount namespace (``unshare --mount --map-root-user``, which needs no
privileges where user namespaces are allowed), where a temporary hosts file is bind-mounted over
``/etc/hosts`` and a ``hosts: files`` nsswitch.conf over ``/etc/nsswitch.conf``. glibc's
``getaddrinfo`` then returns every line of that file for the name — exactly how a headless
Service's name returns one A record per Ready pod — and never asks a DNS server, so the test is
hermetic. Where namespaces are not allowed the test is skipped and says so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from router.discovery import DiscoveredReplica, make_discovery
from router.discovery_dns import DnsDiscovery, DnsName, DnsTarget, parse_dns_url


def test_parse_single_and_multi_name_urls() -> None:
    assert parse_dns_url("dns:ferry-replica.ferry.svc.cluster.local:8000") == DnsTarget(
        names=(DnsName("ferry-replica.ferry.svc.cluster.local", 8000, "mixed"),)
    )
    t = parse_dns_url(
        "dns:prefill@ferry-prefill:8001,decode@ferry-decode:8002,extra:9000?role=decode&model=m"
    )
    assert t.names == (
        DnsName("ferry-prefill", 8001, "prefill"),
        DnsName("ferry-decode", 8002, "decode"),
        DnsName("extra", 9000, "decode"),
    )
    assert t.model == "m" and t.scheme == "http"
    assert parse_dns_url("dns:[::1]:8000?scheme=https").names == (DnsName("::1", 8000, "mixed"),)


@pytest.mark.parametrize(
    "url, message",
    [
        ("dns:ferry-replica", "bad entry"),
        ("dns:ferry-replica:http", "bad entry"),
        ("dns:ferry-replica:70000", "bad entry"),
        ("dns:leader@ferry:8000", "role must be one of"),
        ("dns:ferry:8000?ttl=5", "unknown parameter(s) ttl"),
        ("dns:ferry:8000?scheme=gopher", "scheme must be http or https"),
    ],
)
def test_parse_rejects_bad_urls(url: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_dns_url(url)
    assert message in str(err.value)


async def test_resolves_address_literals_in_process() -> None:
    disc = make_discovery("dns:127.0.0.1:8000,decode@[::1]:8001,127.0.0.1:8000?model=tiny")
    assert isinstance(disc, DnsDiscovery)
    assert await disc.list_replicas() == [
        DiscoveredReplica(url="http://127.0.0.1:8000", role="mixed", model="tiny"),
        DiscoveredReplica(url="http://[::1]:8001", role="decode", model="tiny"),
    ]


CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    from router.discovery_dns import DnsDiscovery

    hosts = sys.argv[1]

    def write(lines):
        # Rewrite in place: the bind mount follows the inode, not the name.
        with open(hosts, "r+") as f:
            f.seek(0); f.truncate(); f.write("".join(line + "\\n" for line in lines))

    async def main():
        pd = DnsDiscovery("dns:prefill@ferry-prefill:8001,decode@ferry-decode:8002")
        pool = DnsDiscovery("dns:ferry-pool:8000")
        out = {}
        out["pd"] = [(r.url, r.role) for r in await pd.list_replicas()]
        out["pool"] = [r.url for r in await pool.list_replicas()]
        write(["127.0.0.1 localhost", "127.0.0.3 ferry-pool", "127.0.0.4 ferry-pool"])  # .2 not ready, .4 added
        out["pool_after"] = [r.url for r in await pool.list_replicas()]
        write(["127.0.0.1 localhost"])  # no Ready pod: the name has no address
        out["pool_gone"] = [r.url for r in await pool.list_replicas()]
        out["pd_gone"] = [r.url for r in await pd.list_replicas()]
        print(json.dumps(out))

    asyncio.run(main())
    """
)


@pytest.fixture
def private_resolver(tmp_path: Path) -> list[str]:
    """The command prefix that runs a child with ``tmp_path/hosts`` as its only resolver."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("util-linux `unshare` is not installed: cannot give a child process its own /etc/hosts")
    hosts = tmp_path / "hosts"
    nsswitch = tmp_path / "nsswitch.conf"
    hosts.write_text("127.0.0.1 localhost\n")
    nsswitch.write_text("hosts: files\n")
    prefix = [
        unshare, "--mount", "--map-root-user", "sh", "-c",
        f'mount --bind "{hosts}" /etc/hosts && mount --bind "{nsswitch}" /etc/nsswitch.conf && exec "$0" "$@"',
    ]  # fmt: skip
    probe = subprocess.run(
        [*prefix, "getent", "hosts", "localhost"], capture_output=True, text=True, timeout=30
    )
    if probe.returncode != 0:
        pytest.skip(f"mount namespaces are not allowed here (unshare said: {probe.stderr.strip()[:200]})")
    return prefix


def test_headless_service_style_name_with_several_addresses(
    private_resolver: list[str], tmp_path: Path
) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(
        "127.0.0.1 localhost\n"
        "127.0.0.2 ferry-pool\n127.0.0.3 ferry-pool\n::1 ferry-pool\n"
        "127.0.0.5 ferry-prefill\n127.0.0.6 ferry-decode\n127.0.0.7 ferry-decode\n"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [*private_resolver, sys.executable, "-c", CHILD, str(hosts)],
        capture_output=True, text=True, timeout=60, cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["pd"] == [
        ["http://127.0.0.5:8001", "prefill"],
        ["http://127.0.0.6:8002", "decode"],
        ["http://127.0.0.7:8002", "decode"],
    ]
    assert out["pool"] == ["http://127.0.0.2:8000", "http://127.0.0.3:8000", "http://[::1]:8000"]
    assert out["pool_after"] == ["http://127.0.0.3:8000", "http://127.0.0.4:8000"]
    assert out["pool_gone"] == []
    assert out["pd_gone"] == []
