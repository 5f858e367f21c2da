"""Tenants: the API keys a router takes, grouped by who holds them (--api-keys-file; --api-key is one tenant).

The file is JSON, {"tenants": {NAME: {"keys": [...], "weight": W, "requests_per_minute": R,
"tokens_per_minute": T, "max_concurrency": C}}}, every field but "keys" optional. A tenant's weight is its
share of the replicas' steps against the other tenants' (the schedulers' fair share); its limits are counted
by router.limits. A key is taken as vLLM takes its --api-key ('Authorization: Bearer KEY', the scheme in any
case) or as Anthropic's clients send it ('x-api-key: KEY'); a key of no tenant gets a 401.

The file is read again on SIGHUP or an admin call (RouterControl.ReloadApiKeys, serve's POST
/admin/reload-api-keys): a file that does not parse leaves the tenants as they were, and says why. Keys are kept
as digests only, so that a lookup's time says nothing of the keys.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

from stagemesh.core.errors import StagemeshError

log = logging.getLogger("stagemesh.router")
DEFAULT_TENANT = "default"  # --api-key's one tenant
MAX_NAME = 64  # a tenant's name is a metric label: short, and bounded in number by the file
MAX_KEY = 1024
FIELDS = ("keys", "weight", "requests_per_minute", "tokens_per_minute", "max_concurrency")
LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrency")


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0  # its share of the steps against the other tenants' (> 0)
    requests_per_minute: int | None = None  # None: no limit
    tokens_per_minute: int | None = None  # prompt + max_tokens of its requests, per minute
    max_concurrency: int | None = None  # its requests in flight at once, over the routers that share a store


def key_of(headers: Mapping[str, str]) -> str | None:
    """The API key a request presents: 'Authorization: Bearer KEY' (the scheme in any case, as vLLM reads it),
    else 'x-api-key: KEY'; None when it presents none."""
    authorization = headers.get("Authorization") or headers.get("authorization")
    if authorization:
        scheme, _, key = authorization.partition(" ")
        return key.strip() if scheme.lower() == "bearer" else None
    given = headers.get("x-api-key") or headers.get("X-Api-Key")
    return given.strip() if given else None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Tenants:
    """Who a key belongs to, as the file said when it was last read well."""

    def __init__(self, by_key: dict[bytes, Tenant], path: str | None = None, unshared: str | None = None):
        """unshared: why per-minute limits cannot be honoured here (several routers counting them apart): a file
        that sets one is refused, with that reason."""
        self.path, self.unshared = path, unshared
        self._by_key = self._checked(by_key)

    @classmethod
    def of_api_key(cls, key: str) -> Tenants:
        """--api-key: one tenant, "default", with no limit."""
        _check_key(key, "--api-key")
        return cls({_digest(key): Tenant(DEFAULT_TENANT)})

    @classmethod
    def from_file(cls, path: str, unshared: str | None = None) -> Tenants:
        """--api-keys-file, read at start-up: StagemeshError naming the line when it does not parse."""
        tenants = cls(_read(path), path, unshared)
        log.info("API keys: %s", tenants.describe())
        return tenants

    def reload(self) -> str:
        """Read the file again: what it holds now (a sentence), or StagemeshError (the tenants stay as they
        were) when it does not parse or cannot be read."""
        if self.path is None:
            raise StagemeshError("the router takes one --api-key, no --api-keys-file: there is nothing to reload")
        try:
            self._by_key = self._checked(_read(self.path))
        except StagemeshError as err:
            log.error("--api-keys-file %s: not reloaded, the %d tenant(s) read before stay: %s", self.path,
                      len(self.names), err)
            raise
        message = self.describe()
        log.info("API keys reloaded: %s", message)
        return message

    def _checked(self, by_key: dict[bytes, Tenant]) -> dict[bytes, Tenant]:
        limited = sorted({t.name for t in by_key.values()
                          if t.requests_per_minute or t.tokens_per_minute or t.max_concurrency})
        if limited and self.unshared:
            raise StagemeshError(f"{self.path}: tenant {limited[0]!r} has a limit (requests_per_minute, "
                                 f"tokens_per_minute or max_concurrency), but {self.unshared}")
        return by_key

    @property
    def top_weight(self) -> float:
        return max((t.weight for t in self._by_key.values()), default=1.0)

    def tenant(self, headers: Mapping[str, str]) -> Tenant | None:
        """The tenant of the key a request presents (None: no key, or one of no tenant)."""
        key = key_of(headers)
        return None if key is None else self._by_key.get(_digest(key))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted({t.name for t in self._by_key.values()}))

    def by_name(self, name: str) -> Tenant | None:
        return next((t for t in self._by_key.values() if t.name == name), None)

    def describe(self) -> str:
        tenants = {t.name: t for t in self._by_key.values()}
        return f"{len(tenants)} tenant(s), {len(self._by_key)} key(s): " + ", ".join(
            f"{t.name} (weight {t.weight:g}" + "".join(f", {f} {getattr(t, f)}" for f in LIMITS
                                                       if getattr(t, f) is not None) + ")"
            for t in sorted(tenants.values(), key=lambda t: t.name))


def _read(path: str) -> dict[bytes, Tenant]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise StagemeshError(f"--api-keys-file {path}: cannot be read: {err}") from None
    return parse(text, path)


def parse(text: str, source: str) -> dict[bytes, Tenant]:
    """The file's keys (as digests) and their tenants; StagemeshError naming the line of what is wrong."""
    try:
        doc = json.loads(text, object_pairs_hook=_unique_names)
    except json.JSONDecodeError as err:
        raise StagemeshError(f"{source}, line {err.lineno}: not JSON: {err.msg}") from None
    except _Duplicate as err:
        raise StagemeshError(f"{source}, line {_line_of(text, json.dumps(err.name), nth=2)}: {err.name!r} "
                             "appears twice in one object") from None
    if not isinstance(doc, dict) or set(doc) != {"tenants"} or not isinstance(doc["tenants"], dict):
        raise StagemeshError(f"{source}: must be a JSON object {{\"tenants\": {{NAME: {{\"keys\": [...], ...}}}}}}")
    if not doc["tenants"]:
        raise StagemeshError(f"{source}: names no tenant")
    by_key: dict[bytes, Tenant] = {}
    for name, spec in doc["tenants"].items():
        def fail(message: str, *after: str, name: str = name) -> StagemeshError:
            return StagemeshError(f"{source}, line {_line_of(text, json.dumps(name), *after)}: tenant "
                                  f"{name[:MAX_NAME]!r}: {message}")
        tenant, keys = _tenant(name, spec, fail)
        for key in keys:
            digest = _digest(key)
            other = by_key.get(digest)
            if other is not None:
                where = "twice" if other.name == name else f"also under tenant {other.name!r}"
                raise fail(f"a key is listed {where}: each key belongs to one tenant", json.dumps(key))
            by_key[digest] = tenant
    return by_key


