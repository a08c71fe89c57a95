"""The one error type for config mistakes: key, bad value, what would be valid."""

from __future__ import annotations


class ConfigError(ValueError):
    def __init__(self, key: str, value: object, problem: str, valid: str) -> None:
        self.key, self.value, self.problem = key, value, problem
        super().__init__(f"{key}={value!r}: {problem}. Valid: {valid}.")


def fail(key: str, value: object, problem: str, valid: str) -> None:
    raise ConfigError(key, value, problem, valid)


def choice(key: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        fail(key, value, "unknown choice", " | ".join(map(str, allowed)))


def positive(key: str, value: float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        fail(key, value, "must be positive", "a number > 0")
