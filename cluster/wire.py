"""Wire format of a batched ``step`` between a ``RayTransport`` and the head actor.

A step travels as one small pickled header (one tuple per call: method code, scalars, offsets) plus
one contiguous ``int32`` buffer holding every token and page array of the batch, instead of a pickle
of many dataclasses with many small numpy arrays. Results come back the same way. What the head
already holds is not sent: a request state (``cache_finished_req``/``cache_unfinished_req``) carries
only the tokens past ``prefix_len``; the head takes the first ``prefix_len`` tokens from the path of
the locked ``last_node`` (the tree resumes its walk there and never reads them otherwise), so a
finished multi-turn request sends its new tokens, not its whole history; a match key that extends
one this client sent before carries a reference to it plus its new tokens (``key_history``). A
returned request state carries no key (it is the key the client sent). Calls and results without a
compact form travel pickled inside the header, unchanged.

Buffers: ``encode_*`` copy into a new buffer the caller owns and sends; decoded arrays are views of
the received (unpickled, writable) buffer, which belongs to the decoding side alone, so result arrays
are private to the caller. Decoding a request state needs the head's tree and runs on the head's
control thread, call by call, in step order (a node created or split by an earlier call of the same
step is seen).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache.cluster.client import ResultRef
from hicache.cluster.head import CacheHead, Call, CallResult, Method
from hicache.cluster.key_history import KeyHistory, SentKeys
from hicache.cluster.tree import FinishResult, MatchPrefixParams, MatchResult, RadixKey, RadixTree, RequestState

_METHODS: tuple[Method, ...] = tuple(Method)
_CODE = {m: i for i, m in enumerate(_METHODS)}
_I32 = np.dtype(np.int32)

# call kinds
_GENERIC, _KEY, _PARAMS_KEY, _STATE, _INT, _REF = range(6)
# result kinds
_R_GENERIC, _R_MATCH, _R_PAGES, _R_STATE, _R_FINISH, _R_VALUE = range(6)

Header = list[tuple]


class _Packer:
    """Collects int32 arrays into one buffer; ``add`` returns (offset, length)."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.size = 0

    def add(self, arr: np.ndarray) -> tuple[int, int]:
        off, n = self.size, int(arr.shape[0])
        self.parts.append(arr)
        self.size += n
        return off, n

    def buffer(self) -> np.ndarray:
        return np.concatenate(self.parts) if self.parts else np.empty(0, _I32)


def _is_i32_vector(arr: Any) -> bool:
    return isinstance(arr, np.ndarray) and arr.dtype == _I32 and arr.ndim == 1


def _plain_int(v: Any) -> bool:
    return type(v) is int


# -- calls (client -> head) ---------------------------------------------------------------------------
def encode_calls(calls: Sequence[Call], sent: SentKeys | None = None) -> tuple[Header, np.ndarray, list[np.ndarray]]:
    """(header, buffer, match keys) of a batch. With ``sent`` (the client's key history) a match key
    that starts with an earlier one refers to it; commit the returned keys to ``sent`` once the head
    ran the step. Raises ``TypeError`` naming the first entry that is not a ``Call``."""
    packer = _Packer()
    header: Header = []
    keys: list[np.ndarray] = []
    for i, call in enumerate(calls):
        if not isinstance(call, Call):
            raise TypeError(f"step expects Call objects, got {type(call).__name__} at index {i}")
        code, arg = _CODE[call.method], call.arg
        if type(arg) is RadixKey or (type(arg) is MatchPrefixParams and type(arg.key) is RadixKey):
            k = arg if type(arg) is RadixKey else arg.key
            tokens = k.token_ids
            ref_id, ref_len = sent.find(tokens) if sent is not None else (-1, 0)
            keys.append(tokens)
            header.append((_KEY if k is arg else _PARAMS_KEY, code, ref_id, ref_len, *packer.add(tokens[ref_len:]),
                           k.extra_key, k.cache_salt))
        elif type(arg) is RequestState and _compact_state(arg):
            k = arg.key
            header.append((_STATE, code, *packer.add(k.token_ids[arg.prefix_len :]), *packer.add(arg.device_pages),
                           arg.prefix_len, arg.last_node, arg.priority, k.extra_key, k.cache_salt))
        elif _plain_int(arg):
            header.append((_INT, code, arg))
        elif type(arg) is ResultRef:
            header.append((_REF, code, arg.index, arg.field, arg.scale, arg.offset))
        else:
            header.append((_GENERIC, code, arg))
    return header, packer.buffer(), keys


def _compact_state(s: RequestState) -> bool:
    return (type(s.key) is RadixKey and not s.components and _is_i32_vector(s.device_pages)
            and _plain_int(s.prefix_len) and 0 <= s.prefix_len <= len(s.key)
            and _plain_int(s.last_node) and _plain_int(s.priority))


def path_tokens(tree: RadixTree, node_id: int, prefix_len: int) -> np.ndarray:
    """Tokens from the namespace root to the end of ``node_id``; ``ValueError`` (as the tree raises
    for a request) when that path is not ``prefix_len`` long."""
    node = tree.node(node_id)
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    depth = sum(p.shape[0] for p in parts)
    if depth != prefix_len:
        raise ValueError(f"prefix_len {prefix_len} does not end at last_node {node_id} (depth {depth})")
    return np.concatenate(parts[::-1]) if parts else np.empty(0, _I32)


