"""The vocabulary of `hf3fsctl doctor`: a check result and the report that collects them.

A check is `ok`, `warn`, `fail` or `skip` (could not run because an earlier check
failed, or does not apply), with a one-line reason and, unless ok, a fix to try.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

STATUSES = ("ok", "warn", "fail", "skip")
_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


@dataclass(frozen=True)
class Check:
    """One check's outcome."""

    name: str  # short, stable: "storage.writable", "metadata.reachable", …
    status: str  # one of STATUSES
    detail: str  # what was found
    fix: str = ""  # what to do about it (empty when ok)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check status {self.status!r} is not one of {STATUSES}")


@dataclass
class Report:
    """Checks in the order they ran."""

    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, status: str, detail: str, fix: str = "") -> Check:
        """Record a check and return it."""
        check = Check(name, status, detail, fix)
        self.checks.append(check)
        return check

    @property
    def failed(self) -> bool:
        """Whether any check failed."""
        return any(check.status == "fail" for check in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """The `--json` document."""
        counts = {status: 0 for status in STATUSES}
        for check in self.checks:
            counts[check.status] += 1
        return {
            "ok": not self.failed,
            "counts": counts,
            "checks": [asdict(check) for check in self.checks],
        }

    def rows(self) -> list[list[Any]]:
        """Table rows for people: status (styled), name, detail, fix."""
        from rich.text import Text

        return [
            [Text(c.status, style=_STYLE[c.status]), c.name, c.detail, c.fix] for c in self.checks
        ]
