"""POST /lookup: a router asks which prefix of a prompt this daemon holds, per tier.

The request and its answer as data, no I/O (the listener reads the body, the server answers it):

    {"model": "M", "cache_salt": "", "token_ids": [...]}        every namespace of model M and that salt
    {"namespace": {geometry as an engine sends it at ATTACH}, "token_ids": [...]}      that namespace

answered 200 with ``{"num_tokens": N, "namespaces": [{"namespace_id", "geometry", "hit_tokens":
{"l2", "l3"[, "remote"]}}]}``, each hit page-aligned, of the longest cached prefix of that tier;
with a remote tier, "remote" is the prefix L2 and the store hold together, the store asked (one
call, its deadline) for the pages after L2's hit where L3 holds no more, as an engine's lookup.
A model maps to one namespace per geometry (tensor-parallel rank, dtype, layout, revision): each
is answered; a tensor-parallel engine holds a prefix where every rank's entry does (the least).
A salted namespace (a tenant's) answers only a request that gives its salt, so a salt keeps its
prompts from being probed as it keeps them from being shared; the answer shows the salt's digest.

Bad input is a 4xx with ``{"error": ...}``: 400 malformed JSON, fields or token ids (ints in
int32, at most MAX_LOOKUP_TOKENS: a longer prompt is looked up by its first MAX_LOOKUP_TOKENS,
which have the same hits up to that length), 404 no namespace matches, 413 a body over
MAX_LOOKUP_BODY_BYTES, 415 a body not declared application/json (a web page cannot send one
without a CORS preflight, which this listener never grants).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import numpy as np

from proto.errors import ProtocolError
from proto.messages import KVGeometry
from proto.tokens import TOKEN_DTYPE

MAX_LOOKUP_BODY_BYTES = 1 << 20
MAX_LOOKUP_TOKENS = 1 << 17
LOOKUP_BODY_TIMEOUT_S = 10.0       # to receive the whole body, once the headers are in
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1


class LookupRefused(Exception):
    """A request this endpoint answers with an HTTP error: ``status`` and a message for the client."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class LookupQuery(NamedTuple):
    token_ids: np.ndarray                  # int32
    model_id: str | None = None            # with cache_salt: every namespace of this model and salt
    cache_salt: str = ""
    geometry: KVGeometry | None = None     # or exactly this namespace

    @classmethod
    def parse(cls, body: bytes) -> "LookupQuery":
        try:
            request = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise LookupRefused(400, f"the body is not JSON: {exc}") from None
        if not isinstance(request, dict):
            raise LookupRefused(400, "the body must be a JSON object")
        unknown = set(request) - {"model", "namespace", "cache_salt", "token_ids"}
        if unknown:
            raise LookupRefused(400, f"unknown fields {sorted(unknown)[:8]}")
        token_ids = _token_ids(request.get("token_ids"))
        if ("model" in request) == ("namespace" in request):
            raise LookupRefused(400, 'give one of "model" (a model id) or "namespace" (a geometry as at ATTACH)')
        if "namespace" in request:
            if "cache_salt" in request:
                raise LookupRefused(400, '"cache_salt" goes inside "namespace"')
            try:
                geometry = KVGeometry.from_wire(request["namespace"])
            except (ProtocolError, TypeError) as exc:
                raise LookupRefused(400, f"bad namespace: {exc}") from None
            return cls(token_ids, geometry=geometry)
        model_id, cache_salt = request["model"], request.get("cache_salt", "")
        if not isinstance(model_id, str) or not model_id:
            raise LookupRefused(400, '"model" must be a non-empty string')
        if not isinstance(cache_salt, str):
            raise LookupRefused(400, '"cache_salt" must be a string')
        return cls(token_ids, model_id=model_id, cache_salt=cache_salt)

    def describe(self) -> str:
        """What was asked for, in a 404's words (never the salt)."""
        if self.geometry is not None:
            return "no namespace of this geometry is attached (engines declare theirs at ATTACH)"
        salted = " with that cache_salt" if self.cache_salt else " without a cache_salt"
        return f"no namespace of model {self.model_id!r}{salted} in this daemon"


def _token_ids(value: Any) -> np.ndarray:
    if not isinstance(value, list):
        raise LookupRefused(400, '"token_ids" must be a list of integers')
    if len(value) > MAX_LOOKUP_TOKENS:
        raise LookupRefused(400, f"{len(value)} token ids; at most max_lookup_tokens={MAX_LOOKUP_TOKENS} "
                                 "(look up the prompt's first ones: a prefix has the same hits)")
    for position, token in enumerate(value):
        if type(token) is not int or not _INT32_MIN <= token <= _INT32_MAX:
            raise LookupRefused(400, f"token_ids[{position}] = {json.dumps(token)[:32]} is not an int32")
    return np.array(value, dtype=TOKEN_DTYPE)


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()
