"""Encryption at rest of stored payloads: keys, where they come from, and the key ring.

A stored message's value and headers (a group row's whole body) are sealed with AES-256-GCM
(`cryptography`, the `encryption` extra): a fresh random 96-bit nonce per seal, stored before the
ciphertext, and associated data that binds the sealed bytes to their row and column, so that
bytes copied to another row or column do not open. Each stored row names the id of its key.

A `KeyRing` holds several keys: the first (newest) seals, every key opens. A key's id is derived
from the key itself (`key_id`), so a row names its key without the store holding anything secret,
and a wrong key given under a right name cannot happen. A key's bytes are never logged, shown, nor
put in an exception text: only its id.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from outbox.errors import ConfigError, DecryptionError, MissingDependencyError

#: AES-256: a key is 32 bytes.
KEY_BYTES = 32
#: The nonce stored before each ciphertext (96 bits, fresh and random for each seal).
NONCE_BYTES = 12
#: The environment variable the `outbox` command reads keys from (newest first, comma-separated).
KEYS_ENV = "OUTBOX_ENCRYPTION_KEYS"


def key_id(secret: bytes) -> str:
    """A key's id: 16 hex digits of a SHA-256 of the key under a fixed label (a fingerprint; the
    key cannot be recovered from it)."""
    return hashlib.sha256(b"kafka-outbox key id\0" + secret).hexdigest()[:16]


def _aead(secret: bytes) -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as exc:
        raise MissingDependencyError(
            "encryption needs the cryptography package: pip install 'kafka-outbox[encryption]'"
        ) from exc
    return AESGCM(secret)


class Key:
    """One AES-256 key and its id. Neither its repr nor its str shows the key's bytes.

    Attributes:
        id: the key's id, 16 hex digits (`key_id`): what the store records beside each row it
            encrypts, what errors and `outbox keys rotate` name. `str(key)` is the id alone, so a
            key put in a log line or an f-string prints its id; `repr(key)` is `Key(id='…')`.
    """

    __slots__ = ("id", "_secret")

    def __init__(self, secret: bytes, *, source: str = "the key") -> None:
        if not isinstance(secret, bytes | bytearray):
            raise ConfigError(f"{source}: an encryption key must be bytes (got {type(secret).__name__})")
        if len(secret) != KEY_BYTES:
            raise ConfigError(
                f"{source}: an encryption key must be {KEY_BYTES} bytes (AES-256), got {len(secret)} bytes"
            )
        self._secret = bytes(secret)
        self.id = key_id(self._secret)

    @classmethod
    def from_text(cls, text: str, *, source: str = "the key") -> Key:
        """A key written as text: 64 hex digits or base64 (standard or URL-safe) of 32 bytes."""
        return cls(_parse_text(text.strip(), source), source=source)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Key:
        """A key read from a file: 32 raw bytes, or its hex or base64 text (whitespace around it ignored)."""
        source = f"key file {os.fspath(path)}"
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read it ({exc.strerror or type(exc).__name__})") from None
        if len(raw) == KEY_BYTES:
            return cls(raw, source=source)
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            raise ConfigError(
                f"{source}: holds {len(raw)} bytes that are not text; a key file holds 32 raw bytes, "
                "or 64 hex digits, or base64 of 32 bytes"
            ) from None
        return cls.from_text(text, source=source)

    @classmethod
    def from_env(cls, name: str) -> Key:
        """A key from an environment variable holding its hex or base64 text."""
        text = os.environ.get(name)
        if not text:
            raise ConfigError(f"environment variable {name} is not set or empty: it should hold an encryption key")
        return cls.from_text(text, source=f"environment variable {name}")

    @classmethod
    def from_callable(cls, fetch: Callable[[], bytes | str], *, name: str | None = None) -> Key:
        """A key that a function returns (a KMS or Vault client): bytes, or hex or base64 text.
        Called once, here."""
        source = f"key source {name or getattr(fetch, '__name__', 'callable')}"
        got = fetch()
        if isinstance(got, str):
            return cls.from_text(got, source=source)
        return cls(got, source=source)

    def __repr__(self) -> str:
        return f"Key(id={self.id!r})"

    def __str__(self) -> str:
        return self.id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Key) and other._secret == self._secret

    def __hash__(self) -> int:
        return hash(self.id)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled for a drain in a process of its own (`drain_in="process"`), over its local pipe.
        return (Key, (self._secret,))


def _parse_text(text: str, source: str) -> bytes:
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text)
        except ValueError:
            pass
    for altchars in (None, b"-_"):  # standard base64, then URL-safe
        try:
            raw = base64.b64decode(text.encode("ascii"), altchars=altchars, validate=True)
        except (binascii.Error, ValueError):
            continue
        if len(raw) == KEY_BYTES:
            return raw
        raise ConfigError(
            f"{source}: an encryption key must be {KEY_BYTES} bytes (AES-256), its base64 text gives {len(raw)} bytes"
        )
    raise ConfigError(
        f"{source}: not a key: give 32 raw bytes, 64 hex digits or base64 of 32 bytes ({len(text)} characters given)"
    )


class KeyRing:
    """Keys, newest first: the newest seals, every key opens.

    Args:
        keys: `Key`s, newest first (at least one; the same key twice is kept once).
    """

    __slots__ = ("keys", "current", "_aeads")

    def __init__(self, keys: Iterable[Key]) -> None:
        unique: dict[str, Key] = {}
        for k in keys:
            if not isinstance(k, Key):
                raise ConfigError(f"a key ring holds Key objects (got {type(k).__name__})")
            unique.setdefault(k.id, k)
        if not unique:
            raise ConfigError("a key ring needs at least one key")
        self.keys: tuple[Key, ...] = tuple(unique.values())
        #: The id of the key that seals.
        self.current: str = self.keys[0].id
        self._aeads = {k.id: _aead(k._secret) for k in self.keys}

    @classmethod
    def from_files(cls, paths: Sequence[str | os.PathLike[str]]) -> KeyRing:
        """A ring of key files, newest first."""
        return cls(Key.from_file(p) for p in paths)

    @classmethod
    def from_env(cls, name: str = KEYS_ENV) -> KeyRing | None:
        """A ring of the keys an environment variable lists (hex or base64, comma-separated,
        newest first); None when it is unset or empty."""
        text = os.environ.get(name, "").strip()
        if not text:
            return None
        parts = [p.strip() for p in text.split(",") if p.strip()]
        return cls(Key.from_text(p, source=f"environment variable {name}, key {i + 1}") for i, p in enumerate(parts))

    @property
    def ids(self) -> tuple[str, ...]:
        """The keys' ids, newest first."""
        return tuple(k.id for k in self.keys)

    def seal(self, plain: bytes, bound: bytes) -> bytes:
        """`plain` sealed with the newest key: nonce, then ciphertext and tag. `bound` (associated
        data) must be given again to open it."""
        nonce = os.urandom(NONCE_BYTES)
        sealed: bytes = self._aeads[self.current].encrypt(nonce, plain, self.current.encode() + b"\0" + bound)
        return nonce + sealed

    def open(self, kid: str, sealed: bytes, bound: bytes, *, what: str = "a stored row") -> bytes:
        """The plain bytes of `sealed`, written by `seal` with the key `kid`.

        Raises:
            DecryptionError: no key of the ring has that id, or the bytes do not open with it.
        """
        aead = self._aeads.get(kid)
        if aead is None:
            raise DecryptionError(kid, f"{what}: encrypted with key {kid}, which is not among the given keys "
                                       f"({', '.join(self.ids)})")
        from cryptography.exceptions import InvalidTag

        try:
            plain: bytes = aead.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], kid.encode() + b"\0" + bound)
        except (InvalidTag, ValueError):
            raise DecryptionError(kid, f"{what}: does not decrypt with key {kid}: the bytes were altered or "
                                       "moved from another row") from None
        return plain

    def __repr__(self) -> str:
        return f"KeyRing(ids={list(self.ids)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (KeyRing, (self.keys,))


#: What `encryption=` accepts: a ring, one key, or keys newest first.
Encryption = KeyRing | Key | Sequence[Key]


def as_key_ring(encryption: Encryption | None) -> KeyRing | None:
    """`encryption=` as a `KeyRing` (None: encryption off)."""
    if encryption is None or isinstance(encryption, KeyRing):
        return encryption
    if isinstance(encryption, Key):
        return KeyRing([encryption])
    if isinstance(encryption, (str, bytes)):
        raise ConfigError("encryption= takes a KeyRing, a Key or a list of Keys (Key.from_file, Key.from_env, ...)")
    return KeyRing(encryption)


def given_keys(paths: Sequence[str | os.PathLike[str]]) -> KeyRing | None:
    """The keys a command line gives: its key files, newest first, else the keys `$OUTBOX_ENCRYPTION_KEYS`
    lists (None: neither). The `outbox` commands' `--key-file` and the Spark job's."""
    return KeyRing.from_files(paths) if paths else KeyRing.from_env(KEYS_ENV)


def missing_key(kid: str, what: str = "a stored row") -> DecryptionError:
    """The error for an encrypted row read without any key."""
    return DecryptionError(kid, f"{what}: encrypted with key {kid}, but no encryption key was given")
