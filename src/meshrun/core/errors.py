"""The one error type for config mistakes: key, bad value, what would be valid."""

from __future__ import annotations


class ConfigError(ValueError):
    def __init__(self, key: str, value: object, problem: str, valid: str) -> None:
        self.key, self.value, self.problem = key, value, problem
        super().__init__(f"{key}={value!r}: {problem}. Valid: {valid}.")


class Refused(ValueError):
    """What a rank refuses of what it was given, before it runs (a checkpoint's file that is
    not what meshrun writes, a module a pipeline would train otherwise): `problem` says what
    and why, `fix` how to go on. A user's to mend, not meshrun's bug: the driver shows the
    message, its traceback stays in the rank's failure record (core/run_files/failures.py);
    where the driver can see the same before launch, it fails with them as a ConfigError."""

    def __init__(self, problem: str, fix: str) -> None:
        self.problem, self.fix = problem, fix
        super().__init__(f"{problem}. Instead: {fix}")


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
