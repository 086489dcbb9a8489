"""Tenants: which API keys the server accepts, and whose each one is.

`--api-key` may be given several times (each key its own tenant, named
api-key-1, api-key-2, ... in order) and `--api-keys-file` maps keys to named
tenants, one `KEY TENANT` per line (several keys may share a tenant, e.g. while
a key is rotated). With two or more tenants the server scopes by tenant what a
request could otherwise learn about another's: prefix-cache hits (the tenant
salts the prefix index) and program ids (identity.py). With one tenant, or no
key at all, there is nobody to hide from and nothing is scoped.

A key is compared with every configured key in constant time, so the time of
a rejection does not tell how much of a key was right."""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_KEY = re.compile(r"[\x21-\x7e]{1,512}")  # printable ASCII: what an Authorization header carries intact


class TenantConfigError(ValueError):
    """A bad key, tenant name or keys file; the message is one line and never shows a key."""


def key_tenants(api_keys: Iterable[str] = (), keys_file: str | Path | None = None) -> dict[str, str]:
    """key -> tenant, from keys given one by one and a keys file."""
    out: dict[str, str] = {}
    for i, key in enumerate(api_keys, 1):
        where = f"--api-key #{i}"
        _check_key(key, where)
        if key in out:
            raise TenantConfigError(f"{where} repeats an earlier --api-key")
        out[key] = f"api-key-{i}"
    if keys_file is not None:
        for key, tenant in read_keys_file(keys_file).items():
            if key in out:
                raise TenantConfigError(f"--api-keys-file {keys_file}: a key in it is also given with --api-key")
            out[key] = tenant
    return out


def read_keys_file(path: str | Path) -> dict[str, str]:
    """The `KEY TENANT` lines of `path` (blank lines and lines starting with # are skipped)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TenantConfigError(f"--api-keys-file {path}: cannot read it: {e}") from None
    out: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"--api-keys-file {path}, line {n}"
        if len(fields) != 2:
            raise TenantConfigError(f"{where}: expected 'KEY TENANT', found {len(fields)} field(s)")
        key, tenant = fields
        _check_key(key, where)
        if not TENANT_NAME.fullmatch(tenant):
            raise TenantConfigError(f"{where}: the tenant name {tenant[:80]!r} must be 1-64 characters among "
                                    "letters, digits, '.', '_' and '-'")
        if key in out:
            raise TenantConfigError(f"{where}: the key repeats line {first_line[key]}")
        out[key], first_line[key] = tenant, n
    if not out:
        raise TenantConfigError(f"--api-keys-file {path}: no keys in it (one 'KEY TENANT' per line)")
    return out


def _check_key(key: str, where: str) -> None:
    if not _KEY.fullmatch(key):
        raise TenantConfigError(f"{where}: a key must be 1-512 printable ASCII characters without spaces")


class Tenants:
    """The keys a server accepts; `authenticate` names a key's tenant."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        for key, tenant in keys.items():
            _check_key(key, "an API key")
            if not TENANT_NAME.fullmatch(tenant):
                raise TenantConfigError(f"the tenant name {tenant[:80]!r} must be 1-64 characters among letters, "
                                        "digits, '.', '_' and '-'")
        self._keys = [(k.encode(), t) for k, t in keys.items()]
        self.names = frozenset(keys.values())

    @property
    def enabled(self) -> bool:
        """A key is required."""
        return bool(self._keys)

    @property
    def scoped(self) -> bool:
        """Caches and program ids are scoped by tenant (there is more than one)."""
        return len(self.names) > 1

    def authenticate(self, token: str) -> str | None:
        """The tenant whose key `token` is, or None."""
        raw = token.encode("utf-8", "replace")
        found = None
        for key, tenant in self._keys:  # every key, hit or miss: the time says nothing
            if hmac.compare_digest(raw, key):
                found = tenant
        return found

    def scope(self, tenant: str | None) -> str | None:
        """What a request of `tenant` is scoped by: the tenant when scoping is on, else None."""
        return tenant if self.scoped else None
