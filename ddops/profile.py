"""Deploy profiles (`playbooks/*.yaml`): what a pivot puts where, validated with `file:line` errors.

A profile names one serving host, the unit to run there, the models to sync (and from where), the
runtime's venv and required packages, conflicting units, the health deadline and the smoke test.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .bundled import LIMITS, SETTINGS
from .errors import ConfigError
from .paths import cache_root, env_path
from .yamlsrc import CONTROL_CHARS, Section, load_yaml


ENGINES = ("ddtree", "sglang")
MODES = LIMITS.MODES
DTYPES = LIMITS.DTYPE_NAMES
LOCAL = "local"  # `from.host: local` = the control machine running ddops
CACHE = "${DDOPS_CACHE}"  # the one variable a local source path may start with
_TEMPLATE_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# Patterns are used with fullmatch: `$` would also match before a trailing newline.
_UNIT = re.compile(r"[A-Za-z0-9@._:-]+\.service")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_IMPORT = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_DEVICE = re.compile(SETTINGS.BY_NAME["device"].pattern)
# A profile's name lands in unit and env-file comments, the unit's Description= (where `%` is a
# specifier), reports and history: letters, digits and a few marks only.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+@-]{0,99}")
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")
# systemd refuses these in an ExecStart= executable, and does not undo `$$` there as it does in arguments.
_EXEC_UNSAFE = re.compile(r"[$\"'\\]")
# Never sync (with --delete) into these: a typo there would wipe a system directory.
_PROTECTED = {"/", "/root", "/home", "/etc", "/usr", "/var", "/opt", "/dev", "/dev/shm", "/tmp", "/srv",
              "/bin", "/sbin", "/lib", "/boot", "/proc", "/sys", "/run", "/mnt", "/media"}
# Trees a model dir may never be inside: the sync mirrors with --delete, so a typo there would wipe
# system files. (/dev/shm/NAME is fine: that is where a RAM-resident model lives.)
_SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/proc", "/sys",
                 "/run", "/var/lib", "/var/log", "/var/spool")
_TOP = ("name", "description", "engine", "host", "unit", "port", "bind", "device", "dtype", "gpus",
        "models", "runtime", "serve", "sglang", "env", "secrets", "conflicts", "training", "health", "smoke",
        "balancer")


@dataclass(frozen=True)
class ModelSource:
    host: str          # an inventory host, or "local" for the control machine
    path: str


@dataclass(frozen=True)
class Model:
    role: str          # "target" or "draft"
    path: str          # where the serving host reads it
    source: ModelSource | None  # where it is synced from; None = must already be on the host
    min_free_gib: float = 0.0


@dataclass(frozen=True)
class TorchPin:
    """`runtime.torch`: the torch build to install (torch==VERSION+cuXY), and the index that has it."""

    version: str
    cuda: str                  # major.minor, e.g. "12.8"
    index: str | None = None   # e.g. https://download.pytorch.org/whl/cu128 (pip's --extra-index-url)
    where: str = ""            # file:line, for preflight's lines

    @property
    def build(self) -> str:
        return f"{self.version}+cu{self.cuda.replace('.', '')}"

    @property
    def requirement(self) -> str:
        return f"torch=={self.build}"


@dataclass(frozen=True)
class Runtime:
    venv: str
    packages: dict[str, str]   # import name -> pip requirement
    ship: str | None           # local path of the runtime package to build and install, or None
    index: bool = True         # False: the host has no package index; ddops pushes a wheelhouse
    wheelhouse: str | None = None  # local dir of wheels for hosts without an index
    torch: TorchPin | None = None  # runtime.torch: sets packages' torch to that build

    @property
    def python(self) -> str:
        return f"{self.venv}/bin/python"


# `serve:` in a profile: the serve settings the runtime's table marks `profile` (same names, types, bounds
# and defaults as ddtree-serve's flags), plus flags passed as they are; `given` names the settings the
# profile sets (the unit passes those, and any other that differs from the runtime's default).
Serve = SETTINGS.config_class(
    "Serve", __name__, SETTINGS.PROFILE_SETTINGS, "A profile's serve settings (the runtime's settings.py).",
    extra_fields=(("extra_args", tuple, dataclasses.field(default=())),
                  ("given", frozenset, dataclasses.field(default=frozenset()))))


# SGLang's --mamba-scheduler-strategy choices (python/sglang/srt/server_args.py). Speculative decoding on
# a hybrid (Gated DeltaNet) target such as Qwen3.5/3.6 needs extra_buffer: z-lab's recipe passes it, and
# some SGLang builds refuse to start DFLASH on such a target without it (preflight checks the target).
MAMBA_STRATEGIES = ("auto", "no_buffer", "extra_buffer", "extra_buffer_lazy")


@dataclass(frozen=True)
class Sglang:
    python: str
    num_draft_tokens: int
    tp_size: int = 1
    dp_attention: bool = False
    extra_args: tuple[str, ...] = ()
    mamba_scheduler_strategy: str | None = None   # None: SGLang's default (auto)


# -- training stop: what a kill would cost, and how to ask for a checkpoint first (issue 17) --------

# Signals a trainer may take as "write a checkpoint now". Never one that stops a process by convention
# (TERM, INT, QUIT, KILL): the request must leave the job running when it is ignored.
CHECKPOINT_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP")


@dataclass(frozen=True)
class TrainingStop:
    """`training:` beyond the grace period. A checkpoint request (a signal or a command run on the host)
    is sent first, then up to `checkpoint_wait_s` for a newer checkpoint before SIGTERM. A kill that
    would lose more than `max_lost_steps` steps (None: no limit) is refused without --accept-lost-steps."""

    checkpoint_signal: str | None = None
    checkpoint_command: tuple[str, ...] = ()
    checkpoint_wait_s: float = 120.0
    max_lost_steps: int | None = None

    def limit(self, accepted: float | None) -> int | None:
        """The most steps this run may lose: --accept-lost-steps when given (inf: no limit), else the profile's."""
        if accepted is None:
            return self.max_lost_steps
        return None if accepted == float("inf") else int(accepted)

    @property
    def request(self) -> str | None:
        """The checkpoint request in words, or None when the profile names none."""
        if self.checkpoint_signal:
            return self.checkpoint_signal
        return " ".join(self.checkpoint_command) if self.checkpoint_command else None