def _tenant(name: str, spec, fail) -> tuple[Tenant, list[str]]:
    if not 0 < len(name) <= MAX_NAME or not name.isprintable():
        raise fail(f"a tenant's name must be 1 to {MAX_NAME} printable characters")
    if not isinstance(spec, dict):
        raise fail("must be an object with \"keys\" (and weight, requests_per_minute, tokens_per_minute, "
                   "max_concurrency)")
    unknown = sorted(set(spec) - set(FIELDS))
    if unknown:
        raise fail(f"unknown field {unknown[0]!r} (the fields are {', '.join(FIELDS)})", json.dumps(unknown[0]))
    keys = spec.get("keys")
    if not isinstance(keys, list) or not keys:
        raise fail("\"keys\" must be a non-empty list of strings", '"keys"')
    for key in keys:
        if not isinstance(key, str):
            raise fail("\"keys\" must be a list of strings", '"keys"')
        _check_key(key, f"a key of tenant {name!r}", lambda m: fail(m, '"keys"'))
    weight = spec.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise fail(f"\"weight\" must be a number > 0, got {weight!r}", '"weight"')
    limits = {}
    for field in LIMITS:
        value = spec.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise fail(f"{field!r} must be an integer >= 1 (or left out: no limit), got {value!r}", json.dumps(field))
        limits[field] = value
    return Tenant(name, float(weight), **limits), keys


def _check_key(key: str, what: str, fail=None) -> None:
    """A key a header can carry: printable ASCII without spaces (a Bearer token's characters)."""
    if 0 < len(key) <= MAX_KEY and key.isascii() and key.isprintable() and not any(c.isspace() for c in key):
        return
    message = f"{what} must be 1 to {MAX_KEY} printable ASCII characters without spaces"
    raise fail(message) if fail is not None else StagemeshError(message)


class _Duplicate(ValueError):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def _unique_names(pairs: list[tuple[str, object]]) -> dict:
    """json's object hook: a name twice in one object (json would keep the last) is refused."""
    seen: dict[str, object] = {}
    for name, value in pairs:
        if name in seen:
            raise _Duplicate(name)
        seen[name] = value
    return seen


def _line_of(text: str, *needles: str, nth: int = 1) -> int:
    """The line (from 1) where the needles occur one after the other (the first one `nth` times); the last line
    found when one is not there."""
    pos = -1
    for i, needle in enumerate(needles):
        for _ in range(nth if i == 0 else 1):
            found = text.find(needle, pos + 1)
            if found < 0:
                return text.count("\n", 0, max(pos, 0)) + 1
            pos = found
    return text.count("\n", 0, max(pos, 0)) + 1