def _key_tokens(header: Header, buf: np.ndarray, history: KeyHistory | None) -> dict[int, np.ndarray] | None:
    """Token ids of every match key of a step (references resolved); None if one refers to an entry
    ``history`` does not hold (the client must resync)."""
    out = {}
    for i, entry in enumerate(header):
        if entry[0] == _KEY or entry[0] == _PARAMS_KEY:
            _, _, ref_id, ref_len, off, n = entry[:6]
            literal = buf[off : off + n]
            if ref_id < 0:
                out[i] = literal.copy()  # history entries must not pin the whole step buffer
                continue
            prefix = history.get(ref_id, ref_len) if history is not None else None
            if prefix is None:
                return None
            out[i] = np.concatenate([prefix, literal])
    return out


def decode_call(entry: tuple, buf: np.ndarray, tree: RadixTree, key_tokens: np.ndarray | None = None) -> Call:
    """The ``Call`` of one header entry (``key_tokens``: a match key's resolved tokens); reads ``tree``
    for a request state's prefix (run it just before the call). ``ValueError``/``TypeError`` when the
    entry names nothing valid."""
    kind, code = entry[0], entry[1]
    method = _METHODS[code]
    if kind == _GENERIC or kind == _INT:
        return Call(method, entry[2])
    if kind == _REF:
        return Call(method, ResultRef(*entry[2:]))
    if kind == _KEY or kind == _PARAMS_KEY:
        key = RadixKey(key_tokens, entry[6], entry[7])
        return Call(method, key if kind == _KEY else MatchPrefixParams(key))
    if kind == _STATE:
        _, _, t_off, t_n, p_off, p_n, prefix_len, last_node, priority, extra_key, cache_salt = entry
        prefix = path_tokens(tree, last_node, prefix_len)
        key = RadixKey(np.concatenate([prefix, buf[t_off : t_off + t_n]]), extra_key, cache_salt)
        return Call(method, RequestState(key, buf[p_off : p_off + p_n], prefix_len, last_node, priority))
    raise ValueError(f"unknown wire entry kind {kind!r}")


def run_step(head: CacheHead, header: Header, buf: np.ndarray,
             history: KeyHistory | None = None) -> tuple[Header, np.ndarray] | None:
    """The head side of a step: resolves the match keys against ``history`` and commits them there,
    then decodes and runs the calls one by one, in order (a request state's prefix is read from the
    tree as it is when its call runs; a ``ResultRef`` argument from the results so far), then encodes
    the results. None, and nothing ran: a key refers to an entry ``history`` lacks (the client must
    resync)."""
    keys = _key_tokens(header, buf, history)
    if keys is None:
        return None
    if history is not None:
        history.commit(list(keys.values()))
    calls: list[Call | None] = []
    results: list[CallResult] = []
    for i, entry in enumerate(header):
        try:
            call = decode_call(entry, buf, head.tree, keys.get(i))
            run = Call(call.method, call.arg.resolve(results)) if type(call.arg) is ResultRef else call
        except (ValueError, TypeError) as e:  # what the head raises for the same call
            calls.append(None)
            results.append(CallResult(False, error=e))
            continue
        calls.append(call)  # as sent: a result is encoded against the client's own argument
        results.extend(head.step([run]))
    return encode_results(results, calls)


# -- results (head -> client) -------------------------------------------------------------------------
def encode_results(results: Sequence[CallResult], calls: Sequence[Call | None]) -> tuple[Header, np.ndarray]:
    """(header, buffer) of a step's results; ``calls`` are the decoded calls they answer (``None``: the
    call did not decode); a returned request state with the call's own key travels without it."""
    packer = _Packer()
    header: Header = []
    for res, call in zip(results, calls):
        v, arg = res.value, getattr(call, "arg", None)
        if res.ok and type(v) is MatchResult and not v.components and _is_i32_vector(v.device_pages):
            header.append((_R_MATCH, *packer.add(v.device_pages), v.device_hit_len, v.host_hit_len,
                           v.last_device_node, v.last_host_node, v.best_match_node, v.storage_hit_len))
        elif res.ok and _is_i32_vector(v):
            header.append((_R_PAGES, *packer.add(v)))
        elif (res.ok and type(v) is RequestState and type(arg) is RequestState and v.key is arg.key
              and not v.components and _is_i32_vector(v.device_pages)):
            header.append((_R_STATE, *packer.add(v.device_pages), v.prefix_len, v.last_node, v.priority))
        elif res.ok and type(v) is FinishResult and _plain_int(v.new_prefix_len) and _plain_int(v.freed_pages):
            header.append((_R_FINISH, v.new_prefix_len, v.freed_pages))
        elif res.ok and (v is None or type(v) is int):
            header.append((_R_VALUE, v))
        else:
            header.append((_R_GENERIC, res))
    return header, packer.buffer()


def decode_results(header: Header, buf: np.ndarray, calls: Sequence[Call]) -> list[CallResult]:
    """The ``CallResult`` list of a reply; ``calls`` are the calls the client sent, in order."""
    out = []
    for entry, call in zip(header, calls):
        kind = entry[0]
        if kind == _R_GENERIC:
            out.append(entry[1])
        elif kind == _R_VALUE:
            out.append(CallResult(True, entry[1]))
        elif kind == _R_FINISH:
            out.append(CallResult(True, FinishResult(entry[1], entry[2])))
        elif kind == _R_MATCH:
            *lens_and_nodes, storage_hit_len = entry[3:]
            out.append(CallResult(True, MatchResult(buf[entry[1] : entry[1] + entry[2]], *lens_and_nodes,
                                                    storage_hit_len=storage_hit_len)))
        elif kind == _R_PAGES:
            out.append(CallResult(True, buf[entry[1] : entry[1] + entry[2]]))
        elif kind == _R_STATE:
            out.append(CallResult(True, RequestState(call.arg.key, buf[entry[1] : entry[1] + entry[2]], *entry[3:])))
        else:
            raise ValueError(f"unknown wire result kind {kind!r}")
    return out
