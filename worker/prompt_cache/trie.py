"""A radix trie over token ids: longest common prefix without scanning every entry.

Edges carry runs of tokens (nodes exist only where entries branch or end), so a 1,000-token
prompt costs a handful of slice comparisons, not 1,000 dict hops, and memory grows with the number
of entries, not with their total length.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    label: tuple[int, ...] = ()
    children: dict[int, _Node] = field(default_factory=dict)
    entries: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class TrieMatch:
    """`length` tokens of the query are shared by every entry in `entry_ids` (and by no longer
    entry); `entry_ids` is empty when nothing matched at all."""

    length: int
    entry_ids: tuple[int, ...]


def _common(a: tuple[int, ...], b: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of `a` and `b[start:]`."""
    n = min(len(a), len(b) - start)
    if a[:n] == b[start : start + n]:
        return n
    i = 0
    while a[i] == b[start + i]:
        i += 1
    return i


class TokenTrie:
    def __init__(self) -> None:
        self._root = _Node()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def insert(self, tokens: tuple[int, ...], entry_id: int) -> None:
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                node.children[tokens[pos]] = _Node(label=tokens[pos:])
                node = node.children[tokens[pos]]
                pos = len(tokens)
                break
            k = _common(child.label, tokens, pos)
            if k < len(child.label):  # split the edge where the new entry leaves it
                mid = _Node(label=child.label[:k])
                child.label = child.label[k:]
                mid.children[child.label[0]] = child
                node.children[tokens[pos]] = mid
                child = mid
            node, pos = child, pos + k
        node.entries.add(entry_id)
        self._size += 1

    def remove(self, tokens: tuple[int, ...], entry_id: int) -> None:
        path: list[_Node] = [self._root]
        pos = 0
        while pos < len(tokens):
            child = path[-1].children.get(tokens[pos])
            if child is None:
                return
            path.append(child)
            pos += len(child.label)
        node = path[-1]
        if entry_id not in node.entries:
            return
        node.entries.discard(entry_id)
        self._size -= 1
        self._prune(path)

    @staticmethod
    def _prune(path: list[_Node]) -> None:
        """Drop empty leaves and merge pass-through nodes, so the trie stays compressed."""
        for i in range(len(path) - 1, 0, -1):
            node, parent = path[i], path[i - 1]
            if node.entries:
                return
            if not node.children:
                del parent.children[node.label[0]]
                continue
            if len(node.children) == 1:
                (only,) = node.children.values()
                only.label = node.label + only.label
                parent.children[node.label[0]] = only
            return

    def longest_match(self, tokens: tuple[int, ...]) -> TrieMatch:
        """Entries sharing the longest prefix with `tokens` (an entry may be longer than it)."""
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = _common(child.label, tokens, pos)
            pos += k
            node = child
            if k < len(child.label):
                break
        if pos == 0:
            return TrieMatch(0, ())
        return TrieMatch(pos, tuple(_subtree_entries(node)))

    def longest_whole_prefix(self, tokens: tuple[int, ...], max_len: int) -> TrieMatch:
        """The longest entries that are a whole prefix of `tokens` and at most `max_len` long."""
        node, pos = self._root, 0
        best = TrieMatch(0, ())
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = _common(child.label, tokens, pos)
            if k < len(child.label) or pos + k > max_len:
                break
            pos += k
            node = child
            if node.entries:
                best = TrieMatch(pos, tuple(node.entries))
        return best


def _subtree_entries(node: _Node) -> Iterator[int]:
    stack = [node]
    while stack:
        n = stack.pop()
        yield from n.entries
        stack.extend(n.children.values())
