"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): a model-free tree proposer over depth-limited suffix tries.

Two structures feed the proposer:

* a per-request :class:`SuffixTrie` over the request's prompt + accepted tokens, extended incrementally by
  :class:`TrieCursor` (O(``max_depth``) work per appended token, never rebuilt);
* an optional per-model :class:`SuffixStore`: one trie over recent completed outputs (bounded by a number of
  outputs, least recently added evicted first; an output produced again is refreshed), learned from every
  finished ``generate()`` call that enables it (in the server: from the served responses).

A trie node is one substring of length <= ``max_depth`` with its occurrence count and a suffix link (the
node of the same string minus its first token). Each step the proposer takes, in each trie, the longest
suffix of the context that occurred before with a continuation, and grows a candidate tree from it best
first by the continuation's empirical probability (product of child count / sibling count), with a node
budget ``ceil(spec_factor * match_len)`` capped at ``num_draft_tokens`` and nodes under ``min_token_prob``
left out; a path that reaches the depth limit, or a context nothing has followed yet, continues through the
suffix link (backing off to a shorter context). The tree with the larger
expected accepted length (sum of node probabilities) is verified by the engine's tree machinery as
deterministic candidates (one-hot q), which keeps sampling lossless.
"""
from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import threading
import time
import types
import weakref
from array import array
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from nemo_spec.inference.engine import DraftTree, StepState
from nemo_spec.inference.sampling import SamplingError, SamplingParams
from nemo_spec.inference.proposers.base import BaseProposer
from nemo_spec.inference.proposers.common import opt_float, opt_int
from nemo_spec.inference.trees import pad_chains

log = logging.getLogger(__name__)

# Defaults measured on held-out code prompts other than the benchmark's (built-in small base, 2-core CPU,
# batch 1): verifying a few more nodes costs little next to a decode step, so the node budget grows fast
# (4 nodes per matched token) up to 24; a trie deeper than 16 matched no more but cost more to build.
DEFAULT_MAX_DEPTH = 16
DEFAULT_NUM_DRAFT_TOKENS = 24
DEFAULT_SPEC_FACTOR = 4.0
DEFAULT_MIN_TOKEN_PROB = 0.1


class SuffixTrie:
    """Every substring of length <= ``max_depth`` of the inserted sequences, with occurrence counts.

    Nodes are integer ids (0 = the root, the empty string) into flat arrays — occurrence count, suffix link
    (the node of the same string minus its first token), token, first child, next and previous sibling — and
    one dict maps (node, token) to the child. No Python object per node: building a prompt's trie does not feed the
    cyclic garbage collector (which, with a large heap such as torch's, costs several times the build).
    Ids of deleted nodes are reused, so the arrays never outgrow the most nodes held at once.
    """

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
        if not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth < 2:
            raise SamplingError(f"suffix trie max_depth must be an int >= 2, got {max_depth!r}")
        self.max_depth = max_depth
        self.edges: Dict[int, int] = {}  # (node << _SHIFT) | token -> child
        self.count = array("q", [0])
        self.link = array("q", [0])
        self.token = array("q", [-1])
        self.first = array("q", [-1])
        self.next = array("q", [-1])
        self.prev = array("q", [-1])  # -1: first child
        self.free: List[int] = []
        self.size = 1  # live nodes, root included

    def new_node(self, parent: int, token: int, link: int) -> int:
        """Create the child ``token`` of ``parent`` (count 0) whose suffix link is ``link``; returns its id."""
        if self.free:
            c = self.free.pop()
            self.count[c], self.link[c], self.token[c], self.first[c] = 0, link, token, -1
        else:
            c = len(self.count)
            self.count.append(0)
            self.link.append(link)
            self.token.append(token)
            self.first.append(-1)
            self.next.append(-1)
            self.prev.append(-1)
        old = self.first[parent]
        self.next[c], self.prev[c] = old, -1
        if old != -1:
            self.prev[old] = c
        self.first[parent] = c
        self.edges[(parent << _SHIFT) | token] = c
        self.size += 1
        return c

    def child(self, node: int, token: int) -> Optional[int]:
        """The child of ``node`` by ``token`` (None if absent)."""
        return self.edges.get((node << _SHIFT) | token)

    def children(self, node: int) -> List[int]:
        """Child ids of ``node``."""
        out, c, nxt = [], self.first[node], self.next
        while c != -1:
            out.append(c)
            c = nxt[c]
        return out

    def add(self, seq: Sequence[int]) -> None:
        """Insert one sequence (all its substrings up to ``max_depth``)."""
        TrieCursor(self, grow=True).extend(seq)

    def remove(self, seq: Sequence[int]) -> None:
        """Remove one previously added sequence; nodes whose count drops to 0 are deleted (their ids reused)."""
        D, edges, count = self.max_depth, self.edges, self.count
        active = [0]
        dead: List[int] = []
        for t in seq:
            nxt = [0]
            for node in active[:D]:
                key = (node << _SHIFT) | t
                c = edges.get(key)
                if c is None:
                    raise SamplingError("SuffixTrie.remove: sequence was not added to this trie")
                count[c] -= 1
                if count[c] == 0:
                    del edges[key]
                    self._unlink(node, c)
                    dead.append(c)
                nxt.append(c)
            active = nxt
        self.size -= len(dead)
        self.free.extend(dead)  # only now: a removal walk must not see an id reused

    def _unlink(self, parent: int, c: int) -> None:
        n, p = self.next[c], self.prev[c]
        if p == -1:
            self.first[parent] = n
        else:
            self.next[p] = n
        if n != -1:
            self.prev[n] = p

    def num_nodes(self) -> int:
        """Nodes below the root."""
        return self.size - 1

    def node(self, path: Sequence[int]) -> Optional[int]:
        """The node of a substring (None if absent)."""
        n: Optional[int] = 0
        for t in path:
            n = self.child(n, t)
            if n is None:
                return None
        return n

    def as_dict(self) -> Dict[Tuple[int, ...], int]:
        """{substring: count} of every node (for tests and debugging)."""
        out: Dict[Tuple[int, ...], int] = {}
        stack: List[Tuple[Tuple[int, ...], int]] = [((), 0)]
        while stack:
            path, node = stack.pop()
            for c in self.children(node):
                key = path + (self.token[c],)
                out[key] = self.count[c]
                stack.append((key, c))
        return out


_SHIFT = 32  # token ids are < 2**32


class TrieCursor:
    """The trie nodes of the current context's suffixes (lengths 0..max_depth), updated as tokens arrive.

    With ``grow`` the context is inserted into the trie as it grows (the per-request trie); without it the
    cursor only follows what the trie already holds (matching a request against the global store), and its
    suffixes stop at the longest one the trie contains.
    """

    def __init__(self, trie: SuffixTrie, grow: bool) -> None:
        self.trie = trie
        self.grow = grow
        self.active: List[int] = [0]  # active[k]: node of the last k tokens

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the context (O(max_depth) each)."""
        trie = self.trie
        D, edges, count, new_node = trie.max_depth, trie.edges, trie.count, trie.new_node
        link, token, first, sib, prev = trie.link, trie.token, trie.first, trie.next, trie.prev
        active = self.active
        for t in tokens:
            nxt = [0]
            if self.grow:
                for node in active[:D]:
                    key = (node << _SHIFT) | t
                    c = edges.get(key)
                    if c is None:
                        if trie.free:
                            c = new_node(node, t, nxt[-1])
                        else:  # new_node inlined: building a prompt's trie is most of the method's cost
                            c = len(count)
                            count.append(0)
                            link.append(nxt[-1])
                            token.append(t)
                            first.append(-1)
                            old = first[node]
                            sib.append(old)
                            prev.append(-1)
                            if old != -1:
                                prev[old] = c
                            first[node] = c
                            edges[key] = c
                            trie.size += 1
                    count[c] += 1
                    nxt.append(c)
            else:
                for node in active[:D]:
                    c = edges.get((node << _SHIFT) | t)
                    if c is None:
                        break  # a longer suffix cannot be present when this one is not
                    nxt.append(c)
            active = nxt
        self.active = active

    def match(self) -> Tuple[int, Optional[int]]:
        """Longest context suffix (up to max_depth - 1 tokens) seen before with a continuation: (length, node)."""
        act, first = self.active, self.trie.first
        for k in range(min(len(act) - 1, self.trie.max_depth - 1), 0, -1):
            if first[act[k]] != -1:
                return k, act[k]
        return 0, None


def expand(trie: SuffixTrie, node: int, depth: int, budget: int,
           min_prob: float) -> Tuple[List[int], List[int], float]:
    """Best-first candidate tree of at most ``budget`` nodes below ``node`` (a context suffix of ``depth`` tokens).

    Returns (tokens, parents as block indices with 0 = the root, score = sum of node probabilities). A
    node's probability is the product along its path of child count / total count of the siblings; nodes
    under ``min_prob`` are left out. Parents come before children, siblings in decreasing probability. A
    path that reaches the trie's depth, or a context that nothing followed yet (the request's own latest
    tokens, e.g. the second period of a repetition), continues from its suffix link: the context minus its
    first token, down to one token.
    """
    D, count, first, nxt, link, token = trie.max_depth, trie.count, trie.first, trie.next, trie.link, trie.token
    tokens: List[int] = []
    parents: List[int] = []
    score = 0.0
    heap: List[Tuple[float, int, int, int, int]] = []
    order = itertools.count()

    def push(src: int, d: int, prob: float, block: int) -> None:
        if d >= D:
            src, d = link[src], d - 1
        while first[src] == -1 and d > 1:  # nothing followed this context: back off to a shorter one
            src, d = link[src], d - 1
        kids = []
        total = 0
        c = first[src]
        while c != -1:
            kids.append(c)
            total += count[c]
            c = nxt[c]
        for c in kids:
            p = prob * count[c] / total
            if p >= min_prob:
                heapq.heappush(heap, (-p, next(order), c, d + 1, block))

    push(node, depth, 1.0, 0)
    while heap and len(tokens) < budget:
        negp, _, c, d, parent = heapq.heappop(heap)
        tokens.append(token[c])
        parents.append(parent)
        score -= negp
        push(c, d, -negp, len(tokens))
    return tokens, parents, score


def node_budget(match_len: int, spec_factor: float, cap: int) -> int:
    """Draft nodes allowed for a match of ``match_len`` tokens: ceil(spec_factor * match_len), at most cap."""
    return max(0, min(cap, math.ceil(spec_factor * match_len - 1e-9)))


class SuffixStore:
    """Global suffix trie over recent completed outputs: at most ``capacity`` outputs, least recently added evicted."""

    def __init__(self, capacity: int, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
        self.trie = SuffixTrie(max_depth)
        self.capacity = 0
        self.outputs: "OrderedDict[Tuple[int, ...], None]" = OrderedDict()
        self.lock = threading.RLock()
        self.resize(capacity)

    def __len__(self) -> int:
        return len(self.outputs)

    def resize(self, capacity: int) -> None:
        """Change the bound (evicting the oldest outputs beyond it)."""
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise SamplingError(f"suffix store capacity must be an int >= 1, got {capacity!r}")
        with self.lock:
            self.capacity = capacity
            self._evict()

    def add(self, tokens: Sequence[int]) -> None:
        """Learn one completed output (an identical output already held is only refreshed)."""
        key = tuple(int(t) for t in tokens)
        if not key:
            return
        with self.lock:
            if key in self.outputs:
                self.outputs.move_to_end(key)
                return
            self.trie.add(key)
            self.outputs[key] = None
            self._evict()

    def _evict(self) -> None:
        while len(self.outputs) > self.capacity:
            old, _ = self.outputs.popitem(last=False)
            self.trie.remove(old)

    def clear(self) -> None:
        """Forget every output."""
        with self.lock:
            self.trie = SuffixTrie(self.trie.max_depth)
            self.outputs.clear()


_STORES: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[int, SuffixStore]]" = weakref.WeakKeyDictionary()
_STORES_LOCK = threading.Lock()


def global_store(model: torch.nn.Module, capacity: int, max_depth: int = DEFAULT_MAX_DEPTH) -> SuffixStore:
    """The global suffix store of ``model`` (one per trie depth), resized to ``capacity`` outputs."""
    with _STORES_LOCK:
        by_depth = _STORES.setdefault(model, {})
        store = by_depth.get(max_depth)
        if store is None:
            store = by_depth[max_depth] = SuffixStore(capacity, max_depth)
            return store
    if store.capacity != capacity:
        store.resize(capacity)
    return store


def _opt_bool(options: Dict[str, Any], key: str, default: bool) -> bool:
    v = options.get(key, default)
    if not isinstance(v, bool):
        raise SamplingError(f"option {key!r} must be true or false, got {v!r}")
    return v


class SuffixProposer(BaseProposer):
    """Suffix decoding: frequency-scored candidate trees from the request's own suffix trie and the model's global one."""

    name = "suffix"

    def __init__(self, model: torch.nn.Module, options: Dict[str, Any]) -> None:
        self.cap = opt_int(options, "num_draft_tokens", DEFAULT_NUM_DRAFT_TOKENS)
        self.max_depth = opt_int(options, "max_depth", DEFAULT_MAX_DEPTH, lo=2)
        self.spec_factor = opt_float(options, "spec_factor", DEFAULT_SPEC_FACTOR)
        p = options.get("min_token_prob", DEFAULT_MIN_TOKEN_PROB)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise SamplingError(f"option 'min_token_prob' must be a number in [0, 1], got {p!r}")
        self.min_prob = float(p)
        self.global_capacity = opt_int(options, "global_cache", 0, lo=0)
        self.global_update = _opt_bool(options, "global_update", True)
        self.lookahead = self.cap
        self.store = global_store(model, self.global_capacity, self.max_depth) if self.global_capacity else None
        self.prefill_s = 0.0  # time spent building the prompt tries
        self.propose_s = 0.0  # time spent proposing (trie updates + tree building)
        self.steps = 0
        self.learned = False

    @property
    def levels(self) -> List[int]:
        """0, half the node cap, the cap."""
        return sorted({0, max(1, self.cap // 2), self.cap})

    def level_depth(self, level: int) -> int:
        """Deepest node a tree of this budget can have (best-first trees are mostly deep chains)."""
        return min(self.levels[level], self.max_depth)

    def setup(self, sess: Any) -> None:
        """Per-slot tries and cursors."""
        n = sess.slots
        self.seqs: List[List[int]] = [[] for _ in range(n)]
        self.local: List[Optional[TrieCursor]] = [None] * n
        self.glob: List[Optional[TrieCursor]] = [None] * n
        self.seen = [0] * n
        self.pending_outputs: List[List[int]] = []
        self.sess = sess

    def admit(self, sess: Any, slot: int, row: Any) -> None:
        """Build the row's trie from its prompt and place it on the global store's trie."""
        t0 = time.perf_counter()
        seq = row.seq
        self.seqs[slot] = seq
        self.local[slot] = TrieCursor(SuffixTrie(self.max_depth), grow=True)
        self.glob[slot] = None
        if self.store is not None:
            with self.store.lock:
                cur = TrieCursor(self.store.trie, grow=False)
                cur.extend(seq[-self.max_depth:])  # only the last max_depth tokens can be matched
                self.glob[slot] = cur
        self.local[slot].extend(seq)
        self.seen[slot] = len(seq)
        self.prefill_s += time.perf_counter() - t0

    def swap(self, i: int, j: int, used: int) -> None:
        """Exchange the two slots' tries."""
        for lst in (self.seqs, self.local, self.glob, self.seen):
            lst[i], lst[j] = lst[j], lst[i]

    def release(self, sess: Any, slot: int, row: Any) -> None:
        """Finished outputs are learned by the global store when the session has no other rows (a generate()
        call's last row), or in groups of ``slots`` outputs while it stays busy (a server under load)."""
        self.local[slot] = self.glob[slot] = None
        if self.store is None or not self.global_update:
            return
        self.pending_outputs.append(list(row.out))
        if sess.num_active() > 1 and len(self.pending_outputs) < sess.slots:
            return
        for out in self.pending_outputs:
            self.store.add(out)
        log.debug("suffix: global store learned %d outputs (%d held, %d trie nodes)", len(self.pending_outputs),
                  len(self.store), self.store.trie.num_nodes())
        self.pending_outputs = []

    def draft(self, r: int) -> Tuple[List[int], List[int]]:
        """Sync row r's cursors with its sequence, then the best candidate tree: (tokens, parents)."""
        seq = self.seqs[r]
        new = seq[self.seen[r]:]
        self.seen[r] = len(seq)
        best: Tuple[List[int], List[int], float] = ([], [], 0.0)
        sources = [(self.local[r], contextlib.nullcontext())]
        if self.glob[r] is not None and self.store is not None:
            sources.append((self.glob[r], self.store.lock))
        for cur, lock in sources:
            with lock:
                if new:
                    cur.extend(new)
                m, node = cur.match()
                budget = node_budget(m, self.spec_factor, self.cap)
                if node is None or budget == 0:
                    continue
                cand = expand(cur.trie, node, m, budget, self.min_prob)
            if cand[2] > best[2]:
                best = cand
        return best[0], best[1]

    def propose(self, sess: Any, st: StepState, level: Optional[int] = None) -> DraftTree:
        """A frequency-scored candidate tree per row (ragged, deterministic candidates)."""
        lv = self.levels
        cap = lv[-1] if level is None else lv[max(0, min(int(level), len(lv) - 1))]
        dev = sess.device
        if cap == 0:
            return DraftTree.empty(st.b, dev)
        t0 = time.perf_counter()
        trees = [self.draft(r) for r in range(st.b)]
        if cap < self.cap:
            trees = [(t[:cap], p[:cap]) for t, p in trees]  # best-first order: a prefix is a tree
        tok, val = pad_chains([t for t, _ in trees], device=dev)
        par, _ = pad_chains([p for _, p in trees], n=tok.shape[1], device=dev)
        depth, kids = 0, 0
        for _, p in trees:
            dep = [0] * (len(p) + 1)
            cnt = [0] * (len(p) + 1)
            for i, q in enumerate(p):
                dep[i + 1] = dep[q] + 1
                cnt[q] += 1
            depth, kids = max(depth, max(dep)), max(kids, max(cnt))
        self.propose_s += time.perf_counter() - t0
        self.steps += 1
        return DraftTree(tok, par, val, max_depth=depth, max_children=kids, sizes=[len(t) for t, _ in trees])


def replay_cost(model: torch.nn.Module, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                options: Optional[Dict[str, Any]] = None) -> Dict[str, float]:
    """Time the suffix proposer on known greedy outputs, step for step as generation ran (no model forwards).

    A greedy step accepts the longest tree path that the output continues, plus one token, so replaying the
    outputs reproduces generation's steps exactly. Returns steps, total/mean proposal seconds and prompt
    indexing seconds. With ``global_cache`` the model's global store is read, never updated.
    """
    opts = {**(options or {}), "global_update": False}
    prop = SuffixProposer(model, opts)
    sess = types.SimpleNamespace(device=torch.device("cpu"), slots=1, num_active=lambda: 1)
    prop.setup(sess)
    steps = 0
    for prompt, out in zip(prompts, outputs):
        if not out:
            continue
        row = types.SimpleNamespace(prompt=list(prompt), params=SamplingParams(), seq=list(prompt), length=0,
                                    gen=torch.Generator(), draft_forwards=0)
        row.seq.append(int(out[0]))  # the first token comes from the prefill, before any proposal
        prop.admit(sess, 0, row)
        st = StepState([row], max_pos=len(prompt) + len(out) + 1)
        pos = 1
        while pos < len(out):
            tree = prop.propose(sess, st)  # timed inside
            steps += 1
            node, acc = 0, 0
            kids: Dict[int, Dict[int, int]] = {}
            for i, (t, p, ok) in enumerate(zip(tree.tokens[0].tolist(), tree.parents[0].tolist(),
                                               tree.valid[0].tolist())):
                if ok:
                    kids.setdefault(p, {}).setdefault(t, i + 1)
            while pos + acc < len(out) and int(out[pos + acc]) in kids.get(node, {}):
                node = kids[node][int(out[pos + acc])]
                acc += 1
            st.seqs[0].extend(int(t) for t in out[pos: pos + acc + 1])
            pos += acc + 1
    return {"steps": steps, "propose_s": prop.propose_s, "propose_ms_per_step": 1e3 * prop.propose_s / max(steps, 1),
            "prefill_s": prop.prefill_s}
