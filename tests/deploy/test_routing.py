"""The routing policies' decisions on hand-built loads and prefix indexes: no Ray, no model."""

from __future__ import annotations

import argparse

import pytest

from infer.core.block_hash import hash_blocks
from infer.deploy.args import add_replica_args, cpus_per_replica, replica_args
from infer.deploy.routing import PrefixIndex, by_load, choose, prompt_block_hashes

BLOCK = 4
A, B, C = "a", "b", "c"


def hashes(tokens: list[int]) -> list[bytes]:
    return prompt_block_hashes(tokens, BLOCK)


PREFIX = list(range(100, 116))  # 4 full blocks
OTHER = list(range(200, 216))


def firsts(decision) -> list:
    return [rank[0] for rank in decision.ranks]


# -- block hashes and the index ---------------------------------------------------------------------------


def test_prompt_hashes_are_the_engines_and_skip_the_partial_block():
    tokens = list(range(10))  # 2 full blocks of 4 + 2 tokens
    assert prompt_block_hashes(tokens, BLOCK) == hash_blocks(tokens, BLOCK, [], 2)
    assert len(prompt_block_hashes(tokens[:3], BLOCK)) == 0


def test_match_counts_leading_blocks_only():
    index = PrefixIndex()
    index.insert(A, hashes(PREFIX))
    assert index.match(A, hashes(PREFIX)) == 4
    assert index.match(A, hashes(PREFIX[:8] + [1, 2, 3, 4])) == 2  # diverges in block 3
    assert index.match(A, hashes([0] + PREFIX[1:])) == 0  # chained: a changed first token matches nothing
    assert index.match(B, hashes(PREFIX)) == 0


def test_lru_bound_evicts_a_prefix_tail_before_its_head():
    index = PrefixIndex(max_blocks=6)
    index.insert(A, hashes(PREFIX))  # 4 blocks
    index.insert(A, hashes(OTHER))  # 4 more: 2 of PREFIX's must go, its deepest first
    assert index.num_blocks(A) == 6
    assert index.match(A, hashes(OTHER)) == 4
    assert index.match(A, hashes(PREFIX)) == 2  # the head survives


def test_remove_forgets_a_replica():
    index = PrefixIndex()
    index.insert(A, hashes(PREFIX))
    index.remove(A)
    assert index.match(A, hashes(PREFIX)) == 0


# -- the policies -----------------------------------------------------------------------------------------


def test_round_robin_ignores_load_and_prefix():
    index = PrefixIndex()
    index.insert(B, hashes(PREFIX))
    loads = {A: 10, B: 0, C: 0}
    assert [choose("round_robin", [A, B, C], loads, t, hashes(PREFIX), index).first for t in range(4)] == [
        A,
        B,
        C,
        A,
    ]


def test_least_loaded_ranks_by_load_and_rotates_ties():
    loads = {A: 3, B: 1, C: 1}
    d = choose("least_loaded", [A, B, C], loads, turn=0)
    assert firsts(d) == [B, C, A]
    assert firsts(choose("least_loaded", [A, B, C], loads, turn=2)) == [C, B, A]  # the tie rotates
    assert by_load([A, B], {}, 0) == [A, B] and by_load([A, B], {}, 1) == [B, A]


def test_prefix_aware_prefers_the_replica_holding_the_prefix():
    index = PrefixIndex()
    index.insert(B, hashes(PREFIX))
    d = choose("prefix_aware", [A, B], {A: 0, B: 2}, 0, hashes(PREFIX + [7, 7]), index, imbalance_bound=4)
    assert (d.first, d.reason, d.matched_blocks) == (B, "prefix", 4)
    assert firsts(d) == [B, A]  # the rest by load, as a fallback when B is full


def test_prefix_aware_longest_match_wins_then_least_loaded_among_equals():
    index = PrefixIndex()
    index.insert(A, hashes(PREFIX[:8]))
    index.insert(B, hashes(PREFIX))
    index.insert(C, hashes(PREFIX))
    d = choose("prefix_aware", [A, B, C], {A: 0, B: 3, C: 1}, 0, hashes(PREFIX), index, imbalance_bound=4)
    assert (d.first, d.matched_blocks) == (C, 4)


def test_prefix_aware_falls_back_to_least_loaded_beyond_the_bound():
    index = PrefixIndex()
    index.insert(B, hashes(PREFIX))
    within = choose("prefix_aware", [A, B], {A: 1, B: 5}, 0, hashes(PREFIX), index, imbalance_bound=4)
    beyond = choose("prefix_aware", [A, B], {A: 1, B: 6}, 0, hashes(PREFIX), index, imbalance_bound=4)
    assert (within.first, within.reason) == (B, "prefix")
    assert (beyond.first, beyond.reason) == (A, "imbalanced")


