"""The torch a runtime venv holds, and the one its pip would install, without installing it.

Runs remotely as `python3 -c SOURCE ARGS_JSON` (stdlib only); prints one JSON object:
`installed`: {version, cuda} from VENV's torch/version.py (None: no torch there);
`resolved`: pip's `install --dry-run --report` for the requirement (None: not asked, or `error` says why).
Pip runs from the venv when it has one, else from the system's python3, else from a throwaway venv in a
temporary dir that is removed again: nothing on the host changes.
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile


def installed(venv):
    """torch's __version__ and cuda from the venv's torch/version.py (no import: torch takes seconds)."""
    for path in glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "torch", "version.py")):
        try:
            with open(path) as fh:
                text = fh.read()
        except OSError:
            continue
        version = re.search(r"^__version__\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        cuda = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        if version:
            return {"version": version.group(1), "cuda": cuda.group(1) if cuda else None, "path": path}
    return None


def run(argv, timeout):
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                          timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def has_pip(python):
    return os.path.exists(python) and run([python, "-m", "pip", "--version"], 60)[0] == 0


def resolve(venv, requirement, pip_args):
    """pip's report of what `pip install REQUIREMENT` would install (torch alone: --no-deps)."""
    scratch = None
    python = os.path.join(venv, "bin", "python")
    try:
        if not has_pip(python):
            python = shutil.which("python3") or "python3"
        if not has_pip(python):
            scratch = tempfile.mkdtemp(prefix="ddops-pip-")
            code, out, err = run([sys.executable, "-m", "venv", scratch], 300)
            if code != 0:
                return None, "no pip on the host, and no venv could be made for one: %s" % (err or out).strip()[-200:]
            python = os.path.join(scratch, "bin", "python")
        argv = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
                "--disable-pip-version-check", "--report", "-"] + pip_args + [requirement]
        code, out, err = run(argv, 600)
        if code != 0:
            return None, "pip could not resolve %s: %s" % (requirement, (err or out).strip().splitlines()[-1:] or "")
        try:
            return json.loads(out), None
        except ValueError:
            return None, "pip printed no report (pip 23.0 or newer has --report)"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, "pip: %s" % exc
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def main():
    args = json.loads(sys.argv[1])
    out = {"installed": installed(args["venv"]), "resolved": None, "error": None, "keeps": args.get("keeps")}
    if args.get("resolve"):
        out["resolved"], out["error"] = resolve(args["venv"], args["resolve"], args.get("pip_args") or [])
    json.dump(out, sys.stdout)


main()
