"""The checkpoint's gloo groups (autopar.runtime.ckpt_store.checkpoint_group) are found only
for the very groups object they were made for: a program compiled after an earlier one was
freed never inherits the freed one's group through a reused id() (that happened on some ranks
and not others, and the ranks that entered `new_group` waited for those that did not: the
checkpoint matrix's rare save hang). They live on the groups object (its
`checkpoint_subgroups`), so nothing outside it keeps them."""
from __future__ import annotations

import gc

import torch.distributed as dist

from autopar.runtime import ckpt_store


class _Groups:
    timeout_s = 5.0

    def __init__(self):
        self.checkpoint_subgroups = {}


def test_a_new_groups_object_never_gets_a_freed_ones_group(monkeypatch):
    made: list[object] = []

    def new_group(**kwargs):
        made.append(object())
        return made[-1]

    monkeypatch.setattr(dist, "new_group", new_group)
    first = _Groups()
    group = ckpt_store.checkpoint_group(first)
    assert ckpt_store.checkpoint_group(first) is group and len(made) == 1
    assert ckpt_store.checkpoint_group(first, "vote") is not group and len(made) == 2
    del first
    gc.collect()
    # CPython hands a freed object's address to the next object of its size at once: each
    # program's groups below would have found its predecessor's entry under an id() key
    for k in range(20):
        ckpt_store.checkpoint_group(_Groups())
        assert len(made) == 3 + k


def test_the_groups_object_holds_its_checkpoint_groups(monkeypatch):
    monkeypatch.setattr(dist, "new_group", lambda **kwargs: object())
    groups = _Groups()
    save, vote = ckpt_store.checkpoint_group(groups), ckpt_store.checkpoint_group(groups, "vote")
    assert groups.checkpoint_subgroups == {"save": save, "vote": vote}
