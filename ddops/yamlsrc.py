"""YAML loading that remembers line numbers, and typed access that reports `file:line` on error.

Inventories and profiles are user-written; every complaint about them names the file, the
line and the key, and suggests the nearest valid key for a typo.
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path
from typing import Any, Iterable

import yaml

from .errors import ConfigError


class LineDict(dict):
    """A mapping from YAML that knows where it and each of its keys came from."""

    line: int = 0
    key_lines: dict[str, int]


class _Loader(yaml.SafeLoader):
    """SafeLoader whose mappings are LineDicts and which refuses duplicate keys."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> LineDict:
    loader.flatten_mapping(node)
    mapping = LineDict()
    mapping.line = node.start_mark.line + 1
    mapping.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, (str, int, float, bool)) or key is None:
            raise yaml.constructor.ConstructorError(
                None, None, "mapping keys must be plain scalars", key_node.start_mark)
        if key in mapping:
            raise ConfigError(
                f"duplicate key {key!r} (first at line {mapping.key_lines[key]})",
                where=f"{loader.name}:{key_node.start_mark.line + 1}",
                fix="each key may appear once in a mapping")
        mapping[key] = loader.construct_object(value_node, deep=True)
        mapping.key_lines[key] = key_node.start_mark.line + 1
    return mapping


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

# No setting takes an integer past int64; and Python refuses to parse one of over 4,300 decimal digits
# (ValueError), or to print one of that size, which a `0x...` literal can reach.
_INT_BITS = 63


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    try:
        value = yaml.constructor.SafeConstructor.construct_yaml_int(loader, node)
    except ValueError:
        value = None
    if value is None or abs(value).bit_length() > _INT_BITS:
        raise ConfigError(f"integer {node.value[:12]}... ({len(node.value)} characters) is too large",
                          where=f"{loader.name}:{node.start_mark.line + 1}",
                          fix="no setting takes more than 18 digits; quote it if it is meant as text")
    return value


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)

# What cannot be one line of a unit file, an environment file or a log: C0 controls (tab included),
# DEL, and the Unicode line separators.
CONTROL_CHARS = re.compile("[\x00-\x1f\x7f\x85\u2028\u2029]")
# What YAML's reader refuses in a stream (a ReaderError that names an offset, not a line).
_UNPRINTABLE = yaml.reader.Reader.NON_PRINTABLE