def test_prefix_aware_without_a_match_is_least_loaded():
    index = PrefixIndex()
    index.insert(B, hashes(OTHER))
    d = choose("prefix_aware", [A, B], {A: 2, B: 0}, 0, hashes(PREFIX), index)
    assert (d.first, d.reason) == (B, "no_match")
    short = choose("prefix_aware", [A, B], {A: 0, B: 0}, 0, hashes(PREFIX[:3]), index)  # no full block
    assert short.reason == "no_match"


def test_choose_is_pure_and_checks_its_input():
    index = PrefixIndex()
    choose("prefix_aware", [A, B], {}, 0, hashes(PREFIX), index)
    assert index.num_blocks(A) == index.num_blocks(B) == 0
    with pytest.raises(ValueError, match="unknown routing policy"):
        choose("random", [A], {}, 0)
    with pytest.raises(ValueError, match="no replica"):
        choose("least_loaded", [], {}, 0)


def test_a_repeated_prefix_sticks_to_one_replica_and_spills_past_the_bound():
    """The router's loop in miniature: route, record, and count requests in flight."""
    index, loads, placed = PrefixIndex(), {A: 0, B: 0}, []
    for turn in range(8):
        prompt = hashes(PREFIX + [turn] * BLOCK)
        d = choose("prefix_aware", [A, B], loads, turn, prompt, index, imbalance_bound=2)
        index.insert(d.first, prompt)
        loads[d.first] += 1  # nothing finishes: the load only grows
        placed.append(d.first)
    assert placed[:4] == [A, A, A, B]  # B takes the prefix once A carries 3 more (bound 2)...
    assert loads[A] - loads[B] <= 3  # ...and from then on the two share it by load


# -- how many replicas fit --------------------------------------------------------------------------------


def test_replicas_beyond_the_cores_or_memory_are_refused_with_the_reason():
    assert cpus_per_replica(2, 2, 24 * 2**30, 2**30) == 1
    assert cpus_per_replica(2, 5, 24 * 2**30, 2**30) == 2
    with pytest.raises(ValueError, match=r"--replicas 3 needs at least 3 CPUs .* 2 are available"):
        cpus_per_replica(3, 2, 24 * 2**30, 2**30)
    with pytest.raises(ValueError, match=r"2 KV pools of 8.00 GiB"):
        cpus_per_replica(2, 2, 16 * 2**30, 8 * 2**30)


def parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", dest="trace_path", default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    add_replica_args(parser)
    return replica_args(parser.parse_args(argv))


def test_replica_flags():
    assert parse([]) is None  # the single-process server
    assert parse(["--replicas", "2", "--routing-policy", "round_robin"]).routing_policy == "round_robin"
    assert parse(["--ray-address", "host:6379"]).replicas == 1
    with pytest.raises(ValueError, match="--replicas must be >= 1"):
        parse(["--replicas", "0"])
    with pytest.raises(ValueError, match="--trace is not supported with --replicas"):
        parse(["--replicas", "2", "--trace", "t.json"])
    with pytest.raises(ValueError, match="--tensor-parallel-size is not supported with --replicas"):
        parse(["--replicas", "2", "--tensor-parallel-size", "2"])


def test_infer_serve_hands_replicas_to_deploy_and_one_engine_to_the_server(monkeypatch):
    import sys
    import types

    from infer import cli

    ran = []
    monkeypatch.setattr("infer.server.launch.run", lambda args: ran.append(("server", args.port)) or 0)
    app = types.ModuleType("infer.deploy.app")  # stands in for the Ray Serve application
    app.run = lambda args, replicas: ran.append(("replicas", replicas.replicas)) or 0
    monkeypatch.setitem(sys.modules, "infer.deploy.app", app)
    assert cli.main(["serve", "--port", "9001"]) == 0
    assert cli.main(["serve", "--replicas", "2", "--port", "9002"]) == 0
    assert ran == [("server", 9001), ("replicas", 2)]


def test_replicas_without_ray_say_what_to_install(monkeypatch, capsys):
    import sys

    from infer import cli

    monkeypatch.setitem(sys.modules, "infer.deploy.app", None)  # an import of it raises ImportError
    assert cli.main(["serve", "--replicas", "2"]) == 2
    assert "pip install 'infer[ray]'" in capsys.readouterr().err


def test_replicas_serve_one_model(tmp_path, capsys):
    from infer import cli
    from infer.models.loader import EMBEDDED_MODEL

    (tmp_path / "embedded").symlink_to(EMBEDDED_MODEL)
    assert cli.main(["serve", "--replicas", "2", "--models-dir", str(tmp_path)]) == 2
    assert "--replicas serves one model" in capsys.readouterr().err
