#!/usr/bin/env python3
"""Probes a running `prompt-r1 serve` (or any OpenAI-compatible server) for the failures of
issue 33: an endless header line, thousands of slow sockets, a 50 MB body, a wrong or missing API
key. Prints, per probe, the status code seen and the server's VmRSS / Threads (from
/proc/PID/status) before and after. Python 3 standard library only.

    scripts/serve_probes.py http://127.0.0.1:8000 --pid 1234 --api-key k

The endless-header probe stops at --header-cap-mib of server RSS growth (default 1024 MiB) or
--header-seconds (default 60 s), whichever comes first, to keep the machine safe.
"""

import argparse
import resource
import socket
import time
import urllib.parse


def proc_status(pid):
    """(VmRSS in MiB, Threads) of the server, or (None, None) once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None, None
    rss = int(fields["VmRSS"].split()[0]) / 1024
    return rss, int(fields["Threads"])


def show(pid):
    rss, threads = proc_status(pid)
    if rss is None:
        return "server gone"
    return f"VmRSS {rss:.1f} MiB, Threads {threads}"


def connect(host, port, timeout=10.0):
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_status(sock, timeout):
    """The status code of the reply on `sock`, or a word for why there is none."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                return "closed without a reply" if not data else f"closed after {data[:40]!r}"
            data += chunk
    except socket.timeout:
        return f"no reply within {timeout:.0f} s"
    except OSError as e:
        return f"connection error ({e.strerror or e})"
    parts = data.split(b"\r\n", 1)[0].split()
    return parts[1].decode() if len(parts) > 1 else f"odd reply {data[:40]!r}"


def request_status(host, port, raw, timeout=10.0):
    try:
        sock = connect(host, port, timeout)
    except OSError as e:
        return f"connect failed ({e})"
    with sock:
        try:
            sock.sendall(raw)
        except OSError as e:
            return f"send failed ({e})"
        return read_status(sock, timeout)


def probe_endless_header(host, port, pid, cap_mib, seconds):
    print(f"probe 1: endless header line (stops at {cap_mib} MiB of server RSS growth or {seconds} s)")
    print(f"  before: {show(pid)}")
    rss0, _ = proc_status(pid)
    sock = connect(host, port)
    sock.settimeout(5.0)
    line = b"a" * (1 << 20)
    sent = 0
    start = time.monotonic()
    reason = None
    try:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\nX-Endless: ".encode())
        while reason is None:
            sock.sendall(line)
            sent += len(line)
            rss, _ = proc_status(pid)
            if rss is None:
                reason = "the server died"
            elif rss - rss0 >= cap_mib:
                reason = f"cap reached: server RSS grew {rss - rss0:.0f} MiB"
            elif time.monotonic() - start >= seconds:
                reason = f"time cap reached ({seconds} s)"
    except socket.timeout:
        reason = "the server stopped reading (send timed out)"
    except OSError as e:
        reason = f"the server closed the connection ({e.strerror or e})"
    elapsed = time.monotonic() - start
    print(f"  sent {sent >> 20} MiB of header in {elapsed:.1f} s; stopped: {reason}")
    print(f"  during: {show(pid)}")
    status = read_status(sock, 5.0)
    sock.close()
    print(f"  status: {status}")
    time.sleep(2.0)
    print(f"  after (closed, +2 s): {show(pid)}")
    print(f"  a normal GET /health now: {request_status(host, port, health(host))}")


def health(host):
    return f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()