def _training_stop(section: Section | None) -> TrainingStop:
    if section is None:
        return TrainingStop()
    signal_name = section.str("checkpoint_signal")
    if signal_name is not None:
        signal_name = signal_name.upper()
        signal_name = signal_name if signal_name.startswith("SIG") else "SIG" + signal_name
        if signal_name not in CHECKPOINT_SIGNALS:
            raise section.fail("checkpoint_signal", f"`training.checkpoint_signal` must be one of "
                               f"{', '.join(CHECKPOINT_SIGNALS)}, got {section.data['checkpoint_signal']!r}",
                               "name the signal the trainer takes as 'write a checkpoint now'; a stop signal "
                               "would end the job the request is meant to keep")
    command = tuple(section.str_list("checkpoint_command"))
    if signal_name and command:
        raise section.fail("checkpoint_command", "`training` names both a checkpoint_signal and a "
                           "checkpoint_command", "keep the one the trainer understands")
    return TrainingStop(checkpoint_signal=signal_name, checkpoint_command=command,
                        checkpoint_wait_s=section.number("checkpoint_wait_s", 120.0, min=1, max=7200),
                        max_lost_steps=section.int("max_lost_steps", None, min=0))


# -- end of the training-stop block ----------------------------------------------------------------


@dataclass(frozen=True)
class Health:
    path: str = "/health"
    deadline_s: float = 300.0
    interval_s: float = 1.0


@dataclass(frozen=True)
class SmokePrompt:
    prompt: str
    expect: str        # a regex the answer must match


@dataclass(frozen=True)
class Smoke:
    prompts: tuple[SmokePrompt, ...]
    max_tokens: int = 16
    min_acceptance: float = 1.0
    lossless_check: bool = True
    timeout_s: float = 120.0


@dataclass(frozen=True)
class Profile:
    path: Path
    name: str
    engine: str
    host: str
    unit: str
    port: int
    bind: str
    device: str
    dtype: str
    gpus: str | None
    models: tuple[Model, ...]
    runtime: Runtime
    serve: Serve
    sglang: Sglang | None
    env: dict[str, str]
    secrets: dict[str, str]    # unit env var -> control-machine env var holding the value
    conflicts: tuple[str, ...]
    training_grace_s: float
    health: Health
    smoke: Smoke
    description: str = ""
    training_stop: TrainingStop = TrainingStop()
    # -- replicas behind a balancer (issue 17): None for a plain one-unit profile ---------------------
    replicas: "Replicas | None" = None
    balancer: "Balancer | None" = None
    lines: dict[str, str] = field(default_factory=dict, compare=False)  # key -> file:line, for errors

    @property
    def replicated(self) -> bool:
        """Whether the runtime runs as instances of a template unit behind HAProxy."""
        return self.replicas is not None

    def model(self, role: str) -> Model | None:
        return next((m for m in self.models if m.role == role), None)

    @property
    def env_file(self) -> str:
        return env_path(self.unit)

    @property
    def api_key_set(self) -> bool:
        return "DDTREE_API_KEY" in self.secrets

    def where(self, key: str) -> str:
        return self.lines.get(key, str(self.path))


