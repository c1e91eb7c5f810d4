"""Where ddops writes on a host (issue 36): the paths a profile names, with symlinks resolved there, stay
where they may live; a failed venv step takes back the venv it made; preflight counts the space ddops's
own writes need, and names a port's holder with what is known."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ddops.errors import StepFailed
from ddops.executor import CommandResult
from ddops.facts import Free, Inspection, PathFact, Tree
from ddops.inventory import load_inventory
from ddops.plan import RunContext
from ddops.preflight import (STATE_FLOOR, VENV_FLOOR, check_confinement, check_disk, holder_words, inspect_local,
                             serving_args, size)
from ddops.profile import load_profile
from ddops.steps.deps import DepsStep, plan_deps
from ddops.facts import Imports

REPO = Path(__file__).resolve().parents[2]
LAB = load_inventory(REPO / "inventories" / "lab.yaml")
VENV = "/opt/ddtree/venv"


@pytest.fixture(scope="module")
def profile():
    return load_profile(REPO / "playbooks" / "lab-ddtree16.yaml", repo_root=REPO)


def dest(paths: dict[str, dict], venv_ok: bool = False, **more) -> Inspection:
    return replace(Inspection(paths={p: PathFact.from_json({"real": p, **f}) for p, f in paths.items()},
                              imports=Imports.from_json({"venv": venv_ok})), **more)


# -- paths, resolved on the host -------------------------------------------------------------------

def test_the_probe_resolves_where_each_path_leads(tmp_path):
    (tmp_path / "usr").mkdir()
    (tmp_path / "usr" / "bin").mkdir()
    (tmp_path / "venv").symlink_to(tmp_path / "usr")
    (tmp_path / "unit").symlink_to("/dev/null")
    out = inspect_local({"paths": [str(tmp_path / "venv"), str(tmp_path / "unit"), str(tmp_path / "new")]})["paths"]
    assert out[str(tmp_path / "venv")] == {"real": str(tmp_path / "usr"), "link": True, "exists": True, "dir": True,
                                           "entries": 1, "venv": False}
    assert out[str(tmp_path / "unit")]["real"] == "/dev/null" and out[str(tmp_path / "unit")]["link"]
    assert not out[str(tmp_path / "new")]["exists"]


def test_serving_args_ask_where_every_written_path_leads(profile):
    args = serving_args(profile, None)
    assert {VENV, "/root/models/tiny-target", "/root/models/tiny-draft", "/etc/systemd/system/ddtree.service",
            "/etc/ddops/ddtree.env", f"{VENV}/ddtree-release.json"} <= set(args["paths"])
    assert {"/var/lib/ddops/backups", VENV, "/var/cache/ddops/releases"} <= set(args["free"])


def test_clean_paths_pass(profile):
    assert check_confinement(profile, dest({VENV: {"exists": False}, "/root/models/tiny-target": {}})) == []


@pytest.mark.parametrize("path, real, words", [
    (VENV, "/usr", "runtime.venv /opt/ddtree/venv on ct200 leads to /usr (a symlink), which is a system directory"),
    ("/root/models/tiny-target", "/etc/ssl", "models.target.path /root/models/tiny-target on ct200 leads to /etc/ssl"),
])
def test_a_symlink_out_of_where_a_dir_may_live_is_refused(profile, path, real, words):
    problems = check_confinement(profile, dest({path: {"real": real, "link": True, "exists": True, "dir": True}}))
    assert len(problems) == 1 and words in problems[0]
    assert "lab-ddtree16.yaml:" in problems[0]


def test_a_symlink_that_stays_in_bounds_is_fine(profile):
    assert check_confinement(profile, dest({VENV: {"real": "/srv/venvs/ddtree", "link": True, "exists": True,
                                                   "dir": True, "entries": 5, "venv": True}}, venv_ok=True)) == []


def test_a_venv_is_made_only_in_a_new_or_empty_dir(profile):
    full = dest({VENV: {"exists": True, "dir": True, "entries": 3, "venv": False}})
    problems = check_confinement(profile, full)
    assert len(problems) == 1 and "holds 3 file(s) and is not a venv" in problems[0]
    assert check_confinement(profile, dest({VENV: {"exists": True, "dir": True, "entries": 0}})) == []
    broken_venv = dest({VENV: {"exists": True, "dir": True, "entries": 4, "venv": True}})
    assert check_confinement(profile, broken_venv) == []     # a venv missing its python is made again in place


def test_a_written_file_that_is_a_link_is_refused(profile):
    unit = "/etc/systemd/system/ddtree.service"
    problems = check_confinement(profile, dest({unit: {"real": "/lib/systemd/system/ssh.service", "link": True,
                                                       "exists": True}}))
    assert problems == [f"{unit} on ct200 is a symlink to /lib/systemd/system/ssh.service: ddops writes that file "
                        "and follows no link out of its folder; remove the link (`systemctl disable` or `rm`) first"]


# -- a failed venv step takes back the venv it made --------------------------------------------------

class VenvFails:
    """`python3 -m venv` fails (ensurepip missing, say); every argv is kept."""

    def __init__(self) -> None:
        self.commands: list[list[str]] = []

    def run(self, host, argv, **kwargs) -> CommandResult:
        self.commands.append(list(argv))
        code = 1 if argv[:3] == ["python3", "-m", "venv"] else 0
        return CommandResult(host.name, "", code, "", "ensurepip is not available" if code else "", 0)


@pytest.mark.parametrize("existed, removed", [(False, True), (True, False)])
def test_a_failed_venv_step_removes_only_a_venv_it_made(profile, existed, removed):
    operations = plan_deps(profile, Imports.from_json({"venv": False}), venv_dir=PathFact(real=VENV, exists=existed))
    assert operations[0].data["new_dir"] is not existed
    executor = VenvFails()
    with pytest.raises(StepFailed, match="creating the venv failed"):
        DepsStep().apply(RunContext(profile=profile, inventory=LAB, executor=executor), operations)
    assert (["rm", "-rf", "--one-file-system", "--", VENV] in executor.commands) is removed


def test_without_facts_about_the_dir_nothing_is_removed(profile):
    assert plan_deps(profile, Imports.from_json({"venv": False}))[0].data["new_dir"] is False


# -- space where ddops writes ---------------------------------------------------------------------

@pytest.mark.parametrize("n, text", [(0, "0 B"), (512, "512 B"), (1536, "1.5 KiB"), (64 * 2**20, "64 MiB"),
                                     (123 * 2**30, "123 GiB"), (int(1.25 * 2**30), "1.25 GiB"), (3 * 2**40, "3 TiB")])
def test_sizes_read_in_the_unit_that_fits(n, text):
    assert size(n) == text


def test_ddops_own_writes_share_their_filesystem_with_the_models(profile):
    free = {p: Free("/", 10 * 2**20, device=1) for p in ("/var/lib/ddops/backups", VENV, "/var/cache/ddops/releases",
                                                          "/root/models/tiny-target", "/root/models/tiny-draft")}
    trees = {"target": Tree(exists=True, bytes=0), "draft": Tree(exists=True, bytes=0)}
    problems = check_disk(profile, trees, replace(dest({}), free=free))
    assert len(problems) == 1
    assert problems[0].startswith("not enough disk on ct200:/: need ")
    assert f"backups {size(STATE_FLOOR)} in /var/lib/ddops/backups" in problems[0]
    assert f"venv (pip install) {size(VENV_FLOOR)} in {VENV}" in problems[0]
    assert problems[0].endswith("free 10 MiB")
    roomy = {p: replace(f, free_bytes=100 * 2**30) for p, f in free.items()}
    assert check_disk(profile, trees, replace(dest({}), free=roomy)) == []


def test_a_complete_venv_needs_no_room_for_pip(profile):
    free = {p: Free("/", 100 * 2**20, device=1) for p in ("/var/lib/ddops/backups", VENV, "/var/cache/ddops/releases")}
    ok = Imports.from_json({"venv": True, "modules": {m: {"ok": True} for m in profile.runtime.packages}})
    shipless = replace(profile, runtime=replace(profile.runtime, ship=None))
    trees = {"target": Tree(exists=True, bytes=0), "draft": Tree(exists=True, bytes=0)}
    assert check_disk(shipless, trees, replace(dest({}), free=free, imports=ok)) == []
    assert check_disk(profile, trees, replace(dest({}), free=free, imports=ok)) != []   # + the releases' floor


# -- a port's holder --------------------------------------------------------------------------------

@pytest.mark.parametrize("holder, words", [
    ({"unit": "sglang.service", "pid": 7, "cmdline": "python -m sglang"}, "sglang.service (pid 7: python -m sglang)"),
    ({"unit": None, "pid": 9, "cmdline": "nc -l 8000"}, "pid 9 (nc -l 8000)"),
    ({"unit": None, "pid": 9, "cmdline": ""}, "pid 9"),
    ({"unit": None, "pid": None, "cmdline": None}, "a process this host cannot see (another container"),
])
def test_a_port_holder_is_named_with_what_is_known(holder, words):
    assert holder_words(holder).startswith(words)
    assert "None" not in holder_words(holder)



def test_an_sglang_profile_s_venv_is_sglang_s_own(profile):
    """ddops never writes into an SGLang venv: a link there (to /usr/local, say) is the operator's choice."""
    sglang = load_profile(REPO / "playbooks" / "lab-sglang-dflash.yaml", repo_root=REPO)
    venv = sglang.runtime.venv
    assert check_confinement(sglang, dest({venv: {"real": "/usr/local/sglang", "link": True, "exists": True,
                                                  "dir": True, "entries": 5, "venv": True}})) == []
