"""A node's children named without listing them: a lowest node of 10,000 devices that asks 10 a
round reads 10 cids and holds, so a round's cost follows the work it does, not the size of the
federation (issue 38)."""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping, Sequence

from hfl.tree.shape import Tree


class DeviceCids(Sequence[str]):
    """A lowest node's device cids (``"000042"``) in cid order, each written when read: a round
    that asks 10 of 10,000 devices reads 10. Ids below 1,000,000 sort as their cids do; a larger
    id (seven digits) would not, so those cids are sorted as strings once."""

    def __init__(self, device_ids: Sequence[int]) -> None:
        self.ids = sorted(device_ids)
        self._strings = sorted(f"{d:06d}" for d in self.ids) if self.ids and self.ids[-1] >= 10**6 else None

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index):  # noqa: ANN001, ANN204 - an int or a slice, as Sequence's
        if self._strings is not None:
            return self._strings[index]
        if isinstance(index, slice):
            return [f"{d:06d}" for d in self.ids[index]]
        return f"{self.ids[index]:06d}"

    def device(self, cid: object) -> int:
        """The device id of ``cid``; KeyError for a cid that is no device of the node."""
        if isinstance(cid, str) and cid.isdigit():
            d = int(cid)
            i = bisect.bisect_left(self.ids, d)
            if i < len(self.ids) and self.ids[i] == d and f"{d:06d}" == cid:
                return d
        raise KeyError(cid)

    def __contains__(self, cid: object) -> bool:
        try:
            self.device(cid)
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self._strings) if self._strings is not None else (f"{d:06d}" for d in self.ids)


class DeviceHolds(Mapping[str, frozenset]):
    """A lowest node's ``holds`` (child cid -> the devices under it: the device itself), made
    when asked for (algorithm.sampling=devices reads it)."""

    def __init__(self, cids: DeviceCids) -> None:
        self.cids = cids

    def __getitem__(self, cid: str) -> frozenset:
        return frozenset([self.cids.device(cid)])

    def holding(self, drawn: frozenset[int]) -> list[str]:
        """The cids of the drawn devices this node holds, in cid order, looked up from the smaller
        side (a node of 10,000 devices under a draw of 200,000 checks its 10,000)."""
        ids = self.cids.ids
        if len(drawn) * 16 < len(ids):
            found = [d for d in sorted(drawn) if (i := bisect.bisect_left(ids, d)) < len(ids) and ids[i] == d]
        else:
            found = [d for d in ids if d in drawn]
        return sorted(f"{d:06d}" for d in found)

    def __iter__(self) -> Iterator[str]:
        return iter(self.cids)

    def __len__(self) -> int:
        return len(self.cids)


class SubtreeHolds(Mapping[str, frozenset]):
    """An inner node's ``holds`` (child path -> the devices of its subtree), each computed when
    first asked for: only algorithm.sampling=devices reads it, and a level-1 node of a million-device
    tree would otherwise list every device below it on every call."""

    def __init__(self, tree: Tree, children: list[str]) -> None:
        self.tree, self.children = tree, children
        self._made: dict[str, frozenset] = {}

    def __getitem__(self, path: str) -> frozenset:
        if path not in self._made:
            if path not in self.children:
                raise KeyError(path)
            self._made[path] = frozenset(self.tree.devices_under(path))
        return self._made[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self.children)

    def __len__(self) -> int:
        return len(self.children)
