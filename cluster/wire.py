"""Wire format of a batched ``step`` between a ``RayTransport`` and the head actor.

A step travels as one small pickled header (one tuple per call: method code, scalars, offsets) plus
one contiguous ``int32`` buffer holding every token and page array of the batch, instead of a pickle
of many dataclasses with many small numpy arrays. Results come back the same way. What the head
already holds is not sent. A key that starts with one this client sent before (``key_history``: the
match keys and request-state keys of its earlier steps) travels as a reference to it plus its new
tokens, so a multi-turn prompt sends the user's new tokens (the previous turn's finish sent its
output) and a finish sends its output tokens. A request state (``cache_finished_req``/
``cache_unfinished_req``) without such a reference carries only the tokens past ``prefix_len``: the
head takes the first ``prefix_len`` tokens from the path of the locked ``last_node`` (the tree resumes
its walk there). A returned request state carries no key (it is the key the client sent). A request's
start (``begin_request``) sends its key as a match does, plus its scalars; its result, the match and
the pages, as a match's and an alloc's. Calls and results without a compact form travel pickled inside
the header, unchanged.

The head runs the decoded calls as ``CacheHead.dispatch`` does (its methods looked up once per step; no
``Call`` per call), catching what ``CacheHead.step`` catches, so every answer is the one the head gives
the same ``Call`` in process. Every decoded key holds checked ids: a request buffer is scanned once per
step (all words valid ids: the usual case), and only a key with ids that scan did not cover (a bad
buffer, or a key-history entry built from one) is built by ``RadixKey``'s own checks, which fail its call.

Buffers: ``encode_*`` copy into a new buffer the caller owns and sends; decoded arrays are views of
the received (unpickled, writable) buffer, which belongs to the decoding side alone, so result arrays
are private to the caller (the tree copies the pages it keeps; key-history entries are copies).
Decoding a request state needs the head's tree and runs on the head's control thread, call by call,
in step order (a node created or split by an earlier call of the same step is seen).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache.cluster.begin import BeginParams, BeginResult
from hicache.cluster.client import ResultRef, StepRun
from hicache.cluster.head import CALL_ERRORS, NO_ARG_METHODS, CacheHead, Call, CallResult, Method
from hicache.cluster.key_history import KeyHistory, SentKeys
from hicache.cluster.tree import FinishResult, MatchPrefixParams, MatchResult, RadixKey, RadixTree, RequestState

_METHODS: tuple[Method, ...] = tuple(Method)
_CODE = {m: i for i, m in enumerate(_METHODS)}
_I32 = np.dtype(np.int32)
_STATE_METHODS = frozenset({Method.CACHE_FINISHED_REQ, Method.CACHE_UNFINISHED_REQ})
_NO_ARG_CODES = frozenset(_CODE[m] for m in NO_ARG_METHODS)

# call kinds
_GENERIC, _KEY, _STATE, _INT, _REF, _BEGIN = range(6)
# result kinds
_R_GENERIC, _R_MATCH, _R_PAGES, _R_STATE, _R_FINISH, _R_VALUE, _R_BEGIN = range(7)
# a key's prefix: ``ref_id >= 0``: that key-history entry; -1: none (the literal is the whole key);
_FROM_PATH = -2  # (request states only) the path from the root to ``last_node``

Header = list[tuple]
# a step's resolved keys: per header entry (tokens or None, checked), and in call order (keys, unchecked positions)
_Resolved = tuple[list[np.ndarray | None], list[bool], list[np.ndarray], list[int]]
_NONE_TAINTED: frozenset[int] = frozenset()
_min_reduce = np.minimum.reduce  # the ufunc itself (ndarray.min wraps it in Python code)


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
def encode_calls(calls: Sequence[Call], sent: SentKeys | None = None) -> tuple[Header, np.ndarray, list[bytes | np.ndarray]]:
    """(header, buffer, keys) of a batch. With ``sent`` (the client's key history) a key that starts
    with an earlier one refers to it (a request state's key otherwise takes its first ``prefix_len``
    tokens from the tree); ``keys``: what to commit to ``sent`` (``SentKeys.commit_copies``) when the step
    is sent (every match key, every request-state key sent as a reference), in call order: with ``sent``
    their token bytes (private copies), else the token arrays. Raises ``TypeError`` naming the first
    entry that is not a ``Call``."""
    packer = _Packer()
    header: Header = []
    keys: list[bytes | np.ndarray] = []
    find = sent.find if sent is not None else None
    for i, call in enumerate(calls):
        if type(call) is not Call and not isinstance(call, Call):
            raise TypeError(f"step expects Call objects, got {type(call).__name__} at index {i}")
        method, arg = call.method, call.arg
        code, kind = _CODE[method], type(arg)
        if kind is ResultRef:  # the most frequent kinds first (a step's chained lock + alloc per request)
            header.append((_REF, code, arg.index, arg.field, arg.scale, arg.offset))
        elif kind is int:
            header.append((_INT, code, arg))
        elif (method is Method.MATCH_PREFIX and (kind is RadixKey or (kind is MatchPrefixParams and type(arg.key) is RadixKey))
              or kind is BeginParams and method is Method.BEGIN_REQUEST):
            k = arg if kind is RadixKey else arg.key
            tokens = k.token_ids
            if find is not None:
                data = tokens.tobytes()  # the history's private copy, and what ``find`` verifies against
                ref_id, ref_len = find(tokens, data)
                keys.append(data)
            else:
                ref_id, ref_len = -1, 0
                keys.append(tokens)
            entry: tuple[Any, ...] = (_KEY, code, ref_id, ref_len, *packer.add(tokens[ref_len:]), k.extra_key,
                                      k.cache_salt)
            if kind is BeginParams:  # the key as a match's, then the scalars
                entry = (_BEGIN, *entry[1:], arg.total_tokens, arg.hold_writes, arg.check_prefetch, arg.prefetch_id,
                         arg.l3_min_tokens, arg.l3_below, arg.l1_only)
            header.append(entry)
        elif kind is RequestState and method in _STATE_METHODS and _compact_state(arg):
            k = arg.key
            tokens = k.token_ids
            if find is not None:
                data = tokens.tobytes()
                ref_id, ref_len = find(tokens, data)
            else:
                ref_id = -1
            if ref_id >= 0 and ref_len >= arg.prefix_len:
                keys.append(data)
            else:
                ref_id, ref_len = _FROM_PATH, arg.prefix_len
            header.append((_STATE, code, ref_id, ref_len, *packer.add(tokens[ref_len:]), k.extra_key, k.cache_salt,
                           *packer.add(arg.device_pages), arg.prefix_len, arg.last_node, arg.priority))
        else:
            header.append((_GENERIC, code, arg))
    return header, packer.buffer(), keys


def _compact_state(s: RequestState) -> bool:
    key, pages, prefix_len = s.key, s.device_pages, s.prefix_len  # tests inlined: one call per finish
    return (type(key) is RadixKey and not s.components and type(pages) is np.ndarray and pages.dtype == _I32
            and pages.ndim == 1 and type(prefix_len) is int and 0 <= prefix_len <= key.token_ids.shape[0]
            and type(s.last_node) is int and type(s.priority) is int)


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


def _history_keys(header: Header, buf: np.ndarray, history: KeyHistory | None) -> _Resolved | None:
    """The token ids of every key of a step that does not come from the tree (references resolved), per
    header entry (None for the others), whether each is checked (every id valid: ``_checked_buffer`` and
    the entry it refers to), and the same keys in call order with the positions of the unchecked ones
    (what the step commits to the key history). None if one refers to an entry ``history`` does not hold
    (the client must resync). Each key is its own new array (one step-wide array would be mmapped fresh
    every step, and its page faults cost more than the per-key copies it saves)."""
    tokens: list[np.ndarray | None] = []
    checked: list[bool] = []
    keys: list[np.ndarray] = []
    unchecked: list[int] = []
    get = history.get if history is not None else None
    tainted = history.unchecked if history is not None else _NONE_TAINTED
    concatenate = np.concatenate
    all_checked = _checked_buffer(buf)
    for entry in header:
        kind = entry[0]
        if (kind != _KEY and kind != _STATE and kind != _BEGIN) or entry[2] == _FROM_PATH:
            tokens.append(None)
            checked.append(all_checked)  # (a request state's literal tokens; its prefix comes from the tree)
            continue
        ref_id, ref_len, off, n = entry[2:6]
        if ref_id < 0:
            key = buf[off : off + n].copy()  # history entries must not pin the whole step buffer
            ok = all_checked
        else:
            prefix = get(ref_id, ref_len) if get is not None else None
            if prefix is None:
                return None
            key = concatenate((prefix, buf[off : off + n]))
            ok = all_checked and ref_id not in tainted
        if not ok:
            unchecked.append(len(keys))
        tokens.append(key)
        checked.append(ok)
        keys.append(key)
    return tokens, checked, keys, unchecked


def _checked_buffer(buf: Any) -> bool:
    """Whether every word of a request buffer is a valid token id (a 1-D int32 array, all >= 0): then no key
    built from it, or from history entries built the same way, needs its own scan (``RadixKey.from_checked``)."""
    return type(buf) is np.ndarray and buf.dtype == _I32 and buf.ndim == 1 and (buf.shape[0] == 0 or _min_reduce(buf) >= 0)


def _radix_key(tokens: np.ndarray, checked: bool, extra_key: Any, cache_salt: Any) -> RadixKey:
    """The key of a decoded entry: ids already checked are not scanned again; anything else goes through
    ``RadixKey``'s own checks (and fails the call with its error)."""
    if checked and (extra_key is None or type(extra_key) is str) and (cache_salt is None or type(cache_salt) is str):
        return RadixKey.from_checked(tokens, extra_key, cache_salt)
    return RadixKey(tokens, extra_key, cache_salt)


def _decode_state(entry: tuple, buf: np.ndarray, tree: RadixTree, tokens: np.ndarray | None,
                  checked: bool) -> RequestState:
    """The ``RequestState`` of a request-state entry, as the head runs it: ``tokens`` is the key's resolved
    token ids (None: its prefix comes from ``tree``, read now; the tree holds checked ids), ``checked``
    whether the ids that came from the client are. ``ValueError``/``TypeError`` when the entry names
    nothing valid."""
    if entry[0] != _STATE:
        raise ValueError(f"unknown wire entry kind {entry[0]!r}")
    _, _, ref_id, ref_len, t_off, t_n, extra_key, cache_salt, p_off, p_n, prefix_len, last_node, priority = entry
    if tokens is None:
        tokens = np.concatenate([path_tokens(tree, last_node, ref_len), buf[t_off : t_off + t_n]])
    key = _radix_key(tokens, checked, extra_key, cache_salt)
    return RequestState(key, buf[p_off : p_off + p_n], prefix_len, last_node, priority)


def run_step(head: CacheHead, header: Header, buf: np.ndarray,
             history: KeyHistory | None = None) -> tuple[Header, np.ndarray] | None:
    """The head side of a step: resolves the keys against ``history`` and commits them there, then
    decodes and runs the calls one by one, in order (a request state's prefix is read from the tree as
    it is when its call runs; a ``ResultRef`` argument from the results so far), then encodes the
    results. None, and nothing ran: a key refers to an entry ``history`` lacks (the client must resync)."""
    resolved = _history_keys(header, buf, history)
    if resolved is None:
        return None
    tokens, checked, keys, unchecked = resolved
    if history is not None:
        history.commit(keys, unchecked)
    args: list[Any] = []
    run = StepRun()
    values, errors = run.values, run.errors
    add_arg, add_value, add_error, resolve = args.append, values.append, errors.append, run.resolve
    fns = [getattr(head, m.value) for m in _METHODS]  # the head's bound methods, by method code
    tree = head.tree
    for entry, key_tokens, key_checked in zip(header, tokens, checked):
        kind, code = entry[0], entry[1]
        try:  # decode: what fails here fails the call as the head's own step would (CALL_ERRORS)
            if kind == _REF:
                _, _, index, field, scale, offset = entry
                arg = resolve(index, field, scale, offset)
            elif kind == _INT or kind == _GENERIC:
                arg = entry[2]
            elif kind == _KEY or kind == _BEGIN:
                if key_tokens is None:  # (a key entry that names the tree path: only request states may)
                    raise ValueError(f"wire entry {entry[:4]!r} has no key tokens")
                key = _radix_key(key_tokens, key_checked, entry[6], entry[7])
                arg = key if kind == _KEY else BeginParams(key, *entry[8:])  # match_prefix takes the key itself
            else:
                arg = _decode_state(entry, buf, tree, key_tokens, key_checked)
        except CALL_ERRORS as e:
            add_arg(None)
            add_value(None)
            add_error(e)
            continue
        add_arg(arg)
        try:  # CacheHead.dispatch, with the method looked up once per step
            value = fns[code]() if code in _NO_ARG_CODES else fns[code](arg)
        except CALL_ERRORS as e:
            add_value(None)
            add_error(e)
            continue
        add_value(value)
        add_error(None)
    return encode_results(values, errors, args)


# -- results (head -> client) -------------------------------------------------------------------------
def encode_results(values: Sequence[Any], errors: Sequence[BaseException | None],
                   args: Sequence[Any]) -> tuple[Header, np.ndarray]:
    """(header, buffer) of a step's results (``StepRun``'s lists: the value of each call, or the error that
    failed it); ``args`` are the arguments the calls ran with (``None``: the call did not decode); a
    returned request state with the call's own key travels without it."""
    packer = _Packer()
    header: Header = []
    for v, error, arg in zip(values, errors, args):
        if error is not None:
            header.append((_R_GENERIC, CallResult(False, error=error)))
            continue
        vt = type(v)
        if vt is MatchResult and _compact_match(v):
            header.append((_R_MATCH, *_match_fields(v, packer)))
        elif vt is BeginResult and _compact_match(v.match) and (v.pages is None or _is_i32_vector(v.pages)):
            header.append((_R_BEGIN, *_match_fields(v.match, packer), v.fetched, v.prefetch,
                           *((-1, -1) if v.pages is None else packer.add(v.pages)), v.l3_s, v.alloc_s,
                           v.miss_reason))
        elif vt is np.ndarray and v.dtype == _I32 and v.ndim == 1:
            header.append((_R_PAGES, *packer.add(v)))
        elif (vt is RequestState and type(arg) is RequestState and v.key is arg.key
              and not v.components and _is_i32_vector(v.device_pages)):
            header.append((_R_STATE, *packer.add(v.device_pages), v.prefix_len, v.last_node, v.priority))
        elif vt is FinishResult and _plain_int(v.new_prefix_len) and _plain_int(v.freed_pages):
            header.append((_R_FINISH, v.new_prefix_len, v.freed_pages))
        elif v is None or vt is int:
            header.append((_R_VALUE, v))
        else:
            header.append((_R_GENERIC, CallResult(True, v)))
    return header, packer.buffer()


def _compact_match(m: MatchResult) -> bool:
    return not m.components and _is_i32_vector(m.device_pages)


def _match_fields(m: MatchResult, packer: _Packer) -> tuple:
    """A compact match's 8 header fields (its pages go to ``packer``)."""
    return (*packer.add(m.device_pages), m.device_hit_len, m.host_hit_len, m.last_device_node, m.last_host_node,
            m.best_match_node, m.storage_hit_len)


def _decode_match(entry: tuple, buf: np.ndarray) -> MatchResult:
    """The match whose fields ``_match_fields`` wrote at ``entry[1:9]``."""
    off, n, device_hit_len, host_hit_len, last_device, last_host, best, storage_hit_len = entry[1:9]
    return MatchResult(buf[off : off + n], device_hit_len, host_hit_len, last_device, last_host, best,
                       storage_hit_len=storage_hit_len)


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
            out.append(CallResult(True, _decode_match(entry, buf)))
        elif kind == _R_BEGIN:
            fetched, prefetch, p_off, p_n, l3_s, alloc_s, why = entry[9:]
            pages = None if p_n < 0 else buf[p_off : p_off + p_n]
            out.append(CallResult(True, BeginResult(_decode_match(entry, buf), fetched, prefetch, pages, l3_s, alloc_s,
                                                    miss_reason=why)))
        elif kind == _R_PAGES:
            out.append(CallResult(True, buf[entry[1] : entry[1] + entry[2]]))
        elif kind == _R_STATE:
            out.append(CallResult(True, RequestState(call.arg.key, buf[entry[1] : entry[1] + entry[2]], *entry[3:])))
        else:
            raise ValueError(f"unknown wire result kind {kind!r}")
    return out
