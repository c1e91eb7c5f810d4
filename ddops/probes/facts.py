"""Gather one host's facts in one round trip: identity, GPUs, training job, units, runtime health,
and each replicated deployment's replicas and balancer; for `ddops top`, each runtime's /metrics too.

Runs remotely as `python3 -c SOURCE ARGS_JSON` (stdlib only); prints one JSON object. With
`"metrics"` in its arguments it also reads a JSON object on stdin: the API keys by port (secrets never
go on a command line).
"""
import json
import os
import re
import socket
import sys
import time

GPU_FIELDS = ["index", "name", "memory.used", "memory.total", "utilization.gpu"]
POOL_METRICS = ("ddtree_kv_pages_used", "ddtree_kv_pages_free")
UNIT_PROPS = ["ActiveState", "SubState", "ActiveEnterTimestamp", "NRestarts", "MainPID", "LoadState", "ExecStart"]
# A serving unit's command line (systemd's ExecStart argv): ddtree-serve's or SGLang's, and its
# tensor-parallel size (ddtree-serve's --tensor-parallel, SGLang's --tp-size or --tensor-parallel-size).
SERVERS = re.compile(r"argv\[\]=\S*(?:/ddtree-serve|python\S* .*-m sglang\.launch_server)\s")
TP_FLAG = re.compile(r"\s--(?:tensor-parallel(?:-size)?|tp-size)[= ](\d+)")


def number(text):
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        return None


def gpus(with_cuda=False):
    """The GPUs, each with its compute capability and health (ddops.probes.gpuhealth), and the driver. A
    field the driver does not know makes nvidia-smi refuse the whole query (before R510 compute_cap, before
    R460 remapped_rows): it is asked again with fewer, and what it no longer asks is None."""
    for fields in (GPU_FIELDS + ["compute_cap"] + HEALTH_FIELDS, GPU_FIELDS + ["compute_cap"], GPU_FIELDS):
        code, out, err = run(["nvidia-smi", "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits"])
        if code == 0:
            break
    if code != 0:   # a GPU off the bus can fail nvidia-smi as a whole: its Xid is wanted most then
        return {"error": (err or out).strip() or "nvidia-smi exit %d" % code, "list": [],
                "driver": {"version": None, "cuda": None},
                "xid": {"source": None, "error": None, "events": []} if code == 127 else xid_events()}
    rows = []
    for line in out.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(fields):
            continue
        row = {"index": number(cells[0]), "name": cells[1], "memory_used_mib": number(cells[2]),
               "memory_total_mib": number(cells[3]), "utilization_pct": number(cells[4]),
               "compute_cap": number(cells[5]) if len(cells) > 5 else None}
        if len(cells) > 6:
            row.update(health_cells(cells[6:]))
        rows.append(row)
    holders(rows)
    return {"error": None, "list": rows, "driver": driver_facts(rows, with_cuda), "xid": xid_events()}


def clock_ticks():
    return os.sysconf(os.sysconf_names["SC_CLK_TCK"])


def uptime_s():
    with open("/proc/uptime") as fh:
        return float(fh.read().split()[0])


def process(pid, command):
    """pid's record, with its elapsed time (None if it has gone meanwhile)."""
    try:
        with open("/proc/%s/stat" % pid) as fh:
            stat = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    started = int(stat[19]) / clock_ticks()
    return {"pid": int(pid), "cmdline": command, "elapsed_s": round(uptime_s() - started, 1)}


def processes(pattern):
    """Processes whose command line matches pattern (not this probe, not its shell, no ddops script)."""
    found = []
    for pid, command in matching_pids(pattern):
        record = process(pid, command)
        if record:
            found.append(record)
    return found


def training(spec):
    if not spec:
        return None
    found = processes(spec["pattern"]) if spec.get("pattern") else []
    unit = unit_state(spec["unit"]) if spec.get("unit") else None
    if not found and unit and unit.get("MainPID") not in (None, 0):
        record = process(unit["MainPID"], cmdline(unit["MainPID"]))
        found = [record] if record and record["cmdline"] else []
    main = found[0] if found else None
    return {
        "running": bool(found),
        "pid": main["pid"] if main else None,
        "cmdline": main["cmdline"] if main else None,
        "elapsed_s": main["elapsed_s"] if main else None,
        "pids": [p["pid"] for p in found],
        "unit": unit,
        "last_step": last_step(spec.get("log")),
        "last_loss": last_loss(spec.get("log")),
        "checkpoints": spec.get("checkpoints"),
        "newest_checkpoint": newest_checkpoint(spec.get("checkpoints")),
    }


def unit_state(unit):
    code, out, err = run(["systemctl", "show", unit, "--property=" + ",".join(UNIT_PROPS)])
    if code != 0:
        return {"unit": unit, "error": (err or out).strip()}
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    state = {
        "unit": unit,
        "ActiveState": props.get("ActiveState"),
        "SubState": props.get("SubState"),
        "LoadState": props.get("LoadState"),
        "since": props.get("ActiveEnterTimestamp") or None,
        "NRestarts": number(props.get("NRestarts", "")),
        "MainPID": number(props.get("MainPID", "")),
    }
    command = props.get("ExecStart", "")
    if SERVERS.search(command):   # a server spans one GPU unless its command line says more
        tp = TP_FLAG.search(command)
        state["tensor_parallel"] = int(tp.group(1)) if tp else 1
    return state