def resolve_profile(name_or_path: str, search: Path | None = None) -> Path:
    """`zlab-ddtree16` -> playbooks/zlab-ddtree16.yaml; a path is taken as it is."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        return candidate
    base = search or Path(os.environ.get("DDOPS_PLAYBOOKS", "playbooks"))
    for suffix in (".yaml", ".yml"):
        if (base / f"{name_or_path}{suffix}").exists():
            return base / f"{name_or_path}{suffix}"
    known = sorted(p.stem for p in base.glob("*.y*ml")) if base.is_dir() else []
    raise ConfigError(f"no deploy profile named {name_or_path!r} in {base}/",
                      fix=f"known profiles: {', '.join(known) or 'none'}; or pass a path to a .yaml file")


def load_profile(path: Path | str, *, repo_root: Path | None = None) -> Profile:
    """Read and validate a deploy profile; any problem is a ConfigError naming file:line."""
    path = Path(path)
    top = load_yaml(path, "deploy profile")
    top.reject_unknown(_TOP)
    root = repo_root or Path.cwd()
    engine = top.str("engine", "ddtree", choices=ENGINES)
    name = top.str("name", path.stem)
    if not _NAME.fullmatch(name):
        raise top.fail("name", f"profile name {name!r} must be letters, digits and . _ + @ - (at most 100)",
                       "set `name:` to e.g. lab-ddtree16" + ("" if "name" in top.data else
                                                             f"; it defaults to the file name {path.stem!r}"))
    unit = top.str("unit", required=True)
    if not _UNIT.fullmatch(unit):
        raise top.fail("unit", f"invalid systemd service name {unit!r}", "e.g. `ddtree.service`")
    port = top.int("port", required=True, min=1, max=65535)
    device = top.str("device", "cuda")
    if not _DEVICE.fullmatch(device):
        raise top.fail("device", f"`device` must be cpu, cuda or cuda:N, got {device!r}")
    gpus = top.data.get("gpus")
    if gpus is not None:
        if isinstance(gpus, list) and all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus):
            gpus = ",".join(str(g) for g in gpus)
        elif isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= 0:
            gpus = str(gpus)
        else:
            raise top.fail("gpus", f"`gpus` must be a list of GPU indexes like [0, 1], got {gpus!r}",
                           "it becomes CUDA_VISIBLE_DEVICES")
        if len(set(gpus.split(","))) < len(gpus.split(",")):
            raise top.fail("gpus", f"`gpus` lists a GPU twice: [{gpus.replace(',', ', ')}]",
                           "list each GPU once (a server or replica never shares one of its GPUs)")
    env = _env(top)
    secrets = _secrets(top)
    bind = _bind(top)
    if bind not in ("127.0.0.1", "localhost", "::1") and "DDTREE_API_KEY" not in secrets:
        raise top.fail("bind", f"`bind: {bind}` exposes the runtime without an API key",
                       "add `secrets: {DDTREE_API_KEY: {env: YOUR_ENV_VAR}}` or bind 127.0.0.1")
    models = _models(top)
    runtime = _runtime(top, root)
    serve = _serve(top)
    gpus = tensor_parallel_gpus(top, gpus, device, serve.tensor_parallel)
    sglang = _sglang(top, engine)
    if engine == "ddtree":
        if models and not any(m.role == "target" for m in models):
            raise top.fail("models", "the ddtree engine needs a `models.target`")
        if serve.mode != "ar" and not any(m.role == "draft" for m in models):
            raise top.fail("models", f"mode {serve.mode} needs a `models.draft` (only mode ar runs without one)")
    else:
        if not any(m.role == "draft" for m in models) or not any(m.role == "target" for m in models):
            raise top.fail("models", "the sglang DFLASH engine needs `models.target` and `models.draft`")
    conflicts = tuple(top.str_list("conflicts"))
    for c in conflicts:
        if not _UNIT.fullmatch(c):
            raise top.fail("conflicts", f"invalid systemd service name {c!r} in `conflicts`")
        if c == unit:
            raise top.fail("conflicts", f"`conflicts` names the profile's own unit {unit}")
    training = top.section("training")
    grace = 30.0
    if training is not None:
        training.reject_unknown(("grace_s", "checkpoint_signal", "checkpoint_command", "checkpoint_wait_s",
                                 "max_lost_steps"))
        grace = training.number("grace_s", 30.0, min=0, max=3600)
    training_stop = _training_stop(training)
    lines = {k: top.where(k) for k in top.keys()}
    replicas, balancer = replicas_and_balancer(top, unit, port, gpus, serve.tensor_parallel)
    if replicas is not None and engine != "ddtree":
        raise top.fail("engine", "replicas behind the balancer run the ddtree engine only",
                       "SGLang spreads one server over GPUs itself (`sglang.tp_size`)")
    return Profile(path=path, name=name, engine=engine, host=top.str("host", required=True), unit=unit,
                   port=port, bind=bind, device=device, dtype=top.str("dtype", "bfloat16", choices=DTYPES),
                   gpus=gpus, models=models, runtime=runtime, serve=serve, sglang=sglang, env=env,
                   secrets=secrets, conflicts=conflicts, training_grace_s=grace, health=_health(top),
                   smoke=_smoke(top, engine), description=top.one_line("description", ""),
                   training_stop=training_stop, replicas=replicas, balancer=balancer, lines=lines)


def tensor_parallel_gpus(top: Section, gpus: str | None, device: str, ranks: int) -> str | None:
    """`gpus` for a server over `ranks` GPUs (serve.tensor_parallel): its processes take the GPUs of
    CUDA_VISIBLE_DEVICES in order, so `device` names no single GPU, and a plain unit is given exactly
    `ranks` of them (`gpus`, else 0 to ranks-1). Replicas get theirs from `serve.replicas`; on the CPU
    the ranks need none."""
    if ranks == 1 or not device.startswith("cuda"):
        return gpus
    if device != "cuda":
        raise top.fail("device", f"`device: {device}` names one GPU, and serve.tensor_parallel {ranks} spans {ranks}",
                       "set `device: cuda`: the ranks take the GPUs of `gpus` (CUDA_VISIBLE_DEVICES) in order")
    if _TEMPLATE_UNIT.fullmatch(top.data.get("unit") or ""):
        return gpus
    if gpus is None:
        return ",".join(str(i) for i in range(ranks))
    listed = gpus.split(",")
    if len(listed) != ranks:
        raise top.fail("gpus", f"`gpus` lists {len(listed)} GPU(s) and serve.tensor_parallel is {ranks}: the "
                       f"server spans exactly the GPUs it is given, one process each",
                       f"list {ranks} GPUs, or set serve.tensor_parallel to {len(listed)}")
    return gpus


def _bind(top: Section) -> str:
    """The runtime's listen address: an IP address or a host name, nothing that could split its argument."""
    bind = top.str("bind", "127.0.0.1")
    try:
        ipaddress.ip_address(bind)
    except ValueError:
        if not _HOSTNAME.fullmatch(bind) or len(bind) > 253:
            raise top.fail("bind", f"`bind` must be an IP address or a host name, got {bind!r}",
                           "e.g. 127.0.0.1 or 0.0.0.0") from None
    return bind


