"""The process's settings: every ``MPDL_*`` environment variable, read and validated in one place.

``current()`` reads the environment once, the first time it is asked, and keeps the result; a bad
value raises ``ValueError`` naming the variable and what it expects. Code that changes a setting
at run time (``mpdl train --emulate``, ``mpdl bench --emulate``) calls ``use(...)`` or
``update(...)`` instead of writing ``os.environ``; everything that depends on a setting reads it
from ``current()`` (or from the communicator that was built with it).

| variable | field | meaning (default) |
|---|---|---|
| MPDL_TIMEOUT | timeout | seconds a wait inside a collective may take before it raises (300) |
| MPDL_CHECK | check | 1: compare every collective's arguments across ranks first (0) |
| MPDL_SEGMENT_BYTES | segment_bytes | pipeline segment of ring and tree algorithms (1 MiB) |
| MPDL_STAGING_CHUNK_BYTES | staging_chunk_bytes | chunk of a staged GPU message (4 MiB) |
| MPDL_RANKS_PER_NODE | ranks_per_node | emulated nodes of k consecutive ranks (real nodes) |
| MPDL_EMULATE | emulation | slowed links, e.g. ``inter=10Gbit/s,20us`` (none) |
| MPDL_COST_MODEL | cost_model | parameter file of `auto`, or ``off`` / ``defaults`` (~/.cache/mpdl) |
| MPDL_AUTO_CACHE | auto_cache | folder of `auto`'s first-use calibrations, or ``off`` (~/.cache/mpdl) |
| MPDL_VERIFY_RUNS | verify_runs | runs of `auto`'s choice and its runner-up that a plan times (3; 0: off) |
| MPDL_CUDA_AWARE | cuda_aware | 0 or 1: whether MPI takes GPU buffers (detected) |
| MPDL_NO_CUPY | no_cupy | 1: act as if CuPy were not installed (0) |
| MPDL_ROUND_PER_HOP | round_per_hop | 1: 16- and 8-bit sums travel narrow, rounded at every hop (0) |
| MPDL_MALLOC | malloc | ``default``: keep glibc's malloc settings (tuned) |
| MPDL_BLAS | blas | the layers' float32 products: ``auto`` (MKL where installed), ``mkl`` or
  ``numpy`` (auto) |
| MPDL_FLIGHT_DIR | flight_dir | where flight records go (CHECKPOINT/flight under `mpdl train
  --checkpoint`, else ./mpdl-flight) |
| MPDL_FLIGHT_RECORDS | flight_records | operations the flight recorder keeps; 0: off (1000) |
| MPDL_STALL_WARN | stall_warn | seconds in one wait before a rank says whom it waits for (60) |
| MPDL_FAULT | fault | tests only: ``kill``, ``stall`` or ``nan:RANK:STEP``, or ``skip:RANK:SEQ`` (none) |
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

#: the variable of link emulation (mpdl.emulation); its spec is parsed here like every setting's
EMULATE_ENV = "MPDL_EMULATE"

_BANDWIDTH = re.compile(r"^([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(bit|b|byte)/s$", re.I)
_LATENCY = re.compile(r"^([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(ns|us|µs|ms|s)$", re.I)
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class Link:
    """An emulated link: bytes per second and seconds of latency per message."""

    bandwidth: float
    latency: float

    def delay(self, nbytes: int) -> float:
        """Seconds a message of nbytes takes on this link: latency + nbytes / bandwidth."""
        return self.latency + nbytes / self.bandwidth

    def describe(self) -> str:
        parts = [] if self.bandwidth == float("inf") else [f"{self.bandwidth * 8 / 1e9:g}Gbit/s"]
        return ",".join([*parts, f"{round(self.latency * 1e9) / 1e3:g}us"])


@dataclass(frozen=True)
class Emulation:
    """The emulated links: `inter` between nodes, `intra` inside a node (either may be None)."""

    inter: Link | None = None
    intra: Link | None = None

    def describe(self) -> str:
        """The spec in canonical form, e.g. 'inter=10Gbit/s,20us'."""
        parts = [f"{name}={link.describe()}" for name, link in (("inter", self.inter),
                                                                 ("intra", self.intra)) if link]
        return ";".join(parts)


def _parse_bandwidth(text: str) -> float:
    m = _BANDWIDTH.match(text.strip())
    if not m:
        raise ValueError(f"bandwidth {text!r}: expected a number and a unit such as 10Gbit/s, "
                         f"100Mbit/s or 1.25GB/s")
    value = float(m.group(1)) * _PREFIX[m.group(2).lower()]
    if m.group(3).lower() == "bit":
        value /= 8  # bits to bytes
    if value <= 0:
        raise ValueError(f"bandwidth {text!r}: expected a positive rate")
    return value


def _parse_latency(text: str) -> float:
    m = _LATENCY.match(text.strip())
    if not m:
        raise ValueError(f"latency {text!r}: expected a number and a unit such as 20us, 0.5ms or 1s")
    return float(m.group(1)) * _SECONDS[m.group(2).lower()]


def parse(spec: str) -> Emulation:
    """Parse 'inter=10Gbit/s,20us' (optionally ';intra=100Gbit/s,1us'). A link may give its bandwidth,
    its latency or both, in either order; ValueError names what is wrong."""
    links: dict[str, dict[str, float]] = {}
    current: str | None = None
    for token in (t.strip() for t in re.split(r"[;,\s]+", spec.strip())):
        if not token:
            continue
        if "=" in token:
            current, _, token = token.partition("=")
            current = current.strip().lower()
            if current not in ("inter", "intra"):
                raise ValueError(f"{EMULATE_ENV}: unknown link {current!r}; expected inter= or intra=")
            if current in links:
                raise ValueError(f"{EMULATE_ENV}: link {current!r} given twice")
            links[current] = {}
        if current is None:
            raise ValueError(f"{EMULATE_ENV}: {spec!r} must start with inter= or intra=")
        try:
            if token.lower().endswith("/s"):
                key, value = "bandwidth", _parse_bandwidth(token)
            else:
                key, value = "latency", _parse_latency(token)
        except ValueError as exc:
            raise ValueError(f"{EMULATE_ENV}: {exc}") from None
        if key in links[current]:
            raise ValueError(f"{EMULATE_ENV}: {current} link has two {key} values in {spec!r}")
        links[current][key] = value
    if not links:
        raise ValueError(f"{EMULATE_ENV}: empty spec; expected e.g. inter=10Gbit/s,20us")
    made = {name: Link(v.get("bandwidth", float("inf")), v.get("latency", 0.0))
            for name, v in links.items()}
    return Emulation(inter=made.get("inter"), intra=made.get("intra"))



@dataclass(frozen=True)
class Settings:
    """Every setting of mpdl, with its default; ``from_environment`` fills it from ``MPDL_*``."""

    timeout: float = 300.0
    check: bool = False
    segment_bytes: int = 1 << 20
    staging_chunk_bytes: int = 4 << 20
    ranks_per_node: int | None = None
    emulation: Emulation | None = None
    #: the cost model's parameter file, or "off" (no model: the size rule) or "defaults"
    cost_model: str = ""
    #: the folder where `auto` keeps its first-use calibrations (one file per machine and world
    #: shape; see mpdl.tuning.firstuse), or "off": no first-use calibration (defaults)
    auto_cache: str = ""
    #: runs of each of `auto`'s choice and the cost model's runner-up that a persistent all-reduce
    #: plan times, taking turns, before it keeps the faster (mpdl.tuning.verify); 0: off
    verify_runs: int = 3
    cuda_aware: bool | None = None
    no_cupy: bool = False
    #: 16- and 8-bit sums, averages and products reduced in their own dtype, rounded at every
    #: hop (fewer bytes), instead of in float32 and rounded once (mpdl.collectives.ops)
    round_per_hop: bool = False
    malloc: str = "tuned"
    #: the BLAS of the layers' float32 products (mpdl.blas): "auto", "mkl" or "numpy"
    blas: str = "auto"
    #: where flight records are written ("": CHECKPOINT/flight under mpdl train, else
    #: ./mpdl-flight)
    flight_dir: str = ""
    #: operations the flight recorder keeps per rank (0: the recorder is off)
    flight_records: int = 1000
    #: seconds a rank waits in one operation before it prints which peers it waits for
    stall_warn: float = 60.0
    #: a fault injected for tests: ("kill", "stall" or "nan", rank, step) or ("skip", rank,
    #: sequence number)
    fault: tuple[str, int, int] | None = None

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"timeout: expected a positive number of seconds, got {self.timeout!r}")
        for name in ("segment_bytes", "staging_chunk_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive number of bytes, got {value!r}")
        if self.ranks_per_node is not None and (not isinstance(self.ranks_per_node, int)
                                                or self.ranks_per_node < 1):
            raise ValueError(f"ranks_per_node: expected a positive integer or None, got "
                             f"{self.ranks_per_node!r}")
        if self.malloc not in ("tuned", "default"):
            raise ValueError(f"malloc: expected 'tuned' or 'default', got {self.malloc!r}")
        if self.blas not in ("auto", "mkl", "numpy"):
            raise ValueError(f"blas: expected 'auto', 'mkl' or 'numpy', got {self.blas!r}")
        if not isinstance(self.flight_records, int) or self.flight_records < 0:
            raise ValueError(f"flight_records: expected an integer >= 0, got "
                             f"{self.flight_records!r}")
        if not isinstance(self.verify_runs, int) or self.verify_runs < 0:
            raise ValueError(f"verify_runs: expected an integer >= 0, got {self.verify_runs!r}")
        if not self.stall_warn > 0:
            raise ValueError(f"stall_warn: expected a positive number of seconds, got "
                             f"{self.stall_warn!r}")
        if not self.cost_model:
            object.__setattr__(self, "cost_model", default_cost_model_path())
        if not self.auto_cache:
            object.__setattr__(self, "auto_cache", default_auto_cache())

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> Settings:
        """The settings the ``MPDL_*`` variables of ``env`` (default: ``os.environ``) ask for."""
        env = os.environ if env is None else env
        fields: dict = {}
        raw = env.get("MPDL_TIMEOUT", "").strip()
        if raw:
            try:
                fields["timeout"] = float(raw)
            except ValueError:
                raise ValueError(f"MPDL_TIMEOUT: expected a number of seconds, got {raw!r}") from None
            if not fields["timeout"] > 0:
                raise ValueError(f"MPDL_TIMEOUT: expected a positive number of seconds, got {raw!r}")
        fields["check"] = env.get("MPDL_CHECK", "0").strip() not in ("", "0")
        for var, field, unit in (("MPDL_SEGMENT_BYTES", "segment_bytes", "integer (bytes)"),
                                 ("MPDL_STAGING_CHUNK_BYTES", "staging_chunk_bytes",
                                  "integer (bytes)"),
                                 ("MPDL_RANKS_PER_NODE", "ranks_per_node", "integer"),
                                 ("MPDL_VERIFY_RUNS", "verify_runs", "integer")):
            value = _positive_int(env, var, unit)
            if value is not None:
                fields[field] = value
        raw = env.get(EMULATE_ENV, "").strip()
        if raw and raw.lower() not in ("0", "off", "none"):
            fields["emulation"] = parse(raw)
        fields["cost_model"] = _path_or_word(env, "MPDL_COST_MODEL", {
            "off": "off", "none": "off", "defaults": "defaults"}, default_cost_model_path)
        fields["auto_cache"] = _path_or_word(env, "MPDL_AUTO_CACHE", {
            "off": "off", "none": "off", "0": "off"}, default_auto_cache)
        raw = env.get("MPDL_CUDA_AWARE", "").strip()
        if raw:
            if raw not in ("0", "1"):
                raise ValueError(f"MPDL_CUDA_AWARE: expected 0 or 1, got {raw!r}")
            fields["cuda_aware"] = raw == "1"
        fields["no_cupy"] = env.get("MPDL_NO_CUPY", "").strip() == "1"
        fields["round_per_hop"] = env.get("MPDL_ROUND_PER_HOP", "").strip() == "1"
        if env.get("MPDL_MALLOC", "").strip().lower() == "default":
            fields["malloc"] = "default"
        raw = env.get("MPDL_BLAS", "").strip().lower()
        if raw:
            if raw not in ("auto", "mkl", "numpy"):
                raise ValueError(f"MPDL_BLAS: expected auto, mkl or numpy, got {raw!r}")
            fields["blas"] = raw
        fields["flight_dir"] = env.get("MPDL_FLIGHT_DIR", "").strip()
        raw = env.get("MPDL_FLIGHT_RECORDS", "").strip()
        if raw:
            if not raw.isdigit():
                raise ValueError(f"MPDL_FLIGHT_RECORDS: expected an integer >= 0 (0: off), got "
                                 f"{raw!r}")
            fields["flight_records"] = int(raw)
        raw = env.get("MPDL_STALL_WARN", "").strip()
        if raw:
            try:
                fields["stall_warn"] = float(raw)
            except ValueError:
                fields["stall_warn"] = 0.0
            if not fields["stall_warn"] > 0:
                raise ValueError(f"MPDL_STALL_WARN: expected a positive number of seconds, got "
                                 f"{raw!r}")
        raw = env.get("MPDL_FAULT", "").strip()
        if raw:
            fields["fault"] = _parse_fault(raw)
        return cls(**fields)

    def describe(self) -> dict:
        """The settings as plain values (for `mpdl info` and JSON output)."""
        values = dataclasses.asdict(self)
        values["emulation"] = self.emulation.describe() if self.emulation else None
        return values


def _parse_fault(raw: str) -> tuple[str, int, int]:
    kind, _, rest = raw.partition(":")
    rank, _, where = rest.partition(":")
    if kind not in ("kill", "stall", "nan", "skip") or not rank.isdigit() or not where.isdigit():
        raise ValueError(f"MPDL_FAULT: expected kill:RANK:STEP, stall:RANK:STEP, nan:RANK:STEP or "
                         f"skip:RANK:SEQ, got {raw!r}")
    return kind, int(rank), int(where)


def _path_or_word(env: Mapping[str, str], var: str, words: dict[str, str],
                  default: Callable[[Mapping[str, str]], str]) -> str:
    """A path variable: the word's meaning for one of `words` (any case), else the path with ~
    expanded, or default(env) when it is unset or empty."""
    raw = env.get(var, "").strip()
    if raw.lower() in words:
        return words[raw.lower()]
    return os.path.expanduser(raw) if raw else default(env)


def _positive_int(env: Mapping[str, str], var: str, unit: str) -> int | None:
    raw = env.get(var, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{var}: expected a positive {unit}, got {raw!r}")
    return value


def _cache_home(env: Mapping[str, str] | None = None) -> str:
    """$XDG_CACHE_HOME/mpdl, else ~/.cache/mpdl."""
    env = os.environ if env is None else env
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "mpdl")


def default_cost_model_path(env: Mapping[str, str] | None = None) -> str:
    """Where calibrate saves and `auto` reads by default: $XDG_CACHE_HOME/mpdl (~/.cache/mpdl)."""
    return os.path.join(_cache_home(env), "costmodel.json")


def default_auto_cache(env: Mapping[str, str] | None = None) -> str:
    """Where `auto` keeps its first-use calibrations by default: $XDG_CACHE_HOME/mpdl."""
    return _cache_home(env)


def default_data_cache(env: Mapping[str, str] | None = None) -> str:
    """Where datasets fetched at first use are kept: $XDG_CACHE_HOME/mpdl/datasets."""
    return os.path.join(_cache_home(env), "datasets")


_current: list[Settings] = []


def current() -> Settings:
    """This process's settings: the environment's, read at the first call, or what ``use`` set."""
    if not _current:
        _current.append(Settings.from_environment())
    return _current[0]


def use(settings: Settings | None) -> Settings | None:
    """Make ``settings`` this process's settings (None: read the environment again at the next
    ``current()``); returns the settings that were in force, so a caller can put them back (None
    when the environment had not been read yet: ``use(None)`` puts that back)."""
    previous = _current[0] if _current else None
    _current.clear()
    if settings is not None:
        _current.append(settings)
    return previous


def update(**changes: object) -> Settings:
    """Change some settings for the rest of the process (``update(emulation=...)``); returns the
    settings that were in force before."""
    return use(dataclasses.replace(current(), **changes))
