"""Disaggregated prefill and decode across machines, played by network namespaces: the prefill and the decode
instance each in a namespace of its own, their KV cache moving over a veth pair between the two, the proxy and the
client in this namespace reaching each instance over a veth pair of its own."""
import os
import shutil
import subprocess
import uuid

import pytest

from test_disagg import COMMON, COMPUTED, BYTES, PROMPTS, complete
from test_server import RemoteServer

SUBNET = "10.231"  # .1: this namespace <-> prefill, .2: this namespace <-> decode, .3: prefill <-> decode


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def namespaces():
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2's `ip` to create network namespaces and veth pairs")
    tag = uuid.uuid4().hex[:6]
    prefill_ns, decode_ns = f"inferno-pf-{tag}", f"inferno-dc-{tag}"
    try:
        ip("netns", "add", prefill_ns)
        ip("netns", "add", decode_ns)
        for i, ns in ((1, prefill_ns), (2, decode_ns)):  # this namespace <-> each instance
            here, there = f"h{i}{tag}", f"n{i}{tag}"
            ip("link", "add", here, "type", "veth", "peer", "name", there)
            ip("link", "set", there, "netns", ns)
            ip("addr", "add", f"{SUBNET}.{i}.1/24", "dev", here)
            ip("link", "set", here, "up")
            ip("-n", ns, "addr", "add", f"{SUBNET}.{i}.2/24", "dev", there)
            ip("-n", ns, "link", "set", there, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        ip("link", "add", f"kp{tag}", "type", "veth", "peer", "name", f"kd{tag}")  # prefill <-> decode
        for ns, end, host in ((prefill_ns, f"kp{tag}", 1), (decode_ns, f"kd{tag}", 2)):
            ip("link", "set", end, "netns", ns)
            ip("-n", ns, "addr", "add", f"{SUBNET}.3.{host}/24", "dev", end)
            ip("-n", ns, "link", "set", end, "up")
    except subprocess.CalledProcessError as e:
        for ns in (prefill_ns, decode_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {e.stderr.decode().strip()}")
    yield prefill_ns, decode_ns
    for ns in (prefill_ns, decode_ns):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture(scope="module")
def instances(namespaces):
    prefill_ns, decode_ns = namespaces
    prefill = RemoteServer(*COMMON, "--kv-role", "prefill", "--kv-host", f"{SUBNET}.3.1",
                           host=f"{SUBNET}.1.2", launcher=("ip", "netns", "exec", prefill_ns))
    decode = RemoteServer(*COMMON, "--kv-role", "decode", host=f"{SUBNET}.2.2",
                          launcher=("ip", "netns", "exec", decode_ns))
    proxy = RemoteServer("--prefill", prefill.url, "--decode", decode.url, "--local-prefill-below", "0",
                        subcommand="proxy")  # every prompt moves over the veth pair
    yield prefill, decode, proxy
    for server in (proxy, decode, prefill):
        server.close()


def test_kv_cache_moves_between_namespaces_and_output_matches_local_compute(instances):
    prefill, decode, proxy = instances
    local = [complete(decode, p).choices[0].text for p in PROMPTS[2:6]]  # the decode instance alone, prompt included
    before = decode.metrics()
    assert [complete(proxy, p).choices[0].text for p in PROMPTS[2:6]] == local
    after = decode.metrics()
    assert after[COMPUTED] == before[COMPUTED]
    assert after[BYTES] > before[BYTES]
    prefill.wait_for_idle_engine(timeout=10)
    decode.wait_for_idle_engine(timeout=10)
