"""Which address a coordinator binds and advertises: host names, addresses, interface names."""
from __future__ import annotations

import ipaddress
import socket

from tangram_hpc import function
from tangram_hpc.connection import ConnectionInfo
from tangram_hpc.launch import LocalCluster
from tangram_hpc.netaddr import advertised_host, interface_address, is_loopback_name, resolve_host


def test_interfaces_and_addresses_resolve():
    assert interface_address("lo") == "127.0.0.1"
    assert interface_address("no-such-if0") is None
    assert resolve_host("lo") == "127.0.0.1" and resolve_host("127.0.0.2") == "127.0.0.2"
    assert resolve_host("0.0.0.0") == "0.0.0.0" and resolve_host("node17.cluster") == "node17.cluster"
    assert advertised_host("0.0.0.0", "lo") == ("127.0.0.1", "interface lo")
    assert advertised_host("0.0.0.0", "127.0.0.2") == ("127.0.0.2", "--advertise-host")
    assert advertised_host("127.0.0.2", None) == ("127.0.0.2", "the bound address")
    assert is_loopback_name("localhost") and is_loopback_name("127.0.0.2") and not is_loopback_name("192.0.2.7")


def test_bound_to_all_interfaces_it_never_silently_advertises_a_loopback_name():
    host, why = advertised_host("0.0.0.0", None)
    if is_loopback_name(host):      # a machine with no routed interface at all: said, with the remedy
        assert "set --advertise-host" in why
    else:
        assert host == socket.getfqdn() or not ipaddress.ip_address(host).is_loopback


def test_a_coordinator_bound_to_an_interface_name(tmp_path):
    with LocalCluster(workers=1, cores=1, run_dir=tmp_path / "run", extra_args=["--host", "lo"]) as cl:
        info = ConnectionInfo.read(cl.connection_file)
        assert info.client_address.startswith("tcp://127.0.0.1:") and info.worker_address.startswith("tcp://127.0.0.1:")
        with cl.client() as c:
            assert c.submit(function("math:sqrt", 49)).result(30).output == 7.0


def test_the_metrics_target_follows_the_same_rule(monkeypatch):
    """Bound to every interface on a host whose name is a loopback one, the Prometheus target
    named 'localhost' while workers were told the routed address."""
    from tangram_hpc.coordinator.exporter import MetricsServer
    monkeypatch.setattr(socket, "getfqdn", lambda *a: "localhost")
    servers = [MetricsServer("0.0.0.0", 0, list), MetricsServer("0.0.0.0", 0, list, advertise_host="lo"),
               MetricsServer("127.0.0.1", 0, list)]
    try:
        everywhere, by_interface, loopback = (m.host for m in servers)
        assert everywhere == advertised_host("0.0.0.0", None)[0]
        assert everywhere != "localhost" or "set --advertise-host" in advertised_host("0.0.0.0", None)[1]
        assert by_interface == "127.0.0.1" and loopback == "127.0.0.1"    # an interface name resolved
    finally:
        for m in servers:
            m.close()