def _executable(section: Section, key: str) -> str:
    """An absolute path that systemd can run as the first word of ExecStart= (or the dir holding it)."""
    value = section.abspath(key, required=True)
    if _EXEC_UNSAFE.search(value):
        raise section.fail(key, f"`{section.path}.{key}` {value!r} holds $, a quote or a backslash, which "
                           "systemd cannot take in the path of the program it starts", "move it to a plain path")
    return value


def _env(top: Section) -> dict[str, str]:
    section = top.section("env")
    if section is None:
        return {}
    out = {}
    for key in section.keys():
        if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
            raise section.fail(key, f"invalid environment variable name {key!r}")
        value = section.data[key]
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise section.fail(key, f"`env.{key}` must be a string or a number, got {value!r}")
        if CONTROL_CHARS.search(str(value)):
            raise section.fail(key, f"`env.{key}` contains a newline or control character: {value!r}",
                               "an environment file value is one line of printable text")
        out[key] = str(value)
    return out


def _secrets(top: Section) -> dict[str, str]:
    section = top.section("secrets")
    if section is None:
        return {}
    out = {}
    for key in section.keys():
        if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
            raise section.fail(key, f"invalid environment variable name {key!r}")
        item = section.section(key, required=True)
        item.reject_unknown(("env",))
        source = item.str("env", required=True)
        if not _ENV_NAME.fullmatch(source):
            raise item.fail("env", f"invalid environment variable name {source!r}")
        out[key] = source
    return out


def _system_tree(path: str) -> str | None:
    """The system tree a normalised absolute path is in, if any."""
    return next((t for t in _SYSTEM_TREES if path == t or path.startswith(t + "/")), None)


def model_dir_problem(path: str) -> str | None:
    """Why a normalised absolute path may not be a model dir (the sync mirrors into it with --delete),
    or None. Preflight asks again of the path with its symlinks resolved on the host."""
    inside = _system_tree(path)
    if path in _PROTECTED or path.count("/") < 2 or inside or (path.startswith("/dev/") and
                                                              not path.startswith("/dev/shm/")):
        return "a system directory or too shallow" + (
            f" (inside {inside}, which the sync's --delete would damage)" if inside else "")
    return None


def venv_dir_problem(path: str) -> str | None:
    """Why a normalised absolute path may not hold the runtime's venv (`python3 -m venv` writes bin/,
    lib/, include/ and pyvenv.cfg into it), or None."""
    inside = _system_tree(path)
    if path in _PROTECTED or path.count("/") < 2 or inside:
        return "a system directory or too shallow" + (
            f" (inside {inside}, where a venv's bin/ and lib/ would mix with the system's)" if inside else "")
    return None


def _model_path(section: Section, key: str) -> str:
    value = section.abspath(key, required=True)
    norm = os.path.normpath(value)
    problem = model_dir_problem(norm)
    if problem:
        raise section.fail(key, f"model path {value!r} is {problem}",
                           "name the model's own directory, e.g. /root/models/NAME")
    return norm


