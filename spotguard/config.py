"""Configuration for every command: the layered loader, errors and small validators.

Precedence, the one rule every command follows (`Layers`): a flag given on the command line,
else its SPOTGUARD_* environment variable, else the entry in the `--config FILE` (YAML or JSON;
also SPOTGUARD_CONFIG) for commands that take one, else the default. The first layer that sets
a value wins; an empty environment variable counts as unset.

Contract: a bad flag, environment variable or config-file entry raises `ConfigError` naming the
field as the user wrote it (`--interval`, `--interval (from SPOTGUARD_INTERVAL)` or
`interval (in FILE)`) before anything starts; the CLI prints it and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing or invalid. `field` names it as the user wrote it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def positive_float(field: str, value: Any, *, allow_zero: bool = False) -> float:
    """Parses `value` as a finite float > 0 (or >= 0 with allow_zero), else ConfigError(field)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(field, f"expected a number, got {value!r}") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise ConfigError(field, f"expected a finite number, got {value!r}")
    if number < 0 or (number == 0 and not allow_zero):
        raise ConfigError(field, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return number


def positive_int(field: str, value: Any, *, allow_zero: bool = False) -> int:
    """Parses `value` as an int > 0 (or >= 0 with allow_zero), else ConfigError(field)."""
    try:
        number = int(str(value), 10)
    except (TypeError, ValueError):
        raise ConfigError(field, f"expected a whole number, got {value!r}") from None
    if number < 0 or (number == 0 and not allow_zero):
        raise ConfigError(field, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return number


def one_of(field: str, value: Any, choices: tuple[str, ...]) -> str:
    """Returns `value` if it is one of `choices`, else ConfigError(field)."""
    if value not in choices:
        raise ConfigError(field, f"expected one of {', '.join(choices)}, got {value!r}")
    return value


def http_url(field: str, value: Any) -> str:
    """Returns `value` without a trailing slash if it is an http(s) URL, else ConfigError(field)."""
    from yarl import URL

    try:
        url = URL(str(value))
    except (TypeError, ValueError):
        raise ConfigError(field, f"not a URL: {value!r}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError(field, f"expected an http:// or https:// URL, got {value!r}")
    return str(url).rstrip("/")


def read_config_file(path: str, field: str, known_keys: tuple[str, ...]) -> dict[str, Any]:
    """Reads a YAML (JSON for `*.json`) mapping of settings, keys with `-` read as `_`.
    ConfigError(field) when unreadable or not a mapping; ConfigError naming an unknown key."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(field, f"cannot read {path}: {exc}") from None
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(field, f"{path}: not valid {'JSON' if path.endswith('.json') else 'YAML'}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(field, f"{path}: expected a mapping of settings")
    normalized: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known_keys:
            raise ConfigError(f"{key} (in {path})", f"unknown setting; known: {', '.join(known_keys)}")
        normalized[name] = value
    return normalized


_DEFAULT_ENV = object()


class Layers:
    """One command's settings, looked up in the order the module docstring states.

    `args` holds the parsed flags, None meaning "not given" (so flags must default to None);
    `environ` the environment; `file_keys` the settings a config file may hold: with none, the
    command has no file layer. The file comes from `args.config`, else SPOTGUARD_CONFIG, and is
    read (and checked for unknown keys) here, so a bad file fails before any setting is used.
    """

    def __init__(self, args: argparse.Namespace, environ: Mapping[str, str] | None = None, *,
                 file_keys: tuple[str, ...] = ()):
        self.args = args
        self.environ = os.environ if environ is None else environ
        self.file: dict[str, Any] = {}
        self.path: str | None = None
        if file_keys:
            flag_path = getattr(args, "config", None)
            self.path = flag_path or self.environ.get("SPOTGUARD_CONFIG") or None
            if self.path:
                self.file = read_config_file(self.path, "--config" if flag_path else "SPOTGUARD_CONFIG", file_keys)

    def get(self, key: str, default: Any = None, *, flag: str | None = None, env: Any = _DEFAULT_ENV,
            also_env: tuple[str, ...] = ()) -> tuple[Any, str]:
        """(value, field) of setting `key` (the args attribute and file key).

        `flag` names it on the command line (default `--key` with `_` as `-`); `env` is its
        variable (default SPOTGUARD_<KEY>; None: the setting has none), `also_env` further
        variables tried after it. The field is the flag for a flag or a default,
        `FLAG (from VAR)` for a variable, `key (in FILE)` for the file.
        """
        flag = flag or f"--{key.replace('_', '-')}"
        value = getattr(self.args, key, None)
        if value is not None:
            return value, flag
        names = (() if env is None else (f"SPOTGUARD_{key.upper()}" if env is _DEFAULT_ENV else env,)) + also_env
        for name in names:
            if self.environ.get(name) not in (None, ""):
                return self.environ[name], f"{flag} (from {name})"
        if self.file.get(key) is not None:
            return self.file[key], f"{key} (in {self.path})"
        return default, flag

    def value(self, key: str, default: Any = None, **kwargs: Any) -> Any:
        """The value alone of `get(key, default, **kwargs)`."""
        return self.get(key, default, **kwargs)[0]

    def parse(self, key: str, default: Any, parser: Callable[[str, Any], T], **kwargs: Any) -> T:
        """`parser(field, value)` of `get(key, default, **kwargs)`: a validator such as
        `positive_float`, so a bad value's ConfigError names the field it came from."""
        value, field = self.get(key, default, **kwargs)
        return parser(field, value)
