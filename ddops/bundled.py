"""The bundled runtime's pure-Python modules ddops reads: `limits` (the serve limits), `settings` (every
serve setting, declared once), `capacity` (what a GPU's memory holds) and `drafter_layout` (the drafter
layouts its loader serves). Nothing else of the runtime.

Read from this checkout's runtime/ when there is one: that is the runtime `runtime.ship` builds and
deploys, whatever version of it is installed here (setup.sh installs it editable, so they agree). Else
(ddops installed without the repo) from the installed ddtree_runtime. These modules import only the
standard library and each other, and the package's `__init__` imports nothing, so neither way pulls
torch onto the control machine.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from .errors import ConfigError

_CHECKOUT = Path(__file__).resolve().parents[1] / "runtime" / "ddtree_runtime"
_PACKAGE = "ddops._bundled_runtime"   # the checkout's ddtree_runtime, under a name of its own


def runtime_module(name: str) -> ModuleType:
    """`ddtree_runtime.<name>` of the checkout (else the installed runtime); a ConfigError says what to
    install when neither has it."""
    if (_CHECKOUT / f"{name}.py").is_file():
        if _PACKAGE not in sys.modules:
            spec = importlib.util.spec_from_file_location(_PACKAGE, _CHECKOUT / "__init__.py",
                                                          submodule_search_locations=[str(_CHECKOUT)])
            package = importlib.util.module_from_spec(spec)
            sys.modules[_PACKAGE] = package
            spec.loader.exec_module(package)
        return importlib.import_module(f"{_PACKAGE}.{name}")
    try:
        return importlib.import_module(f"ddtree_runtime.{name}")
    except ImportError:
        raise ConfigError(f"cannot check deploy profiles: the DDTree runtime's {name} (ddtree_runtime.{name}) "
                          "are not installed", fix="run ddops from its checkout, or `pip install ./runtime`") from None


LIMITS = runtime_module("limits")
SETTINGS = runtime_module("settings")
CAPACITY = runtime_module("capacity")
DRAFTER = runtime_module("drafter_layout")