def _venv_path(section: Section) -> str:
    value = os.path.normpath(_executable(section, "venv"))
    problem = venv_dir_problem(value)
    if problem:
        raise section.fail("venv", f"`runtime.venv` {value!r} is {problem}",
                           "give the venv a directory of its own, e.g. /opt/ddtree/venv")
    return value


def _local_source(section: Section) -> str:
    """A model dir on the control machine: written as an absolute path, `~/...` or `${DDOPS_CACHE}/...`,
    outside the system trees once symlinks are resolved, and a model dir (config.json) if it exists.
    One that does not exist yet (built or fetched later) is refused by preflight, before any change."""
    raw = section.str("path", required=True)
    if not raw.startswith(("/", "~/", CACHE + "/")):
        raise section.fail("path", f"local source path {raw!r} must be absolute",
                           f"start it with /, ~/ or {CACHE}/ (a relative path depends on where ddops runs)")
    cache = str(cache_root())
    expanded = os.path.expanduser(cache + raw[len(CACHE):] if raw.startswith(CACHE) else raw)
    if CONTROL_CHARS.search(expanded):
        raise section.fail("path", f"local source path {raw!r} contains a newline or control character")
    section.refuse_parent_steps("path", raw)
    real = os.path.realpath(expanded)
    if _system_tree(real) or real in _PROTECTED or real.count("/") < 2:
        raise section.fail("path", f"local source path {raw!r} is {real}, a system directory or too shallow",
                           "name the model's own directory, e.g. ~/models/NAME")
    if os.path.exists(real) and not os.path.isfile(os.path.join(real, "config.json")):
        raise section.fail("path", f"local source path {raw!r} ({real}) is not a model directory: no config.json",
                           "point it at a directory holding the model's config.json and weights")
    return real


def _models(top: Section) -> tuple[Model, ...]:
    section = top.section("models")
    if section is None:
        return ()
    section.reject_unknown(("target", "draft"))
    models = []
    for role in ("target", "draft"):
        item = section.section(role)
        if item is None:
            continue
        item.reject_unknown(("path", "from", "min_free_gib"))
        src = item.section("from")
        source = None
        if src is not None:
            src.reject_unknown(("host", "path"))
            host = src.str("host", required=True)
            path = _local_source(src) if host == LOCAL else _model_path(src, "path")
            source = ModelSource(host, path)
        models.append(Model(role=role, path=_model_path(item, "path"), source=source,
                            min_free_gib=item.number("min_free_gib", 0.0, min=0, max=100000)))
    return tuple(models)


def _runtime_needs(pyproject: Path, packages: dict[str, str]) -> dict[str, str]:
    """The shipped runtime's dependencies the profile does not install (import name -> requirement): the
    wheel goes in with --no-deps, so each must be in runtime.packages (import name = the distribution's,
    with `-` as `_`)."""
    import tomllib

    try:
        needs = tomllib.loads(pyproject.read_text()).get("project", {}).get("dependencies", [])
    except (OSError, ValueError):
        return {}
    have = {name.lower() for name in packages}
    missing = {}
    for requirement in needs:
        name = re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]
        if name.replace("-", "_").lower() not in have:
            missing[name.replace("-", "_")] = requirement
    return missing


def _runtime(top: Section, root: Path) -> Runtime:
    section = top.section("runtime", required=True)
    section.reject_unknown(("venv", "packages", "ship", "index", "wheelhouse", "torch"))
    packages_section = section.section("packages")
    packages: dict[str, str] = {}
    if packages_section is not None:
        for key in packages_section.keys():
            if not isinstance(key, str) or not _IMPORT.fullmatch(key):
                raise packages_section.fail(key, f"invalid import name {key!r}",
                                            "keys are import names, values pip requirements")
            packages[key] = packages_section.str(key, required=True)
    torch = _torch_pin(section)
    if torch is not None:
        if "torch" in packages:
            raise section.fail("torch", "both runtime.torch and runtime.packages.torch name the torch to install",
                               "keep one: runtime.torch pins the build (version and CUDA)")
        packages["torch"] = torch.requirement
    ship = section.str("ship")
    if ship is not None:
        ship_path = (root / ship).resolve()
        if not (ship_path / "pyproject.toml").is_file():
            raise section.fail("ship", f"`runtime.ship: {ship}` has no pyproject.toml ({ship_path})",
                               "point it at the runtime package, e.g. `runtime`")
        ship = str(ship_path)
        missing = _runtime_needs(ship_path / "pyproject.toml", packages)
        if missing:
            raise section.fail("packages", f"runtime.packages lacks {', '.join(missing)}, which the shipped "
                                           f"runtime needs ({ship_path / 'pyproject.toml'})",
                               "add them under runtime.packages (import name: pip requirement), e.g. "
                               + ", ".join(f"`{m}: {r}`" for m, r in missing.items()))
    index = section.bool("index", True)
    wheelhouse = section.str("wheelhouse")
    if wheelhouse is not None:
        wheelhouse = str((root / os.path.expanduser(wheelhouse)).resolve())
    if not index and wheelhouse is None:
        raise section.fail("index", "`index: false` needs a `wheelhouse` (a local dir of wheels to push)")
    return Runtime(venv=_venv_path(section), packages=packages, ship=ship,
                   index=index, wheelhouse=wheelhouse, torch=torch)