def health(port, path):
    import urllib.error  # only hosts with a service port pay for this import
    import urllib.request

    url = "http://127.0.0.1:%d%s" % (port, path)
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            body = resp.read(65536).decode(errors="replace")
            code = resp.status
    except urllib.error.HTTPError as exc:
        body, code = exc.read(65536).decode(errors="replace"), exc.code
    except (OSError, ValueError) as exc:
        return {"url": url, "healthy": False, "http_status": None, "detail": str(getattr(exc, "reason", exc))}
    try:
        detail = json.loads(body)
    except ValueError:
        detail = body.strip()[:500]
    status = detail.get("status") if isinstance(detail, dict) else None
    healthy = code == 200 and status in (None, "ok", "healthy")
    out = {"url": url, "healthy": healthy, "http_status": code, "detail": detail}
    if healthy and isinstance(detail, dict) and "running" in detail:  # a runtime that shows its load here
        out["pool"] = pool_metrics(port)
    return out


def pool_metrics(port):
    """The paged pool's gauges from /metrics (ddtree_kv_pages_used, ddtree_kv_pages_free), where the runtime
    has them and serves /metrics without a key; {} otherwise."""
    import urllib.request

    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=3) as resp:
            text = resp.read(1 << 20).decode(errors="replace")
    except (OSError, ValueError):
        return {}
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in POOL_METRICS:
            found[name] = number(value.strip())
    return found


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(port, wanted, api_key=None):
    """The runtime's /metrics on port: the samples whose name is in `wanted`, as [name, labels, value],
    with the host's clock at the read (rates are deltas over it)."""
    import urllib.error
    import urllib.request

    headers = {"Authorization": "Bearer " + api_key} if api_key else {}
    req = urllib.request.Request("http://127.0.0.1:%d/metrics" % port, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=3) as resp:
            text = resp.read(4 << 20).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return {"error": "HTTP %d" % exc.code, "at": time.time(), "samples": []}
    except (OSError, ValueError) as exc:
        return {"error": str(getattr(exc, "reason", exc)), "at": time.time(), "samples": []}
    samples = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) not in wanted:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        samples.append([m.group(1), dict(_LABEL.findall(m.group(2) or "")), value])
    return {"error": None, "at": time.time(), "samples": samples}


def with_metrics(entry, port, metrics):
    if metrics:
        entry["metrics"] = scrape(port, set(metrics["names"]), metrics["keys"].get(str(port)))
    return entry


def replicated(folder, metrics=None):
    """Each replicated deployment ddops installed here (its manifest): every replica's unit and health,
    and the balancer's unit, its public health and how it sees each replica."""
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    except OSError:
        return []
    out = []
    for name in names:
        manifest = read_json(os.path.join(folder, name))
        if not isinstance(manifest, dict) or "replicas" not in manifest:
            continue
        bal = manifest["balancer"]
        servers, error = {}, None
        try:
            servers = haproxy_servers(bal["socket"], bal["backend"])
        except (OSError, RuntimeError) as exc:
            error = "%s: %s" % (exc.__class__.__name__, exc)
        path = manifest.get("health_path") or "/health"
        replicas = [with_metrics(dict(r, state=unit_state(r["unit"]), health=health(r["port"], path),
                                      balancer=servers.get(r["server"])), r["port"], metrics)
                    for r in manifest["replicas"]]
        out.append({"template": manifest["template"], "profile": manifest.get("profile"), "replicas": replicas,
                    "balancer": {"unit": bal["unit"], "port": bal["port"], "state": unit_state(bal["unit"]),
                                 "health": health(bal["port"], path), "error": error}})
    return out


def pivot_state(lock_path, journal_path):
    """The pivot lock's holder (its lease's seconds left on this host's clock) and an open journal of
    intent, and whether both belong to the same run; the tokens themselves stay here."""
    holder, journal = read_json(lock_path), read_json(journal_path)
    same = bool(isinstance(holder, dict) and isinstance(journal, dict) and holder.get("token")
                and holder.get("token") == journal.get("token"))
    lease_left = None
    if isinstance(holder, dict) and holder.get("lease_s") and holder.get("renewed_at"):
        lease_left = round(holder["renewed_at"] + holder["lease_s"] - time.time(), 1)
    strip = lambda d: {k: v for k, v in d.items() if k not in ("token", "undo", "notes")} if isinstance(d, dict) else d
    return {"lock": strip(holder), "lease_left_s": lease_left, "journal": strip(journal), "same_run": same}


def main():
    args = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    metrics = None
    if args.get("metrics"):
        metrics = {"names": args["metrics"], "keys": json.loads(sys.stdin.read() or "{}")}
    started = time.time()
    services = [unit_state(s["unit"]) for s in args.get("services", [])]
    # a unit systemd has no file for is not scraped: its port may be a balancer's (replicas took over)
    absent = {s["unit"] for s in services if s.get("LoadState") == "not-found"}
    facts = {
        "hostname": socket.gethostname(),
        "gpus": gpus(bool(args.get("cuda_version"))),
        "training": training(args.get("training")),
        "services": services,
        "runtime": [with_metrics(dict(health(s["port"], s.get("health") or "/health"), unit=s["unit"]),
                                 s["port"], None if s["unit"] in absent else metrics)
                    for s in args.get("services", []) if s.get("port")],
    }
    if args.get("replicas_dir"):
        facts["replicas"] = replicated(args["replicas_dir"], metrics)
    if args.get("lock"):
        facts["pivot"] = pivot_state(args["lock"], args["journal"])
    facts["probe_s"] = round(time.time() - started, 3)
    json.dump(facts, sys.stdout)


main()
