"""Reading a MindFormers config source (a path, YAML text, bytes or a mapping) into plain Python data, with one
ConfigError for anything that is not a readable, reasonably sized, reasonably nested YAML document."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from .errors import ConfigError, ConfigIssue
from .schema import ParallelConfig

__all__ = ["MAX_DEPTH", "MAX_FILE_BYTES", "MAX_NODES", "check_depth", "read_source"]

MAX_FILE_BYTES = 16 << 20
MAX_DEPTH = 32
# YAML nodes (scalars, aliases, mappings, sequences) a config may hold: the largest of 37 real MindFormers configs
# has 548 parse events; a long list under the size cap would otherwise take minutes and GBs to build
MAX_NODES = 20_000
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser where PyYAML was built with it
_OPEN = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_CLOSE = (yaml.MappingEndEvent, yaml.SequenceEndEvent)


def read_source(source: Any, label: str | None) -> tuple[Any, str | None]:
    if isinstance(source, ParallelConfig):
        raise ConfigError([ConfigIssue("", "ParallelConfig", "is already a loaded config",
                                       "use it directly instead of calling load_config again")], label)
    if isinstance(source, Mapping):
        return source, label or "<dict>"
    if isinstance(source, bytes):
        return _parse(source, label or "<bytes>"), label or "<bytes>"
    if isinstance(source, os.PathLike):
        return _read_file(Path(source), label)
    if isinstance(source, str):
        if _names_a_file(source):
            return _read_file(Path(source), label)
        return _parse(source.encode("utf-8", "surrogatepass"), label or "<yaml text>"), label or "<yaml text>"
    raise ConfigError([ConfigIssue("", type(source).__name__, "is not a path, a mapping or YAML text",
                                   "pass a MindFormers YAML file path, YAML text or a dict")], label)


def _names_a_file(text: str) -> bool:
    """A one-line string is a path when it names an existing file or looks like a YAML file name; anything
    with a newline, or a one-line mapping such as `{parallel_config: {...}}`, is YAML text."""
    if "\n" in text or len(text) > 4096:
        return False
    try:
        if Path(text).is_file():
            return True
    except (OSError, ValueError):  # too long for a file name, NUL bytes, ...
        return False
    return text.strip().endswith((".yaml", ".yml", ".json")) and not text.lstrip().startswith(("{", "["))


def _read_file(path: Path, label: str | None) -> tuple[Any, str]:
    label = label or str(path)
    if not path.is_file():
        raise ConfigError([ConfigIssue("file", str(path), "does not exist or is not a file",
                                       "pass the path of a MindFormers YAML")], label)
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ConfigError([ConfigIssue("file", str(path), f"is larger than {MAX_FILE_BYTES >> 20} MiB",
                                       "pass a MindFormers YAML, not a data file")], label)
    return _parse(path.read_bytes(), label), label


def _parse(data: bytes, label: str) -> Any:
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError([ConfigIssue("", f"{len(data)} bytes", "is too large for a configuration",
                                       "pass a MindFormers YAML")], label)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError([ConfigIssue("file", label, "is not UTF-8 text (binary file?)",
                                       "pass a MindFormers YAML file")], label) from None
    if "\x00" in text:
        raise ConfigError([ConfigIssue("file", label, "contains NUL bytes (binary file?)",
                                       "pass a MindFormers YAML file")], label)
    try:
        _check_events(text, label)  # bounds first, from the parser's event stream (cheap, stops at the limit)
        return yaml.load(text, Loader=_LOADER)  # noqa: S506 (a safe loader: SafeLoader or its C twin)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError([ConfigIssue("", label, f"is not valid YAML{at}: {problem}",
                                       "fix the YAML syntax")], label) from None


def _check_events(text: str, label: str) -> None:
    """Nesting depth and node count from the event stream, before any Python object is built."""
    depth = nodes = 0
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, _CLOSE):
            depth -= 1
            continue
        if isinstance(event, (yaml.NodeEvent)):
            nodes += 1
            if nodes > MAX_NODES:
                raise ConfigError([ConfigIssue("", label, f"holds more than {MAX_NODES} YAML values, more than a "
                                               "configuration does", "pass a MindFormers YAML, not a data file")],
                                  label)
        if isinstance(event, _OPEN):
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError([ConfigIssue("", label, f"is nested more than {MAX_DEPTH} levels deep, deeper "
                                               "than a MindFormers config", f"keep nesting under {MAX_DEPTH} "
                                               "levels")], label)


def check_depth(node: Any, depth: int = 0, seen: set | None = None) -> None:
    """MindFormers caps YAML nesting; aliases can also make a small file a huge tree. Walk each node once."""
    seen = set() if seen is None else seen
    if id(node) in seen or not isinstance(node, (dict, list)):
        return
    seen.add(id(node))
    if depth > MAX_DEPTH:
        raise RecursionError
    for child in (node.values() if isinstance(node, dict) else node):
        check_depth(child, depth + 1, seen)
