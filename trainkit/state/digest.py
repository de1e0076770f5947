"""A short digest of a registered item's state, to tell whether the ranks of a run hold the same state.

Side effects: none. Tensors are read on the CPU (a 0-d running sum, a generator's state: small by construction;
the engine never digests a model or an optimizer, which DDP keeps replicated and FSDP shards).
"""

from __future__ import annotations

import hashlib
import pickle
import re
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["state_digest"]

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def state_digest(state: Any) -> str:
    """A digest of ``state`` that two processes holding equal states compute alike.

    Tensors count by dtype, shape and bytes (not by device or identity), dicts by their sorted keys, lists and
    tuples in order, sets by their members' sorted digests, other leaves by their pickle (by their ``repr`` without
    memory addresses when they cannot be pickled).

    :param state: A state dict, a plain value, or a tensor.
    :returns: A 32-character hex digest.

    >>> state_digest({"sum": torch.tensor(2.0), "count": 1}) == state_digest({"count": 1, "sum": torch.tensor(2.0)})
    True
    >>> state_digest({"rank": 0}) == state_digest({"rank": 1})
    False
    >>> state_digest({"seen": {"b", "a"}}) == state_digest({"seen": {"a", "b"}})
    True
    """
    digest = hashlib.blake2b(digest_size=16)
    _feed(digest, state, {})
    return digest.hexdigest()


def _feed(digest: Any, value: Any, walked: dict[int, bytes]) -> None:
    """Feed ``value``: a leaf as itself, a container as the digest of its contents, computed once per container (a
    shared one costs its first walk only: linear in distinct containers; equal states digest alike however they
    share their parts)."""
    if isinstance(value, Mapping | list | tuple | set | frozenset):
        key = id(value)
        inner = walked.get(key)
        if inner is None:
            walked[key] = b"cycle"  # while its contents are fed: a container inside itself (refused before a save)
            inner = walked[key] = _container_digest(value, walked)
        digest.update(b"C" + inner)
    else:
        _feed_leaf(digest, value)


def _container_digest(value: Any, walked: dict[int, bytes]) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    if isinstance(value, Mapping):
        digest.update(f"D{len(value)}".encode())
        for key in sorted(value, key=repr):  # the order of insertion is no part of a state
            _feed(digest, key, walked)
            _feed(digest, value[key], walked)
    elif isinstance(value, (list, tuple)):
        digest.update(f"L{len(value)}".encode())
        for item in value:
            _feed(digest, item, walked)
    else:  # a set: pickled, it follows the process's own string hashing, so its members' digests are sorted
        digest.update(f"S{len(value)}".encode())
        members = []
        for item in value:
            member = hashlib.blake2b(digest_size=16)
            _feed(member, item, walked)
            members.append(member.digest())
        for item in sorted(members):
            digest.update(item)
    return digest.digest()


def _feed_leaf(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    else:
        try:
            data = pickle.dumps(value, protocol=4)
        except Exception:  # noqa: BLE001 - an unpicklable leaf still has a repr to compare
            data = _ADDRESS.sub("", repr(value)).encode()  # an object's address differs on every rank
        digest.update(b"P" + len(data).to_bytes(8, "little") + data)
