"""Handing the job secret to every rank through a store anyone can read (torchrun's TCPStore).

torchrun's store has no authentication: any process that can reach MASTER_ADDR:MASTER_PORT may
read every key. So the secret never goes there in plaintext. Each rank publishes an ephemeral
Diffie-Hellman public value (RFC 7919 group ffdhe2048, 256-bit private exponents); rank 0
publishes its own and, per rank, the job secret sealed under the key both derive (HMAC-SHA256 as
the key derivation, stream and MAC). A process that only reads the store learns nothing of the
secret. This does not authenticate rank 0 against a process that can also *write* torchrun's
store (torchrun gives nothing to authenticate with): where that matters, export the same
``GPUCOMM_SECRET`` to every rank, and no secret material is published at all.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from ..errors import SealError

__all__ = ["KeyPair", "seal", "unseal", "SealError"]

# RFC 7919 ffdhe2048: a safe prime, generator 2
P = int(
    "FFFFFFFFFFFFFFFFADF85458A2BB4A9AAFDC5620273D3CF1D8B9C583CE2D3695A9E13641146433FBCC939DCE249B3EF97D2FE363630C75D8"
    "F681B202AEC4617AD3DF1ED5D5FD65612433F51F5F066ED0856365553DED1AF3B557135E7F57C935984F0C70E0E68B77E2A689DAF3EFE8721"
    "DF158A136ADE73530ACCA4F483A797ABC0AB182B324FB61D108A94BB2C8E3FBB96ADAB760D7F4681D4F42A3DE394DF4AE56EDE76372BB190B"
    "07A7C8EE0A6D709E02FCE1CDF7E2ECC03404CD28342F619172FE9CE98583FF8E4F1232EEF28183C3FE3B1B4C6FAD733BB5FCBC2EC22005C58"
    "EF1837D1683B2C6F34A26C1B2EFFA886B423861285C97FFFFFFFFFFFFFFFF", 16)
G = 2
_BYTES = (P.bit_length() + 7) // 8
_MAC = 32


class KeyPair:
    """An ephemeral Diffie-Hellman key pair; ``public`` goes to the store as hex."""

    def __init__(self) -> None:
        self._private = secrets.randbits(256) | (1 << 255)
        self.public = pow(G, self._private, P)

    def public_hex(self) -> str:
        return format(self.public, "x")

    def shared_key(self, peer_public_hex: str, context: bytes) -> bytes:
        """The 32-byte key both sides derive; ``context`` binds it to this job and pair of ranks."""
        try:
            peer = int(peer_public_hex, 16)
        except (TypeError, ValueError):
            raise SealError("the peer's public value is not a hex number") from None
        if not 2 <= peer <= P - 2:
            raise SealError("the peer's public value is out of range (tampered with?)")
        shared = pow(peer, self._private, P).to_bytes(_BYTES, "big")
        return hmac.digest(hashlib.sha256(b"gpucomm-secret-exchange").digest(), shared + context, "sha256")


def _stream(key: bytes, n: int) -> bytes:
    blocks = [hmac.digest(key, b"stream" + i.to_bytes(4, "big"), "sha256") for i in range(-(-n // 32))]
    return b"".join(blocks)[:n]


def seal(secret: bytes, key: bytes) -> str:
    """``secret`` encrypted and authenticated under ``key``, as hex."""
    body = bytes(a ^ b for a, b in zip(secret, _stream(key, len(secret))))
    return (body + hmac.digest(key, b"mac" + body, "sha256")).hex()


def unseal(sealed_hex: str, key: bytes) -> bytes:
    """The secret ``seal`` wrapped; SealError if ``key`` is not the one it was sealed under."""
    try:
        blob = bytes.fromhex(sealed_hex)
    except (TypeError, ValueError):
        raise SealError("the sealed secret is not hex") from None
    body, tag = blob[:-_MAC], blob[-_MAC:]
    if len(blob) <= _MAC or not hmac.compare_digest(tag, hmac.digest(key, b"mac" + body, "sha256")):
        raise SealError("the sealed secret does not authenticate under the derived key")
    return bytes(a ^ b for a, b in zip(body, _stream(key, len(body))))
