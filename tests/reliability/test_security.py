"""Security on the real lab: host keys, shell injection, secrets, unit hardening, bind address."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from faultlab import (ddops, healthy, inventory_variant, no_leftovers, pivot, sh, step, unit_state, variant)

pytestmark = [pytest.mark.lab, pytest.mark.slow]

PWNED = "/root/ddops-pwned"
# Each would create a file under PWNED if any shell ever interpreted it.
PAYLOADS = [
    f"a; touch {PWNED}/semicolon",
    f"$(touch {PWNED}/dollar)",
    f"`touch {PWNED}/backtick`",
    f"it's \"quoted\" \\ and ' ; touch {PWNED}/quote '",
    f"${{HOME}} $$ %n %% && touch {PWNED}/and | tee {PWNED}/pipe",
]
NEWLINE = f"line1\nline2; touch {PWNED}/newline"


def pwned(lab) -> dict[str, str]:
    return {h: sh(lab, h, f"ls -A {PWNED} 2>/dev/null").strip() for h in ("ct200", "pve", "llm-two")}


@pytest.fixture
def markers(lab):
    for h in ("ct200", "pve", "llm-two"):
        sh(lab, h, f"rm -rf {PWNED}; mkdir -p {PWNED}")
    yield
    for h in ("ct200", "pve", "llm-two"):
        sh(lab, h, f"rm -rf {PWNED}")


def test_pivot_refuses_changed_and_unknown_host_keys(lab, base, tmp_path):
    known = Path(lab.known_hosts).read_text().splitlines()
    other_key = next(l for l in known if l.startswith("[127.0.0.1]:2202 ")).split(" ", 1)[1]
    before = unit_state(lab)
    for host, port in (("pve", 2200), ("eval-a6000", 2203)):
        wrong = tmp_path / f"wrong-{host}"
        wrong.write_text("\n".join(f"[127.0.0.1]:{port} {other_key}" if l.startswith(f"[127.0.0.1]:{port} ")
                                   else l for l in known) + "\n")
        inventory = inventory_variant(lab, tmp_path, f"inv-{host}",
                                      lambda d, w=wrong: d["defaults"].update(known_hosts=str(w)))
        done, report = pivot(lab, base["profile"], inventory=inventory)
        assert done.returncode == 4 and report["outcome"] == "failed", report
        assert f"host key for {host}" in report["error"] and "has CHANGED" in report["error"]
        assert "ssh-keygen" in report["error"]
    empty = tmp_path / "empty"
    empty.write_text("")
    inventory = inventory_variant(lab, tmp_path, "inv-empty", lambda d: d["defaults"].update(known_hosts=str(empty)))
    done, report = pivot(lab, base["profile"], inventory=inventory)
    assert done.returncode == 4 and "is unknown" in report["error"] and "--accept-new-host-keys" in report["error"]
    assert empty.read_text() == ""  # strict by default: nothing was trusted on first sight
    assert unit_state(lab) == before


def test_executor_arguments_arrive_literally(lab, markers):
    from ddops.executor import Executor
    from ddops.inventory import load_inventory

    inventory = load_inventory(lab.inventory_path)
    with Executor(inventory) as ex:
        for host in ("ct200", "llm-two"):  # through `pct exec ... bash -lc` and straight
            for payload in PAYLOADS + [NEWLINE]:
                result = ex.run(inventory.host(host), ["printf", "%s", payload])
                assert result.ok and result.stdout == payload, (host, payload, result)
    assert pwned(lab) == {"ct200": "", "pve": "", "llm-two": ""}


def test_inventory_values_are_inert(lab, markers, tmp_path):
    def poison(doc):
        doc["hosts"]["ct200"]["training"].update(pattern=f"train_dflash`touch {PWNED}/inv-pattern`$(id)",
                                                 log=f"/root/train/x.log; touch {PWNED}/inv-log",
                                                 checkpoints=f"/root/train/$(touch {PWNED}/inv-ckpt)")
        doc["hosts"]["llm-two"]["expect"]["hostname"] = f"llm-two'; touch {PWNED}/inv-expect; '"
    inventory = inventory_variant(lab, tmp_path, "poisoned", poison)
    done = ddops(lab, "--limit", "ct200,llm-two", "status", "--json", inventory=inventory)
    assert done.returncode in (0, 2), done.stderr
    records = {r["host"]: r for r in json.loads(done.stdout)}
    assert set(records) == {"ct200", "llm-two"}
    assert pwned(lab) == {"ct200": "", "pve": "", "llm-two": ""}


def test_injection_in_profile_values_and_secrets_never_leak(lab, base, markers, tmp_path):
    """One pivot carries every payload in env values and the served model name, an API key and a
    non-loopback bind; each arrives byte-exact, nothing executes, the key shows up nowhere but the
    0600 environment file. A rollback then brings the base state back."""
    key = "sk-rel-" + secrets.token_hex(16)
    env_values = {f"REL_INJ_{i}": p for i, p in enumerate(PAYLOADS)}
    served = f"tiny`touch {PWNED}/sm`$(touch {PWNED}/sm2); 'x' \"y\" %n $HOME {NEWLINE}"
    profile = variant(base["folder"], "inject", {
        **{f"env.{k}": v for k, v in env_values.items()},
        "serve.served_model_name": served, "bind": "0.0.0.0",
        "secrets": {"DDTREE_API_KEY": {"env": "REL_API_KEY"}}}, base=base["profile"])
    done, report = pivot(lab, profile, env={"REL_API_KEY": key})
    try:
        assert done.returncode == 0 and report["outcome"] == "ok", report
        assert step(report, "smoke")["status"] == "done"
        pid = unit_state(lab)["pid"]
        environ = dict(item.split("=", 1) for item in
                       sh(lab, "ct200", f"tr '\\0' '\\n' < /proc/{pid}/environ").splitlines() if "=" in item)
        for name, value in env_values.items():
            assert environ[name] == value, name
        argv = sh(lab, "ct200", f"cat /proc/{pid}/cmdline").split("\0")
        assert argv[argv.index("--served-model-name") + 1] == served
        assert argv[argv.index("--host") + 1] == "0.0.0.0" and key not in argv
        assert sh(lab, "ct200", "ss -ltnH 'sport = :8200' | awk '{print $4}'").split() == ["0.0.0.0:8200"]
        assert pwned(lab) == {"ct200": "", "pve": "", "llm-two": ""}
        # The key: in the 0600 env file (so the runtime has it), and nowhere else ddops printed or wrote.
        assert sh(lab, "ct200", "stat -c '%a %U' /etc/ddops/ddtree.env").strip() == "600 root"
        assert f"DDTREE_API_KEY={key}" in sh(lab, "ct200", "cat /etc/ddops/ddtree.env")
        assert "DDTREE_API_KEY=***" in done.stderr  # the diff shows it masked
        places = {
            "ddops output": done.stdout + done.stderr,
            "history": ddops(lab, "history", "--host", "ct200", "--json").stdout,
            "backup list": ddops(lab, "rollback", "--host", "ct200", "--list", "--json").stdout,
            "host files": sh(lab, "ct200", "cat /etc/systemd/system/ddtree.service /var/lib/ddops/history.jsonl "
                                           "/var/lib/ddops/backups/*/*/meta.json"),
            "journal": sh(lab, "ct200", "journalctl -u ddtree.service -n 300 --no-pager"),
            "status": ddops(lab, "--limit", "ct200", "status", "--json").stdout,
        }
        for where, text in places.items():
            assert key not in text, f"the API key leaked into {where}"
        modes = sh(lab, "ct200", "stat -c '%a' /var/lib/ddops/backups/ddtree.service/*/env "
                                 "/var/lib/ddops/backups/ddtree.service/*/ | sort -u").split()
        assert set(modes) <= {"600", "700"}, modes
        # The key is enforced: no key, no answer.
        code = sh(lab, "ct200", "python3 -c \"import urllib.request as u, urllib.error as e\n"
                                "try: u.urlopen('http://127.0.0.1:8200/v1/models', timeout=5); print(200)\n"
                                "except e.HTTPError as x: print(x.code)\"").strip()
        assert code == "401"
    finally:
        back = ddops(lab, "rollback", "--host", "ct200", "--json", env={"REL_API_KEY": key})
    assert back.returncode == 0, back.stderr
    assert key not in back.stdout + back.stderr
    state = unit_state(lab)
    assert (state["unit"], state["env"]) == (base["unit"], base["env"]) and healthy(lab) and not no_leftovers(lab)


def test_runtime_unit_is_hardened_and_binds_loopback(lab, base):
    props = dict(line.split("=", 1) for line in sh(
        lab, "ct200", "systemctl show ddtree.service -p NoNewPrivileges -p ProtectSystem -p PrivateTmp "
                      "-p ProtectControlGroups -p RestrictSUIDSGID -p PrivateDevices -p Restart").splitlines())
    assert props == {"NoNewPrivileges": "yes", "ProtectSystem": "full", "PrivateTmp": "yes",
                     "ProtectControlGroups": "yes", "RestrictSUIDSGID": "yes", "PrivateDevices": "no",
                     "Restart": "on-failure"}
    listening = sh(lab, "ct200", "ss -ltnH 'sport = :8200' | awk '{print $4}'").split()
    assert listening == ["127.0.0.1:8200"]
    assert "EnvironmentFile=/etc/ddops/ddtree.env" in sh(lab, "ct200", "cat /etc/systemd/system/ddtree.service")
    # A non-loopback bind without a key is refused by profile validation (tests/unit/test_profile.py,
    # `bind: 0.0.0.0` -> "without an API key"); with a key it listens where asked (the test above).
