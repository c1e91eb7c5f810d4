"""Flags checked against the server that will run the unit: argparse help parsed into its long flags
(groups, aliases, `--no-x`, long metavars, help text that mentions other flags), the unit's flags read
from its command line, the refusal naming each missing flag, and the shipped runtime's own --help."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from ddops.facts import ServerFlags
from ddops.profile import load_profile
from ddops.release import release_id
from ddops.serverflags import check_flags, parse_help, shipped_flags, unit_flags
from ddops.steps.unit import exec_argv
from ddtree_runtime.server.cli import build_parser

REPO = Path(__file__).resolve().parents[2]


def long_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")}


def test_every_flag_of_the_runtimes_parser_is_read_from_its_help():
    parser = build_parser()
    assert parse_help(parser.format_help()) == long_flags(parser)


def test_groups_aliases_negations_and_help_text_that_names_other_flags():
    parser = argparse.ArgumentParser(prog="launch_server")
    group = parser.add_argument_group("Speculative decoding")
    group.add_argument("--speculative-algorithm", "--speculative-algo", choices=["EAGLE", "DFLASH"])
    group.add_argument("--a-very-long-option-name-that-pushes-help-down", metavar="SOME_LONG_METAVAR",
                       help="-1 means unlimited; see --not-a-flag-of-this-server " * 4)
    parser.add_argument("--enable-thing", action=argparse.BooleanOptionalAction)
    parser.add_argument("--tp-size", "--tp", type=int)
    flags = parse_help(parser.format_help())
    assert flags == long_flags(parser) and "--not-a-flag-of-this-server" not in flags
    assert {"--speculative-algo", "--no-enable-thing", "--tp"} <= flags


def test_the_units_flags_come_from_its_command_line():
    assert unit_flags(["/v/bin/ddtree-serve", "--target", "/m", "--port=8200", "--mode", "ddtree", "--port", "1",
                       "-x", "--x-y"]) == ["--target", "--port", "--mode", "--x-y"]


def test_a_flag_the_server_lacks_is_named_with_where_it_comes_from():
    profile = load_profile(REPO / "playbooks" / "lab-ddtree16.yaml", repo_root=REPO)
    profile = replace(profile, serve=replace(profile.serve, extra_args=("--speculative-gamma", "4")))
    argv = exec_argv(profile)
    server = ServerFlags(source="ddtree-serve installed on ct200", flags=frozenset(unit_flags(argv)) - {
        "--speculative-gamma", "--dtype"})
    problem, = check_flags(profile, argv, server)
    assert problem == ("ddtree-serve installed on ct200 has no flags --dtype, --speculative-gamma (from extra_args), "
                       "which the unit passes; remove them from the profile or install a server that has them")
    assert check_flags(profile, argv, replace(server, flags=frozenset(unit_flags(argv)))) == []


def test_a_server_that_cannot_be_asked_is_a_problem_unless_deps_installs_it():
    profile = load_profile(REPO / "playbooks" / "lab-ddtree16.yaml", repo_root=REPO)
    gone = ServerFlags(source="ddtree-serve installed on ct200", error="exit 127: not found", missing=True)
    assert check_flags(profile, exec_argv(profile), gone) == [
        "cannot check the unit's flags against ddtree-serve installed on ct200: exit 127: not found"]
    later = replace(profile, runtime=replace(profile.runtime, packages={**profile.runtime.packages,
                                                                         "ddtree_runtime": "ddtree-runtime"}))
    assert check_flags(later, exec_argv(later), gone) == []


def test_the_shipped_runtime_is_asked_its_own_help():
    ship = str(REPO / "runtime")
    server = shipped_flags(ship, release_id(ship))
    assert server.error is None and server.flags == long_flags(build_parser())
    assert server.source.startswith(f"ddtree-serve of the runtime shipped from {ship} (release ")
