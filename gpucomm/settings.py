"""Reading gpucomm's settings from the environment: each under its GPUCOMM_ name and Horovod's,
the first one set wins, and a malformed value is an error that names the variable."""

from __future__ import annotations

from typing import Mapping

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def env_number(env: Mapping[str, str], names: tuple[str, ...], default: float | None, *,
               allow_zero: bool = False, maximum: float | None = None) -> float | None:
    """The first of ``names`` set in ``env`` as a positive (or, with ``allow_zero``, non-negative)
    number, at most ``maximum`` when given, else ``default``. NaN is never a setting."""
    for name in names:
        value = env.get(name, "").strip()
        if not value:
            continue
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not a number") from None
        if number != number or number < 0 or (number == 0 and not allow_zero):
            raise ValueError(f"{name}={value!r} must be {'non-negative' if allow_zero else 'positive'}")
        if maximum is not None and number > maximum:
            raise ValueError(f"{name}={value!r} must be at most {maximum:g}")
        return number
    return default


def env_seconds(env: Mapping[str, str], names: tuple[str, ...], default: float) -> float:
    """The first of ``names`` set in ``env`` as a positive number of seconds, else ``default``."""
    return env_number(env, names, default)  # type: ignore[return-value]


def env_flag(env: Mapping[str, str], names: tuple[str, ...]) -> bool:
    """True when the first of ``names`` set in ``env`` says yes (1/true/yes/on)."""
    for name in names:
        value = env.get(name)
        if value is None:
            continue
        value = value.strip().lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise ValueError(f"{name}={value!r} is not a boolean: use 1 or 0.")
    return False


def env_flag_default_on(name: str, env: Mapping[str, str] | None = None) -> bool:
    """``env_flag`` for a setting that is on unless set to 0/false/no/off."""
    import os  # noqa: PLC0415

    env = os.environ if env is None else env
    return env.get(name) is None or env_flag(env, (name,))


__all__ = ["env_flag", "env_flag_default_on", "env_number", "env_seconds"]