def _torch_pin(runtime: Section) -> TorchPin | None:
    """`runtime.torch: {version: "2.7.1", cuda: "12.8", index: URL}`; YAML may read the CUDA as a number."""
    pin = runtime.section("torch")
    if pin is None:
        return None
    pin.reject_unknown(("version", "cuda", "index"))
    values = {k: (str(pin.data[k]) if isinstance(pin.data.get(k), (int, float)) and not isinstance(pin.data[k], bool)
                  else pin.str(k, required=k != "index")) for k in ("version", "cuda", "index")}
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?", values["version"] or ""):
        raise pin.fail("version", f"runtime.torch.version must be a release like 2.7.1, got {values['version']!r}")
    if not re.fullmatch(r"\d+\.\d", values["cuda"] or ""):
        raise pin.fail("cuda", f"runtime.torch.cuda must be a CUDA version like \"12.8\", got {values['cuda']!r}",
                       "quote it in YAML")
    if values["index"] is not None and not re.fullmatch(r"https?://\S+", values["index"]):
        raise pin.fail("index", f"runtime.torch.index must be an http(s) URL, got {values['index']!r}")
    return TorchPin(version=values["version"], cuda=values["cuda"], index=values["index"], where=pin.where())


def _serve(top: Section) -> Serve:
    section = top.section("serve")
    if section is None:
        return Serve()
    section.reject_unknown([s.name for s in SETTINGS.PROFILE_SETTINGS] + ["extra_args", "replicas"])
    # the runtime's own bounds; the block size's ceiling is the drafter's, checked by preflight
    values = {s.name: _setting(section, s) for s in SETTINGS.PROFILE_SETTINGS}
    serve = Serve(**values, extra_args=tuple(section.str_list("extra_args")),
                  given=frozenset(s.name for s in SETTINGS.PROFILE_SETTINGS if s.name in section.data))
    if serve.tensor_parallel > 1 and top.str("engine", "ddtree") != "ddtree":
        raise section.fail("tensor_parallel", "`serve.tensor_parallel` is the bundled runtime's",
                           "an SGLang profile sets `sglang.tp_size`")
    if serve.prefix_cache_rows and not serve.prefix_cache:
        raise section.fail("prefix_cache_rows", "`serve.prefix_cache_rows` needs the prefix cache",
                           fix="drop it, or set `prefix_cache: true`")
    return serve


def _setting(section: Section, setting) -> object:
    """One serve setting from the profile, checked against the runtime's declaration of it."""
    default = setting.default_value()
    if setting.type is bool:
        return section.bool(setting.name, default)
    if setting.type is int:
        return section.int(setting.name, default, min=setting.minimum, max=setting.maximum)
    if setting.type is float:
        return section.number(setting.name, default, min=setting.minimum, max=setting.maximum)
    if setting.type is dict:
        return _template_kwargs(section, setting.name) if setting.name in section.data else default
    value = section.str(setting.name, default, choices=setting.choices)
    if value is not default and setting.problem(value):
        raise section.fail(setting.name, f"`serve.{setting.name}` {setting.problem(value)}, got {value!r}")
    return value


def _template_kwargs(serve: Section, key: str) -> dict:
    """A JSON-object setting (`serve.chat_template_kwargs`): flat template variables (name: string,
    number or bool)."""
    section = serve.section(key, required=True)
    values = {}
    for name in section.keys():
        value = section.data[name]
        if not isinstance(name, str) or not _TEMPLATE_VARIABLE.fullmatch(name):
            raise section.fail(name, f"invalid chat template variable name {name!r}")
        if not isinstance(value, (str, int, float, bool)):
            raise section.fail(name, f"`serve.{key}.{name}` must be a string, number or bool, got {value!r}")
        values[name] = value
    return values


