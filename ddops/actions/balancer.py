"""ddops-action balancer: drain, readmit or read replicas in HAProxy through its admin (runtime API) socket.

Reads its arguments as JSON on stdin: socket, backend, servers, action (drain | ready | up | state),
timeout_s, interval_s. `drain` sets each server's state to drain (no new requests) and waits, bounded,
until its current sessions and queue reach 0; `ready` puts each back and waits until HAProxy's own
health check says UP; `up` only waits for that (it changes nothing); `state` reads. Prints one JSON
object: every server's status and sessions, and whether the wait succeeded.
"""
import json
import sys
import time
# haproxy_command() and haproxy_servers() come from hostlib.py, which probe_source() prepends.


def wait(spec, done):
    """Poll until done(states) or the timeout; returns (ok, seconds waited, last states)."""
    started = time.monotonic()
    while True:
        states = haproxy_servers(spec["socket"], spec["backend"])
        if done(states):
            return True, time.monotonic() - started, states
        if time.monotonic() - started >= spec.get("timeout_s", 60):
            return False, time.monotonic() - started, states
        time.sleep(spec.get("interval_s", 0.25))


def main():
    spec = json.loads(sys.stdin.read())
    path, backend, servers = spec["socket"], spec["backend"], spec.get("servers") or []
    out = {"action": spec["action"], "servers": servers}
    try:
        for name in servers:
            if spec["action"] in ("drain", "ready"):
                answer = haproxy_command(path, "set server %s/%s state %s" % (backend, name, spec["action"])).strip()
                if answer:
                    raise RuntimeError("HAProxy refused `set server %s/%s state %s`: %s"
                                       % (backend, name, spec["action"], answer))
        if spec["action"] == "drain":
            ok, waited, states = wait(spec, lambda st: all(
                st.get(n, {}).get("sessions", 0) == 0 and st.get(n, {}).get("queued", 0) == 0 for n in servers))
        elif spec["action"] in ("ready", "up"):
            ok, waited, states = wait(spec, lambda st: all(st.get(n, {}).get("status") == "UP" for n in servers))
        else:
            ok, waited, states = True, 0.0, haproxy_servers(path, backend)
    except (OSError, RuntimeError) as exc:
        out.update(ok=False, error="%s: %s" % (exc.__class__.__name__, exc))
        json.dump(out, sys.stdout)
        return
    out.update(ok=ok, waited_s=round(waited, 2), states=states, error=None)
    json.dump(out, sys.stdout)


main()
