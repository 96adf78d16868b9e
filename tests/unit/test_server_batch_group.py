"""Where the server tells clients apart (several API keys), all of a client's requests are one group of
the batch, so that one client's 100 requests weigh as one client's beside another's stream; else only an
API request's n choices are."""

from __future__ import annotations

from types import SimpleNamespace

from infer.server.auth import ANONYMOUS, owner_of
from infer.server.fanout import batch_group


def state(*keys: str):
    return SimpleNamespace(args=SimpleNamespace(api_key_owners=tuple(owner_of(k.encode()) for k in keys)))


def test_with_several_keys_a_clients_requests_share_one_group():
    s, alice, bob = state("a", "b"), owner_of(b"a"), owner_of(b"b")
    assert batch_group(s, alice, "cmpl-1", 1) == batch_group(s, alice, "cmpl-2", 128) is not None
    assert batch_group(s, alice, "cmpl-1", 1) != batch_group(s, bob, "cmpl-3", 1)


def test_with_one_key_or_none_only_n_choices_share_a_group():
    for s, owner in ((state("a"), owner_of(b"a")), (state(), ANONYMOUS)):
        assert batch_group(s, owner, "cmpl-1", 1) is None
        assert batch_group(s, owner, "cmpl-2", 4) == "cmpl-2"