def _sglang(top: Section, engine: str) -> Sglang | None:
    section = top.section("sglang")
    if engine != "sglang":
        if section is not None:
            raise top.fail("sglang", "`sglang:` is only for `engine: sglang`")
        return None
    if section is None:
        raise top.fail(None, "`engine: sglang` needs an `sglang:` section")
    section.reject_unknown(("python", "num_draft_tokens", "tp_size", "dp_attention", "extra_args",
                            "draft_block_size", "mamba_scheduler_strategy"))
    dp = section.bool("dp_attention", False)
    if dp:
        raise section.fail("dp_attention", "SGLang rejects DFLASH speculative decoding with dp-attention",
                           "set `dp_attention: false`")
    tokens = section.int("num_draft_tokens", required=True, min=1, max=64)
    block = section.int("draft_block_size")
    if block is not None and tokens > block:
        raise section.fail("num_draft_tokens", f"{tokens} draft tokens exceed the drafter's block size {block}",
                           "SGLang refuses it; use at most the block size")
    extra = tuple(section.str_list("extra_args"))
    if any(a.startswith("--enable-dp-attention") for a in extra):
        raise section.fail("extra_args", "SGLang rejects DFLASH with --enable-dp-attention")
    if any(a.startswith("--mamba-scheduler-strategy") for a in extra):
        raise section.fail("extra_args", "`--mamba-scheduler-strategy` in `sglang.extra_args`",
                           "set `sglang.mamba_scheduler_strategy` instead (preflight checks it against the target)")
    return Sglang(python=_executable(section, "python"), num_draft_tokens=tokens,
                  tp_size=section.int("tp_size", 1, min=1, max=64), dp_attention=dp, extra_args=extra,
                  mamba_scheduler_strategy=section.str("mamba_scheduler_strategy", choices=MAMBA_STRATEGIES))


def _health(top: Section) -> Health:
    section = top.section("health")
    if section is None:
        return Health()
    section.reject_unknown(("path", "deadline_s", "interval_s"))
    path = section.str("path", "/health")
    if not re.fullmatch(r"/[!-~]*", path):
        raise section.fail("path", f"`health.path` must be a URL path like /health, got {path!r}")
    return Health(path=path, deadline_s=section.number("deadline_s", 300.0, min=1, max=7200),
                  interval_s=section.number("interval_s", 1.0, min=0.1, max=60))


def _smoke(top: Section, engine: str) -> Smoke:
    section = top.section("smoke", required=True)
    section.reject_unknown(("prompts", "max_tokens", "min_acceptance", "lossless_check", "timeout_s"))
    prompts = []
    for index, item in enumerate(section.list("prompts", required=True)):
        entry = section.item_section("prompts", index, item)
        entry.reject_unknown(("prompt", "expect"))
        expect = entry.str("expect", required=True)
        try:
            re.compile(expect)
        except re.error as exc:
            raise entry.fail("expect", f"`expect` is not a valid regex: {exc}") from None
        prompts.append(SmokePrompt(prompt=entry.str("prompt", required=True), expect=expect))
    if not prompts:
        raise section.fail("prompts", "`smoke.prompts` is empty", "add a prompt with a checkable answer")
    lossless = section.bool("lossless_check", engine == "ddtree")
    if lossless and engine != "ddtree":
        raise section.fail("lossless_check", "the lossless spot-check needs the ddtree runtime's per-request "
                           "`speculative` override", "set `lossless_check: false` for sglang")
    return Smoke(prompts=tuple(prompts), max_tokens=section.int("max_tokens", 16, min=1, max=4096),
                 min_acceptance=section.number("min_acceptance", 1.0, min=0, max=64),
                 lossless_check=lossless, timeout_s=section.number("timeout_s", 120.0, min=1, max=3600))


# -- replicas and the balancer (issue 17) --------------------------------------------------------------
# A replicated profile names a template unit (`ddtree@.service`); replica N runs as `ddtree@N.service`
# on its own port and GPUs, and HAProxy serves the profile's `port` in front of them all.

_TEMPLATE_UNIT = re.compile(r"[A-Za-z0-9._:-]+@\.service")
# What HAProxy's config may carry unquoted: a health path (no `#`, quote, backslash or `$` that its
# parser would read as a comment, a quote or a variable).
HAPROXY_WORD = re.compile(r"[A-Za-z0-9/_.~:+=,-]+")


@dataclass(frozen=True)
class Replica:
    """One instance of the template unit: its index (1-based, the `%i`), unit, port and GPUs."""

    index: int
    unit: str                 # e.g. ddtree@1.service
    port: int
    gpus: tuple[int, ...]     # CUDA_VISIBLE_DEVICES; () = not pinned (gpus_each: 0)

    @property
    def server(self) -> str:
        """Its name in the balancer's backend."""
        return f"r{self.index}"


@dataclass(frozen=True)
class Replicas:
    count: int
    gpus_each: int
    first_port: int
    members: tuple[Replica, ...]


@dataclass(frozen=True)
class Balancer:
    """HAProxy in front of the replicas (Debian's package, its config rendered by ddops)."""

    backend: str = "replicas"
    drain_timeout_s: float = 120.0      # how long a drain waits for a replica's sessions to reach 0
    ready_timeout_s: float = 60.0       # how long a readmitted replica may take to be UP in HAProxy
    check_interval_s: float = 1.0       # HAProxy's active health check interval
    timeout_s: float = 600.0            # client and server timeouts: a long generation is not an error
    socket: str = "/run/haproxy/admin.sock"
    config: str = "/etc/haproxy/haproxy.cfg"
    unit: str = "haproxy.service"