def load_yaml(path: Path, what: str) -> "Section":
    """Parse a YAML file whose top level must be a mapping; errors name file and line."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{what} not found", where=str(path),
                          fix="check the path, or pass another with -i/--inventory") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {what}: {exc.__class__.__name__}", where=str(path)) from None
    bad = _UNPRINTABLE.search(text)
    if bad:
        line = text.count("\n", 0, bad.start()) + 1
        raise ConfigError(f"control character {bad.group()!r} (U+{ord(bad.group()):04X}) in the {what}",
                          where=f"{path}:{line}", fix="remove it: YAML takes printable text, tabs and line breaks")
    loader = _Loader(text)
    loader.name = str(path)
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark else ""
        problem = exc.problem or exc.context or "invalid YAML"
        raise ConfigError(f"invalid YAML: {problem}", where=f"{path}{line}",
                          fix="fix the syntax (indentation, quoting, colons)") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {exc}", where=str(path)) from None
    finally:
        loader.dispose()
    if not isinstance(data, LineDict):
        raise ConfigError(f"the {what} must be a YAML mapping at the top level",
                          where=f"{path}:1", fix="start with keys such as `hosts:`")
    return Section(data, str(path), "")


_MISSING = object()
# A number with an exponent but no dot (`1e308`, `5E-3`): YAML 1.1 leaves it a string.
_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _type_name(value: Any) -> str:
    return {str: "a string", int: "an integer", bool: "true/false", float: "a number",
            list: "a list", LineDict: "a mapping", type(None): "empty"}.get(type(value), type(value).__name__)


class Section:
    """Typed, located access to one YAML mapping (`hosts.ct200.expect`, say)."""

    def __init__(self, data: LineDict, source: str, path: str, line: int | None = None) -> None:
        self.data = data
        self.source = source
        self.path = path
        self.line = line or data.line  # where the mapping's own key stands, for whole-mapping errors

    def where(self, key: str | None = None) -> str:
        line = self.data.key_lines.get(key, self.line) if key is not None else self.line
        return f"{self.source}:{line}"

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str | None, what: str, fix: str | None = None) -> ConfigError:
        return ConfigError(what, where=self.where(key), fix=fix)

    def keys(self) -> list[str]:
        return list(self.data)

    def reject_unknown(self, allowed: Iterable[str]) -> None:
        allowed = list(allowed)
        for key in self.data:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f"did you mean `{close[0]}`?" if close else f"known keys: {', '.join(allowed)}"
                raise self.fail(key, f"unknown key `{self._name(str(key))}`", hint)

    def _get(self, key: str, required: bool) -> Any:
        if key not in self.data or self.data[key] is None:
            if required:
                raise self.fail(None, f"missing required key `{self._name(key)}`",
                                f"add `{key}:` to {self.path or 'the top level'}")
            return _MISSING
        return self.data[key]

    def _expect(self, key: str, value: Any, kinds: tuple[type, ...], what: str) -> None:
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            raise self.fail(key, f"`{self._name(key)}` must be {what}, got {_type_name(value)} {value!r}")

    def str(self, key: str, default: Any = None, *, required: bool = False,
            choices: Iterable[str] | None = None) -> Any:
        value = self._get(key, required)
        if value is _MISSING:
            return default
        self._expect(key, value, (str,), "a string")
        if not value.strip():
            raise self.fail(key, f"`{self._name(key)}` must not be empty")
        if "\0" in value:
            raise self.fail(key, f"`{self._name(key)}` contains a NUL byte", "no argument or file can carry one")
        if choices is not None and value not in (choices := list(choices)):
            raise self.fail(key, f"`{self._name(key)}` must be one of {', '.join(choices)}, got {value!r}")
        return value

    def one_line(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        """A string that is one line of printable text: it is written into unit and environment files."""
        value = self.str(key, default, required=required)
        if isinstance(value, str) and CONTROL_CHARS.search(value):
            raise self.fail(key, f"`{self._name(key)}` contains a line break or control character: {value!r}",
                            "make it one line of printable text")
        return value

    def int(self, key: str, default: Any = None, *, required: bool = False,
            min: int | None = None, max: int | None = None) -> Any:
        value = self._get(key, required)
        if value is _MISSING:
            return default
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            raise self.fail(key, f"`{self._name(key)}` must be an integer, got {value} (a number with an exponent)",
                            "write it out in digits")
        self._expect(key, value, (int,), "an integer")
        self._check_range(key, value, min, max)
        return value

    def number(self, key: str, default: Any = None, *, required: bool = False,
               min: float | None = None, max: float | None = None) -> Any:
        value = self._get(key, required)
        if value is _MISSING:
            return default
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            value = float(value)   # YAML 1.1 reads `1e308` (no dot) as text; it is the number it looks like
        self._expect(key, value, (int, float), "a number")
        if not math.isfinite(value):
            raise self.fail(key, f"`{self._name(key)}` must be a finite number, got {value}")
        self._check_range(key, value, min, max)
        return float(value)

    def _check_range(self, key: str, value: float, min: float | None, max: float | None) -> None:
        if (min is not None and value < min) or (max is not None and value > max):
            bounds = f"between {min} and {max}" if min is not None and max is not None else (
                f"at least {min}" if min is not None else f"at most {max}")
            raise self.fail(key, f"`{self._name(key)}` must be {bounds}, got {value}")

    def bool(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        value = self._get(key, required)
        if value is _MISSING:
            return default
        self._expect(key, value, (bool,), "true or false")
        return value

    def abspath(self, key: str, default: Any = None, *, required: bool = False,
                home_ok: bool = False) -> Any:
        """An absolute path (or `~/...` where home_ok): relative paths are ambiguous on a remote host."""
        value = self.str(key, default, required=required)
        if value is None or value is default:
            return value
        if not (value.startswith("/") or (home_ok and value.startswith("~"))):
            raise self.fail(key, f"`{self._name(key)}` must be an absolute path, got {value!r}",
                            "start it with /")
        if CONTROL_CHARS.search(value):
            raise self.fail(key, f"`{self._name(key)}` contains a newline or control character: {value!r}",
                            "a path is one line of printable text")
        self.refuse_parent_steps(key, value)
        return value

    def refuse_parent_steps(self, key: str, path: str) -> None:
        """A path with a `..` step: what it names depends on links along the way, and it is how a path
        climbs out of where it may live (`/opt/ddtree/../../usr`)."""
        if ".." in path.split("/"):
            raise self.fail(key, f"`{self._name(key)}` {path!r} has a `..` step", "write the path it means without `..`")

    def list(self, key: str, *, required: bool = False) -> list[Any]:
        value = self._get(key, required)
        if value is _MISSING:
            return []
        self._expect(key, value, (list,), "a list")
        return value

    def str_list(self, key: str, *, required: bool = False) -> list[str]:
        items = self.list(key, required=required)
        for item in items:
            if not isinstance(item, str) or not item.strip():
                raise self.fail(key, f"`{self._name(key)}` must be a list of strings, got item {item!r}")
            if "\0" in item:
                raise self.fail(key, f"`{self._name(key)}` has an item with a NUL byte: {item!r}",
                                "no argument can carry one")
        return items

    def section(self, key: str, *, required: bool = False) -> "Section | None":
        value = self._get(key, required)
        if value is _MISSING:
            return None
        self._expect(key, value, (LineDict,), "a mapping")
        return Section(value, self.source, self._name(key), self.data.key_lines.get(key))

    def item_section(self, key: str, index: int, value: Any) -> "Section":
        """A mapping found as item `index` of the list under `key`."""
        if not isinstance(value, LineDict):
            raise self.fail(key, f"`{self._name(key)}[{index}]` must be a mapping, got {_type_name(value)}")
        return Section(value, self.source, f"{self._name(key)}[{index}]", value.line)
