"""ConfigError: every problem in a configuration, reported at once, each naming key, value, rule and fix."""
from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any


_REPR = reprlib.Repr()  # Python 3.10 has no keyword arguments here
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 6, 4, 60, 60, 40


def _show(value: Any) -> str:
    # bounded: a hostile value (e.g. a YAML alias bomb) must not be expanded into the message
    text = _REPR.repr(value)
    text = text.replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class ConfigIssue:
    """One problem: the YAML key path, the offending value, the rule broken, and how to fix it."""

    key: str
    value: Any
    rule: str
    fix: str = ""

    def __str__(self) -> str:
        head = f"{self.key}={_show(self.value)}" if self.key else _show(self.value)
        text = f"{head} {self.rule}" if self.rule else head
        return f"{text}; fix: {self.fix}" if self.fix else text


class ConfigError(ValueError):
    """A configuration that MindFormers (or msparallel_ds) would not run. Lists every issue found."""

    def __init__(self, issues: list[ConfigIssue] | ConfigIssue | str, source: str | None = None):
        if isinstance(issues, str):
            issues = [ConfigIssue("", issues, "")]
        elif isinstance(issues, ConfigIssue):
            issues = [issues]
        self.issues: list[ConfigIssue] = list(issues)
        self.source = source
        super().__init__(self._message())

    @property
    def keys(self) -> list[str]:
        return [i.key for i in self.issues]

    def _message(self) -> str:
        where = f" in {self.source}" if self.source else ""
        if len(self.issues) == 1:
            return f"invalid configuration{where}: {self.issues[0]}"
        lines = [f"invalid configuration{where}: {len(self.issues)} problems"]
        lines += [f"  - {issue}" for issue in self.issues]
        return "\n".join(lines)


class ConfigWarning(UserWarning):
    """A key that MindFormers accepts but that has no effect, or is deprecated, or is adjusted."""