def raise_fd_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def probe_slow_sockets(host, port, pid, count):
    limit = raise_fd_limit()
    count = min(count, max(0, limit - 64))
    print(f"probe 2: {count} slow sockets (each sends half a head, then nothing; our fd limit {limit})")
    print(f"  before: {show(pid)}")
    sockets = []
    failures = 0
    start = time.monotonic()
    for _ in range(count):
        try:
            sock = connect(host, port, timeout=5.0)
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\nX-Slow: ".encode())
            sockets.append(sock)
        except OSError:
            failures += 1
    print(f"  opened {len(sockets)} in {time.monotonic() - start:.1f} s ({failures} failed)")
    opened = time.monotonic()
    time.sleep(1.0)
    print(f"  while open: {show(pid)}")
    start = time.monotonic()
    status = request_status(host, port, health(host), timeout=15.0)
    print(f"  status of a normal GET /health meanwhile: {status} ({time.monotonic() - start:.2f} s)")
    alive = 0
    for sock in sockets:
        sock.setblocking(False)
        try:
            alive += sock.recv(1) != b""
        except BlockingIOError:
            alive += 1
        except OSError:
            pass
    print(f"  slow sockets the server still holds open {time.monotonic() - opened:.0f} s after: {alive}")
    for sock in sockets:
        sock.close()
    time.sleep(2.0)
    print(f"  after (closed, +2 s): {show(pid)}")


def probe_large_body(host, port, pid, api_key, megabytes):
    size = megabytes * 1_000_000
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\n"
    chunk = b"x" * (1 << 20)
    for kind in ("content-length", "chunked"):
        print(f"probe 3{'a' if kind == 'content-length' else 'b'}: a {megabytes} MB body ({kind})")
        print(f"  before: {show(pid)}")
        sock = connect(host, port, timeout=30.0)
        sent = 0
        start = time.monotonic()
        note = "sent it all"
        try:
            if kind == "content-length":
                sock.sendall(f"{head}Content-Length: {size}\r\n\r\n".encode())
                while sent < size:
                    piece = chunk[: min(len(chunk), size - sent)]
                    sock.sendall(piece)
                    sent += len(piece)
            else:
                sock.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
                while sent < size:
                    sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                    sent += len(chunk)
                sock.sendall(b"0\r\n\r\n")
        except socket.timeout:
            note = "the server stopped reading"
        except OSError as e:
            note = f"the server closed the connection ({e.strerror or e})"
        status = read_status(sock, 30.0)
        sock.close()
        print(f"  sent {sent / 1e6:.0f} MB in {time.monotonic() - start:.1f} s ({note}); status: {status}")
        time.sleep(1.0)
        print(f"  after (+1 s): {show(pid)}")


def probe_api_key(host, port, pid, api_key):
    print("probe 4: the API key on GET /v1/models")
    print(f"  before: {show(pid)}")
    base = f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
    cases = [("missing key", ""), ("wrong key", "Authorization: Bearer wrong-key\r\n")]
    if api_key:
        cases.append(("right key", f"Authorization: Bearer {api_key}\r\n"))
    for name, header in cases:
        raw = (base + header + "\r\n").encode()
        print(f"  {name}: status {request_status(host, port, raw)}")
    print(f"  after: {show(pid)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:8000 (a /v1 suffix is ignored)")
    parser.add_argument("--pid", type=int, required=True, help="the server's process id (same machine)")
    parser.add_argument("--api-key", default="", help="the server's key, for the body and key probes")
    parser.add_argument("--sockets", type=int, default=4000)
    parser.add_argument("--body-mb", type=int, default=50)
    parser.add_argument("--header-cap-mib", type=int, default=1024)
    parser.add_argument("--header-seconds", type=float, default=60.0)
    parser.add_argument("--only", default="1234", help="which probes to run, e.g. 14")
    args = parser.parse_args()
    url = urllib.parse.urlsplit(args.url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    print(f"server {host}:{port}, pid {args.pid}: {show(args.pid)}")
    if "1" in args.only:
        probe_endless_header(host, port, args.pid, args.header_cap_mib, args.header_seconds)
    if "2" in args.only:
        probe_slow_sockets(host, port, args.pid, args.sockets)
    if "3" in args.only:
        probe_large_body(host, port, args.pid, args.api_key, args.body_mb)
    if "4" in args.only:
        probe_api_key(host, port, args.pid, args.api_key)
    print(f"end: {show(args.pid)}")


if __name__ == "__main__":
    main()
