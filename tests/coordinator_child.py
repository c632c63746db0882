"""A stand-in trainer that only joins `jax.distributed` the way the CLI does (`_devices.join`, from the
JAX_* variables the launcher sets, or from `--coordinator ADDRESS --processes N --id I`), then process 0
prints, as one JSON line, every address listening on the coordinator's port (read from /proc/net/tcp
and tcp6), and every process leaves through `jax.distributed.shutdown`."""

import ipaddress
import json
import os
import socket
import sys

import jax

from eqx_diloco.lm._devices import join


def listening_addresses(port: int) -> list[str]:
    """The local addresses of the TCP sockets listening on `port` (state 0A in /proc/net/tcp*)."""
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as rows:
            next(rows)
            for row in rows:
                local, state = row.split()[1], row.split()[3]
                address, hex_port = local.split(":")
                if state != "0A" or int(hex_port, 16) != port:
                    continue
                raw = bytes.fromhex(address)
                # The kernel prints each 32-bit word in host (little-endian) order.
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                address = ipaddress.ip_address(raw if family == socket.AF_INET6 else raw[:4])
                # gRPC listens on IPv4 through an IPv6 socket: ::ffff:127.0.0.1 is 127.0.0.1.
                found.append(str(getattr(address, "ipv4_mapped", None) or address))
    return found


if __name__ == "__main__":
    args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    coordinator = args.get("--coordinator", os.environ.get("JAX_COORDINATOR_ADDRESS"))
    num_processes = int(args.get("--processes", os.environ.get("JAX_NUM_PROCESSES", "1")))
    process_id = int(args.get("--id", os.environ.get("JAX_PROCESS_ID", "0")))
    join(coordinator, num_processes, process_id, heartbeat_timeout_s=30, timeout_s=60)
    if process_id == 0:
        print(json.dumps({"coordinator": coordinator,
                          "listening": listening_addresses(int(coordinator.rpartition(":")[2]))}), flush=True)
    jax.distributed.shutdown()
