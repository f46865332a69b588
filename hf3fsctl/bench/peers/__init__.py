"""The servers benchmarks measure beside hf3fsctl's own, each loopback-only and private to a run.

- `in_tree`: the metadata server that ships in vLLM
  (`vllm/distributed/kv_transfer/kv_connector/v1/hf3fs/hf3fs_metadata_server.py`) and
  its own client class behind the few calls `bench metadata`'s cells make, so the same
  cells measure both servers in one run. Its store is in memory and unbounded,
  namespaces do not exist in it, and a key is "stored" once every initialised rank
  confirmed it: the cells use one rank.
- `redis_server`: a private `redis-server` (Debian's package) with persistence off (a
  benchmark measures the store's scripts, not disk fsyncs), for `bench metadata`'s
  `redis` and `serve-redis` modes.
- `redis_cluster`: a private Redis Cluster of 3 masters (no replicas, persistence off)
  made with `redis-cli --cluster create`, for the `redis-cluster` (one slot) and
  `redis-sharded` (`?shards=N`) modes; each master's CPU is read apart.
- `lmcache`: LMCache's multiprocess server with a file-system L2 (docs/vllm.md), the
  `lmcache` peer of `bench e2e`.

Each starts in a work directory, waits until it listens, and stops (SIGTERM, then
SIGKILL) on exit (`process`). A peer whose program is missing here raises
`MetadataUnavailable` with a hint, and the benchmark skips that mode and says so.
"""
