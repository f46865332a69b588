"""Where a sharded Redis store puts its shards and pages (`meta/redis/sharded.py`), with no
Redis: the shards' hash tags, their Cluster slots, the page interleave and the splits."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from hf3fsctl.errors import ConfigError, InvalidRequest
from hf3fsctl.meta.redis.sharded import CLUSTER_SLOTS, shard_pages, shard_prefix, split
from hf3fsctl.meta.redis.store import PREFIX


def _slot(prefix: str) -> int:
    return int(key_slot(prefix[1 : prefix.index("}")].encode()))


@pytest.mark.parametrize("shards", [2, 3, 4, 5, 6, 8, 12, 16])
def test_n_shards_land_on_n_masters_of_an_evenly_split_cluster(shards: int) -> None:
    prefixes = [shard_prefix(PREFIX, s, shards) for s in range(shards)]
    assert prefixes[0] == PREFIX  # shard 0 is the store's own prefix (its records live there)
    assert len(set(prefixes)) == shards
    assert len({_slot(p) for p in prefixes}) == shards
    # `redis-cli --cluster create` gives master m the slots [m * 16384 / M, (m+1) * 16384 / M)
    masters = [_slot(p) * shards // CLUSTER_SLOTS for p in prefixes]
    assert sorted(masters) == list(range(shards))
    # the same shard count gives the same tags in every process
    assert prefixes == [shard_prefix(PREFIX, s, shards) for s in range(shards)]


def test_a_prefix_without_a_hash_tag_cannot_be_sharded() -> None:
    with pytest.raises(InvalidRequest, match="TAG"):
        shard_prefix("plain:", 1, 4)


@pytest.mark.parametrize("num_pages", [4, 5, 7, 1000, 1001])
@pytest.mark.parametrize("shards", [2, 3, 4])
def test_each_page_of_a_file_belongs_to_exactly_one_shard(num_pages: int, shards: int) -> None:
    owned = [shard_pages(num_pages, s, shards) for s in range(shards)]
    assert sum(owned) == num_pages
    # shard s knows its pages 0..owned-1, the file holds them at local * shards + s
    placed = sorted(local * shards + s for s in range(shards) for local in range(owned[s]))
    assert placed == list(range(num_pages))


@pytest.mark.parametrize("total", [0, 1, 3, 4, 10, 10**12 + 7])
def test_splits_add_up_and_differ_by_at_most_one(total: int) -> None:
    parts = [split(total, s, 4) for s in range(4)]
    assert sum(parts) == total
    assert max(parts) - min(parts) <= 1


def test_shard_count_in_a_url_is_checked() -> None:
    from hf3fsctl.config.urls import MetadataUrl

    assert MetadataUrl.parse("redis+cluster://h:1,h:2?shards=3").shards == 3
    assert MetadataUrl.parse("redis+cluster://h:1").shards == 1
    for bad in (
        "redis://h:1/0?shards=2",
        "redis+cluster://h:1?shards=0",
        "redis+cluster://h:1?x=1",
    ):
        with pytest.raises(ConfigError, match=r"metadata\.url"):
            MetadataUrl.parse(bad)
