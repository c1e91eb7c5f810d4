"""ddops-probe unitwatch: one look at a unit and its HTTP health, for the health gate's polls."""
import json
import subprocess
import sys
import urllib.error
import urllib.request

PROPS = "ActiveState,SubState,NRestarts,MainPID,ExecMainStatus,ExecMainCode,Result"


def main():
    spec = json.loads(sys.argv[1])
    done = subprocess.run(["systemctl", "show", spec["unit"], "--property=" + PROPS],
                          capture_output=True, text=True, timeout=15)
    unit = dict(l.split("=", 1) for l in done.stdout.splitlines() if "=" in l)
    url = "http://127.0.0.1:%d%s" % (spec["port"], spec.get("path", "/health"))
    health = {"url": url, "http_status": None, "body": None, "error": None}
    if spec["port"]:
        try:
            with urllib.request.urlopen(url, timeout=spec.get("timeout", 3)) as resp:
                health["http_status"], raw = resp.status, resp.read(65536)
        except urllib.error.HTTPError as exc:
            health["http_status"], raw = exc.code, exc.read(65536)
        except (OSError, ValueError) as exc:
            raw = b""
            health["error"] = str(getattr(exc, "reason", exc))
        try:
            health["body"] = json.loads(raw.decode(errors="replace")) if raw else None
        except ValueError:
            health["body"] = raw.decode(errors="replace")[:300]
    json.dump({"unit": unit, "health": health}, sys.stdout)


main()