def template_instance(template: str, index: int) -> str:
    """`ddtree@.service`, 2 -> `ddtree@2.service`."""
    return template.replace("@.service", f"@{index}.service")


def replicas_and_balancer(top: Section, unit: str, port: int, gpus: str | None,
                          tensor_parallel: int = 1) -> tuple[Replicas | None, Balancer | None]:
    """`serve.replicas` (a count, or `{count, gpus_each, first_port}`) and `balancer:`; both only with a
    template unit, which needs them. With serve.tensor_parallel N each replica spans N GPUs: the next N
    of `gpus` (or of 0, 1, ...) in order."""
    serve = top.section("serve")
    raw = serve.data.get("replicas") if serve is not None else None
    template = _TEMPLATE_UNIT.fullmatch(unit) is not None
    if raw is None:
        if template:
            raise top.fail("unit", f"{unit} is a template unit: it needs `serve.replicas`",
                           "add `replicas: 2` under `serve:`, or name a plain unit like ddtree.service")
        if top.section("balancer") is not None:
            raise top.fail("balancer", "`balancer:` is only for replicas (`serve.replicas` and a template unit)")
        return None, None
    if not template:
        raise serve.fail("replicas", f"replicas run as instances of a template unit, and {unit} is not one",
                         f"set `unit: {unit.removesuffix('.service')}@.service`")
    if isinstance(raw, int) and not isinstance(raw, bool):
        count = serve.int("replicas", min=1, max=64)
        gpus_each, first_port = tensor_parallel, port + 1
    else:
        section = serve.section("replicas", required=True)
        section.reject_unknown(("count", "gpus_each", "first_port"))
        count = section.int("count", required=True, min=1, max=64)
        gpus_each = section.int("gpus_each", tensor_parallel, min=0, max=64)
        first_port = section.int("first_port", port + 1, min=1, max=65535)
        if tensor_parallel > 1 and gpus_each != tensor_parallel:
            raise section.fail("gpus_each", f"`serve.replicas.gpus_each: {gpus_each}` with serve.tensor_parallel "
                               f"{tensor_parallel}: each replica spans {tensor_parallel} GPUs, one process each",
                               "drop `gpus_each`: with tensor_parallel it is the same number")
    if first_port + count - 1 > 65535 or first_port <= port < first_port + count:
        raise serve.fail("replicas", f"replica ports {first_port}-{first_port + count - 1} must fit below 65536 "
                         f"and leave the public port {port} to the balancer", "set `replicas.first_port`")
    pool = [int(g) for g in gpus.split(",")] if gpus is not None else list(range(count * gpus_each))
    if len(pool) < count * gpus_each:
        raise top.fail("gpus", f"{count} replicas x {gpus_each} GPU(s) need {count * gpus_each} GPUs, "
                       f"`gpus` lists {len(pool)}", "list more GPUs, or fewer replicas"
                       + (" or a smaller serve.tensor_parallel" if tensor_parallel > 1 else ""))
    health = top.section("health")
    path = health.data.get("path", "/health") if health is not None else "/health"
    if isinstance(path, str) and not HAPROXY_WORD.fullmatch(path):
        raise health.fail("path", f"`health.path` {path!r} cannot go into HAProxy's health check as it is",
                          "use letters, digits and / _ . ~ : + = , - only")
    members = tuple(Replica(index=i + 1, unit=template_instance(unit, i + 1), port=first_port + i,
                            gpus=tuple(pool[i * gpus_each:(i + 1) * gpus_each])) for i in range(count))
    return Replicas(count=count, gpus_each=gpus_each, first_port=first_port, members=members), _balancer(top)


def _balancer(top: Section) -> Balancer:
    section = top.section("balancer")
    if section is None:
        return Balancer()
    section.reject_unknown(("drain_timeout_s", "ready_timeout_s", "check_interval_s", "timeout_s"))
    return Balancer(drain_timeout_s=section.number("drain_timeout_s", 120.0, min=0, max=3600),
                    ready_timeout_s=section.number("ready_timeout_s", 60.0, min=1, max=3600),
                    check_interval_s=section.number("check_interval_s", 1.0, min=0.1, max=60),
                    timeout_s=section.number("timeout_s", 600.0, min=1, max=86400))


def check_against_inventory(profile: Profile, inventory) -> None:
    """Every host the profile names must be in the inventory (`host` may name a group of them)."""
    from .errors import ConfigError as _CE

    serving = inventory.groups.get(profile.host, [profile.host])   # a group: pivoted host by host
    names = serving + [m.source.host for m in profile.models if m.source and m.source.host != LOCAL]
    for name in names:
        if name not in inventory.hosts:
            raise _CE(f"profile names host {name!r}, which is not in {inventory.path}",
                      where=profile.where("host") if name in serving else profile.where("models"),
                      fix=f"known hosts: {', '.join(inventory.hosts)}; groups: {', '.join(inventory.groups)}")
